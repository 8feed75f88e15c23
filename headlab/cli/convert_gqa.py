"""`headlab convert-gqa`: fewer KV heads by pooling groups of them (Ainslie et al. 2023), saved as a checkpoint
that vanilla transformers loads, verified by reloading it."""

from __future__ import annotations

import json

import click

from headlab.checkpoint import check_checkpoint_out
from headlab.cli.options import data_options, model_options, out_option
from headlab.gqa import GROUPINGS, METHODS, POOLS, convert_checkpoint
from headlab.report_text import human_bytes


def print_summary(record: dict) -> None:
    """Before/after perplexity and KV bytes per token, the groups and the reload check, one line each."""
    rows = [("KV heads", f"{record['kv_heads_before']} -> {record['kv_heads_after']}")]
    before, after = record.get("perplexity_before"), record.get("perplexity_after")
    if before and after:
        rows.append(("perplexity", f"{before['perplexity']:.4f} -> {after['perplexity']:.4f}"))
        rows.append(("scored tokens", f"{after['scored_tokens']:,}"))
    rows.append(
        (
            "KV cache per token",
            f"{human_bytes(record['measured_kv_bytes_per_token_before'])} -> "
            f"{human_bytes(record['measured_kv_bytes_per_token_after'])} (measured from a real cache)",
        )
    )
    conversion = record["conversion"]
    if conversion["action"] == "pool":
        methods = sorted(set(conversion["methods"]))
        how = conversion["pool"]
        if conversion.get("method") == "svd":
            merge = conversion["merge"]
            how = f"svd merge (keys {merge['keys']}, values {merge['values']}, {merge['calibration_tokens']:,} calib tokens)"
        rows.append(("pool / grouping", f"{how} / {conversion['grouping']} ({', '.join(methods)})"))
        rows.append(("layers permuted", str(conversion["permuted_layers"])))
        rows.append(("groups, layer 0", str(conversion["groups"][0])))
    check = record["verification"]
    rows.append(("reload check", f"{check['loader']}: max |logit diff| {check['max_abs_diff']:.2e}"))
    rows.append(("written", record["out"]))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")


@click.command("convert-gqa")
@model_options
@click.option("--kv-heads", type=int, required=True, help="KV heads after conversion; must divide the current count")
@click.option(
    "--method",
    type=click.Choice(METHODS),
    default="mean",
    show_default=True,
    help="mean: pool each group by --pool (Ainslie et al.); svd: calibrated training-free merge (weighted SVD of "
    "values, complex rank-1 keys per rotary frequency, folded into the query and output projections)",
)
@click.option(
    "--pool", type=click.Choice(POOLS), default="mean", show_default=True, help="how a group becomes one head"
)
@click.option(
    "--grouping",
    type=click.Choice(GROUPINGS),
    default="contiguous",
    show_default=True,
    help="contiguous: transformers' layout; similarity: group KV heads that behave alike on calibration text",
)
@click.option(
    "--calib-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="calibration tokens for similarity grouping and the svd merge",
)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of --pool random")
@click.option("--no-eval", is_flag=True, help="skip the before/after perplexity")
@data_options(default_split="eval", max_tokens=2048, seq_len=512, batch_size=4)
@out_option(required=False, help_text="checkpoint directory (written atomically) [default: headlab-gqa]")
@click.option("--json", "as_json", is_flag=True, help="print the JSON record instead of a table")
def command(
    load,
    kv_heads,
    method,
    pool,
    grouping,
    calib_tokens,
    seed,
    no_eval,
    data,
    text_column,
    part,
    max_tokens,
    seq_len,
    batch_size,
    out,
    overwrite,
    as_json,
):
    """Pool groups of KV heads into one (MHA -> GQA, GQA -> fewer groups or MQA) and save a checkpoint."""
    from pathlib import Path

    out = Path(out) if out is not None else Path("headlab-gqa")
    check_checkpoint_out(out, overwrite)
    record = convert_checkpoint(
        load(),
        kv_heads,
        out,
        pool=pool,
        method=method,
        grouping=grouping,
        corpus=data,
        text_column=text_column,
        part=part,
        max_tokens=max_tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        calib_tokens=calib_tokens,
        seed=seed,
        evaluate=not no_eval,
        overwrite=overwrite,
        progress=not as_json,
    )
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
    else:
        print_summary(record)
