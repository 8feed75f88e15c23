"""Head gates: a (layers x heads) gate multiplied into each head's output just before the output projection, and the
mask-file format (CSV `layer,head,gate`) that importance and pruning share.

The gate is a forward pre-hook on the adapter's `out_proj(layer)`, whose input is the head outputs concatenated
head-major ([..., H * D]); so it works with any attention kernel, fused or separate projections, gated attention
(after the sigmoid gate), hybrid models (softmax layers only) and encoders. It replaces transformers' removed
`head_mask`: MultiHead = sum_h xi_h Att_h(x) W_o^h (Michel, Levy & Neubig 2019).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from headlab.core.arch import AttentionLayer, adapter_for
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_write_text
from headlab.core.loading import LoadedModel
from headlab.mechanisms.hooks import hooks

MASK_COLUMNS = ("layer", "head", "gate")


def _model_and_adapter(loaded_or_model):
    if isinstance(loaded_or_model, LoadedModel):
        return loaded_or_model.model, loaded_or_model.adapter
    return loaded_or_model, adapter_for(loaded_or_model)


def _layers(layers_or_model) -> list[AttentionLayer]:
    """Attention layers from a list of AttentionLayer, a LoadedModel or a model."""
    if isinstance(layers_or_model, (list, tuple)):
        return list(layers_or_model)
    model, adapter = _model_and_adapter(layers_or_model)
    return adapter.attention_layers(model)


def ones_gates(
    layers_or_model, batch: int | None = None, *, requires_grad: bool = True, dtype=torch.float32, device=None
) -> list[torch.Tensor]:
    """All-ones gates, one leaf tensor per attention layer: [H_l] (shared by the batch) or [batch, H_l]."""
    gates = []
    for layer in _layers(layers_or_model):
        shape = (layer.num_heads,) if batch is None else (batch, layer.num_heads)
        gates.append(torch.ones(shape, dtype=dtype, device=device, requires_grad=requires_grad))
    return gates


@dataclass
class GateHandle:
    """What `head_gates` yields: the gates in use and, with keep_outputs=True, each layer's gated output-projection
    input from the last forward (`outputs[l]`, [B, T, H_l * D]; None for an ungated layer)."""

    gates: list[torch.Tensor | None]
    outputs: list[torch.Tensor | None] = field(default_factory=list)


def _check_gates(layers: list[AttentionLayer], gates) -> list[torch.Tensor | None]:
    gates = list(gates)
    if len(gates) != len(layers):
        raise HeadlabError(f"{len(gates)} gate tensors for {len(layers)} attention layers")
    for layer, gate in zip(layers, gates):
        if gate is None:
            continue
        if not isinstance(gate, torch.Tensor) or gate.dim() not in (1, 2) or gate.shape[-1] != layer.num_heads:
            shape = tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__
            raise HeadlabError(
                f"layer {layer.index}: gate must be [H] or [B, H] with H = {layer.num_heads}, got {shape}"
            )
    return gates


@contextlib.contextmanager
def head_gates(loaded_or_model, gates, *, keep_outputs: bool = False):
    """Multiply head h of attention layer l by gates[l][..., h] inside the block (hooks removed on exit, always).

    gates: one tensor per attention layer (None leaves a layer alone), [H_l] shared by the batch or [B, H_l] one
    row per sequence (per-sequence gradients from one backward pass); soft or 0/1, any float dtype (cast to the
    activations' dtype in the product, so gradients reach a float32 gate from a bfloat16 model).
    """
    model, adapter = _model_and_adapter(loaded_or_model)
    layers = adapter.attention_layers(model)
    gates = _check_gates(layers, gates)
    handle = GateHandle(gates, [None] * len(layers))

    def make_hook(index: int, layer: AttentionLayer, gate: torch.Tensor):
        H, D = layer.num_heads, layer.head_dim

        def hook(x: torch.Tensor) -> torch.Tensor:
            # x: [B, T, H*D], head-major
            if gate.dim() == 2 and x.shape[0] != gate.shape[0]:
                raise HeadlabError(
                    f"layer {layer.index}: per-sequence gates for {gate.shape[0]} rows, got {x.shape[0]}"
                )
            g = gate.to(device=x.device, dtype=x.dtype)
            g = g.view(*g.shape[:-1], *([1] * (x.dim() - g.dim())), H, 1)  # [H, 1] or [B, 1.., H, 1]
            y = (x.unflatten(-1, (H, D)) * g).flatten(-2)  # [B, T, H*D]
            if keep_outputs:
                handle.outputs[index] = y
            return y

        return hook

    site_hooks = [
        ("heads_out", layer, make_hook(index, layer, gate))
        for index, (layer, gate) in enumerate(zip(layers, gates))
        if gate is not None
    ]
    with hooks(adapter, site_hooks):
        yield handle


def gates_from_pruned(layers: list[AttentionLayer], pruned: list[set[int]]) -> list[torch.Tensor]:
    """0/1 gates [H_l]: 0 for pruned heads (the mask-file format of headlab.mechanisms.gates)."""
    gates = []
    for layer, heads in zip(layers, pruned):
        gate = torch.ones(layer.num_heads, dtype=torch.float32)
        gate[sorted(heads)] = 0.0
        gates.append(gate)
    return gates


# ---- mask files --------------------------------------------------------------------------------------------------


def read_mask(path, layers) -> list[torch.Tensor]:
    """Gates [H_l] (float32) from a CSV with columns layer,head,gate; heads not listed keep gate 1.

    `layers`: the model's attention layers (or a LoadedModel / model). Unknown layers or heads, duplicate rows,
    missing columns and non-finite gates are HeadlabErrors.
    """
    layers = _layers(layers)
    path = Path(path)
    if not path.is_file():
        raise HeadlabError(f"no such mask file: {path}")
    try:
        frame = pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read mask file {path}: {str(error).splitlines()[0]}") from None
    missing = [c for c in MASK_COLUMNS if c not in frame.columns]
    if missing:
        raise HeadlabError(f"mask file {path} lacks column(s) {', '.join(missing)}; expected layer,head,gate")
    gates = [torch.ones(layer.num_heads, dtype=torch.float32) for layer in layers]
    seen = set()
    for row, (layer, head, gate) in enumerate(frame[list(MASK_COLUMNS)].itertuples(index=False, name=None), start=2):
        try:
            layer_f, head_f, gate = float(layer), float(head), float(gate)
        except (TypeError, ValueError):
            raise HeadlabError(f"{path}:{row}: layer, head and gate must be numbers") from None
        if not (layer_f.is_integer() and head_f.is_integer()):
            raise HeadlabError(f"{path}:{row}: layer and head must be integers, got {layer}, {head}")
        layer_i, head_i = int(layer_f), int(head_f)
        if not 0 <= layer_i < len(layers):
            raise HeadlabError(
                f"{path}:{row}: layer {layer_i} out of range (the model has {len(layers)} attention layers)"
            )
        if not 0 <= head_i < layers[layer_i].num_heads:
            raise HeadlabError(
                f"{path}:{row}: head {head_i} out of range (layer {layer_i} has {layers[layer_i].num_heads} heads)"
            )
        if not math.isfinite(gate):
            raise HeadlabError(f"{path}:{row}: gate must be finite, got {gate}")
        if (layer_i, head_i) in seen:
            raise HeadlabError(f"{path}:{row}: layer {layer_i} head {head_i} listed twice")
        seen.add((layer_i, head_i))
        gates[layer_i][head_i] = gate
    return gates


def write_mask(path, gates, layers) -> Path:
    """Write gates ([H_l] per layer) as CSV layer,head,gate, every head listed; atomic (temporary file + rename)."""
    layers = _layers(layers)
    gates = _check_gates(layers, gates)
    lines = [",".join(MASK_COLUMNS)]
    for layer, gate in zip(layers, gates):
        if gate is None:
            gate = torch.ones(layer.num_heads)
        if gate.dim() != 1:
            raise HeadlabError(
                f"layer {layer.index}: a mask file holds one gate per head ([H]), got {tuple(gate.shape)}"
            )
        lines += [f"{layer.index},{head},{float(value)!r}" for head, value in enumerate(gate.detach().cpu().tolist())]
    return atomic_write_text(Path(path), "\n".join(lines) + "\n")
