"""`headlab importance`: per-head importance (grad, taylor or exact ablation) on the calibration part of a corpus,
written as a tidy table (CSV + Parquet) with a KV-group table and meta.json."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.cli.options import (
    allow_foreign_option,
    data_options,
    guard,
    low_memory_option,
    model_options,
    out_option,
)
from headlab.core.errors import HeadlabError
from headlab.measure.importance_methods import IMPORTANCE_METHODS


@click.command("importance")
@model_options
@data_options(default_split="calibration", max_tokens=None, seq_len=256, batch_size=4)
@click.option(
    "--method",
    type=click.Choice(IMPORTANCE_METHODS.names()),
    default="grad",
    show_default=True,
    help="; ".join(
        f"{m.name}: {m.help} (--max-tokens default {m.default_max_tokens})" for m in IMPORTANCE_METHODS.values()
    ),
)
@click.option("--no-layer-norm", is_flag=True, help="skip the per-layer L2 normalisation")
@click.option("--no-global-norm", is_flag=True, help="skip the global min-max scaling to [0, 1]")
@click.option(
    "--mask",
    type=click.Path(path_type=Path),
    default=None,
    help="CSV layer,head,gate: score with these heads already gated (unlisted heads keep gate 1)",
)
@click.option(
    "--bertology-compat",
    is_flag=True,
    help="grad only: reproduce transformers' old run_bertology.py, which never reset the gradient between batches",
)
@click.option(
    "--gradient-checkpointing",
    is_flag=True,
    help="grad/taylor: recompute each block in the backward pass instead of keeping activations (long windows)",
)
@low_memory_option
@allow_foreign_option
@out_option(required=False, help_text="output directory, written atomically [default: runs/importance-METHOD]")
def command(
    load,
    text,
    method,
    no_layer_norm,
    no_global_norm,
    mask,
    bertology_compat,
    gradient_checkpointing,
    allow_foreign_scores,
    low_memory,
    out,
    overwrite,
):
    """Head importance on calibration text: gradient scores (Michel et al. 2019), Fisher, second-order or exact
    ablation; --method lists each with its definition and its --max-tokens default.

    Importance reads calibration text only: the eval part is kept for perplexity.
    """
    if text.split != "calibration":
        raise HeadlabError(
            f"--split {text.split}: importance is scored on calibration text only (eval text is for perplexity)"
        )
    if bertology_compat and method != "grad":
        raise HeadlabError("--bertology-compat applies to --method grad only")
    if gradient_checkpointing and not IMPORTANCE_METHODS[method].backward:
        raise HeadlabError("--gradient-checkpointing applies to grad and taylor (ablation runs no backward pass)")
    if mask is not None and (mask.is_dir() or not (mask.exists() or mask.is_symlink())):  # a FIFO: the guard names it
        raise HeadlabError(f"no such mask file: {mask}")
    # start-up: torch and pandas load when the command runs, not for --help
    from headlab.core.tables import write_run
    from headlab.core.validate import check_table_origin
    from headlab.measure.importance import choose_low_memory, head_importance

    out = out if out is not None else Path("runs") / f"importance-{method}"
    guard(out, overwrite, {"model": load.spec}, data=text.data, mask=mask)
    loaded = load()
    check_table_origin(mask, loaded, "--mask", allow_foreign_scores)
    if low_memory is None:  # whole batches when their activations fit in the memory available, as prune chooses
        low_memory = choose_low_memory(loaded, text.batch_size, text.seq_len)
    result = head_importance(
        loaded,
        method=method,
        text=text
        if text.max_tokens is not None
        else text.but(max_tokens=IMPORTANCE_METHODS[method].default_max_tokens),
        layer_norm=not no_layer_norm,
        global_norm=not no_global_norm,
        accumulate="bertology" if bertology_compat else "per-sequence",
        mask=mask,
        gradient_checkpointing=gradient_checkpointing or (low_memory and IMPORTANCE_METHODS[method].backward),
        max_rows=1 if low_memory else None,
    )
    write_run(out, {"importance": result.table, "kv_groups": result.kv_groups}, result.meta, overwrite=overwrite)
    top = result.table.sort_values("rank").head(10)
    click.echo(
        f"{method} importance of {len(result.table)} heads over {result.meta['scored_tokens']:,} tokens "
        f"({result.meta['seconds']:.1f} s) -> {out}"
    )
    click.echo("most important: " + ", ".join(f"L{r.layer}H{r.head} ({r.importance:.3f})" for r in top.itertuples()))
