"""`headlab info`: layout, parameters and the KV-cache ladder of a model."""

from __future__ import annotations

import json

import click

from headlab.cli.options import model_options, print_rows
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.measure.choices import DTYPE_BYTES


@click.command("info")
@model_options
@click.option("--context", type=click.IntRange(min=1), default=8192, show_default=True, help="tokens in the cache")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="sequences in the cache")
@click.option(
    "--cache-dtype",
    type=click.Choice(list(DTYPE_BYTES)),
    default=None,
    help="dtype of the cached keys and values [default: the model's]",
)
@click.option(
    "--kv-budget",
    type=float,
    default=None,
    metavar="FRACTION",
    help="also price a per-layer KV budget: this fraction of the model's KV cache (convert-gqa --kv-budget)",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(load, context, batch, cache_dtype, kv_budget, as_json):
    """Model type, heads, parameters and KV-cache bytes (with the MHA / GQA / MQA ladder and the MLA rung)."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.loading import load_structure
    from headlab.measure.costs import model_info

    if kv_budget is not None and not 0 < kv_budget <= 1:  # before loading
        raise HeadlabError(f"--kv-budget {kv_budget} must be a fraction of the model's KV cache in (0, 1]")
    if load.device_map is not None or load.max_memory is not None:
        raise HeadlabError("info reads no weights (the model's structure only): drop --device-map and --max-memory")
    loaded = load_structure(load.spec, device=load.device, dtype=load.dtype, check_weights=load.check_weights)
    info = model_info(loaded, context=context, batch=batch, cache_dtype=cache_dtype, kv_budget=kv_budget)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    rows = [
        ("model", info["model"]),
        ("model type", info["model_type"]),
        ("blocks / attention layers", f"{info['blocks']} / {info['attention_layers']}"),
        ("query heads / KV heads / head_dim", f"{info['query_heads']} / {info['kv_heads']} / {info['head_dim']}"),
        *(
            [("MLA latent + rope dims", f"{info['kv_lora_rank']} + {info['rope_dim']}")]
            if "kv_lora_rank" in info
            else []
        ),
        ("parameters", f"{info['parameters']:,}"),
        ("attention parameters", f"{info['attention_parameters']:,}"),
        (f"KV cache per token ({info['cache_dtype']})", human_bytes(info["kv_bytes_per_token"])),
        (f"KV cache, {context:,} tokens x {batch}", human_bytes(info["kv_bytes"])),
    ]
    print_rows(rows)
    if info["ladder"]:
        click.echo(f"\nKV-cache ladder ({context:,} tokens x {batch}, {info['cache_dtype']}):")
        for step in info["ladder"]:
            mark = "  <- this model" if step["current"] else ""
            what = f"{step['kv_heads']:>3} KV heads" if step["kv_heads"] is not None else _latent(step)
            click.echo(
                f"  {step['variant']:<8} {what}  "
                f"{human_bytes(step['kv_bytes_per_token']):>10}/token  {human_bytes(step['kv_bytes']):>10}{mark}"
            )
    if "kv_budget" in info:
        budget = info["kv_budget"]
        heads = f"{budget['kv_heads']} of {budget['total_kv_heads']} KV heads, " if budget["kv_heads"] else ""
        choices = " or ".join("/".join(map(str, c)) for c in budget["choices_per_layer"])
        click.echo(
            f"\nPer-layer KV budget {budget['fraction']:g}: at most {human_bytes(budget['kv_bytes_per_token'])}/token, "
            f"{human_bytes(budget['kv_bytes'])} ({heads}each layer {choices}; convert-gqa --kv-budget places them)"
        )
    if info["mla_rungs"]:
        click.echo("\nMLA rung (one latent + a shared rotary key per token and layer, at the same bytes):")
        for step in info["mla_rungs"]:
            click.echo(
                f"  {step['variant']:<9} {_latent(step)}  "
                f"{human_bytes(step['kv_bytes_per_token']):>10}/token  {human_bytes(step['kv_bytes']):>10}"
            )


def _latent(step: dict) -> str:
    """An MLA cache's split, e.g. "320+64 latent" (kv_lora_rank + rope dims), as wide as "  3 KV heads"."""
    return f"{step['kv_lora_rank']}+{step['rope_dim']} latent".rjust(12)
