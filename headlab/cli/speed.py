"""`headlab speed`: measured prefill/decode tokens/s, peak memory and KV-cache bytes for a list of checkpoints."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.cli.options import guard, kv_cache_option, kv_policy_option
from headlab.core.units import human_bytes
from headlab.runtimes.choices import RUNTIMES


def _ints(ctx, param, value):
    try:
        numbers = tuple(int(v) for v in str(value).split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not numbers or min(numbers) < 1:
        raise click.BadParameter(f"{value!r}: give positive integers, e.g. 512,2048")
    return numbers


@click.command("speed")
@click.argument("models", nargs=-1, metavar="[MODEL]...")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help="weights dtype")
@click.option("--contexts", default="512,2048,8192", show_default=True, callback=_ints, help="context lengths")
@click.option("--batches", default="1,8", show_default=True, callback=_ints, help="batch sizes")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=16, show_default=True, help="timed decode steps")
@click.option(
    "--prefill-limit",
    type=click.IntRange(min=0),
    default=16384,
    show_default=True,
    help="points with more tokens (context x batch) fill the KV cache with random values instead of a timed "
    "prefill (decode is still measured on the full cache); 0 = always prefill",
)
@click.option(
    "--runtime",
    "runtimes",
    type=click.Choice(RUNTIMES),
    multiple=True,
    default=RUNTIMES,
    show_default=True,
    help="runtimes to measure (llama.cpp when llama-cpp-python is installed)",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="run directory: speed.csv/.parquet, meta.json, speed.png",
)
@click.option("--overwrite", is_flag=True, help="replace an existing --out")
@kv_cache_option
@kv_policy_option
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(  # click passes every option as a parameter
    models,
    device,
    dtype,
    contexts,
    batches,
    decode_tokens,
    prefill_limit,
    runtimes,
    out,
    overwrite,
    kv_cache,
    kv_policy,
    as_json,
):
    """Measure each MODEL (hub id, checkpoint directory or .gguf; default the embedded SmolLM2-135M): prefill and
    decode tokens/s with the KV cache at every context x batch, peak memory and KV-cache bytes held. The first
    model is the reference of decode_speedup and kv_ratio. --kv-cache: transformers decodes from that cache (its
    bytes as stored); llama.cpp keeps its f16 cells. --kv-policy: each model is measured again in transformers
    under that policy, from a cache whose streaming heads store only sinks + window ("MODEL + kv-policy" rows)."""
    # start-up: torch, pandas and matplotlib load when the command runs, not for --help
    from headlab.kv.policy import read_policy
    from headlab.runtimes.speed import SpeedSpec, check_policy_cache, run_speed

    if kv_policy is not None:  # before reading the policy: the conflict is the first thing to say
        check_policy_cache(kv_cache)
    spec = SpeedSpec(contexts, batches, decode_tokens, prefill_limit, tuple(runtimes), kv_cache=kv_cache)
    if out is not None:  # never onto, around or inside a model it measures or the policy it reads (symlinks resolved)
        inputs = {f"model {name or '(embedded)'}": name for name in (list(models) or [None])}
        guard(out, overwrite, inputs, **{"kv-policy": kv_policy})
    policy = read_policy(kv_policy) if kv_policy is not None else None
    table, figure_path = run_speed(
        list(models) or [None],
        spec,
        device=device,
        dtype=dtype,
        out=out,
        overwrite=overwrite,
        progress=not as_json,
        policy=policy,
    )
    if as_json:
        click.echo(table.to_json(orient="records", indent=2))
        return
    shown = table.assign(
        prefill=table["prefill_tokens_per_s"].map(lambda v: "-" if v != v else f"{v:,.0f}"),
        decode=table["decode_tokens_per_s"].map(lambda v: f"{v:,.1f}"),
        kv=table["kv_cache_bytes"].map(human_bytes),
        peak=table["peak_memory_bytes"].map(human_bytes),
        speedup=table["decode_speedup"].map(lambda v: f"{v:.2f}x"),
    )[["model", "runtime", "kv_cache", "context", "batch", "prefill", "decode", "speedup", "kv", "peak", "cache_fill"]]
    click.echo(shown.to_string(index=False))
    if out is not None:
        click.echo(
            f"wrote {out}/speed.csv, speed.parquet, meta.json" + (f", {figure_path.name}" if figure_path else "")
        )
