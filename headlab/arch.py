"""Architecture adapters: the one place that knows where each attention layer's projections live and how heads
are laid out in them. Everything else in headlab works on the canonical per-head view (HeadWeights) and never asks
which model family it is looking at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from headlab.errors import HeadlabError


@dataclass
class AttentionLayer:
    """One softmax-attention layer of a model, with its head layout."""

    index: int  # position among the model's softmax-attention layers (0 .. L-1)
    block: int  # index of the transformer block that holds it (hybrid models skip linear-attention blocks)
    module: nn.Module  # the module whose forward calls transformers' attention interface
    num_heads: int  # H, query heads
    num_kv_heads: int  # G, key/value heads (= H without GQA)
    head_dim: int  # D

    @property
    def group_size(self) -> int:
        """Query heads per KV head; transformers' repeat_kv makes query head h read KV head h // group_size."""
        return self.num_heads // self.num_kv_heads

    def kv_head_of(self, head: int) -> int:
        return head // self.group_size


@dataclass
class HeadWeights:
    """Canonical per-head tensors of one attention layer, independent of how the model fuses or names them.

    C is the hidden size. Dq is head_dim, or 2 * head_dim for gated attention (Qwen3-Next, Qwen3.5), where each
    head's query rows come first and its gate rows second.
    """

    q: torch.Tensor  # [H, Dq, C]
    k: torch.Tensor  # [G, D, C]
    v: torch.Tensor  # [G, D, C]
    o: torch.Tensor  # [C, H, D]  output projection, one [C, D] block per head
    q_bias: torch.Tensor | None = None  # [H, Dq]
    k_bias: torch.Tensor | None = None  # [G, D]
    v_bias: torch.Tensor | None = None  # [G, D]
    o_bias: torch.Tensor | None = None  # [C]
    # Per-head norm weights. [D] when one norm is shared by every head (Qwen3, Gemma3, Qwen3-Next);
    # [H, D] / [G, D] when the norm spans all heads jointly (OLMo2: RMS over H * D values).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k.shape[1]

    def copy(self) -> HeadWeights:
        return replace(self, **{f: (t.clone() if t is not None else None) for f, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {f: getattr(self, f) for f in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")}


@dataclass
class Adapter:
    """How one family of architectures lays out its attention heads.

    Subclasses implement `blocks`, `attention_module`, `out_proj`, `read` and `write`; the flags below tell the
    rest of headlab what a family can and cannot express.
    """

    model_types: tuple[str, ...]
    is_encoder: bool = False  # masked-LM encoders (bidirectional attention, [CLS]/[SEP])
    gated: bool = False  # query projection also produces a per-head output gate
    # q/k norms normalise over all heads at once (OLMo2): removing a head changes the others' normalisation, so
    # physical pruning and KV pooling are approximations there.
    norm_spans_heads: bool = False
    # The config can hold head counts and head_dim independently (so a uniformly pruned checkpoint loads with
    # vanilla from_pretrained); False where head_dim is derived as hidden_size // heads (GPT-2, OPT, BERT, ...).
    free_head_dim: bool = True
    # The config has num_key_value_heads, so GQA conversion is expressible.
    supports_gqa: bool = True
    extra: dict = field(default_factory=dict)

    # ---- to implement per family -------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def attention_module(self, block: nn.Module) -> nn.Module | None:
        """The module that calls the attention interface, or None for blocks without softmax heads."""
        raise NotImplementedError

    def out_proj(self, layer: AttentionLayer) -> nn.Module:
        """The output projection; its input is the concatenation of head outputs, head-major ([.., H * D])."""
        raise NotImplementedError

    def head_dim(self, module: nn.Module) -> int:
        raise NotImplementedError

    def read(self, layer: AttentionLayer) -> HeadWeights:
        raise NotImplementedError

    def write(self, layer: AttentionLayer, weights: HeadWeights) -> None:
        """Replace the layer's projections with `weights` (any head counts) and update the module's bookkeeping."""
        raise NotImplementedError

    def set_config_heads(self, config, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Write uniform head counts into a config so vanilla from_pretrained builds matching shapes."""
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------
    def attention_layers(self, model: nn.Module) -> list[AttentionLayer]:
        layers = []
        for block_index, block in enumerate(self.blocks(model)):
            module = self.attention_module(block)
            if module is None:
                continue
            layer = AttentionLayer(len(layers), block_index, module, 0, 0, self.head_dim(module))
            weights = self.read(layer)
            layer.num_heads, layer.num_kv_heads = weights.num_heads, weights.num_kv_heads
            layers.append(layer)
        if not layers:
            raise HeadlabError(f"{type(model).__name__} has no softmax-attention layers headlab can find")
        return layers


ADAPTERS: dict[str, Adapter] = {}


def register(adapter: Adapter) -> Adapter:
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter
    return adapter


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model_or_config) -> Adapter:
    """The adapter for a model or config; unsupported types get an error listing the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise HeadlabError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return ADAPTERS[model_type]


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    return adapter_for(model).attention_layers(model)
