"""`headlab importance`: per-head importance (grad, taylor or exact ablation) on the calibration part of a corpus,
written as a tidy table (CSV + Parquet) with a KV-group table and meta.json."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.cli.options import allow_foreign_option, data_options, guard, model_options, out_option
from headlab.core.errors import HeadlabError
from headlab.core.tables import write_run
from headlab.core.validate import check_table_origin
from headlab.measure.importance import DEFAULT_MAX_TOKENS, METHODS, head_importance


@click.command("importance")
@model_options
@data_options(default_split="calibration", max_tokens=None, seq_len=256, batch_size=4)
@click.option("--method", type=click.Choice(METHODS), default="grad", show_default=True, help="importance score")
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
@click.option(
    "--low-memory/--no-low-memory",
    default=True,
    show_default=True,
    help="one sequence per forward/backward pass, with activation checkpointing for grad/taylor (same scores, "
    "a fraction of the memory; --no-low-memory is faster)",
)
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
    """Head importance on calibration text: grad (Michel et al. 2019, E_x |dL(x)/dxi_h|), taylor (per-token
    |ctx_h . dL/dctx_h|) or ablation (exact loss increase with one head masked).

    --max-tokens defaults to 2048 for grad and taylor, 256 for ablation (one forward pass set per head).
    Importance reads calibration text only: the eval part is kept for perplexity.
    """
    if text.split != "calibration":
        raise HeadlabError(
            f"--split {text.split}: importance is scored on calibration text only (eval text is for perplexity)"
        )
    if bertology_compat and method != "grad":
        raise HeadlabError("--bertology-compat applies to --method grad only")
    if gradient_checkpointing and method == "ablation":
        raise HeadlabError("--gradient-checkpointing applies to grad and taylor (ablation runs no backward pass)")
    if mask is not None and not mask.is_file():
        raise HeadlabError(f"no such mask file: {mask}")
    out = out if out is not None else Path("runs") / f"importance-{method}"
    guard(out, overwrite, {"model": load.spec}, data=text.data, mask=mask)
    loaded = load()
    check_table_origin(mask, loaded, "--mask", allow_foreign_scores)
    result = head_importance(
        loaded,
        method=method,
        text=text if text.max_tokens is not None else text.but(max_tokens=DEFAULT_MAX_TOKENS[method]),
        layer_norm=not no_layer_norm,
        global_norm=not no_global_norm,
        accumulate="bertology" if bertology_compat else "per-sequence",
        mask=mask,
        gradient_checkpointing=gradient_checkpointing or (low_memory and method != "ablation"),
        max_rows=1 if low_memory else None,
    )
    write_run(out, {"importance": result.table, "kv_groups": result.kv_groups}, result.meta, overwrite=overwrite)
    top = result.table.sort_values("rank").head(10)
    click.echo(
        f"{method} importance of {len(result.table)} heads over {result.meta['scored_tokens']:,} tokens "
        f"({result.meta['seconds']:.1f} s) -> {out}"
    )
    click.echo("most important: " + ", ".join(f"L{r.layer}H{r.head} ({r.importance:.3f})" for r in top.itertuples()))
