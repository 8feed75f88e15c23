"""`headlab prune --streaming`: head pruning of a safetensors checkpoint one attention module at a time, for models
larger than memory. The heads come from `--heads` or a score table (nothing here runs the model); each attention
module is read from the files, sliced (physical) or zeroed (mask) by the same per-layer functions as the in-memory
prune (`slice_layer`, `mask_layer`), written out and dropped (`headlab.core.streaming`). The checkpoint and its
pruning record equal the in-memory prune's, tensor for tensor; no perplexity is measured.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from headlab.core.checkpoint import META_FILE
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory, write_json
from headlab.core.layout import HEAD_LAYOUT_KEY, has_head_layout, physical_layout
from headlab.core.loading import LoadedModel
from headlab.core.streaming import (
    DEFAULT_MAX_SHARD_BYTES,
    LayerEditor,
    ShardWriter,
    TensorReader,
    copy_side_files,
    read_source_config,
    skeleton,
    stored_names,
    stream_tensors,
    verify_streamed,
)
from headlab.core.tables import versions, write_run
from headlab.core.validate import check_table_origin
from headlab.measure.costs import costs
from headlab.mechanisms.gates import gates_from_pruned, write_mask
from headlab.pruning.prune import (
    RECORD_DIR,
    PruneSpec,
    Selection,
    check_request,
    choose_heads,
    mask_layer,
    original_layers,
    prepare_config,
    selection_record,
    slice_layer,
)
from headlab.pruning.scores import ScoreRequest


def check_streamable(selection: Selection) -> None:
    """What a prune that never runs the model can do: heads given by name or by a score table, ranked."""
    if selection.heads is None and selection.scores is None:
        raise HeadlabError(
            "streaming never runs the model, so it cannot score heads: give heads= (--heads) or a score table "
            "(--scores, e.g. from `headlab importance` on a smaller machine or with --device-map auto)"
        )
    if selection.iterative or selection.select != "rank" or selection.budget == "search":
        raise HeadlabError(
            "streaming never runs the model: iterative=, select= other than rank and budget='search' re-score or "
            "measure it; prune in memory"
        )


def _source_model(source: Path, out: Path, overwrite: bool, max_shard_bytes: int):
    """The checkpoint's files, its skeleton as a LoadedModel on the meta device (stored dtype), and its reader."""
    files, config = read_source_config(source, out, overwrite, max_shard_bytes)
    if has_head_layout(config):
        raise HeadlabError(f"{source} is already pruned per layer ({HEAD_LAYOUT_KEY}); prune it again in memory")
    model, adapter = skeleton(config)
    loaded = LoadedModel(model, None, adapter, str(source), str(source), torch.device("meta"), torch.float32)
    reader = TensorReader(source, files)
    first_key = next(iter(stored_names(model, loaded.layers[0].module, reader.where).values()))
    loaded.dtype = reader.torch_dtype(first_key)  # costs count KV bytes in the stored dtype
    return loaded, reader


def prune_streaming(
    source,
    spec: PruneSpec | None = None,
    selection: Selection | None = None,
    *,
    out,
    mode: str = "physical",
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    allow_foreign_scores: bool = False,
    progress: bool = True,
) -> dict:
    """Prune the heads `selection` names (heads=, or scores= with `spec`'s amount) from a safetensors checkpoint
    directory into `out` (atomic; the source is never touched), one attention module in memory at a time. Returns
    the record written as headlab.json (spec, selection: PruneSpec(), Selection() when None): costs before and after by arithmetic, the loader, the structural check."""
    hf_logging.disable_progress_bar()  # headlab shows its own progress
    source, out = Path(source), Path(out)
    spec, selection = spec or PruneSpec(), selection or Selection()
    check_streamable(selection)
    loaded, reader = _source_model(source, out, overwrite, max_shard_bytes)
    spec, budget, _ = check_request(loaded, spec, selection, mode=mode, compensate=None, out=out, overwrite=overwrite)
    check_table_origin(selection.scores, loaded, "scores=", allow_foreign_scores)
    request = ScoreRequest(progress=progress, table=selection.scores)
    choice = choose_heads(loaded, spec, request, selection, budget=budget, joint=False, compensate=None)
    layers = loaded.layers
    gates = gates_from_pruned(layers, choice.pruned)  # on the original heads, before physical surgery
    before, total_heads = costs(loaded), sum(layer.num_heads for layer in layers)
    layout = physical_layout(layers, choice.pruned) if mode == "physical" else None
    edit = (
        partial(_slice, adapter=loaded.adapter, layout={lay.layer: lay for lay in layout})
        if layout is not None
        else partial(_mask, adapter=loaded.adapter, pruned={layer.index: p for layer, p in zip(layers, choice.pruned)})
    )
    options = dict(heads=selection.heads, scores=selection.scores, method=selection.method, iterative=None,
                   select="rank", budget=budget, calibration_tokens=None, joint=None, seed=selection.seed)  # fmt: skip
    with atomic_directory(out, overwrite=overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        stream_tensors(reader, LayerEditor(loaded.model, layers, reader, edit), layers, writer, progress)
        shards = writer.finish()
        after = costs(loaded)  # the meta modules now have the pruned shapes
        loader = prepare_config(loaded, layout)
        loaded.model.config.save_pretrained(tmp)
        copy_side_files(source, tmp)
        record = {
            **loaded.describe(),
            "streaming": True,
            "mode": mode,
            "loader": loader,
            "selection": selection_record(options, spec),
            "pruned_heads": sum(len(p) for p in choice.pruned),
            "total_heads": total_heads,
            "approximate": mode == "physical" and loaded.adapter.norm_spans_heads,
            "padding_heads": sum(len(lay.padding) for lay in layout or []),
            "costs_before": before,
            "costs_after": after,
            "shards": shards,
            "bytes_written": writer.total_bytes,
            "max_shard_bytes": max_shard_bytes,
            "verification": verify_streamed(tmp, set(reader.where)),
            "versions": versions(),
            "out": str(out),
        }
        write_run(tmp / RECORD_DIR, {"heads": choice.table}, record, overwrite=False)
        write_mask(tmp / RECORD_DIR / "mask.csv", gates, original_layers(choice.table))
        write_json(tmp / META_FILE, record)
    return record


def _slice(layer, *, adapter, layout: dict) -> None:
    slice_layer(adapter, layer, layout[layer.index])


def _mask(layer, *, adapter, pruned: dict) -> None:
    mask_layer(adapter, layer, pruned[layer.index])
