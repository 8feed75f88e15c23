"""Rotary embeddings that differ by layer (Gemma 3: sliding-window layers rotate at a local base, full-attention
layers at the global one) against deepseek_v3's single rotary embedding.

A config either holds one `rope_parameters` dict or one per layer type (keyed "full_attention",
"sliding_attention"); `rope_parameters_for` reads either. The MLA conversion gives deepseek_v3 the full-attention
layers' RoPE (exact there) and, in a layer whose frequencies differ, lets each of the target's rotary pairs carry the
source pair whose frequency is nearest in log scale, one-to-one and within a factor of 2 (`matched_frequencies`). A
matched pair then rotates at the target's frequency instead of its own: relative position t - s turns its logit term
by (t - s)(f_target - f_source), the approximation, recorded per layer as the largest relative frequency change; a
pair no target comes near loses RoPE, as the RoPE truncation's pairs do."""

from __future__ import annotations

import math

import torch

from headlab.core.errors import HeadlabError

FULL_ATTENTION = "full_attention"  # transformers' layer type of the layers that see every earlier token
SLIDING_ATTENTION = "sliding_attention"  # and of the layers that see the last sliding_window tokens
# A layer's rotary pair rides one of deepseek_v3's only when their frequencies are within this factor; a pair further
# from every target loses RoPE instead (it then counts with its mean rotation, as the RoPE truncation's do), rather
# than turn at a frequency unrelated to its own.
MATCH_WITHIN = 2.0


def rope_parameters_for(config, layer_type: str | None = None) -> dict:
    """`config.rope_parameters` of one layer type: its entry where the parameters are keyed by layer type, else the
    one dict every layer shares. layer_type None: the full-attention layers' (what deepseek_v3 takes)."""
    params = getattr(config, "rope_parameters", None) or {}
    if not any(isinstance(v, dict) for v in params.values()):
        return params
    return params[layer_type or FULL_ATTENTION] or {}


def layer_type_of(config, block: int) -> str | None:
    """The transformers layer type of block `block` (config.layer_types), or None where the config lists none."""
    types = getattr(config, "layer_types", None)
    return types[block] if types else None


def inverse_frequencies(config, dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float64, attention factor) of the RoPE of `layer_type`'s layers at `dim` rotary
    dims, as transformers computes them (modeling_rope_utils.ROPE_INIT_FUNCTIONS; default: theta^(-2i/dim)). The
    attention factor multiplies cos and sin, so q.k of the rotary dims by its square."""
    params, cpu = rope_parameters_for(config, layer_type), torch.device("cpu")  # numbers to compare, on any device
    if params.get("rope_type", "default") == "default":
        return float(params["rope_theta"]) ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=cpu) / dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # start-up: only scaled RoPE needs the registry

    keyed = params is not getattr(config, "rope_parameters", None)
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    inv_freq, factor = init(config, cpu, layer_type=layer_type or FULL_ATTENTION) if keyed else init(config, cpu)
    if len(inv_freq) != dim // 2:
        raise HeadlabError(f"{config.model_type}'s RoPE has {len(inv_freq)} frequencies where {dim // 2} were expected")
    return inv_freq.double(), float(factor)


def matched_frequencies(source: torch.Tensor, target: torch.Tensor, within: float = MATCH_WITHIN) -> list[int | None]:
    """For each target inverse frequency, the index of a source one within a factor `within` of it (each used at most
    once), or None: pairs taken in order of |ln(f_target / f_source)|, smallest first, ties by target then source
    index. Where the source's frequencies include the target's, those are matched exactly."""
    distance = (target.log()[:, None] - source.log()[None, :]).abs()  # [targets, sources]
    order = sorted((float(distance[j, i]), j, i) for j in range(len(target)) for i in range(len(source)))
    chosen: dict[int, int] = {}
    used: set[int] = set()
    for gap, j, i in order:
        if gap <= math.log(within) and j not in chosen and i not in used:
            chosen[j] = i
            used.add(i)
    return [chosen.get(j) for j in range(len(target))]


def frequency_change(source: torch.Tensor, target: torch.Tensor, kept: list[int | None]) -> float:
    """Largest |f_target / f_source - 1| over the matched pairs (0: the layer keeps its own frequencies)."""
    pairs = [(j, i) for j, i in enumerate(kept) if i is not None]
    return max((abs(float(target[j] / source[i]) - 1) for j, i in pairs), default=0.0)


def window_of(config) -> int | None:
    """The sliding window of the layers that have one, or None (a window at least as long as every position never
    slides: Qwen2's unused sliding_window field)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    limit = getattr(config, "max_position_embeddings", None) or math.inf
    if window >= limit:
        return None
    return window if types is None or SLIDING_ATTENTION in types else None
