"""What a model costs: parameters, attention FLOPs per token, KV-cache bytes, peak memory; `headlab info`'s summary.

Pure arithmetic over the adapter's view of the model; every change (pruning, conversion) is priced here.
"""

from __future__ import annotations

import resource

import torch

from headlab.errors import HeadlabError
from headlab.loading import LoadedModel


def peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak on GPU; on CPU the process's peak resident set (ru_maxrss, in KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


def kv_cache_bytes(
    layers_kv: list[tuple[int, int]], tokens: int = 1, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """KV-cache bytes = 2 (K and V) x sum over attention layers of (KV heads x head_dim) x tokens x batch x bytes."""
    return 2 * sum(g * d for g, d in layers_kv) * tokens * batch * bytes_per_element


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
    """Attention FLOPs per token at a given context: 2 x (projection MACs) + 2 x 2 x H x D x context (QK^T and AV)."""
    flops = 0
    for layer in loaded.layers:
        weights = loaded.adapter.read(layer)
        macs = sum(weights.tensors()[name].numel() for name in ("q", "k", "v", "o"))
        flops += 2 * macs + 4 * layer.num_heads * layer.head_dim * context
    return flops


def model_info(loaded: LoadedModel, context: int = 8192, batch: int = 1, cache_dtype: str | None = None) -> dict:
    """What `headlab info` prints: layout, sizes and the KV-cache ladder (MHA, each GQA-g, MQA)."""
    layers = loaded.layers
    cache_dtype = cache_dtype or str(loaded.dtype).removeprefix("torch.")
    if cache_dtype not in DTYPE_BYTES:
        raise HeadlabError(f"unknown --cache-dtype {cache_dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    element = DTYPE_BYTES[cache_dtype]
    heads = sorted({layer.num_heads for layer in layers})
    kv_heads = sorted({layer.num_kv_heads for layer in layers})
    current = [(layer.num_kv_heads, layer.head_dim) for layer in layers]
    ladder = []
    if len(heads) == 1:  # the ladder needs one head count for all layers
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
    per_token = kv_cache_bytes(current, 1, 1, element)
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
    }


def costs(loaded: LoadedModel, context: int = 1024) -> dict:
    """Parameters, attention FLOPs per token at `context`, and KV-cache bytes per token (model dtype)."""
    element = DTYPE_BYTES.get(str(loaded.dtype).removeprefix("torch."), 4)
    layers = loaded.layers
    return {
        **parameter_counts(loaded),
        "attention_flops_per_token": attention_flops_per_token(loaded, context),
        "kv_bytes_per_token": kv_cache_bytes([(layer.num_kv_heads, layer.head_dim) for layer in layers], 1, 1, element),
        "query_heads": sum(layer.num_heads for layer in layers),
        "kv_heads": sum(layer.num_kv_heads for layer in layers),
        "flops_context": context,
    }


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Arithmetic (as `headlab info`): 2 x sum over softmax layers of G x D x bytes per element (model dtype)."""
    element = DTYPE_BYTES[str(loaded.dtype).removeprefix("torch.")]
    return kv_cache_bytes([(layer.num_kv_heads, layer.head_dim) for layer in loaded.layers], 1, 1, element)
