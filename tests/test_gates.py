"""Head gates: a zero gate equals zeroing the head's output-projection columns, ones change nothing, hooks never
outlive the context, and mask files round-trip and refuse bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from models import ALL_TYPES, tiny_inputs, tiny_model

from headlab.core.arch import adapter_for, attention_layers
from headlab.core.errors import HeadlabError
from headlab.mechanisms.gates import head_gates, ones_gates, read_mask, write_mask


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def _zero_head_columns(model, layer_index: int, head: int):
    """A copy of `model` whose output projection ignores `head` of `layer_index`, written through the adapter."""
    model = copy.deepcopy(model)
    adapter = adapter_for(model)
    layer = attention_layers(model)[layer_index]
    weights = adapter.read(layer)
    weights.o[:, head, :] = 0
    adapter.write(layer, weights)
    return model


@pytest.mark.parametrize("name", ALL_TYPES)
def test_ones_leave_logits_unchanged(name):
    model, inputs = tiny_model(name), tiny_inputs(name)
    reference = _logits(model, inputs)
    for batch in (None, 2):
        with head_gates(model, ones_gates(model, batch)):
            assert torch.equal(_logits(model, inputs), reference)
    assert _hook_count(model) == 0


@pytest.mark.parametrize("name", ALL_TYPES)
def test_zero_gate_equals_zeroed_output_columns(name):
    model, inputs = tiny_model(name), tiny_inputs(name)
    layers = attention_layers(model)
    last, head = len(layers) - 1, 2
    expected = _logits(_zero_head_columns(model, last, head), inputs)
    gates = ones_gates(model, requires_grad=False)
    gates[last][head] = 0
    with head_gates(model, gates):
        torch.testing.assert_close(_logits(model, inputs), expected, rtol=0, atol=1e-5)
    # Per-sequence gates: only row 0 loses the head.
    rows = ones_gates(model, 2, requires_grad=False)
    rows[last][0, head] = 0
    reference = _logits(model, inputs)
    with head_gates(model, rows):
        out = _logits(model, inputs)
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], reference[1], rtol=0, atol=1e-5)
    assert not torch.allclose(expected[0], reference[0])  # the head mattered, so the check above had teeth


def test_hooks_removed_after_an_exception():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with head_gates(model, ones_gates(model)):
            assert _hook_count(model) == len(attention_layers(model))
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_none_leaves_a_layer_ungated_and_bad_shapes_fail():
    model = tiny_model("llama")
    gates = ones_gates(model)
    with head_gates(model, [None, gates[1]]):
        assert _hook_count(model) == 1
    with pytest.raises(HeadlabError, match="gate tensors"):
        with head_gates(model, gates[:1]):
            pass
    with pytest.raises(HeadlabError, match="H = 4"):
        with head_gates(model, [torch.ones(3), gates[1]]):
            pass
    with pytest.raises(HeadlabError, match="per-sequence gates for 3 rows"):
        with head_gates(model, ones_gates(model, 3)):
            _logits(model, tiny_inputs("llama", batch=2))
    assert _hook_count(model) == 0


def test_bfloat16_model_float32_gate_gets_float32_gradient():
    model = tiny_model("llama").to(torch.bfloat16)
    gates = ones_gates(model, 2)
    with head_gates(model, gates):
        model(**tiny_inputs("llama")).logits.float().sum().backward()
    assert all(g.grad is not None and g.grad.dtype == torch.float32 and torch.isfinite(g.grad).all() for g in gates)


def test_mask_file_round_trip_and_partial_files(tmp_path):
    layers = attention_layers(tiny_model("llama"))
    gates = [torch.tensor([1.0, 0.0, 0.25, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])]
    path = write_mask(tmp_path / "mask.csv", gates, layers)
    assert path.read_text().splitlines()[0] == "layer,head,gate"
    for got, want in zip(read_mask(path, layers), gates):
        assert torch.equal(got, want)
    partial = tmp_path / "partial.csv"
    partial.write_text("layer,head,gate\n1,3,0\n")
    assert [g.tolist() for g in read_mask(partial, layers)] == [[1, 1, 1, 1], [1, 1, 1, 0]]


@pytest.mark.parametrize(
    "content, message",
    [
        ("layer,head\n0,1\n", "lacks column"),
        ("layer,head,gate\n2,0,0\n", "layer 2 out of range"),
        ("layer,head,gate\n0,4,0\n", "head 4 out of range"),
        ("layer,head,gate\n-1,0,0\n", "out of range"),
        ("layer,head,gate\n0,1.5,0\n", "integers"),
        ("layer,head,gate\n0,x,0\n", "numbers"),
        ("layer,head,gate\n0,1,nan\n", "finite"),
        ("layer,head,gate\n0,1,0\n0,1,1\n", "twice"),
    ],
)
def test_bad_mask_files(tmp_path, content, message):
    layers = attention_layers(tiny_model("llama"))
    path = tmp_path / "mask.csv"
    path.write_text(content)
    with pytest.raises(HeadlabError, match=message):
        read_mask(path, layers)


def test_missing_mask_file_and_batched_gates_in_a_file(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(HeadlabError, match="no such mask file"):
        read_mask(tmp_path / "nope.csv", model)
    with pytest.raises(HeadlabError, match="one gate per head"):
        write_mask(tmp_path / "m.csv", ones_gates(model, 2), model)
