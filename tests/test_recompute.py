"""Activation recompute (headlab.mechanisms.recompute) for importance and uptrain: the same scores as without it, blocks
really recomputed in the backward pass, dropout kept off, and the model's previous state restored."""

from __future__ import annotations

import json

import pytest
import torch
from models import ALL_TYPES, ENCODER_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.importance import head_importance
from headlab.mechanisms.recompute import activation_checkpointing


def _loaded(name, **overrides):
    return from_model(tiny_model(name, **overrides), tiny_tokenizer(encoder=name in ENCODER_TYPES))


def _batches(name):
    inputs = tiny_inputs(name, batch=3, seq=12, seed=3)
    mask = inputs["attention_mask"].clone()
    mask[1, 9:] = 0  # one padded row
    return [(inputs["input_ids"][:2], mask[:2]), (inputs["input_ids"][2:], mask[2:])]


def _count_calls(loaded):
    """Calls of every attention module: a recomputed block calls its attention again."""
    counts = [0] * len(loaded.layers)
    hooks = []
    for i, layer in enumerate(loaded.layers):

        def hook(module, args, output, i=i):
            counts[i] += 1

        hooks.append(layer.module.register_forward_hook(hook))
    return counts, hooks


# attention_dropout 0.5: a checkpointed block that ran in training mode would drop attention weights and change
# the scores, so equality with the plain run also shows dropout stayed off.
@pytest.mark.parametrize("name,overrides", [("llama", {"attention_dropout": 0.5}), ("gpt2", {"attn_pdrop": 0.5})])
@pytest.mark.parametrize("method", ["grad", "taylor"])
def test_checkpointed_scores_equal_plain_and_blocks_are_recomputed(name, overrides, method):
    loaded = _loaded(name, **overrides)
    batches = _batches(name)
    counts, hooks = _count_calls(loaded)
    plain = head_importance(loaded, batches, method=method, progress=False)
    plain_calls = list(counts)
    counts[:] = [0] * len(counts)
    checkpointed = head_importance(loaded, batches, method=method, gradient_checkpointing=True, progress=False)
    for hook in hooks:
        hook.remove()
    assert plain_calls == [len(batches)] * len(loaded.layers)
    assert counts == [2 * len(batches)] * len(loaded.layers)  # forward + recomputation in backward
    for a, b in zip(plain.raw, checkpointed.raw):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert checkpointed.meta["gradient_checkpointing"] is True and plain.meta["gradient_checkpointing"] is False
    assert not loaded.model.training and not loaded.model.is_gradient_checkpointing


@pytest.mark.parametrize("name", ALL_TYPES)
def test_every_architecture_recomputes_and_scores_the_same(name):
    loaded = _loaded(name)
    batches = _batches(name)
    plain = head_importance(loaded, batches, progress=False)
    counts, hooks = _count_calls(loaded)
    checkpointed = head_importance(loaded, batches, gradient_checkpointing=True, progress=False)
    for hook in hooks:
        hook.remove()
    assert counts == [2 * len(batches)] * len(loaded.layers)
    for a, b in zip(plain.raw, checkpointed.raw):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_state_is_restored():
    model = tiny_model("llama")
    model.eval()
    with activation_checkpointing(model) as applies:
        assert applies and model.is_gradient_checkpointing and not model.training
    assert not model.is_gradient_checkpointing and not hasattr(model, "_require_grads_hook")
    assert not any(m.training for m in model.modules())
    # A model already checkpointing in training mode keeps both.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    funcs = {id(m): m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()}
    with activation_checkpointing(model):
        assert not model.training
    assert model.is_gradient_checkpointing and all(m.training for m in model.modules())
    assert funcs == {id(m): m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()}
    with activation_checkpointing(model, enabled=False) as applies:
        assert applies is False


def test_no_grad_forward_inside_is_plain_eval():
    """Without grad mode the blocks run as is, in eval mode (dropout off): the logits equal the plain ones."""
    model = tiny_model("llama", attention_dropout=0.5).eval()
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        plain = model(**inputs).logits
        with activation_checkpointing(model):
            inside = model(**inputs).logits
    torch.testing.assert_close(inside, plain)


def test_ablation_refuses_checkpointing_and_cli_records_it(tmp_path, capsys):
    with pytest.raises(HeadlabError, match="backward pass, not method=.ablation."):
        head_importance(_loaded("llama"), _batches("llama"), method="ablation", gradient_checkpointing=True)
    model_dir = save_tiny("llama", tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    base = ["importance", "--model", model_dir, "--data", corpus, "--device", "cpu", "--seq-len", "32"]
    out = tmp_path / "out"
    code, _, stderr = run_cli([*base, "--max-tokens", "64", "--gradient-checkpointing", "--out", out], capsys)
    assert code == 0, stderr
    assert json.loads((out / "meta.json").read_text())["gradient_checkpointing"] is True
    code, _, stderr = run_cli(
        [*base, "--method", "ablation", "--gradient-checkpointing", "--out", tmp_path / "o2"], capsys
    )
    assert code == 2 and "no backward pass" in stderr and not (tmp_path / "o2").exists()
