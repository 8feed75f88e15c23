"""DuoAttention's gates (headlab.kv.duo_gates, headlab.mechanisms.head_cache.head_gates): the gated attention is
alpha x full + (1 - alpha) x the masked streaming policy, head by head; the objective's gradient matches finite
differences; the first Adam step moves every gate by the learning rate; `kv-policy --score gates` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_text import run_cli, save_tiny

from headlab.core.data import TextSpec, load_corpus
from headlab.core.loading import load_model
from headlab.kv.duo_gates import (
    GateSpec,
    answer_batches,
    answer_logits,
    gate_bands,
    gated_distillation,
    optimized_gates,
)
from headlab.measure.stats import retrieval_sequences
from headlab.mechanisms.head_cache import LayerStreaming, head_gates, head_policy

SINKS, WINDOW = 2, 8


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny("llama", tmp_path_factory.mktemp("gates") / "model", max_position_embeddings=512)
    return load_model(str(path), device="cpu")


def _gates(loaded, values):
    """{layer: (band, alpha)} with every layer's KV-head gates set to `values`."""
    bands = gate_bands(loaded, SINKS, WINDOW)
    return {i: (band, torch.tensor(values, dtype=torch.float32)) for i, band in bands.items()}


def _first_out_proj_input(loaded, ids, context):
    """The head outputs entering layer 0's output projection ([T, H * D], head-major) inside `context`."""
    seen = []
    handle = loaded.model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args: seen.append(args[0][0].detach().clone())
    )
    try:
        with torch.no_grad(), context:
            logits = loaded.model(input_ids=ids).logits
    finally:
        handle.remove()
    return seen[0], logits


def test_gated_attention_mixes_full_and_streaming_head_by_head(loaded):
    ids = torch.randint(3, loaded.model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    layers = loaded.layers
    group, head_dim = layers[0].group_size, layers[0].head_dim
    plain, plain_logits = _first_out_proj_input(loaded, ids, torch.enable_grad())
    full, full_logits = _first_out_proj_input(loaded, ids, head_gates(loaded.model, layers, _gates(loaded, [1.0, 1.0])))
    torch.testing.assert_close(full, plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(full_logits, plain_logits, rtol=0, atol=1e-5)
    # gates (1, 0): KV head 1 streams, exactly as the masked policy streams it
    policy = {layer.index: LayerStreaming((1,), layer.num_kv_heads, group, SINKS, WINDOW) for layer in layers}
    gated = head_gates(loaded.model, layers, _gates(loaded, [1.0, 0.0]))
    mixed, mixed_logits = _first_out_proj_input(loaded, ids, gated)
    masked, masked_logits = _first_out_proj_input(loaded, ids, head_policy(loaded.model, layers, policy))
    torch.testing.assert_close(mixed, masked, rtol=0, atol=1e-6)
    torch.testing.assert_close(mixed_logits, masked_logits, rtol=0, atol=1e-5)
    assert not torch.allclose(mixed, full, atol=1e-4)  # the streaming head did lose keys at 40 tokens
    # gates (0.3, 0.8): each query head's output is its KV head's mix of the two
    stream, _ = _first_out_proj_input(loaded, ids, head_gates(loaded.model, layers, _gates(loaded, [0.0, 0.0])))
    between, _ = _first_out_proj_input(loaded, ids, head_gates(loaded.model, layers, _gates(loaded, [0.3, 0.8])))
    alpha = torch.tensor([0.3, 0.8]).repeat_interleave(group).repeat_interleave(head_dim)
    torch.testing.assert_close(between, alpha * full + (1 - alpha) * stream, rtol=0, atol=1e-6)


def _batches(loaded):
    text = TextSpec(load_corpus("pydoc-topics"), split="calibration")
    sequences, _ = retrieval_sequences(loaded, text, length=256, count=2)
    return answer_batches(loaded, sequences)


def test_answer_logits_are_the_full_forwards_answer_rows(loaded):
    text = TextSpec(load_corpus("pydoc-topics"), split="calibration")
    sequences, _ = retrieval_sequences(loaded, text, length=256, count=1)
    ids, target = sequences[0]
    input_ids = torch.tensor([ids])
    rows = torch.tensor([[t >= 0 for t in target]])
    assert 0 < int(rows.sum()) < rows.shape[1] // 2  # a few answer rows at the end: the shortcut has work to skip
    with torch.no_grad():
        full = loaded.model(input_ids=input_ids).logits[rows]
        torch.testing.assert_close(answer_logits(loaded.model, input_ids, rows), full, rtol=0, atol=1e-5)


def test_distillation_gradient_matches_finite_differences(loaded):
    batches = _batches(loaded)
    bands = gate_bands(loaded, SINKS, WINDOW)
    alpha = {i: torch.full((band.num_kv_heads,), 0.5, requires_grad=True) for i, band in bands.items()}
    with head_gates(loaded.model, loaded.layers, {i: (bands[i], alpha[i]) for i in bands}):
        gated_distillation(loaded.model, batches, backward=True)
        step = 0.05
        for layer, head in ((0, 0), (1, 1)):
            with torch.no_grad():
                alpha[layer][head] += step
                above = gated_distillation(loaded.model, batches, backward=False)
                alpha[layer][head] -= 2 * step
                below = gated_distillation(loaded.model, batches, backward=False)
                alpha[layer][head] += step
            assert abs(alpha[layer].grad[head].item()) > 1e-5  # a real slope, not two zeros
            assert alpha[layer].grad[head].item() == pytest.approx((above - below) / (2 * step), rel=0.05, abs=1e-7)


def test_first_step_moves_every_gate_by_the_learning_rate(loaded):
    """At alpha = 1 the gated model is the original, so the distillation gradient is 0 and only the L1 pull acts:
    Adam's first step is lr x sign(gradient) for every gate."""
    text = TextSpec(load_corpus("pydoc-topics"), split="calibration")
    frame, meta = optimized_gates(loaded, text, sinks=SINKS, window=WINDOW, progress=False,
                                  spec=GateSpec(steps=1, lr=0.1, prompts=2, length=256))  # fmt: skip
    assert frame["score"].tolist() == pytest.approx([0.9] * len(frame), abs=1e-4)
    assert len(frame) == sum(layer.num_kv_heads for layer in loaded.layers)
    assert meta["steps_record"][0]["kl"] == pytest.approx(0.0, abs=1e-6) and meta["steps"] == 1
    before = [p.requires_grad for p in loaded.model.parameters()]
    assert all(before)  # the weights are frozen only during the optimisation


def test_gate_spec_refusals():
    for spec in (GateSpec(steps=0), GateSpec(prompts=0), GateSpec(lr=0), GateSpec(l1=-1)):
        with pytest.raises(Exception, match="gate optimisation needs"):
            spec.check()


def test_kv_policy_score_gates_end_to_end(loaded, tmp_path, capsys):
    model = save_tiny("llama", tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "policy"
    code, stdout, stderr = run_cli(["kv-policy", "--model", model, "--data", "pydoc-topics", "--context", "512",
                                    "--sinks", "2", "--window", "16", "--score", "gates", "--gate-steps", "2",
                                    "--budget", "0.6", "--out", out], capsys)  # fmt: skip
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["policy"]["score"] == "gates" and meta["statistics"]["gates"]["steps"] == 2
    assert len(meta["statistics"]["gates"]["steps_record"]) == 2
    assert meta["policy"]["kv_fraction"] <= 0.6 + 1e-9


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--score", "gates", "--stats", "somewhere"), "--score gates trains its gates on passkey prompts"),
        (("--gate-steps", "3"), "--gate-steps sets the training of --score gates"),
        (("--score", "gates", "--gate-steps", "0"), "Invalid value for '--gate-steps'"),
    ],
)
def test_kv_policy_gates_refusals(tmp_path, capsys, extra, message):
    model = save_tiny("llama", tmp_path / "model", max_position_embeddings=512)
    out = tmp_path / "policy"
    code, _, stderr = run_cli(["kv-policy", "--model", model, "--out", out, *extra], capsys)
    assert code == 2 and message in stderr and not out.exists()
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
