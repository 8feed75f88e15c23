"""Captured layers compute attention once: the output is probabilities x V from the statistics' chunks. It must equal
sdpa's (or, for soft-capping and sinks, which sdpa lacks, eager's) on every adapter's tiny model, with causal, padded
(right and left), bidirectional and sliding-window masks.

Tolerance (float32): 1e-5 absolute + 1e-4 relative per output element, on real (non-padding) query rows. Padding rows
that see no key at all have no defined output (sdpa's and eager's differ there too) and feed no real token.
"""

from __future__ import annotations

import pytest
import torch
from models import ALL_TYPES, tiny_inputs, tiny_model

from headlab.core.arch import AttentionLayer
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.mechanisms.capture import OUTPUTS, capture_attention, output_from_chunks

ATOL, RTOL = 1e-5, 1e-4  # float32 chunked P x V against the fused kernel (docs/performance.md)


def _padded_inputs(name: str) -> dict[str, torch.Tensor]:
    inputs = tiny_inputs(name, batch=3, seq=12)
    inputs["attention_mask"][1, 8:] = 0  # right padding
    inputs["attention_mask"][2, :3] = 0  # left padding
    return inputs


def _outputs(model, layers, inputs, output: str, chunk_size: int = 5):
    """Per-layer attention outputs [B, T, H, D] and the logits, with the layer outputs taken from `output`."""
    seen = {}

    def on_output(layer, out, valid):
        seen[layer.index] = out.clone()

    with torch.no_grad(), capture_attention(model, layers, lambda chunk: None, on_output, chunk_size, output) as cap:
        logits = model(**inputs).logits
    assert cap.calls == len(layers)
    return seen, logits


@pytest.mark.parametrize("name", ALL_TYPES)
def test_chunked_output_equals_sdpa(name):
    """Causal or bidirectional, padded on either side; gemma3 and mistral have windows of 4 < 12 tokens."""
    model = tiny_model(name, attn_implementation="sdpa")
    loaded = from_model(model)
    inputs = _padded_inputs(name)
    real = inputs["attention_mask"].bool()  # [B, T]
    chunked, chunked_logits = _outputs(model, loaded.layers, inputs, "chunks")
    fused, fused_logits = _outputs(model, loaded.layers, inputs, "sdpa")
    for index in fused:
        torch.testing.assert_close(chunked[index][real], fused[index][real], atol=ATOL, rtol=RTOL)
    with torch.no_grad():
        plain = model(**inputs).logits  # no capture at all: the model's own sdpa
    torch.testing.assert_close(fused_logits[real], plain[real], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(chunked_logits[real], plain[real], atol=ATOL, rtol=RTOL)


def test_bfloat16_output_within_bfloat16_rounding():
    """A bfloat16 model: chunks compute in float32 and round the weights to bfloat16 like eager; sdpa rounds inside
    its kernel. They agree to bfloat16 precision (8 bits of mantissa)."""
    model = tiny_model("llama", attn_implementation="sdpa").to(torch.bfloat16)
    loaded = from_model(model)
    inputs = _padded_inputs("llama")
    real = inputs["attention_mask"].bool()
    chunked, _ = _outputs(model, loaded.layers, inputs, "chunks")
    fused, _ = _outputs(model, loaded.layers, inputs, "sdpa")
    for index in fused:
        assert chunked[index].dtype == torch.bfloat16
        torch.testing.assert_close(chunked[index][real].float(), fused[index][real].float(), atol=2e-2, rtol=2e-2)


def _by_hand(model_type: str, **config):
    """A tiny model of a family with no headlab adapter (soft-capping gemma2, sink gpt_oss); its attention layers are
    listed by hand, which is all the capture needs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        **config,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    layers = [AttentionLayer(i, i, block.self_attn, 4, 2, 16) for i, block in enumerate(model.model.layers)]
    with torch.no_grad():  # logits of order 1-10 instead of the init's 1e-2, so a cap of 0.5 bites
        for layer in layers:
            layer.module.q_proj.weight.mul_(10)
            layer.module.k_proj.weight.mul_(10)
    return model, layers


@pytest.mark.parametrize("cap", [0.5, None])
def test_soft_capping_equals_eager(cap):
    """gemma2 with attention logit soft-capping (sdpa cannot apply it): the capture's output equals eager's."""
    model, layers = _by_hand("gemma2", attn_logit_softcapping=cap, final_logit_softcapping=None)
    inputs = _padded_inputs("llama")
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        eager = model(**inputs).logits
    for output in ("chunks", "sdpa"):  # soft-capped layers take their output from the chunks either way
        _, logits = _outputs(model, layers, inputs, output)
        torch.testing.assert_close(logits[real], eager[real], atol=ATOL, rtol=RTOL)


def test_soft_capping_is_applied():
    """The cap of the test above really changes this model's logits (so the equality is not vacuous)."""
    inputs = _padded_inputs("llama")
    with torch.no_grad():
        capped = _by_hand("gemma2", attn_logit_softcapping=0.5, final_logit_softcapping=None)[0](**inputs).logits
        free = _by_hand("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)[0](**inputs).logits
    assert (capped - free).abs().max() > 1e-3


def _gpt_oss():
    """A tiny gpt_oss: learned attention sinks, alternating sliding and full layers."""
    model, layers = _by_hand(
        "gpt_oss",
        num_local_experts=2,
        num_experts_per_tok=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    with torch.no_grad():
        for layer in layers:
            layer.module.sinks.copy_(torch.randn(4) * 2)  # sinks that take a visible share of each row
    return model, layers


def test_sinks_equal_eager():
    model, layers = _gpt_oss()
    inputs = _padded_inputs("llama")
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        eager = model(**inputs).logits
    masses = []

    def on_chunk(chunk):
        masses.append(chunk.probs.sum(-1)[chunk.query_valid[:, None, :].expand_as(chunk.probs[..., 0])])

    with torch.no_grad(), capture_attention(model, layers, on_chunk, chunk_size=5, output="chunks"):
        logits = model(**inputs).logits
    torch.testing.assert_close(logits[real], eager[real], atol=ATOL, rtol=RTOL)
    masses = torch.cat(masses)
    assert masses.max() <= 1 + 1e-6 and masses.mean() < 0.9  # the sinks took part: rows sum to less than 1


def test_chunked_output_carries_gradients_like_sdpa():
    """Under autograd the chunked output is differentiable and gives sdpa's input gradients."""
    model = tiny_model("qwen2", attn_implementation="sdpa")
    loaded = from_model(model)
    inputs = _padded_inputs("qwen2")
    real = inputs["attention_mask"].bool()
    grads = {}
    for output in ("chunks", "sdpa"):
        embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
        with capture_attention(model, loaded.layers, lambda chunk: None, output=output):
            logits = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits
        logits[real].square().sum().backward()
        grads[output] = embeds.grad[real]
    torch.testing.assert_close(grads["chunks"], grads["sdpa"], atol=1e-4, rtol=1e-4)


def test_output_rule():
    assert output_from_chunks("chunks", torch.device("meta"))
    assert not output_from_chunks("sdpa", torch.device("cpu"))
    assert output_from_chunks("auto", torch.device("cpu"))  # measured faster on an idle CPU: docs/performance.md
    assert not output_from_chunks("auto", torch.device("meta"))  # a device type never measured keeps sdpa
    assert set(OUTPUTS) == {"auto", "chunks", "sdpa"}
    with pytest.raises(HeadlabError, match="unknown attention output source 'flash'"):
        capture_attention(tiny_model("llama"), [], lambda chunk: None, output="flash").__enter__()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_rows_compute_only_the_chunks_that_hold_them(name):
    """With `rows` set, on_chunk sees exactly the chunks holding a wanted row (the rest are never computed), the
    weights of those rows are the full run's, and the output comes from sdpa: the logits of a plain forward."""
    model = tiny_model(name, attn_implementation="sdpa")
    loaded = from_model(model)
    inputs = tiny_inputs(name, batch=2, seq=12)
    rows = torch.zeros(12, dtype=torch.bool)
    rows[[1, 11]] = True  # chunk size 5: chunks [0, 5) and [10, 12); [5, 10) holds no wanted row
    full, picked = {}, {}

    def keep(store):
        return lambda chunk: store.setdefault(chunk.layer.index, {}).update({chunk.start: chunk.probs.clone()})

    with torch.no_grad(), capture_attention(model, loaded.layers, keep(full), None, 5, "chunks") as cap:
        model(**inputs)
    assert cap.chunks_run == 3 * len(loaded.layers)
    with torch.no_grad(), capture_attention(model, loaded.layers, keep(picked), None, 5, "chunks") as cap:
        cap.rows = rows
        logits = model(**inputs).logits
    assert cap.chunks_run == 2 * len(loaded.layers)
    for index, chunks in picked.items():
        assert sorted(chunks) == [0, 10]
        for start, probs in chunks.items():
            torch.testing.assert_close(probs, full[index][start], atol=ATOL, rtol=RTOL)
    with torch.no_grad():
        plain = model(**inputs).logits
    torch.testing.assert_close(logits, plain, atol=ATOL, rtol=RTOL)
    with torch.no_grad(), capture_attention(model, loaded.layers, keep({}), None, 5) as cap:
        cap.rows = torch.ones(7, dtype=torch.bool)
        with pytest.raises(HeadlabError, match=r"rows have shape \(7,\), the call has 12 queries"):
            model(**inputs)
