"""The per-KV-head cache policy at run time (headlab.mechanisms.head_cache): the masked policy equals an eager
attention with the policy's mask written out by hand, and a real cache that stores only sinks + window gives the same
logits as the masked policy while holding the bytes it claims."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.models.llama.modeling_llama import repeat_kv

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.mechanisms.head_cache import (
    HeadPolicyCache,
    LayerStreaming,
    StreamingHeadsLayer,
    cache_bytes,
    head_policy,
    policy_cache,
)

SINKS, WINDOW = 2, 5


def _policies(loaded, streaming: dict[int, tuple[int, ...]]):
    return {
        layer.index: LayerStreaming(streaming.get(layer.index, ()), layer.num_kv_heads, layer.group_size, SINKS, WINDOW)
        for layer in loaded.layers
    }


def _reference_logits(model, ids, streaming_query_heads: dict[int, set[int]]):
    """Eager attention with the policy's mask built per head from its definition: query i sees key j iff j <= i and,
    for a streaming head, j < sinks or i - j < window."""
    layer_of = {id(block.self_attn): index for index, block in enumerate(model.model.layers)}

    def attention(module, q, k, v, mask, scaling=None, **kwargs):
        B, H, T, D = q.shape
        k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
        scores = (q @ k.transpose(-1, -2)) * scaling
        i, j = torch.arange(T)[:, None], torch.arange(k.shape[2])[None, :]
        visible = torch.zeros(H, T, k.shape[2], dtype=torch.bool)
        for h in range(H):
            band = (j < SINKS) | (i - j < WINDOW) if h in streaming_query_heads[layer_of[id(module)]] else True
            visible[h] = (j <= i) & band
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        return (probs @ v).transpose(1, 2), None

    AttentionInterface.register("test_reference_policy", attention)
    saved = model.config._attn_implementation
    model.set_attn_implementation("test_reference_policy")
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation(saved)


@pytest.fixture
def llama():
    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=128)
    return model, from_model(model)


@torch.no_grad()
def test_masked_policy_equals_the_mask_written_out(llama):
    model, loaded = llama
    streaming = {0: (1,), 1: (0,)}  # KV head g serves query heads 2g, 2g+1 (group size 2)
    query_heads = {0: {2, 3}, 1: {0, 1}}
    ids = torch.randint(10, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    reference = _reference_logits(model, ids, query_heads)
    with head_policy(model, loaded.layers, _policies(loaded, streaming)):
        masked = model(ids).logits
    torch.testing.assert_close(masked, reference, atol=1e-5, rtol=1e-5)
    assert (model(ids).logits - reference).abs().max() > 1e-2  # the policy changes the model at this length


@torch.no_grad()
def test_policy_with_no_streaming_head_is_the_model(llama):
    model, loaded = llama
    ids = torch.randint(10, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    with head_policy(model, loaded.layers, _policies(loaded, {})):
        same = model(ids).logits
    torch.testing.assert_close(same, model(ids).logits)


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@torch.no_grad()
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_real_cache_gives_the_masked_logits_and_holds_only_sinks_and_window(llama, device):
    """Also on CUDA (scripts/gpu_check.sh runs the cuda marker), where the eviction must not sync or copy indices."""
    model, _ = llama
    loaded = from_model(model.to(device))
    tolerance = 1e-5 if device == "cpu" else 1e-4  # CUDA's sdpa kernels sum in another order
    streaming = {0: (1,), 1: (0, 1)}
    policies = _policies(loaded, streaming)
    ids = torch.randint(10, 100, (2, 33), generator=torch.Generator().manual_seed(2)).to(device)
    options = dict(max_new_tokens=9, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with head_policy(model, loaded.layers, policies):
        masked = model.generate(ids, cache=DynamicCache(config=model.config), **options)
    cache = HeadPolicyCache(model.config, {layer.block: policies[layer.index] for layer in loaded.layers})
    with head_policy(model, loaded.layers, policies), policy_cache(cache):
        real = model.generate(ids, cache=cache, **options)
    assert torch.equal(masked.sequences, real.sequences)
    for step_masked, step_real in zip(masked.scores, real.scores):
        torch.testing.assert_close(step_real, step_masked, atol=tolerance, rtol=tolerance)
    # bytes by hand: 33 + 8 slots written (the last token is never fed back); a streaming head keeps the sinks and
    # the last window - 1 slots, a full head all of them
    slots = 33 + 9 - 1
    head_slot_bytes = 2 * 2 * loaded.layers[0].head_dim * 4  # batch 2, keys and values, float32
    full_heads, streaming_heads = 1, 3  # layer 0: one full, one streaming; layer 1: both streaming
    expected = head_slot_bytes * (full_heads * slots + streaming_heads * (SINKS + WINDOW - 1))
    assert cache_bytes(cache) == expected
    assert cache_bytes(masked.past_key_values) == head_slot_bytes * 4 * slots


@pytest.mark.parametrize("sinks, window", [(0, 1), (2, 5), (4, 3), (6, 2)])
def test_eviction_keeps_exactly_the_sinks_and_the_window_over_uneven_updates(sinks, window):
    """The streaming part after each update and eviction holds the positions j < sinks or j > seen - window of
    everything written, in order, by a slow reference that keeps the whole history."""
    policy = LayerStreaming((1,), num_kv_heads=2, group_size=1, sinks=sinks, window=window)
    layer = StreamingHeadsLayer(policy)
    generator = torch.Generator().manual_seed(0)
    history = []
    for size in (1, 3, 1, 1, 7, 2, 1, 1, 4, 1):  # a prefill shorter than the sinks, then mixed chunks
        keys = torch.randn(1, 2, size, 4, generator=generator)
        layer.update(keys, keys + 1)
        layer.evict()
        history.append(keys[:, 1])
        written = torch.cat(history, dim=1)  # [1, seen, 4], the streaming head's keys
        seen = written.shape[1]
        kept = [j for j in range(seen) if j < sinks or j > seen - window]
        assert layer.slots.tolist() == kept
        torch.testing.assert_close(layer.stream_keys[:, 0], written[:, kept], atol=0, rtol=0)
        torch.testing.assert_close(layer.stream_values[:, 0], written[:, kept] + 1, atol=0, rtol=0)


def test_policy_refuses_a_sliding_window_layer_and_bad_sizes():
    model = tiny_model("gemma3_text", attn_implementation="sdpa")
    loaded = from_model(model)
    policies = {
        layer.index: LayerStreaming((0,), layer.num_kv_heads, layer.group_size, 1, 2) for layer in loaded.layers
    }
    with pytest.raises(HeadlabError, match="full-attention layer"):
        HeadPolicyCache(model.config, {layer.block: policies[layer.index] for layer in loaded.layers})
    with pytest.raises(HeadlabError, match="window"):
        LayerStreaming((0,), 2, 2, 1, 0)
    with pytest.raises(HeadlabError, match="outside"):
        LayerStreaming((2,), 2, 2, 1, 4)
