"""`headlab eval`: perplexity in lm-eval's rolling windows on the evaluation part of a corpus, or lm-eval tasks."""

from __future__ import annotations

import json

import click

from headlab.cli.options import data_options, guard, model_options, out_option, task_options
from headlab.cli.parsing import parse_list
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes


@click.command("eval")
@model_options
@data_options(default_split="eval", max_tokens=4096, seq_len=512, batch_size=4, perplexity_windows=True)
@click.option(
    "--stride",
    type=int,
    default=None,
    help="new tokens scored per window after the first; each gets max-length - stride extra context "
    "[default: max-length, lm-eval's layout]",
)
@task_options(
    "comma-separated lm-eval tasks to run instead of perplexity (needs the lmeval extra); --max-length applies "
    "only when given, else lm-eval's default for the model"
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="at most this many documents per task")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="few-shot examples per task")
@out_option(required=False, help_text="with --tasks: write tasks.csv/.parquet and meta.json here (atomically)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(  # click passes every option as a parameter
    load,
    text,
    stride,
    tasks,
    include_path,
    limit,
    num_fewshot,
    out,
    overwrite,
    as_json,
):
    """Perplexity, NLL, bits per token, word perplexity and bits per byte (lm-evaluation-harness definitions and
    windows: docs/evaluation.md), or lm-eval tasks (--tasks) on the model as loaded."""
    if tasks is not None:
        explicit = click.get_current_context().get_parameter_source("seq_len").name != "DEFAULT"
        _run_tasks(
            load,
            tasks,
            include_path,
            text.seq_len if explicit else None,
            text.batch_size,
            limit,
            num_fewshot,
            out,
            overwrite,
            as_json,
        )
        return
    if out is not None or include_path is not None:
        raise HeadlabError("--out and --include-path go with --tasks")
    from headlab.measure.evaluate import perplexity  # start-up: torch loads when the command runs, not for --help

    loaded = load()
    result = perplexity(loaded, text=text, stride=stride, progress=not as_json)
    if as_json:
        click.echo(
            json.dumps(
                {**loaded.describe(), "data": text.data or "pydoc-topics", "split": text.split, **result.to_dict()},
                indent=2,
            )
        )
        return
    rows = [
        ("objective", result.objective),
        ("perplexity", f"{result.perplexity:.4f}"),
        ("mean NLL (nats/token)", f"{result.nll:.5f}"),
        ("bits per token", f"{result.bits_per_token:.5f}"),
        ("word perplexity", f"{result.word_perplexity:.4f}"),
        ("bits per byte", f"{result.bits_per_byte:.5f}"),
        ("scored tokens", f"{result.scored_tokens:,}"),
        ("words / bytes", f"{result.words:,} / {result.bytes:,}"),
        ("max-length / stride", f"{result.max_length} / {result.stride} ({result.windows} windows)"),
        ("tokens/s", f"{result.tokens_per_s:,.1f}"),
        ("peak memory", human_bytes(result.peak_memory_bytes)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


def _run_tasks(load, tasks, include_path, max_length, batch_size, limit, num_fewshot, out, overwrite, as_json):
    """lm-eval tasks on the loaded model; names, YAMLs and the output directory are checked before loading it."""
    # start-up: torch, pandas and lm-eval load when the command runs, not for --help
    from headlab.core.tables import write_run
    from headlab.runtimes.lm_eval_bridge import run_tasks, task_manager

    names = parse_list(tasks, str, "tasks")
    manager = task_manager(names, include_path)
    if out is not None:
        guard(out, overwrite, {"model": load.spec}, **{"include-path": include_path})
    loaded = load()
    result = run_tasks(
        loaded,
        names,
        include_path=include_path,
        max_length=max_length,
        batch_size=batch_size,
        limit=limit,
        num_fewshot=num_fewshot,
        manager=manager,
    )
    meta = {**loaded.describe(), **result.meta}
    if out is not None:
        write_run(out, {"tasks": result.table}, meta, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps({**meta, "results": result.table.to_dict("records")}, indent=2, default=str))
        return
    click.echo(result.table[["task", "metric", "value", "stderr"]].to_string(index=False, float_format="{:.4f}".format))
    if out is not None:
        click.echo(f"\nwrote {out}/tasks.csv, tasks.parquet, meta.json")
