"""Chunked vocabulary projection + cross-entropy (headlab.mechanisms.losses) against whole logits and F.cross_entropy: losses,
gradients to the hidden states, gate gradients through every adapter's tiny model, and the fallback for models that
transform their logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import ALL_TYPES, tiny_inputs, tiny_model

from headlab.core.loading import from_model
from headlab.mechanisms import losses
from headlab.mechanisms.gates import head_gates, ones_gates


def _case(dtype, bias: bool, B=3, T=7, C=16, V=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, C, generator=generator, dtype=dtype)
    head = torch.nn.Linear(C, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, C, generator=generator, dtype=dtype))
        if bias:
            head.bias.copy_(torch.randn(V, generator=generator, dtype=dtype))
    head.requires_grad_(False)  # the chunked loss serves frozen heads (importance); see test_trainable_head_refused
    labels = torch.randint(0, V, (B, T), generator=generator)
    labels[:, -1] = losses.IGNORE  # the last position predicts nothing
    labels[1, 4:] = losses.IGNORE  # right padding
    return hidden, head, labels


def _slow_nll(hidden, head, labels):
    """One position at a time: -log softmax(W h + c)[y], summed per sequence (the obvious implementation)."""
    B, T, _ = hidden.shape
    out = []
    for b in range(B):
        total = torch.zeros((), dtype=torch.float64)
        for t in range(T):
            if labels[b, t] != losses.IGNORE:
                logits = (head.weight.double() @ hidden[b, t].double()) + (
                    head.bias.double() if head.bias is not None else 0
                )
                total = total - torch.log_softmax(logits, -1)[labels[b, t]]
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("chunk_bytes", [4 * 50 * 2, 4 * 50 * 5, 2**20])  # 2 rows, 5 rows, everything at once
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_gradient_equal_plain(monkeypatch, chunk_bytes, bias):
    monkeypatch.setattr(losses, "CHUNK_BYTES", chunk_bytes)
    hidden, head, labels = _case(torch.float64, bias)
    weights = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)  # a weighted sum: each sequence's own scale
    grads = {}
    for name in ("chunked", "plain"):
        h = hidden.clone().requires_grad_(True)
        if name == "chunked":
            nll = losses.chunked_nll(h, head, labels)
        else:
            nll = losses.plain_nll(head(h), labels)
        (nll * weights).sum().backward()
        grads[name] = (nll.detach(), h.grad)
    torch.testing.assert_close(grads["chunked"][0], _slow_nll(hidden, head, labels), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(grads["chunked"][0], grads["plain"][0], rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(grads["chunked"][1], grads["plain"][1], rtol=1e-12, atol=1e-10)
    assert grads["chunked"][1][1, 4:].abs().max() == 0  # unscored positions get no gradient
    assert head.weight.grad is None  # the head is frozen: no weight gradient is computed


def test_float32_chunked_loss_within_float32_rounding(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_BYTES", 4 * 50 * 3)
    hidden, head, labels = _case(torch.float32, True)
    h = hidden.clone().requires_grad_(True)
    nll = losses.chunked_nll(h, head, labels)
    nll.sum().backward()
    torch.testing.assert_close(nll.double(), _slow_nll(hidden, head, labels), rtol=1e-5, atol=1e-4)
    reference = hidden.clone().requires_grad_(True)
    losses.plain_nll(head(reference), labels).sum().backward()
    torch.testing.assert_close(h.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_trainable_head_refused():
    hidden, head, labels = _case(torch.float32, True)
    head.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen head"):
        losses.chunked_nll(hidden.requires_grad_(True), head, labels)


def test_no_gradient_work_without_autograd():
    hidden, head, labels = _case(torch.float32, False)
    with torch.no_grad():
        nll = losses.chunked_nll(hidden, head, labels)
    assert not nll.requires_grad
    torch.testing.assert_close(nll, losses.plain_nll(head(hidden), labels))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_gate_gradients_through_the_model_equal_plain(name, monkeypatch):
    """Per-sequence gate gradients dL(x_b)/dxi with the chunked loss equal those of whole logits (float64)."""
    monkeypatch.setattr(losses, "CHUNK_BYTES", 8 * 128 * 3)  # 3 positions per chunk: several chunks per batch
    dtype = torch.float32 if name == "qwen3_next" else torch.float64  # its MoE grouped matmul has no float64
    model = tiny_model(name, attn_implementation="sdpa").to(dtype).requires_grad_(False)  # frozen, as importance
    loaded = from_model(model)
    inputs = tiny_inputs(name, batch=2, seq=10)
    inputs["attention_mask"][1, 7:] = 0
    # Any labels will do for the loss's algebra (encoders included): random targets on real positions.
    targets = torch.randint(0, 128, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    labels = torch.where(inputs["attention_mask"].bool(), targets, losses.IGNORE)
    labels[:, -1] = losses.IGNORE
    head = model.get_output_embeddings()
    assert losses._head_slot(model) is not None  # the chunked path really runs for this family
    results = {}
    for chunked in (True, False):
        gates = ones_gates(loaded, 2, dtype=dtype)
        with head_gates(loaded, gates):
            nll = losses.sequence_nll(model, inputs["input_ids"], inputs["attention_mask"], labels, chunked=chunked)
        results[chunked] = (nll.detach(), torch.autograd.grad(nll.sum(), gates))
    assert model.get_output_embeddings() is head and model not in losses._TRANSFORMED_LOGITS  # stand-in gone
    tolerance = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[True][0], results[False][0], **tolerance)
    for got, expected in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(got, expected, **tolerance)


def test_transformed_logits_fall_back_to_whole_logits():
    """gemma2 soft-caps its logits after the head: scoring hidden states instead would be wrong, so the model is
    scored with whole logits (the result equals F.cross_entropy on the model's own logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma2",
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
        final_logit_softcapping=0.1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(3, 64, (2, 6))
    mask = torch.ones_like(ids)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), losses.IGNORE)], 1)
    model.requires_grad_(False)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=losses.IGNORE, reduction="none").sum(1)
    for _ in range(2):  # the first call finds the transform, the second remembers it
        torch.testing.assert_close(losses.sequence_nll(model, ids, mask, labels), expected)
    assert model in losses._TRANSFORMED_LOGITS
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)


def test_head_restored_after_an_exception():
    model = tiny_model("llama", attn_implementation="sdpa")
    head = model.get_output_embeddings()
    ids = torch.randint(3, 100, (1, 4))
    labels = torch.full_like(ids, 5)

    def explode(module, args):
        raise RuntimeError("boom")

    hook = model.model.norm.register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        losses.sequence_nll(model, ids, torch.ones_like(ids), labels)
    hook.remove()
    assert model.get_output_embeddings() is head


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3_text"])
def test_evaluation_log_probs_in_chunks_equal_whole_logits(name, monkeypatch):
    """headlab.measure.evaluate's per-token log-probabilities from final states projected a few rows at a time
    (final_states + picked_log_probs) equal log_softmax of the model's own whole logits (float64)."""
    monkeypatch.setattr(losses, "CHUNK_BYTES", 8 * 128 * 3)  # 3 rows per chunk: several chunks per row
    model = tiny_model(name, attn_implementation="sdpa").to(torch.float64)
    inputs = tiny_inputs(name, batch=2, seq=10)
    with torch.no_grad():
        logits = model(**inputs).logits  # [B, T, V]
        states, head = losses.final_states(model, inputs["input_ids"], inputs["attention_mask"])
    targets = torch.randint(0, logits.shape[-1], (10,), generator=torch.Generator().manual_seed(1))
    for row in range(2):
        expected = torch.log_softmax(logits[row], -1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(losses.picked_log_probs(states[row], head, targets), expected)
    assert head is not None  # the chunked projection really ran (none of these transforms its logits)


def test_evaluation_falls_back_to_whole_logits_when_the_forward_transforms_them():
    """A soft-capped head (gemma2): final_states hands back the model's own logits and no head to project with."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma2", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, final_logit_softcapping=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(3, 64, (2, 6))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        states, head = losses.final_states(model, ids, torch.ones_like(ids))
    assert head is None
    torch.testing.assert_close(states, expected)
