"""A per-KV-head cache policy at run time: each KV head keeps either the whole cache or only its attention sinks plus a
recent window (StreamingLLM, Xiao et al. 2023; chosen per head as in DuoAttention, Xiao et al. 2024).

A model runs under a policy in one of two ways, which give the same logits (tests/test_head_cache.py):
- masked: every head reads the ordinary cache, and a streaming head's keys outside its sinks and window are masked;
- real cache: `HeadPolicyCache` stores only the sinks and the window for streaming heads, so the memory a policy saves
  is measured (`cache_bytes`), not computed.

Positions are cache slots (0 = the batch's first token). A streaming head lets query slot i see key slot j iff j <= i
and (j < sinks or i - j < window); keys keep the rotary position they were written with (as DuoAttention; StreamingLLM
re-rotates, which only matters past the trained positions).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headlab.core.errors import HeadlabError
from headlab.mechanisms.capture import _visibility, routed

FUNCTION_NAME = "headlab_head_policy"  # must not contain "sdpa" (transformers would run its sdpa checks on it)
GATES_FUNCTION_NAME = "headlab_head_gates"


@dataclass(frozen=True)
class LayerStreaming:
    """The streaming KV heads of one attention layer and the sinks + window they keep."""

    streaming: tuple[int, ...]  # KV heads that keep sinks + window; the others keep the whole cache
    num_kv_heads: int
    group_size: int  # query heads per KV head: query head h reads KV head h // group_size
    sinks: int
    window: int

    def __post_init__(self):
        if self.sinks < 0 or self.window < 1:
            raise HeadlabError(f"sinks must be >= 0 and window >= 1, got {self.sinks} and {self.window}")
        if any(not 0 <= head < self.num_kv_heads for head in self.streaming):
            raise HeadlabError(f"streaming KV heads {self.streaming} outside 0..{self.num_kv_heads - 1}")

    @property
    def full(self) -> tuple[int, ...]:
        return tuple(head for head in range(self.num_kv_heads) if head not in self.streaming)

    def query_heads(self, kv_heads) -> list[int]:
        """Query heads reading `kv_heads`, in the order sdpa's repeat_kv pairs them with those KV heads."""
        return [kv * self.group_size + r for kv in kv_heads for r in range(self.group_size)]

    def band(self, query_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
        """[Tq, Tk] bool: key slot j within query slot i's sinks or window (causality comes from the mask)."""
        distance = query_slots[:, None] - key_slots[None, :]
        return (key_slots[None, :] < self.sinks) | (distance < self.window)


@functools.cache
def _head_indices(policy: LayerStreaming, device: torch.device) -> dict[str, torch.Tensor]:
    """The layer's KV and query head indices on `device`, made once: a decode step then copies nothing from the host
    (a host-to-device copy per layer and step held a GPU decode back)."""

    def index(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return {"full": index(policy.full), "stream": index(policy.streaming),
            "full_queries": index(policy.query_heads(policy.full)),
            "stream_queries": index(policy.query_heads(policy.streaming))}  # fmt: skip


class StreamingHeadsLayer(DynamicLayer):
    """One layer's cache: the full KV heads as a DynamicLayer (`keys`, `values`), the streaming heads' sinks + window
    apart (`stream_keys`, `stream_values` [B, G_s, m, D]).

    The streaming part holds the slots [0, sink_end) and [recent_start, seen), in that order (`slots`): the sinks are
    never evicted and the recent slots stay contiguous, so eviction is two slices computed from these counts on the
    host, with no device sync. `update` returns the full heads' states only; headlab's policy attention function reads
    the streaming part and calls `evict` once the layer has attended, so after every forward a streaming head holds at
    most sinks + window - 1 slots (what the next query can see)."""

    def __init__(self, policy: LayerStreaming):
        super().__init__()
        self.policy = policy
        self.stream_keys = self.stream_values = None
        self.seen = self.sink_end = self.recent_start = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.stream_keys = key_states.new_empty(0)
        self.stream_values = value_states.new_empty(0)
        self.seen = self.sink_end = self.recent_start = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        heads = _head_indices(self.policy, key_states.device)
        self.keys = torch.cat([self.keys, key_states.index_select(1, heads["full"])], dim=-2)
        self.values = torch.cat([self.values, value_states.index_select(1, heads["full"])], dim=-2)
        self.stream_keys = torch.cat([self.stream_keys, key_states.index_select(1, heads["stream"])], dim=-2)
        self.stream_values = torch.cat([self.stream_values, value_states.index_select(1, heads["stream"])], dim=-2)
        self.seen += key_states.shape[-2]
        return self.keys, self.values

    @property
    def slots(self) -> torch.Tensor:
        """[m] the cache slot of each stored streaming position."""
        device = self.stream_keys.device
        sinks = torch.arange(self.sink_end, device=device)
        return torch.cat([sinks, torch.arange(self.recent_start, self.seen, device=device)])

    def evict(self) -> None:
        """Drop the streaming heads' slots no later query can see: keep j < sinks or j > seen - window."""
        sink_end = min(self.policy.sinks, self.seen)
        recent_start = max(self.seen - self.policy.window + 1, sink_end)
        if sink_end == self.sink_end and recent_start == self.recent_start:
            return
        # the stored recent slots start at recent_start of the last eviction, sink_end rows in
        first_recent = self.sink_end + (recent_start - self.recent_start)
        for name in ("stream_keys", "stream_values"):
            states = getattr(self, name)
            setattr(self, name, torch.cat([states[..., :sink_end, :], states[..., first_recent:, :]], dim=-2))
        self.sink_end, self.recent_start = sink_end, recent_start

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self.stream_keys = self.stream_values = None
        self.seen = self.sink_end = self.recent_start = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise HeadlabError("a streaming-heads cache cannot be cropped (evicted slots are gone)")

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.values, self.stream_keys, self.stream_values) if t is not None)


# id(attention module) -> (its layer's policy, its block index); dispatch by identity, as capture does
_ACTIVE: dict[int, tuple[LayerStreaming, int]] = {}
# id(attention module) -> (the sinks + window band of its layer, its KV heads' gates alpha), for head_gates
_GATED: dict[int, tuple[LayerStreaming, torch.Tensor]] = {}
# The HeadPolicyCache the running forward writes to (set by `policy_cache`); None: streaming heads are masked.
_CACHE: list = [None]


class HeadPolicyCache(DynamicCache):
    """transformers' DynamicCache with a StreamingHeadsLayer in every block whose layer has streaming KV heads.

    layers: {block index: LayerStreaming}. Only plain full-attention cache layers are replaced: a sliding-window layer
    already keeps a window, and a policy there is refused."""

    def __init__(self, config, layers: dict[int, LayerStreaming]):
        super().__init__(config=config)
        for block, policy in layers.items():
            if not policy.streaming:
                continue
            if block >= len(self.layers) or type(self.layers[block]) is not DynamicLayer:
                kind = type(self.layers[block]).__name__ if block < len(self.layers) else "no cache layer"
                raise HeadlabError(f"block {block} has {kind}; streaming heads need a full-attention layer")
            self.layers[block] = StreamingHeadsLayer(policy)


def cache_bytes(cache) -> int:
    """Bytes the cache's tensors hold now (keys and values of every layer, streaming parts included)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, StreamingHeadsLayer):
            total += layer.nbytes()
        else:
            total += sum(
                t.nbytes for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None
            )
    return total


def _attend(module, query, key, value, mask, kwargs) -> torch.Tensor:
    """sdpa over one group of heads: [B, t, h, D]."""
    output, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    return output


def _policy_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: full KV heads as sdpa, streaming KV heads restricted to sinks + window."""
    policy, block = _ACTIVE.get(id(module), (None, None))
    if policy is None or not policy.streaming:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, Tq, D = query.shape
    layer = _CACHE[0].layers[block] if _CACHE[0] is not None else None
    real = isinstance(layer, StreamingHeadsLayer)
    Tk = layer.seen if real else key.shape[2]
    device = query.device
    heads = _head_indices(policy, device)
    if real:
        stream_keys, stream_values = layer.stream_keys, layer.stream_values
        full_keys, full_values = key, value
    else:
        stream_keys, stream_values = key.index_select(1, heads["stream"]), value.index_select(1, heads["stream"])
        full_keys, full_values = key.index_select(1, heads["full"]), value.index_select(1, heads["full"])
    if real and Tq == 1 and attention_mask is None:
        # one query at the last slot, no padding: it sees every slot a real cache still holds (the sinks and the
        # window - 1 slots before it, evicted to that after the last forward), so no mask is built
        stream_visible = None
    else:
        visible, bias, _ = _visibility(attention_mask, module, kwargs, Tq, Tk, device)  # [B|1, 1, Tq, Tk]
        if bias is not None:
            raise HeadlabError("a head policy needs a boolean attention mask (sdpa's); got an additive one")
        key_slots = layer.slots if real else torch.arange(Tk, device=device)
        query_slots = torch.arange(Tk - Tq, Tk, device=device)
        stream_visible = visible.index_select(-1, key_slots) & policy.band(query_slots, key_slots)
    output = query.new_empty(B, Tq, H, value.shape[-1])
    stream_queries = heads["stream_queries"]
    output[:, :, stream_queries] = _attend(
        module, query.index_select(1, stream_queries), stream_keys, stream_values, stream_visible, kwargs
    )
    if policy.full:
        full_queries = heads["full_queries"]
        # the full heads read the mask transformers built (None: sdpa's causal rule) over every slot
        output[:, :, full_queries] = _attend(
            module, query.index_select(1, full_queries), full_keys, full_values, attention_mask, kwargs
        )
    if real:
        layer.evict()
    return output, None


def _gated_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function, DuoAttention's training-time mix (Xiao et al. 2024, eq. 1): per KV head h,
    alpha_h x full attention + (1 - alpha_h) x attention restricted to sinks + window, for every query head of h."""
    entry = _GATED.get(id(module))
    if entry is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    band, alpha = entry
    Tq, Tk, device = query.shape[2], key.shape[2], query.device
    visible, bias, _ = _visibility(attention_mask, module, kwargs, Tq, Tk, device)
    if bias is not None:
        raise HeadlabError("head gates need a boolean attention mask (sdpa's); got an additive one")
    stream_visible = visible & band.band(torch.arange(Tk - Tq, Tk, device=device), torch.arange(Tk, device=device))
    full = _attend(module, query, key, value, attention_mask, kwargs)  # [B, Tq, H, D]
    stream = _attend(module, query, key, value, stream_visible, kwargs)
    weight = alpha.repeat_interleave(band.group_size).to(full.dtype)[None, None, :, None]
    return stream + weight * (full - stream), None


def register() -> str:
    """Register the policy and gate attention functions and sdpa's mask function under their names (idempotent);
    returns the policy's."""
    # Deferred for start-up time: transformers' modeling_utils is only needed once a model is loaded.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, function in ((FUNCTION_NAME, _policy_attention), (GATES_FUNCTION_NAME, _gated_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return FUNCTION_NAME


@contextlib.contextmanager
def policy_cache(cache: HeadPolicyCache):
    """Inside `head_policy`: forwards write `cache` (give the same object to the model or generate()), whose
    streaming heads store only sinks + window."""
    saved, _CACHE[0] = _CACHE[0], cache
    try:
        yield cache
    finally:
        _CACHE[0] = saved


@contextlib.contextmanager
def head_policy(model, layers, policies: dict[int, LayerStreaming], cache: HeadPolicyCache | None = None):
    """Run `model` under the policy: `layers` (headlab AttentionLayers), `policies` {layer index: LayerStreaming}.

    Streaming heads are masked over the ordinary cache, or, with `cache` (or inside `policy_cache`), stored as sinks +
    window in that HeadPolicyCache. The attention implementation is restored on exit."""
    register()
    entries = [(layer, (policies[layer.index], layer.block)) for layer in layers if layer.index in policies]
    with routed(model, FUNCTION_NAME, _ACTIVE, entries, "already runs under a head policy; policies cannot nest"):
        with contextlib.ExitStack() as stack:
            if cache is not None:
                stack.enter_context(policy_cache(cache))
            yield


@contextlib.contextmanager
def head_gates(model, layers, gates: dict[int, tuple[LayerStreaming, torch.Tensor]]):
    """Run `model` with DuoAttention's gated attention in the block: `gates` {layer index: (band, alpha)}, alpha a
    [num_kv_heads] tensor in [0, 1] (1: full attention, 0: only band.sinks + band.window), which may require grad.
    Layers not in `gates` run plain sdpa; the attention implementation is restored on exit."""
    register()
    entries = [(layer, gates[layer.index]) for layer in layers if layer.index in gates]
    with routed(model, GATES_FUNCTION_NAME, _GATED, entries, "already runs under head gates; gates cannot nest"):
        yield


__all__ = [
    "FUNCTION_NAME",
    "GATES_FUNCTION_NAME",
    "HeadPolicyCache",
    "LayerStreaming",
    "StreamingHeadsLayer",
    "cache_bytes",
    "head_gates",
    "head_policy",
    "policy_cache",
]
