"""`headlab report`: every analysis on any model (info, statistics, importance, attention gallery, pruning sweep,
GQA sweep and grouping), then report.md and a self-contained report.html with the figures and tables."""

from __future__ import annotations

import dataclasses

import click

from headlab.cli.options import guard, model_options, out_option
from headlab.cli.parsing import parse_list, token_count
from headlab.core.data import load_corpus
from headlab.viz.choices import FORMATS


def report_options(function, quick_by_default: bool = False):
    """Options shared by `headlab report` and `headlab demo` (the demo runs the quick preset unless --full)."""
    function = click.option(
        "--format", "fmt", type=click.Choice(FORMATS), default="png", show_default=True, help="figure format"
    )(function)
    if quick_by_default:
        quick = click.option(
            "--quick/--full",
            default=True,
            show_default=True,
            help="the quick preset less its recovery step (fewer tokens and sweep points), or the full one with "
            "recovery (about three times as long)",
        )
    else:
        quick = click.option("--quick", is_flag=True, help="fewer tokens and sweep points (about half the time)")
    function = quick(function)
    function = click.option("--text-column", default=None, help="text column of a table corpus [default: text]")(
        function
    )
    return click.option(
        "--data",
        default=None,
        metavar="SPEC",
        help="corpus: a built-in corpus (broad, a domain such as prose or speeches, pydoc-topics), a "
        ".txt/.jsonl/.csv/.parquet file, a datasets directory or a hub 'name:config:split' [default: broad]",
    )(function)


@click.command("report")
@model_options
@report_options
@out_option(required=True, help_text="report directory (written atomically)")
@click.option(
    "--tasks",
    default=None,
    metavar="NAMES",
    help="comma-separated lm-eval tasks the pruning sweep also runs (accuracy against heads pruned; lmeval extra)",
)
@click.option("--include-path", default=None, metavar="DIR", help="directory of local lm-eval task YAMLs")
@click.option(
    "--orders",
    default=None,
    metavar="LIST",
    help="comma-separated pruning orders of the report's sweep, any of `headlab sweep --orders` (e.g. "
    "importance,fisher,obs,random) [default: the preset's]",
)
@click.option(
    "--long-context",
    "long_lengths",
    default=None,
    metavar="N,N",
    help="also measure long-context retrieval and NLL by position of the original, the svd merge and a per-KV-head "
    "cache policy at half the cache at these "
    "lengths (2k = 2048; headlab longeval); a 2k prompt of a 135M model is about 15 s of 2 CPU cores [default: off]",
)
def command(load, data, text_column, quick, fmt, out, overwrite, tasks, include_path, orders, long_lengths):
    """Analyse a model end to end and write OUT/report.md and OUT/report.html, each step's tables under OUT
    (redraw the figures with `headlab plot OUT`)."""
    # start-up: torch, pandas and matplotlib load when the command runs, not for --help
    from headlab.pruning.sweep import TaskSpec, check_sweep
    from headlab.reporting.report import PRESETS, run_report
    from headlab.runtimes.lm_eval_bridge import task_manager

    settings = PRESETS["quick" if quick else "full"]
    if orders is not None:
        settings = dataclasses.replace(settings, orders=tuple(parse_list(orders, str, "orders")))
        check_sweep(settings.fractions, settings.orders, settings.seeds)
    if long_lengths is not None:
        lengths = tuple(parse_list(long_lengths, token_count, "long-context"))
        settings = dataclasses.replace(settings, long_lengths=lengths)
    guard(out, overwrite, {"model": load.spec}, data=data)
    load_corpus(data, text_column)
    task_list = parse_list(tasks, str, "tasks") if tasks is not None else None
    if task_list:  # names, YAMLs and lm-eval itself are checked before the model loads
        task_manager(task_list, include_path)
    report = run_report(
        load(),
        out,
        data=data,
        text_column=text_column,
        quick=quick,
        settings=settings,
        overwrite=overwrite,
        fmt=fmt,
        tasks=TaskSpec(task_list, include_path) if task_list else None,
    )
    for line in report.summary:
        click.echo(f"- {line}")
    click.echo(f"wrote {out}/report.md and {out}/report.html ({len(report.figures)} figures)")
