"""Architecture adapters: the one place that knows where each attention layer's projections live and how heads
are laid out in them. Everything else in headlab works on the canonical per-head view (HeadWeights) and never asks
which model family it is looking at.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from headlab.core.errors import HeadlabError

# Named places a hook can reach (Adapter.hook_site resolves them; headlab.mechanisms.hooks registers there).
HOOK_SITES = ("attn_in", "heads_out")
# Model-level sites, one per model (Adapter.model_site): "resid_final" is the residual stream entering the final norm.
MODEL_SITES = ("resid_final",)


@dataclass
class AttentionLayer:
    """One softmax-attention layer of a model, with its head layout."""

    index: int  # position among the model's softmax-attention layers (0 .. L-1)
    block: int  # index of the transformer block that holds it (hybrid models skip linear-attention blocks)
    module: nn.Module  # the module whose forward calls transformers' attention interface
    num_heads: int  # H, query heads
    num_kv_heads: int  # G, key/value heads (= H without GQA)
    head_dim: int  # D
    # The transformer block itself: some families keep the output projection outside `module` (BERT's
    # attention.output.dense), so adapters resolve projection paths from here.
    block_module: nn.Module | None = field(default=None, repr=False)

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
    head's query rows come first and its gate rows second. Norm weights are the raw parameters as stored
    (Gemma's RMSNorm multiplies by 1 + weight).
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
        names = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")
        return {f: getattr(self, f) for f in names}

    def take(self, heads, kv_heads=None) -> HeadWeights:
        """The query heads `heads` and KV heads `kv_heads` (default: all), in the given order, as a new HeadWeights.

        The caller keeps the result valid for repeat_kv: query head h of the result must belong to KV head
        h // (H' / G') of the result.
        """
        heads = torch.as_tensor(list(heads), dtype=torch.long, device=self.q.device)
        kv = torch.arange(self.num_kv_heads) if kv_heads is None else torch.as_tensor(list(kv_heads), dtype=torch.long)
        kv = kv.to(self.k.device)

        def pick(t, index, dim=0):
            return None if t is None else t.index_select(dim, index.to(t.device))

        # A norm spanning heads has one row per head and travels with it; a shared [D] norm stays as is.
        spans = self.q_norm is not None and self.q_norm.dim() == 2
        return HeadWeights(
            q=pick(self.q, heads),
            k=pick(self.k, kv),
            v=pick(self.v, kv),
            o=pick(self.o, heads, dim=1),
            q_bias=pick(self.q_bias, heads),
            k_bias=pick(self.k_bias, kv),
            v_bias=pick(self.v_bias, kv),
            o_bias=None if self.o_bias is None else self.o_bias.clone(),
            q_norm=pick(self.q_norm, heads) if spans else (None if self.q_norm is None else self.q_norm.clone()),
            k_norm=pick(self.k_norm, kv) if spans else (None if self.k_norm is None else self.k_norm.clone()),
        )


@dataclass
class FinalNorm:
    """The norm before the unembedding, written so its scale can be frozen (TransformerLens' apply_ln_to_stack):
    N(x) = gain * P(x) / s(x) + bias, s(x) = sqrt(mean(P(x)^2) + eps), P centring (LayerNorm) or the identity (RMSNorm).
    """

    module: nn.Module  # its input is the final residual stream [B, T, C]
    gain: torch.Tensor  # [C], the weight as the norm applies it (1 + weight for Gemma-style norms)
    bias: torch.Tensor | None  # [C] (LayerNorm) or None
    eps: float
    centred: bool  # LayerNorm subtracts the mean over C first; RMSNorm does not


class _ConfigView:
    """A model config with a few fields overridden for one module; every other field is read live from the shared
    config, so a later `model.set_attn_implementation` still reaches the module."""

    def __init__(self, base, **overrides):
        self.__dict__["_base"] = base
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        # Only called for names not overridden; guard _base so copy/pickle of a bare instance cannot recurse.
        if name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)


def _get(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted path, or None where any part is missing (e.g. hybrid blocks without self_attn)."""
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _set(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, new)


def _param(tensor: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """A fresh contiguous parameter on `like`'s device and dtype (never aliasing the caller's tensor)."""
    data = tensor.detach().to(device=like.device, dtype=like.dtype).clone(memory_format=torch.contiguous_format)
    return nn.Parameter(data, requires_grad=like.requires_grad)


def _linear_like(old: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """nn.Linear holding weight [out, in] (and bias [out]) on old's device/dtype; built on meta to skip init."""
    with torch.device("meta"):
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    new.weight = _param(weight, old.weight)
    if bias is not None:
        new.bias = _param(bias, old.bias if old.bias is not None else old.weight)
    new.train(old.training)
    return new


def _conv1d_like(old: Conv1D, weight: torch.Tensor, bias: torch.Tensor) -> Conv1D:
    """GPT-2's Conv1D holding weight [in, out] (transposed vs nn.Linear) and bias [out]."""
    with torch.device("meta"):
        new = Conv1D(weight.shape[1], weight.shape[0])
    new.weight = _param(weight, old.weight)
    new.bias = _param(bias, old.bias)
    new.train(old.training)
    return new


def _clone(t: torch.Tensor | None, shape=None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach()
    return (t.reshape(shape) if shape is not None else t).clone()


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1)


# Values a module attribute can hold, as functions of the new layout; see Adapter.module_counts.
_COUNTS = {
    "H": lambda H, G, D: H,
    "G": lambda H, G, D: G,
    "H/G": lambda H, G, D: H // G,
    "H*D": lambda H, G, D: H * D,
    "G*D": lambda H, G, D: G * D,
}


@dataclass
class Adapter:
    """How one family of architectures lays out its attention heads.

    Subclasses implement `head_counts`, `out_proj`, `read` and `write`; the fields below locate the blocks and
    the attention module, and the flags tell the rest of headlab what a family can and cannot express.
    """

    model_types: tuple[str, ...]
    is_encoder: bool = False  # masked-LM encoders (bidirectional attention, [CLS]/[SEP])
    gated: bool = False  # query projection also produces a per-head output gate
    # q/k norms normalise over all heads at once (OLMo2): removing a head changes the others' normalisation, so
    # physical pruning and KV pooling are approximations there.
    norm_spans_heads: bool = False
    # Per-head q/k norms see heads before positions ([B, H, T, D], Gemma 3) rather than after ([B, T, H, D], Qwen3):
    # a per-head stand-in for them (headlab.kv.mla.constant_qk_norms) must broadcast that way.
    qk_norm_heads_first: bool = False
    # The config can hold head counts and head_dim independently (so a uniformly pruned checkpoint loads with
    # vanilla from_pretrained); False where head_dim is derived as hidden_size // heads (GPT-2, OPT, BERT, ...).
    free_head_dim: bool = True
    # The config has num_key_value_heads, so GQA conversion is expressible.
    supports_gqa: bool = True
    # Queries and keys get rotary embeddings (rotate_half layout); see rotary_dim.
    rotary: bool = True
    # The cache holds one compressed latent for all heads (MLA) instead of per-KV-head keys and values: KV-head
    # pooling (convert-gqa, expand-kv, merge) does not apply, and kv_cache_numbers gives the latent's size.
    latent_kv: bool = False
    # Which of transformers' two cache slots ("keys", "values") hold keys alone, entering only q.k: a KIVI-grouped
    # quantized cache quantizes those per channel and the others per token (headlab.mechanisms.quantized_cache).
    cache_pure_keys: tuple[bool, bool] = (True, False)
    extra: dict = field(default_factory=dict)
    # Name suffixes of the blocks' ModuleList, tried in order (multimodal wrappers first: their vision towers
    # also hold "layers").
    blocks_path: tuple[str, ...] = ("layers",)
    attn: str = "self_attn"  # block -> module that calls the attention interface
    head_dim_attr: str = "head_dim"  # attribute of that module holding D
    # Module attributes that forward (or transformers' attention functions) read, with the layout value each
    # must hold after a write: "H", "G", "H/G", "H*D" or "G*D".
    module_counts: tuple[tuple[str, str], ...] = (("num_key_value_groups", "H/G"),)
    # Config fields the module's forward reads from `module.config` (Phi3: num_attention_heads); a write gives the
    # module a config view overriding them so layers can differ.
    config_counts: tuple[tuple[str, str], ...] = ()
    # The norm between the last block and the unembedding: its name in the module that holds the block list.
    final_norm_name: str = "norm"
    # Added to that norm's weight before it scales (Gemma and Qwen3-Next store w and multiply by 1 + w).
    norm_offset: float = 0.0
    # Block-relative names of norms applied to a sublayer's output before the residual add (OLMo 2, Gemma 3), and of
    # sublayers that read the residual stream unnormalised (OLMo 2): what a pre-norm target cannot hold
    # (headlab.kv.post_norms).
    post_norms: tuple[str, ...] = ()
    raw_sublayers: tuple[str, ...] = ()
    # Block-relative names of the norms before attention and before the MLP (where a block has them): a pre-norm
    # target (deepseek_v3) names them input_layernorm and post_attention_layernorm.
    pre_norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    # Bias-free linear maps between the final norm and the unembedding, where a model has them (OPT's project_out
    # when word_embed_proj_dim differs from hidden_size); folded into the unembedding.
    unembed_in: tuple[str, ...] = ()

    # ---- to implement per family -------------------------------------------------------------------------
    def head_counts(self, layer: AttentionLayer) -> tuple[int, int]:
        """(H, G) read from the projection shapes, without copying weights."""
        raise NotImplementedError

    def out_proj(self, layer: AttentionLayer) -> nn.Module:
        """The output projection; its input is the concatenation of head outputs, head-major ([.., H * D])."""
        raise NotImplementedError

    def read(self, layer: AttentionLayer) -> HeadWeights:
        raise NotImplementedError

    def ov_weights(self, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_V [G, D, C], W_O [C, H, D]): each head's value map from the layer's (normed) input and its output
        block, biases left out; query head h reads KV head h // (H/G). The OV circuit of head h is W_O[:, h] W_V[g]."""
        weights = self.read(layer)
        return weights.v, weights.o

    def hook_site(self, layer: AttentionLayer, site: str) -> nn.Module:
        """The module whose forward pre-hook sees a named site (HOOK_SITES): "attn_in" -> the attention
        module (its input is the block's normed hidden states [B, T, C]); "heads_out" -> the output projection (its
        input is the head outputs concatenated head-major [B, T, H * D])."""
        if site == "attn_in":
            return layer.module
        if site == "heads_out":
            return self.out_proj(layer)
        raise HeadlabError(f"unknown hook site {site!r}; use one of {', '.join(HOOK_SITES)}")

    def model_site(self, model: nn.Module, site: str) -> nn.Module:
        """The module whose forward pre-hook sees a model-level site (MODEL_SITES): "resid_final" -> the final norm
        (its input is the residual stream after the last block, [B, T, C])."""
        if site == "resid_final":
            return self.final_norm(model).module
        raise HeadlabError(f"unknown model-level hook site {site!r}; use one of {', '.join(MODEL_SITES)}")

    def _beside_blocks(self, model: nn.Module, name: str) -> nn.Module | None:
        """The submodule `name` of the module that holds the block list (where final norms and OPT's project_out
        sit), or None."""
        blocks = self.blocks(model)
        parent = next((m for m in model.modules() if any(c is blocks for c in m.children())), None)
        return None if parent is None else _get(parent, name)

    def qk_norm_modules(self, layer) -> tuple[nn.Module | None, nn.Module | None]:
        """The modules that normalise each query / key head before RoPE (Qwen3, OLMo 2), or None: what the MLA
        conversion replaces by a calibrated constant (headlab.kv.mla.qk_norm_multipliers)."""
        return None, None

    def final_norm(self, model: nn.Module) -> FinalNorm:
        """The norm the last residual stream passes before the unembedding (`final_norm`, beside the blocks).

        Refused for encoders (their LM head transforms before it unembeds) and for models without one (post-LN
        blocks such as OPT-350m's normalise the residual inside every block, so no sum of components reaches it)."""
        name = type(model).__name__
        if self.is_encoder:
            raise HeadlabError(f"{name} is an encoder: its masked-LM head is not a norm followed by an unembedding")
        module = self._beside_blocks(model, self.final_norm_name)
        if module is None:
            raise HeadlabError(f"{name} has no final norm {self.final_norm_name!r} beside its blocks (post-LN blocks?)")
        weight = getattr(module, "weight", None)
        eps = next((getattr(module, a) for a in ("eps", "variance_epsilon") if hasattr(module, a)), None)
        if weight is None or eps is None:
            raise HeadlabError(f"{name}: the final norm {type(module).__name__} has no weight or eps to freeze")
        return FinalNorm(
            module=module,
            gain=weight.detach() + self.norm_offset,
            bias=None if getattr(module, "bias", None) is None else module.bias.detach(),
            eps=float(eps),
            centred=isinstance(module, nn.LayerNorm),
        )

    def unembedding(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W_U [V, C], b_U [V] or None): the output embedding (tied or not) with any unembed_in map folded in, so
        logits = W_U @ N(x) + b_U before soft-capping."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or getattr(head, "weight", None) is None:
            raise HeadlabError(f"{type(model).__name__} has no output embedding (an LM head) to attribute logits to")
        weight = head.weight.detach()
        for name in self.unembed_in:
            module = self._beside_blocks(model, name)
            if module is not None:
                weight = weight @ module.weight.detach()  # [V, P] @ [P, C]: the map comes first
        bias = getattr(head, "bias", None)
        return weight, None if bias is None else bias.detach()

    def write(self, layer: AttentionLayer, weights: HeadWeights) -> None:
        """Replace the layer's projections with `weights` (any head counts) and update the module's bookkeeping.

        H must be a multiple of G (repeat_kv's contiguous groups) and D must stay the model's head_dim. The new
        projections are plain nn.Linear / Conv1D on the old weights' device and dtype; hooks registered on the
        old projection modules do not carry over.
        """
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The ModuleList of transformer blocks, found by name suffix so LM-head and bare models both work."""
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        for suffix in self.blocks_path:
            found = [m for n, m in lists if n == suffix or n.endswith("." + suffix)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                names = [n for n, m in lists if n == suffix or n.endswith("." + suffix)]
                raise HeadlabError(f"{type(model).__name__}: several block lists match {suffix!r}: {names}")
        raise HeadlabError(f"{type(model).__name__} has no block list named like {' or '.join(self.blocks_path)}")

    def attention_module(self, block: nn.Module) -> nn.Module | None:
        """The module that calls the attention interface, or None for blocks without softmax heads."""
        return _get(block, self.attn)

    def head_dim(self, module: nn.Module) -> int:
        return int(getattr(module, self.head_dim_attr))

    def attention_layers(self, model: nn.Module) -> list[AttentionLayer]:
        layers = []
        for block_index, block in enumerate(self.blocks(model)):
            module = self.attention_module(block)
            if module is None:
                continue
            layer = AttentionLayer(len(layers), block_index, module, 0, 0, self.head_dim(module), block)
            layer.num_heads, layer.num_kv_heads = self.head_counts(layer)
            layers.append(layer)
        if not layers:
            raise HeadlabError(f"{type(model).__name__} has no softmax-attention layers headlab can find")
        return layers

    def set_config_heads(self, config, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Write uniform head counts into a config so vanilla from_pretrained builds matching shapes."""
        config = config.get_text_config()
        if not self.supports_gqa and num_kv_heads != num_heads:
            raise HeadlabError(f"{config.model_type} configs cannot hold {num_kv_heads} KV heads for {num_heads} heads")
        if not self.free_head_dim and num_heads * head_dim != config.hidden_size:
            raise HeadlabError(
                f"{config.model_type} derives head_dim as hidden_size // heads, so {num_heads} heads of {head_dim} "
                f"cannot be expressed with hidden_size {config.hidden_size}"
            )
        config.num_attention_heads = num_heads
        if self.supports_gqa:
            config.num_key_value_heads = num_kv_heads
        if self.free_head_dim:
            config.head_dim = head_dim

    def rotary_dim(self, layer: AttentionLayer, config) -> int:
        """Leading dimensions of each query/key head that rotary embeddings rotate, in transformers' rotate_half
        pairs (i, i + rd/2); the remaining D - rd are not rotated. 0 for families without rotary embeddings.
        Reads rope_parameters' partial_rotary_factor (per layer type where the parameters are nested that way)."""
        if not self.rotary:
            return 0
        config = config.get_text_config()
        params = getattr(config, "rope_parameters", None) or {}
        layer_types = getattr(config, "layer_types", None)
        if layer_types and isinstance(params.get(layer_types[layer.block]), dict):
            params = params[layer_types[layer.block]]
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        return int(layer.head_dim * factor) // 2 * 2

    def qk_head_dim(self, layer: AttentionLayer) -> int:
        """Width of each head's queries and keys (the QK^T dot product); D for every family but MLA."""
        return layer.head_dim

    def cache_shapes(self, layer: AttentionLayer, batch: int, tokens: int) -> tuple[tuple, tuple]:
        """Shapes of the (keys, values) transformers' cache holds for the layer: [B, G, T, D] each."""
        shape = (batch, layer.num_kv_heads, tokens, layer.head_dim)
        return shape, shape

    def kv_cache_numbers(self, layer: AttentionLayer) -> int:
        """Numbers one token adds to the layer's KV cache: keys and values of every KV head, 2 x G x D."""
        return 2 * layer.num_kv_heads * layer.head_dim

    def layout_fields(self, config) -> dict[str, int]:
        """The uniform layout a config describes: num_heads, num_kv_heads, head_dim (as set_config_heads writes)."""
        config = config.get_text_config()
        num_heads = config.num_attention_heads
        num_kv_heads = (getattr(config, "num_key_value_heads", None) if self.supports_gqa else None) or num_heads
        head_dim = getattr(config, "head_dim", None) if self.free_head_dim else None
        head_dim = head_dim or config.hidden_size // num_heads
        return {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}

    # ---- helpers for subclasses ---------------------------------------------------------------------------
    def _check(self, layer: AttentionLayer, weights: HeadWeights) -> tuple[int, int, int]:
        """Validate a layout this family can run; returns (H, G, D)."""
        H, G, D = weights.num_heads, weights.num_kv_heads, weights.head_dim
        if D != layer.head_dim:
            # Rotary tables and the softmax scaling are built for the model's head_dim.
            raise HeadlabError(f"layer {layer.index}: head_dim must stay {layer.head_dim}, got {D}")
        if H < 1 or G < 1 or H % G:
            raise HeadlabError(f"layer {layer.index}: {H} query heads cannot be split evenly over {G} KV heads")
        if not self.supports_gqa and G != H:
            raise HeadlabError(f"{'/'.join(self.model_types)} needs as many KV heads as query heads, got {G} for {H}")
        dq = 2 * D if self.gated else D
        if weights.q.shape[1] != dq or weights.o.shape[1:] != (H, D) or weights.v.shape[:2] != (G, D):
            raise ValueError(f"inconsistent HeadWeights: q {tuple(weights.q.shape)}, o {tuple(weights.o.shape)}")
        return H, G, D

    def _update_counts(self, layer: AttentionLayer, H: int, G: int, D: int) -> None:
        module = layer.module
        for attr, what in self.module_counts:
            setattr(module, attr, _COUNTS[what](H, G, D))
        if self.config_counts:
            base = module.config._base if isinstance(module.config, _ConfigView) else module.config
            overrides = {f: _COUNTS[what](H, G, D) for f, what in self.config_counts}
            # Only layers that differ from the shared config need their own view.
            same = all(getattr(base, f, None) == value for f, value in overrides.items())
            module.config = base if same else _ConfigView(base, **overrides)
        layer.num_heads, layer.num_kv_heads = H, G


@dataclass
class SeparateQKV(Adapter):
    """Families with separate q/k/v/o projections (nn.Linear, weight [out, in]); paths are relative to the block."""

    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    q_norm: str | None = None
    k_norm: str | None = None

    def head_counts(self, layer):
        D = layer.head_dim
        return _get(layer.block_module, self.o).in_features // D, _get(layer.block_module, self.k).out_features // D

    def qk_norm_modules(self, layer):
        block = layer.block_module
        return tuple(None if path is None else _get(block, path) for path in (self.q_norm, self.k_norm))

    def out_proj(self, layer):
        return _get(layer.block_module, self.o)

    def read(self, layer):
        block, D = layer.block_module, layer.head_dim
        q, k, v, o = (_get(block, p) for p in (self.q, self.k, self.v, self.o))
        C = q.in_features
        H, G = o.in_features // D, k.out_features // D
        dq = q.out_features // H  # D, or 2D with per-head [query, gate] rows
        w = HeadWeights(
            q=_clone(q.weight, (H, dq, C)),
            k=_clone(k.weight, (G, D, C)),
            v=_clone(v.weight, (G, D, C)),
            o=_clone(o.weight, (o.out_features, H, D)),
            q_bias=_clone(q.bias, (H, dq)),
            k_bias=_clone(k.bias, (G, D)),
            v_bias=_clone(v.bias, (G, D)),
            o_bias=_clone(o.bias),
        )
        for name, path, n in (("q_norm", self.q_norm, H), ("k_norm", self.k_norm, G)):
            if path is not None:
                weight = _get(block, path).weight
                setattr(w, name, _clone(weight, (n, D) if self.norm_spans_heads else None))
        return w

    def write(self, layer, weights):
        H, G, D = self._check(layer, weights)
        block = layer.block_module
        C = weights.q.shape[2]
        for path, w, b in (
            (self.q, weights.q.reshape(-1, C), _flat(weights.q_bias)),  # [H*Dq, C]
            (self.k, weights.k.reshape(G * D, C), _flat(weights.k_bias)),  # [G*D, C]
            (self.v, weights.v.reshape(G * D, C), _flat(weights.v_bias)),  # [G*D, C]
            (self.o, weights.o.reshape(weights.o.shape[0], H * D), weights.o_bias),  # [C, H*D]
        ):
            _set(block, path, _linear_like(_get(block, path), w, b))
        for path, value in ((self.q_norm, weights.q_norm), (self.k_norm, weights.k_norm)):
            if path is not None and value is not None:
                norm = _get(block, path)
                # The norm module keeps its eps; a spanning norm just gets a longer weight ([H*D] / [G*D]).
                norm.weight = _param(value.reshape(-1) if self.norm_spans_heads else value, norm.weight)
        self._update_counts(layer, H, G, D)


@dataclass
class PackedQKV(Adapter):
    """Adapters whose q, k and v share one module `qkv` (each subclass knows its row layout) beside the output
    projection `o`; writing replaces both modules and records the new head counts."""

    qkv: str = ""
    o: str = ""

    def out_proj(self, layer):
        return _get(layer.block_module, self.o)

    def _replace(self, layer, qkv: nn.Module, o: nn.Module, counts: tuple[int, int, int]) -> None:
        """Put the rebuilt `qkv` and `o` modules in place; counts: the new (H, G, D)."""
        _set(layer.block_module, self.qkv, qkv)
        _set(layer.block_module, self.o, o)
        self._update_counts(layer, *counts)


@dataclass
class FusedQKV(PackedQKV):
    """Phi3: one nn.Linear `qkv_proj` with rows [q (H*D), k (G*D), v (G*D)], then `o_proj`."""

    qkv: str = "self_attn.qkv_proj"
    o: str = "self_attn.o_proj"

    def head_counts(self, layer):
        D = layer.head_dim
        H = _get(layer.block_module, self.o).in_features // D
        return H, (_get(layer.block_module, self.qkv).out_features - H * D) // (2 * D)

    def read(self, layer):
        qkv, o = _get(layer.block_module, self.qkv), _get(layer.block_module, self.o)
        D, C = layer.head_dim, qkv.in_features
        H, G = self.head_counts(layer)
        q, k, v = qkv.weight.split([H * D, G * D, G * D])
        qb, kb, vb = qkv.bias.split([H * D, G * D, G * D]) if qkv.bias is not None else (None, None, None)
        return HeadWeights(
            q=_clone(q, (H, D, C)),
            k=_clone(k, (G, D, C)),
            v=_clone(v, (G, D, C)),
            o=_clone(o.weight, (o.out_features, H, D)),
            q_bias=_clone(qb, (H, D)),
            k_bias=_clone(kb, (G, D)),
            v_bias=_clone(vb, (G, D)),
            o_bias=_clone(o.bias),
        )

    def write(self, layer, weights):
        H, G, D = self._check(layer, weights)
        block, C = layer.block_module, weights.q.shape[2]
        weight = torch.cat([weights.q.reshape(H * D, C), weights.k.reshape(G * D, C), weights.v.reshape(G * D, C)])
        biases = (weights.q_bias, weights.k_bias, weights.v_bias)
        bias = None if weights.q_bias is None else torch.cat([_flat(b) for b in biases])  # [(H+2G)*D]
        o = _linear_like(_get(block, self.o), weights.o.reshape(-1, H * D), weights.o_bias)
        self._replace(layer, _linear_like(_get(block, self.qkv), weight, bias), o, (H, G, D))


@dataclass
class InterleavedQKV(PackedQKV):
    """GPT-NeoX: one nn.Linear `query_key_value` whose rows go head by head, [q (D), k (D), v (D)] per head."""

    qkv: str = "attention.query_key_value"
    o: str = "attention.dense"

    def head_counts(self, layer):
        H = _get(layer.block_module, self.o).in_features // layer.head_dim
        return H, H

    def read(self, layer):
        qkv, o = _get(layer.block_module, self.qkv), _get(layer.block_module, self.o)
        D, C = layer.head_dim, qkv.in_features
        H = o.in_features // D
        w = qkv.weight.detach().view(H, 3, D, C)
        b = qkv.bias.detach().view(H, 3, D) if qkv.bias is not None else None
        return HeadWeights(
            q=w[:, 0].clone(),
            k=w[:, 1].clone(),
            v=w[:, 2].clone(),
            o=_clone(o.weight, (o.out_features, H, D)),
            q_bias=None if b is None else b[:, 0].clone(),
            k_bias=None if b is None else b[:, 1].clone(),
            v_bias=None if b is None else b[:, 2].clone(),
            o_bias=_clone(o.bias),
        )

    def write(self, layer, weights):
        H, G, D = self._check(layer, weights)
        block, C = layer.block_module, weights.q.shape[2]
        weight = torch.stack([weights.q, weights.k, weights.v], dim=1).reshape(H * 3 * D, C)  # [H, 3, D, C] flat
        bias = None
        if weights.q_bias is not None:
            bias = torch.stack([weights.q_bias, weights.k_bias, weights.v_bias], dim=1).reshape(-1)  # [H*3*D]
        o = _linear_like(_get(block, self.o), weights.o.reshape(-1, H * D), weights.o_bias)
        self._replace(layer, _linear_like(_get(block, self.qkv), weight, bias), o, (H, G, D))


@dataclass
class Conv1DQKV(PackedQKV):
    """GPT-2: Conv1D `c_attn` with weight [C, 3*H*D] (columns [q, k, v]) and Conv1D `c_proj` with weight [H*D, C]."""

    qkv: str = "attn.c_attn"
    o: str = "attn.c_proj"

    def head_counts(self, layer):
        H = _get(layer.block_module, self.o).weight.shape[0] // layer.head_dim
        return H, H

    def read(self, layer):
        qkv, o = _get(layer.block_module, self.qkv), _get(layer.block_module, self.o)
        D, C = layer.head_dim, qkv.weight.shape[0]
        H = o.weight.shape[0] // D
        q, k, v = qkv.weight.detach().t().split(H * D)  # each [H*D, C]
        qb, kb, vb = qkv.bias.detach().split(H * D)
        return HeadWeights(
            q=_clone(q, (H, D, C)),
            k=_clone(k, (H, D, C)),
            v=_clone(v, (H, D, C)),
            o=_clone(o.weight.detach().t(), (C, H, D)),
            q_bias=_clone(qb, (H, D)),
            k_bias=_clone(kb, (H, D)),
            v_bias=_clone(vb, (H, D)),
            o_bias=_clone(o.bias),
        )

    def write(self, layer, weights):
        H, G, D = self._check(layer, weights)
        block, C = layer.block_module, weights.q.shape[2]
        weight = torch.cat([w.reshape(H * D, C) for w in (weights.q, weights.k, weights.v)]).t()  # [C, 3*H*D]
        zeros = torch.zeros(H * D, dtype=weights.q.dtype, device=weights.q.device)
        biases = (weights.q_bias, weights.k_bias, weights.v_bias)
        bias = torch.cat([_flat(b) if b is not None else zeros for b in biases])  # [3*H*D]
        o_bias = weights.o_bias if weights.o_bias is not None else torch.zeros(C, dtype=weights.o.dtype)
        o = _conv1d_like(_get(block, self.o), weights.o.reshape(C, H * D).t(), o_bias)
        self._replace(layer, _conv1d_like(_get(block, self.qkv), weight, bias), o, (H, G, D))


@dataclass
class LatentHeadWeights(HeadWeights):
    """Per-head tensors of a multi-head latent attention (MLA, DeepSeek-V2/V3) layer, plus the tensors all heads share.

    Per head h: q[h] its query rows of q_proj (or of q_b_proj with a query LoRA), [Dqk, Cq] with Dqk = qk_nope +
    qk_rope (the rope rows in consecutive-pair order); k[h] and v[h] its rows of kv_b_proj, [qk_nope, R] and [Dv, R],
    which read the normed latent (R = kv_lora_rank), not the hidden state; o[:, h] its [C, Dv] output block. Shared by
    every head and never sliced: kv_a ([R + qk_rope, C], the latent and the one rotary key), the latent norm's
    weight [R] (None where the norm is an identity), and the query LoRA's q_a / q_a_norm. The per-head keys are
    k_nope_h = k[h] @ norm(latent) joined with the shared rotary key (DeepSeek-V2, arXiv:2405.04434, eqs. 9-13).
    """

    kv_a: torch.Tensor | None = None  # [R + r, C]
    kv_a_bias: torch.Tensor | None = None  # [R + r]
    latent_norm: torch.Tensor | None = None  # [R]
    q_a: torch.Tensor | None = None  # [Rq, C]
    q_a_bias: torch.Tensor | None = None  # [Rq]
    q_a_norm: torch.Tensor | None = None  # [Rq]

    SHARED = ("kv_a", "kv_a_bias", "latent_norm", "q_a", "q_a_bias", "q_a_norm")

    @property
    def num_kv_heads(self) -> int:
        return self.q.shape[0]  # every query head has its own key and value, expanded from the latent

    @property
    def head_dim(self) -> int:
        return self.v.shape[1]  # Dv: the width each head hands the output projection

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {**super().tensors(), **{f: getattr(self, f) for f in self.SHARED}}

    def take(self, heads, kv_heads=None) -> LatentHeadWeights:
        """Query heads `heads` with their own kv_b rows; kv_heads, when given, must name the same heads (each head
        is its own KV head here); the shared tensors are copied whole."""
        heads = list(heads)
        if kv_heads is not None and list(kv_heads) != heads:
            raise HeadlabError(f"MLA heads carry their own keys and values: KV heads {list(kv_heads)} != {heads}")
        picked = HeadWeights.take(self, heads, heads)
        shared = {f: _clone(getattr(self, f)) for f in self.SHARED}
        return LatentHeadWeights(**{f: getattr(picked, f) for f in HeadWeights.tensors(picked)}, **shared)


@dataclass
class LatentQKV(Adapter):
    """Multi-head latent attention (DeepSeek-V2/V3 in transformers): q_proj (or q_a -> norm -> q_b), a shared
    kv_a_proj_with_mqa giving the latent and one rotary key, kv_a_layernorm on the latent, kv_b_proj expanding it to
    per-head [k_nope; v], and o_proj over H x v_head_dim. AttentionLayer.head_dim is v_head_dim (what a head hands
    the output projection and what gates, reconstruction and compensation slice); queries and keys are wider
    (qk_nope + qk_rope). Heads prune physically (q rows, kv_b rows, o columns); KV-head pooling does not apply: the
    cache is one latent for all heads."""

    q: str = "self_attn.q_proj"
    q_b: str = "self_attn.q_b_proj"
    q_a: str = "self_attn.q_a_proj"
    q_a_norm: str = "self_attn.q_a_layernorm"
    kv_a: str = "self_attn.kv_a_proj_with_mqa"
    latent_norm: str = "self_attn.kv_a_layernorm"
    kv_b: str = "self_attn.kv_b_proj"
    o: str = "self_attn.o_proj"
    # The "keys" slot holds the latent (keys and values both expand from it), "values" the rotary key (cache_shapes).
    cache_pure_keys: tuple[bool, bool] = (False, True)

    def head_counts(self, layer):
        H = _get(layer.block_module, self.o).in_features // layer.head_dim
        return H, H

    def out_proj(self, layer):
        return _get(layer.block_module, self.o)

    def _query(self, layer) -> str:
        """Path of the projection holding the per-head query rows: q_proj, or q_b_proj with a query LoRA."""
        return self.q if _get(layer.block_module, self.q) is not None else self.q_b

    def kv_cache_numbers(self, layer) -> int:
        """The latent and the shared rotary key: kv_lora_rank + qk_rope_head_dim numbers per token (DeepSeek-V2)."""
        return int(layer.module.kv_lora_rank + layer.module.qk_rope_head_dim)

    def cache_shapes(self, layer, batch: int, tokens: int) -> tuple[tuple, tuple]:
        """transformers' DeepseekV3Attention caches the normed latent as "keys" [B, 1, T, kv_lora_rank] and the rotated
        shared key as "values" [B, 1, T, qk_rope_head_dim], and expands them to per-head keys and values per call."""
        rank, rope = self.latent_dims(layer)
        return (batch, 1, tokens, rank), (batch, 1, tokens, rope)

    def qk_head_dim(self, layer) -> int:
        """qk_nope_head_dim + qk_rope_head_dim (head_dim here is the value width)."""
        return int(layer.module.qk_head_dim)

    def latent_dims(self, layer) -> tuple[int, int]:
        """(kv_lora_rank, qk_rope_head_dim) of the layer."""
        return int(layer.module.kv_lora_rank), int(layer.module.qk_rope_head_dim)

    def rotary_dim(self, layer, config) -> int:
        """qk_rope_head_dim: the trailing query/key dimensions, in consecutive pairs (rope_interleave), not the
        rotate_half layout of the other families; the value head (head_dim here) has no rotary part."""
        return int(layer.module.qk_rope_head_dim)

    def read(self, layer):
        block, module = layer.block_module, layer.module
        nope, Dv, Dqk = module.qk_nope_head_dim, module.v_head_dim, module.qk_nope_head_dim + module.qk_rope_head_dim
        q, kv_b, o = _get(block, self._query(layer)), _get(block, self.kv_b), _get(block, self.o)
        H = o.in_features // Dv
        k, v = kv_b.weight.detach().view(H, nope + Dv, -1).split([nope, Dv], dim=1)
        kv_a, q_a = _get(block, self.kv_a), _get(block, self.q_a)
        return LatentHeadWeights(
            q=_clone(q.weight, (H, Dqk, q.in_features)),
            k=k.clone(),
            v=v.clone(),
            o=_clone(o.weight, (o.out_features, H, Dv)),
            q_bias=_clone(q.bias, (H, Dqk)),
            o_bias=_clone(o.bias),
            kv_a=_clone(kv_a.weight),
            kv_a_bias=_clone(kv_a.bias),
            latent_norm=_clone(getattr(_get(block, self.latent_norm), "weight", None)),  # None: identity norm
            q_a=None if q_a is None else _clone(q_a.weight),
            q_a_bias=None if q_a is None else _clone(q_a.bias),
            q_a_norm=None if q_a is None else _clone(_get(block, self.q_a_norm).weight),
        )

    def ov_weights(self, layer):
        """W_V through the latent: v[h] diag(latent norm weight) kv_a[:R] ([H, Dv, C]; the latent RMSNorm as its scale
        only, the rotary key carries no value), and W_O."""
        weights = self.read(layer)
        latent = weights.kv_a[: self.latent_dims(layer)[0]]  # [R, C]
        if weights.latent_norm is not None:
            latent = latent * weights.latent_norm[:, None]
        return weights.v @ latent, weights.o

    def write(self, layer, weights):
        if not isinstance(weights, LatentHeadWeights):
            raise HeadlabError(f"layer {layer.index}: MLA layers take LatentHeadWeights, got {type(weights).__name__}")
        block, module = layer.block_module, layer.module
        H, nope, Dv = weights.num_heads, module.qk_nope_head_dim, module.v_head_dim
        Dqk = nope + module.qk_rope_head_dim
        shapes_ok = (
            weights.q.shape[:2] == (H, Dqk)
            and weights.k.shape[:2] == (H, nope)
            and weights.v.shape[:2] == (H, Dv)
            and weights.o.shape[1:] == (H, Dv)
        )
        if H < 1 or not shapes_ok:
            raise HeadlabError(
                f"layer {layer.index}: MLA heads need q [H, {Dqk}, .], k [H, {nope}, .], v [H, {Dv}, .], o [C, H, {Dv}]"
                f"; got q {tuple(weights.q.shape)}, k {tuple(weights.k.shape)}, v {tuple(weights.v.shape)}, "
                f"o {tuple(weights.o.shape)}"
            )
        kv_b = torch.cat([weights.k, weights.v], dim=1).reshape(H * (nope + Dv), -1)  # [H*(nope+Dv), R], per head
        q_path = self._query(layer)
        for path, w, b in (
            (q_path, weights.q.reshape(H * Dqk, -1), _flat(weights.q_bias)),
            (self.kv_b, kv_b, None),
            (self.o, weights.o.reshape(weights.o.shape[0], H * Dv), weights.o_bias),
        ):
            _set(block, path, _linear_like(_get(block, path), w, b))
        # The shared tensors keep their modules (and shapes); their values are copied in, so restoring an earlier
        # read also undoes training of the latent projection.
        with torch.no_grad():
            for path, attr, value in (
                (self.kv_a, "weight", weights.kv_a),
                (self.kv_a, "bias", weights.kv_a_bias),
                (self.latent_norm, "weight", weights.latent_norm),
                (self.q_a, "weight", weights.q_a),
                (self.q_a, "bias", weights.q_a_bias),
                (self.q_a_norm, "weight", weights.q_a_norm),
            ):
                target = getattr(_get(block, path), attr, None) if _get(block, path) is not None else None
                if target is not None and value is not None:
                    target.copy_(value.to(device=target.device, dtype=target.dtype))
        module.num_heads = H
        self._update_counts(layer, H, H, Dv)

    def set_config_heads(self, config, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """H query heads, each with its own expanded key and value (num_key_value_heads = H); the head dims
        (qk_nope, qk_rope, v_head_dim) stay: config.head_dim is the rope dim in DeepSeek configs and is not touched."""
        config = config.get_text_config()
        if num_kv_heads != num_heads:
            raise HeadlabError(f"{config.model_type} needs as many KV heads as query heads, got {num_kv_heads}")
        if head_dim != config.v_head_dim:
            raise HeadlabError(f"{config.model_type}: v_head_dim must stay {config.v_head_dim}, got {head_dim}")
        config.num_attention_heads = num_heads
        config.num_key_value_heads = num_heads

    def layout_fields(self, config) -> dict[str, int]:
        config = config.get_text_config()
        H = config.num_attention_heads
        return {"num_heads": H, "num_kv_heads": H, "head_dim": config.v_head_dim}


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
        raise HeadlabError(f"unsupported architecture {model_type!r}; supported: {', '.join(supported_model_types())}")
    return ADAPTERS[model_type]


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    return adapter_for(model).attention_layers(model)


# ---- the registry ---------------------------------------------------------------------------------------------
register(SeparateQKV(("llama", "mistral", "qwen2")))
register(SeparateQKV(("qwen3",), q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"))
# Hybrids: blocks holding `linear_attn` have no `self_attn` and are skipped; q_proj rows are [query, gate] per head.
# The multimodal qwen3_5 wrapper keeps the text blocks under language_model (its vision tower uses "blocks").
register(
    SeparateQKV(
        ("qwen3_next", "qwen3_5_text", "qwen3_5"),
        gated=True,
        blocks_path=("language_model.layers", "layers"),
        norm_offset=1.0,
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    )
)
# Gemma3: the multimodal wrapper's SigLIP tower also has encoder.layers, hence language_model first.
register(
    SeparateQKV(
        ("gemma3_text", "gemma3"),
        blocks_path=("language_model.layers", "layers"),
        norm_offset=1.0,
        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        pre_norms=("input_layernorm", "pre_feedforward_layernorm"),
        qk_norm_heads_first=True,
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
    )
)
# OLMo 2's blocks: h = x + norm(attn(x)), out = h + norm(mlp(h)): its post_attention_layernorm is a post-norm.
register(
    SeparateQKV(
        ("olmo2",),
        norm_spans_heads=True,
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        raw_sublayers=("self_attn", "mlp"),
    )
)
register(
    SeparateQKV(
        ("opt",),
        free_head_dim=False,
        supports_gqa=False,
        o="self_attn.out_proj",
        rotary=False,
        module_counts=(("num_heads", "H"),),
        final_norm_name="final_layer_norm",
        unembed_in=("project_out",),
    )
)
register(
    SeparateQKV(
        ("bert", "roberta"),
        is_encoder=True,
        free_head_dim=False,
        supports_gqa=False,
        blocks_path=("encoder.layer",),
        attn="attention.self",
        head_dim_attr="attention_head_size",
        rotary=False,
        q="attention.self.query",
        k="attention.self.key",
        v="attention.self.value",
        o="attention.output.dense",
        module_counts=(("num_attention_heads", "H"), ("all_head_size", "H*D")),
    )
)
# Phi3's forward slices qkv at config.num_attention_heads * head_dim, so that count lives in a per-module config view.
register(
    FusedQKV(
        ("phi3",),
        module_counts=(("num_key_value_groups", "H/G"), ("num_key_value_heads", "G")),
        config_counts=(("num_attention_heads", "H"),),
    )
)
register(
    InterleavedQKV(
        ("gpt_neox",),
        free_head_dim=False,
        supports_gqa=False,
        attn="attention",
        head_dim_attr="head_size",
        module_counts=(),
        final_norm_name="final_layer_norm",
    )
)
register(
    Conv1DQKV(
        ("gpt2",),
        free_head_dim=False,
        supports_gqa=False,
        blocks_path=("h",),
        rotary=False,
        attn="attn",
        final_norm_name="ln_f",
        module_counts=(("num_heads", "H"), ("split_size", "H*D")),
    )
)
# MLA (DeepSeek-V3, dense or MoE MLPs alike: the adapter only reads attention): per-head outputs are v_head_dim wide; the cache is one latent for all heads.
register(
    LatentQKV(
        ("deepseek_v3",),
        supports_gqa=False,
        latent_kv=True,
        head_dim_attr="v_head_dim",
        module_counts=(("num_key_value_groups", "H/G"),),
    )
)
