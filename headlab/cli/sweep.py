"""`headlab sweep`: perplexity against the fraction of heads pruned, for several pruning orders, with a plot."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.cli._long_context import lengths_of, long_context_option, sweep_help
from headlab.cli.options import (
    calibration_tokens_option,
    compensate_option,
    data_options,
    guard,
    low_memory_option,
    model_options,
    out_option,
    task_options,
)
from headlab.cli.parsing import parse_list
from headlab.core.errors import HeadlabError
from headlab.core.fsio import resumable_directory
from headlab.pruning.choices import DEFAULT_FRACTIONS, MODES, UNITS
from headlab.pruning.score_sources import DEFAULT_ORDERS, ORDER_HELP, ORDERS, SWEEP_METHODS
from headlab.recovery.choices import COMPENSATIONS


@click.command("sweep")
@model_options
@data_options(
    default_split="eval",
    max_tokens=1024,
    seq_len=256,
    batch_size=4,
    perplexity_windows=True,
    max_tokens_help="eval-split tokens each pruned model's perplexity is measured on (one forward pass per model, "
    "about 2 s per 1,024 tokens on the embedded model, 2 CPU cores; 26 models by default); calibration text is "
    "bounded by --calibration-tokens",
)
@out_option(
    required=False, help_text="run directory (sweep.csv/.parquet, meta.json, sweep.png) [default: headlab-sweep]"
)
@click.option(
    "--fractions",
    default=",".join(str(f) for f in DEFAULT_FRACTIONS),
    show_default=True,
    help="comma-separated fractions of heads to prune, each in [0, 1)",
)
@click.option(
    "--orders",
    default=",".join(DEFAULT_ORDERS),
    show_default=True,
    help="comma-separated pruning orders: " + "; ".join(f"{k}: {v}" for k, v in ORDER_HELP.items()),
)
@click.option("--seeds", default="0,1,2", show_default=True, help="seeds the random order averages over")
@click.option("--unit", type=click.Choice(UNITS), default="head", show_default=True)
@click.option("--per-layer", is_flag=True, help="prune each fraction within every layer, not globally")
# the library's SweepPlan.allow_empty_layer, and what its refusal of a layer-emptying fraction tells one to pass
@click.option("--allow-empty-layer", is_flag=True, help="allow removing every head of a layer")
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="physical",
    show_default=True,
    help="physical measures the smaller model's speed; mask keeps shapes (same perplexity)",
)
@calibration_tokens_option(
    1024,
    "calibration-split tokens the scores and the --compensate refit read, once per sweep (per fraction for the "
    "iterative order). Cost on the embedded 135M model, 2 idle CPU cores: the gradient pass takes about 5 s per 1,024 "
    "tokens, 3x that with --low-memory; --compensate adds a forward pass, about half that",
)
@low_memory_option
@click.option(
    "--method",
    type=click.Choice(SWEEP_METHODS),
    default="grad",
    show_default=True,
    help="score of the importance and iterative orders",
)
@compensate_option(
    COMPENSATIONS,
    "also measure each pruned model with its output projection refitted (headlab.recovery.compensate; --compensate = ridge)",
)
@task_options(
    "comma-separated lm-eval tasks also run on every pruned model (task/metric columns, sweep_tasks.png; needs "
    "the lmeval extra)"
)
@click.option("--task-limit", type=click.IntRange(min=1), default=None, help="at most this many documents per task")
@long_context_option(help_text=sweep_help("every pruned model (26 by default; fraction 0 is the model before pruning)"))
def command(  # click passes every option as a parameter
    load,
    text,
    out,
    overwrite,
    fractions,
    orders,
    seeds,
    unit,
    per_layer,
    allow_empty_layer,
    mode,
    calibration_tokens,
    low_memory,
    method,
    compensate,
    tasks,
    include_path,
    task_limit,
    long_lengths,
):
    """Prune the lowest fraction of heads in each order, measure perplexity (eval split), parameters, KV bytes and
    tokens/s, and write the table and a plot (perplexity against fraction pruned, one line per order)."""
    # start-up: torch, transformers and pandas load when the command runs, not for --help
    from headlab.core.tables import write_run_files
    from headlab.pruning.sweep import SweepPlan, TaskSpec, check_sweep, sweep, sweep_files
    from headlab.runtimes.lm_eval_bridge import task_manager

    if text.split != "eval":
        raise HeadlabError("sweep scores perplexity on the eval split; scores always use the calibration split")
    fraction_list = parse_list(fractions, float, "fractions")
    order_list = parse_list(orders, str, "orders")
    seed_list = parse_list(seeds, int, "seeds")
    check_sweep(fraction_list, order_list, seed_list)
    if any(o not in ORDERS for o in order_list):
        raise HeadlabError(f"unknown order; use {', '.join(ORDERS)}")
    task_list = parse_list(tasks, str, "tasks") if tasks is not None else None
    lengths = lengths_of(long_lengths)
    if task_list:  # names, YAMLs and lm-eval itself are checked before the model loads
        task_manager(task_list, include_path)
    out = Path(out) if out is not None else Path("headlab-sweep")
    guard(out, overwrite, {"model": load.spec}, data=text.data)
    loaded = load()
    from headlab.measure.longctx import check_passkey_lengths  # start-up: torch loads when the command runs
    from headlab.pruning.selection import check_budget  # start-up: torch loads when the command runs

    if lengths:  # an encoder or a length beyond the model's positions fails before the first score pass
        check_passkey_lengths(loaded, lengths)
    for fraction in fraction_list:  # a fraction that would empty a layer fails before the first score is computed
        budget = "per-layer" if per_layer else "global"
        check_budget(
            loaded.layers, unit=unit, budget=budget, fraction=fraction, count=None, allow_empty_layer=allow_empty_layer
        )
    # Each (order, seed) is a step kept in OUT.partial: a failed or interrupted sweep resumes after the last completed
    # one when the same command runs again (the same model, text and options; headlab.core.fsio.resumable_directory).
    options = dict(fractions=fraction_list, orders=order_list, seeds=seed_list, unit=unit, per_layer=per_layer)
    options.update(allow_empty_layer=allow_empty_layer)
    options.update(mode=mode, calibration_tokens=calibration_tokens, method=method, compensate=compensate)
    options.update(tasks=task_list, include_path=include_path, task_limit=task_limit, long_context=lengths)
    key = {"command": "headlab sweep", "model": loaded.describe(), "options": options, "text": repr(text)}
    plan = SweepPlan(fraction_list, order_list, seed_list, unit, per_layer, allow_empty_layer, mode=mode, method=method)
    task_spec = TaskSpec(task_list, include_path, task_limit) if task_list else None
    with resumable_directory(out, key, overwrite=overwrite) as journal:
        if journal.resumed:
            click.echo(f"resuming from {journal.staging}: {', '.join(journal.resumed)} already done", err=True)
        result = sweep(
            loaded,
            plan,
            text=text,
            calibration_tokens=calibration_tokens,
            eval_tokens=text.max_tokens,
            compensate=compensate,
            tasks=task_spec,
            long_context=lengths,
            journal=journal,
            low_memory=low_memory,
        )
        write_run_files(journal.staging, *sweep_files(result))
    _print(result, out)


def _print(result, out: Path) -> None:
    """The sweep's summary table (and task metrics, passkey accuracy) on standard output."""
    from headlab.runtimes.lm_eval_bridge import metric_columns  # start-up: pandas loads with the run

    summary = (
        result.table.groupby(["order", "compensation", "fraction"], sort=False)
        .agg(pruned=("pruned_heads", "mean"), perplexity=("perplexity", "mean"), tokens_per_s=("tokens_per_s", "mean"))
        .reset_index()
    )
    metrics = metric_columns(result.table)
    passkey = [c for c in result.table.columns if str(c).startswith("passkey_") and c != "passkey_prompts"]
    if metrics or passkey:  # sweep --tasks, --long-context: the task metrics and passkey accuracy beside perplexity
        by = ["order", "compensation", "fraction"]
        means = result.table.groupby(by, sort=False)[metrics + passkey].mean().reset_index()
        summary = summary.merge(means, on=by)
    click.echo(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    figures = "sweep.png" + (", sweep_tasks.png" if metrics else "")
    click.echo(f"\nwrote {out}/sweep.csv, sweep.parquet, meta.json, {figures} ({result.meta['mode']} mode)")
