"""What a model costs: parameters, attention FLOPs per token, KV-cache bytes, peak memory; `headlab info`'s summary.

Pure arithmetic over the adapter's view of the model; every change (pruning, conversion) is priced here.
"""

from __future__ import annotations

import math
import resource

import torch

from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.measure.choices import DTYPE_BYTES


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak on GPU; on CPU the process's peak resident set (ru_maxrss, in KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def kv_cache_bytes(
    layers_kv: list[tuple[int, int]], tokens: int = 1, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """KV-cache bytes = 2 (K and V) x sum over attention layers of (KV heads x head_dim) x tokens x batch x bytes."""
    return 2 * sum(g * d for g, d in layers_kv) * tokens * batch * bytes_per_element


def mla_budget(kv_heads: int, head_dim: int, rope_dim: int) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) of the MLA cache holding as many numbers per token and layer as GQA with `kv_heads`
    KV heads: kv_lora_rank + rope_dim = 2 x G x D (MLA.md: 320 + 64 for SmolLM2's GQA-3, 64 + 64 at MQA)."""
    return 2 * kv_heads * head_dim - rope_dim, rope_dim


def kv_cache_numbers(loaded: LoadedModel) -> int:
    """Numbers one token adds to the KV cache, summed over attention layers (adapter.kv_cache_numbers): 2 x G x D
    per layer for per-head caches, kv_lora_rank + qk_rope_head_dim for MLA's latent cache."""
    return sum(loaded.adapter.kv_cache_numbers(layer) for layer in loaded.layers)


def parameter_counts(loaded: LoadedModel) -> dict:
    """Total parameters (tied weights counted once) and those of the attention projections."""
    seen, total = set(), 0
    for parameter in loaded.model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel()
    attention = 0
    for layer in loaded.layers:
        for tensor in loaded.adapter.read(layer).tensors().values():
            if tensor is not None:
                attention += tensor.numel()
    return {"parameters": total, "attention_parameters": attention}


def attention_flops_per_token(loaded: LoadedModel, context: int) -> int:
    """Attention FLOPs per token at a given context: 2 x (projection MACs) + 2 x H x (Dqk + Dv) x context (QK^T and
    AV; Dqk = Dv = D except in MLA). MLA's projections include the shared latent ones (kv_a, q_a) and kv_b counted
    per token, as transformers computes it (no weight absorption)."""
    flops = 0
    for layer in loaded.layers:
        tensors = loaded.adapter.read(layer).tensors()
        macs = sum(
            tensors[name].numel() for name in ("q", "k", "v", "o", "kv_a", "q_a") if tensors.get(name) is not None
        )
        flops += 2 * macs + 2 * layer.num_heads * (loaded.adapter.qk_head_dim(layer) + layer.head_dim) * context
    return flops


def kv_choices(num_kv_heads: int) -> list[int]:
    """The KV-head counts a layer of G KV heads can be pooled to: the divisors of G, largest first (G keeps it)."""
    return [g for g in range(num_kv_heads, 0, -1) if num_kv_heads % g == 0]


def budget_units(layers, fraction: float, allow_empty_layer: bool = False) -> int:
    """The budget in KV-head-dimension units, sum_l g_l D_l <= floor(fraction x sum_l G_l D_l); a fraction outside
    (0, 1] or below one KV head per layer (allow_empty_layer: below one KV head in the first layer, the one a layer
    without attention cannot be) is a one-line error."""
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 < fraction <= 1):
        raise HeadlabError(f"a KV budget of {fraction} must be a fraction of the original KV cache in (0, 1]")
    total = sum(layer.num_kv_heads * layer.head_dim for layer in layers)
    least = layers[0].head_dim if allow_empty_layer else sum(layer.head_dim for layer in layers)
    units = math.floor(fraction * total + 1e-9)
    if units < least:
        where = "in the first layer" if allow_empty_layer else "per layer"
        raise HeadlabError(
            f"a KV budget of {fraction} is below one KV head {where} ({least / total:.4g} of the original KV cache); "
            "ask for at least that"
        )
    return units


def model_info(
    loaded: LoadedModel,
    context: int = 8192,
    batch: int = 1,
    cache_dtype: str | None = None,
    kv_budget: float | None = None,
) -> dict:
    """What `headlab info` prints: layout, sizes and the KV-cache ladder (MHA, each GQA-g, MQA); with `kv_budget`
    (a fraction of this model's KV cache) also what a per-layer budget keeps (convert-gqa --kv-budget)."""
    layers = loaded.layers
    cache_dtype = cache_dtype or str(loaded.dtype).removeprefix("torch.")
    if cache_dtype not in DTYPE_BYTES:
        raise HeadlabError(f"unknown cache_dtype={cache_dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    element = DTYPE_BYTES[cache_dtype]
    heads = sorted({layer.num_heads for layer in layers})
    kv_heads = sorted({layer.num_kv_heads for layer in layers})
    ladder = []
    if len(heads) == 1 and not loaded.adapter.latent_kv:  # the ladder needs one head count for all layers
        num_heads = heads[0]
        for g in sorted({g for g in range(1, num_heads + 1) if num_heads % g == 0}, reverse=True):
            name = "MHA" if g == num_heads else "MQA" if g == 1 else f"GQA-{g}"
            per_token = kv_cache_bytes([(g, layer.head_dim) for layer in layers], 1, 1, element)
            ladder.append(
                {
                    "variant": name,
                    "kv_heads": g,
                    "kv_bytes_per_token": per_token,
                    "kv_bytes": per_token * context * batch,
                    "current": [g] * len(layers) == [layer.num_kv_heads for layer in layers],
                }
            )
    if loaded.adapter.latent_kv:
        ladder = _latent_rows(loaded, element, context * batch)
    per_token = kv_cache_numbers(loaded) * element
    return {
        "model": loaded.spec,
        "model_type": loaded.model.config.model_type,
        "blocks": len(loaded.adapter.blocks(loaded.model)),
        "attention_layers": len(layers),
        "query_heads": heads[0] if len(heads) == 1 else heads,
        "kv_heads": kv_heads[0] if len(kv_heads) == 1 else kv_heads,
        "head_dim": layers[0].head_dim,
        "total_query_heads": sum(layer.num_heads for layer in layers),
        **parameter_counts(loaded),
        "cache_dtype": cache_dtype,
        "context": context,
        "batch": batch,
        "kv_bytes_per_token": per_token,
        "kv_bytes": per_token * context * batch,
        "ladder": ladder,
        "mla_rungs": [] if loaded.adapter.latent_kv else _mla_rungs(loaded, element, context * batch),
        **_latent_fields(loaded),
        **({"kv_budget": _budget_row(loaded, kv_budget, element, context * batch)} if kv_budget is not None else {}),
    }


def _budget_row(loaded: LoadedModel, fraction: float, element: int, tokens: int) -> dict:
    """The KV bytes a per-layer budget keeps at most, and the counts each layer can take (kv_choices)."""
    if loaded.adapter.latent_kv:
        raise HeadlabError("a per-layer KV-head budget applies to KV heads; this model caches an MLA latent")
    units = budget_units(loaded.layers, fraction)
    choices = sorted({tuple(kv_choices(layer.num_kv_heads)) for layer in loaded.layers})
    return {
        "fraction": fraction,
        "kv_bytes_per_token": 2 * units * element,
        "kv_bytes": 2 * units * element * tokens,
        "kv_heads": units // loaded.layers[0].head_dim if len({la.head_dim for la in loaded.layers}) == 1 else None,
        "total_kv_heads": sum(layer.num_kv_heads for layer in loaded.layers),
        "choices_per_layer": [list(c) for c in choices],
    }


def _latent_fields(loaded: LoadedModel) -> dict:
    """An MLA model's latent size (kv_lora_rank, rope_dim) where every layer has the same; {} otherwise."""
    if not loaded.adapter.latent_kv:
        return {}
    dims = sorted({loaded.adapter.latent_dims(layer) for layer in loaded.layers})
    return {"kv_lora_rank": dims[0][0], "rope_dim": dims[0][1]} if len(dims) == 1 else {"latent_dims": dims}


def _latent_rows(loaded: LoadedModel, element: int, tokens: int) -> list[dict]:
    """An MLA model's ladder: its latent cache (what transformers 5, vLLM and llama.cpp hold), and beside it the
    per-head keys and values the latent expands to (H x (qk_nope + qk_rope + v_head_dim) per layer), which an engine
    without an MLA path would cache."""
    latent = kv_cache_numbers(loaded) * element
    expanded = sum(layer.num_heads * (layer.module.qk_head_dim + layer.head_dim) for layer in loaded.layers) * element
    return [
        {"variant": "MLA", "kv_heads": None, **_latent_fields(loaded), "kv_bytes_per_token": latent,
         "kv_bytes": latent * tokens, "current": True},
        {"variant": "expanded", "kv_heads": loaded.layers[0].num_heads, "kv_bytes_per_token": expanded,
         "kv_bytes": expanded * tokens, "current": False},
    ]  # fmt: skip


def _mla_rungs(loaded: LoadedModel, element: int, tokens: int) -> list[dict]:
    """The MLA rung of a per-head (MHA/GQA) model: the latent + rope split at the bytes of its own cache and at the
    MQA cache's, with the rope part as wide as the heads' rotary part (mla_budget). Empty for layers that differ or
    have no rotary embeddings (the DeepSeek format's shared key carries RoPE)."""
    layers = loaded.layers
    if len({(layer.num_kv_heads, layer.head_dim) for layer in layers}) != 1:
        return []
    G, D = layers[0].num_kv_heads, layers[0].head_dim
    rope = loaded.adapter.rotary_dim(layers[0], loaded.model.config)
    if rope == 0:
        return []
    rows = []
    for g in sorted({G, 1}, reverse=True):
        rank, rope_dim = mla_budget(g, D, rope)
        per_token = (rank + rope_dim) * len(layers) * element
        name = "MQA" if g == 1 else "MHA" if g == layers[0].num_heads else f"GQA-{g}"
        rows.append(
            {"variant": f"MLA@{name}", "kv_lora_rank": rank, "rope_dim": rope_dim, "kv_bytes_per_token": per_token,
             "kv_bytes": per_token * tokens}
        )  # fmt: skip
    return rows


def costs(loaded: LoadedModel, context: int = 1024) -> dict:
    """Parameters, attention FLOPs per token at `context`, and KV-cache bytes per token (model dtype)."""
    element = DTYPE_BYTES.get(str(loaded.dtype).removeprefix("torch."), 4)
    layers = loaded.layers
    return {
        **parameter_counts(loaded),
        "attention_flops_per_token": attention_flops_per_token(loaded, context),
        "kv_bytes_per_token": kv_cache_numbers(loaded) * element,
        "query_heads": sum(layer.num_heads for layer in layers),
        "kv_heads": sum(layer.num_kv_heads for layer in layers),
        "flops_context": context,
    }


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Arithmetic (as `headlab info`): 2 x sum over softmax layers of G x D x bytes per element (model dtype); for
    MLA, (kv_lora_rank + qk_rope_head_dim) per layer (kv_cache_numbers)."""
    element = DTYPE_BYTES[str(loaded.dtype).removeprefix("torch.")]
    return kv_cache_numbers(loaded) * element
