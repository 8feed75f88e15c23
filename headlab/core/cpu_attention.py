"""sdpa on a CPU for attention whose value heads are narrower than its query/key heads (MLA: deepseek_v3's queries
and keys are qk_nope + qk_rope wide, its values v_head_dim), computed by torch's fused kernel.

torch's fused CPU kernel (flash attention) takes one head width for queries, keys and values; with narrower values
sdpa falls back to its math path, which materialises every [T, T] score map. On this project's 2-core EPYC, 9 heads
at 2,048 tokens (128-wide keys, 64-wide values, causal) take 0.30 s in the math path and 0.09 s padded, and a
forward of the embedded model's MLA conversion 13.4 s against the GQA source's 5.3 s (docs/performance.md).
Zero columns appended to the values leave the output's first columns unchanged, softmax(S) [V | 0] =
[softmax(S) V | 0], so the padded call computes the same attention in the fused kernel and the padding is dropped.
On CUDA sdpa's memory-efficient kernel takes unequal widths itself, so only CPU inputs are padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Must not contain "sdpa": transformers would run its sdpa-specific fallback checks on it (as for headlab_capture).
FUNCTION_NAME = "headlab_cpu_fused"


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: sdpa, with CPU values narrower than the keys zero-padded to the keys' width
    (so the fused kernel runs) and the padding dropped from the output [B, T, H, Dv]."""
    # start-up: loading imports this module, and `headlab --help` must not pull in transformers' integrations
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    narrower = value.shape[-1] < key.shape[-1] and query.device.type == "cpu"
    if not narrower:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    width = value.shape[-1]
    padded = F.pad(value, (0, key.shape[-1] - width))
    output, weights = sdpa_attention_forward(module, query, key, padded, attention_mask, **kwargs)
    return output[..., :width], weights


def register() -> str:
    """Register attention_forward and sdpa's mask function under FUNCTION_NAME (idempotent)."""
    # start-up: both load transformers' modeling_utils, needed only once a model is loaded
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FUNCTION_NAME, attention_forward)
    AttentionMaskInterface.register(FUNCTION_NAME, sdpa_mask)
    return FUNCTION_NAME


def install(model: nn.Module, device: torch.device, narrow_values: bool) -> dict:
    """Switch a model on the CPU that runs sdpa with values narrower than its keys (`narrow_values`, from its
    adapter) to attention_forward; returns the metadata to record ({} when nothing changed)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if device.type != "cpu" or not narrow_values or implementation != "sdpa":
        return {}
    model.set_attn_implementation(register())
    return {"cpu_attention": "values padded for the fused kernel"}


__all__ = ["FUNCTION_NAME", "attention_forward", "install", "register"]
