"""Layer-by-layer KV-head conversion of a safetensors checkpoint: one attention module in memory at a time, for
models larger than RAM; the same arithmetic as `headlab.kv.gqa.convert`, without running the model. The reading,
editing and shard writing are `headlab.core.streaming`'s; this module chooses the edit (pool or expand)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from headlab.core.checkpoint import META_FILE
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory, write_json
from headlab.core.layout import has_head_layout
from headlab.core.loading import LoadedModel
from headlab.core.streaming import (
    DEFAULT_MAX_SHARD_BYTES,
    LayerEditor,
    ShardWriter,
    TensorReader,
    copy_side_files,
    read_source_config,
    skeleton,
    stream_tensors,
    verify_streamed,
)
from headlab.core.tables import versions
from headlab.kv.gqa import Conversion
from headlab.kv.grouping import (
    POOLS,
    check_direction,
    check_kv_heads,
    contiguous_groups,
    expand_weights,
    gqa_layers,
    identity_groups,
    pool_weights,
)
from headlab.measure.costs import kv_bytes_per_token


def _read_config(source: Path, out: Path, overwrite: bool, pool: str, max_shard_bytes: int):
    """The checks of read_source_config, plus the pool and a single head layout (KV conversion needs one)."""
    if pool not in POOLS:
        raise HeadlabError(f"unknown pool={pool!r}; use one of {', '.join(POOLS)}")
    files, config = read_source_config(source, out, overwrite, max_shard_bytes)
    if has_head_layout(config):
        raise HeadlabError(
            f"{source} has a per-layer head layout (a pruned checkpoint); KV conversion needs one layout"
        )
    return files, config


def _edit_kv(layer, *, adapter, action: str, kv_heads: int, pool: str, seed: int) -> None:
    """One attention module pooled (by `pool`, seeded per layer) or expanded to `kv_heads`, through its adapter."""
    weights = adapter.read(layer)
    if action == "pool":
        adapter.write(layer, pool_weights(weights, kv_heads, pool, seed=seed + layer.index))
    elif action == "expand":
        adapter.write(layer, expand_weights(weights, kv_heads))


def _conversion(G: int, kv_heads: int, action: str, pool: str, seed: int, num_layers: int) -> Conversion:
    """The record of what was done, in the form `headlab.kv.gqa.convert` writes (contiguous groups in every layer)."""
    groups = contiguous_groups(G, kv_heads) if action == "pool" else identity_groups(G, kv_heads)
    conversion = Conversion(G, kv_heads, action, pool if action == "pool" else None, "contiguous", seed)
    conversion.groups = [groups for _ in range(num_layers)]
    conversion.methods = ["contiguous" if action == "pool" else action] * num_layers
    return conversion


def convert_streaming(
    source,
    kv_heads: int | None,
    out,
    *,
    pool: str = "mean",
    seed: int = 0,
    direction: str = "pool",
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> dict:
    """`headlab convert-gqa --streaming` / `expand-kv --streaming`: contiguous KV pooling by `pool` (or repetition)
    of a safetensors checkpoint directory, one layer at a time, into `out` (atomic; the source is never touched).

    Produces the same tensors as `headlab.kv.gqa.convert` on the loaded model (grouping="contiguous", method="mean"),
    stored in the source's dtypes. Similarity grouping and the svd merge need activations and so the whole model;
    they are not available here.
    """
    hf_logging.disable_progress_bar()  # headlab shows its own progress
    source, out = Path(source), Path(out)
    files, config = _read_config(source, out, overwrite, pool, max_shard_bytes)
    model, adapter = skeleton(config)
    loaded = LoadedModel(model, None, adapter, str(source), str(source), torch.device("meta"), torch.float32)
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    kv_heads = H if kv_heads is None else kv_heads  # expand-kv's default: one KV head per query head
    action = check_kv_heads(H, G, kv_heads)
    check_direction(direction, action, H, G, kv_heads)
    reader = TensorReader(source, files)
    edit = partial(_edit_kv, adapter=adapter, action=action, kv_heads=kv_heads, pool=pool, seed=seed)
    converter = LayerEditor(model, layers, reader, edit)

    # KV bytes per token before and after, by arithmetic in the stored dtype (the model is never run here).
    loaded.dtype = reader.torch_dtype(next(iter(converter.file_keys[layers[0].index].values())))
    kv_bytes_before = kv_bytes_per_token(loaded)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        stream_tensors(reader, converter, layers, writer, progress)
        shards = writer.finish()
        kv_bytes_after = kv_bytes_per_token(loaded)  # the meta modules now have the converted shapes
        adapter.set_config_heads(model.config, H, kv_heads, D)
        model.config.save_pretrained(tmp)
        copy_side_files(source, tmp)
        verification = verify_streamed(tmp, set(reader.where))
        record = {
            "model": str(source),
            "source": str(source),
            "streaming": True,
            "kv_heads_before": G,
            "kv_heads_after": kv_heads,
            "kv_bytes_per_token_before": kv_bytes_before,
            "kv_bytes_per_token_after": kv_bytes_after,
            "conversion": _conversion(G, kv_heads, action, pool, seed, len(layers)).to_dict(),
            "shards": shards,
            "bytes_written": writer.total_bytes,
            "max_shard_bytes": max_shard_bytes,
            "verification": verification,
            "versions": versions(),
            "out": str(out),
        }
        write_json(tmp / META_FILE, record)
    return record
