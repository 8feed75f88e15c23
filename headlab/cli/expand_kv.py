"""`headlab expand-kv`: GQA -> MHA (or more KV heads) by repeating each KV head, as repeat_kv does at run time;
lossless, saved as a vanilla-loadable checkpoint verified by reloading it."""

from __future__ import annotations

import click

from headlab.cli.convert_gqa import run_streaming, show
from headlab.cli.options import (
    data_options,
    guard,
    guard_checkpoint_space,
    model_options,
    out_option,
    streaming_options,
)


@click.command("expand-kv")
@model_options
@click.option(
    "--kv-heads",
    type=int,
    default=None,
    help="KV heads after expansion: a multiple of the current count dividing the query heads [default: query heads]",
)
@click.option("--no-eval", is_flag=True, help="skip the before/after perplexity")
@data_options(default_split="eval", max_tokens=2048, seq_len=512, batch_size=4)
@out_option()
@streaming_options("expand")
@click.option("--json", "as_json", is_flag=True, help="print the JSON record instead of a table")
def command(
    load,
    kv_heads,
    no_eval,
    text,
    out,
    overwrite,
    streaming,
    max_shard_size,
    as_json,
):
    """Repeat KV heads (GQA -> MHA); the model computes exactly what it did, with a larger KV cache."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.kv.gqa import convert_checkpoint
    from headlab.kv.grouping import gqa_layers

    guard(out, overwrite, {"model": load.spec}, data=text.data, run_dir_bytes=False)
    if streaming:
        return run_streaming(
            load, kv_heads, out, overwrite=overwrite, direction="expand", max_shard_size=max_shard_size, as_json=as_json
        )
    loaded = load()
    layers = gqa_layers(loaded)
    target = layers[0].num_heads if kv_heads is None else kv_heads
    if target < layers[0].num_kv_heads:
        raise click.UsageError(
            f"--kv-heads {target} is fewer than the current {layers[0].num_kv_heads}; use convert-gqa"
        )
    hidden = loaded.model.config.get_text_config().hidden_size
    itemsize = next(loaded.model.parameters()).element_size()
    # Repeated K and V projections: 2 x hidden x head_dim per added KV head and layer.
    added = sum(2 * hidden * layer.head_dim * (target - layer.num_kv_heads) * itemsize for layer in layers)
    guard_checkpoint_space(out, loaded, extra=max(0, added))
    record = convert_checkpoint(
        loaded,
        target,
        out,
        text=text,
        evaluate=not no_eval,
        direction="expand",
        overwrite=overwrite,
        progress=not as_json,
    )
    show(record, as_json)
