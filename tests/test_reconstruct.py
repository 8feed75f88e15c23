"""Local reconstruction (headlab.recovery.reconstruct): an unchanged layer never moves, a known linear corruption of a layer is
undone, dead (pruned) heads stay dead, KV merges and physical layouts go through the adapters, and every layer leaves
no worse than it came on held-out windows."""

from __future__ import annotations

import copy

import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core.data import Corpus, calibration_batches
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.pruning import prune as P
from headlab.recovery.reconstruct import LocalSpec, dead_heads, reconstruct

CORPUS = Corpus("sample", [SAMPLE_TEXT * 6])


pytestmark = pytest.mark.usefixtures("one_thread")


def other_tokenizer():
    """A character tokenizer with another vocabulary (letters mapped to other ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, **{chr(c): c - 20 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


def _pair(name="llama"):
    teacher = from_model(tiny_model(name), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    return teacher, student


def _batches(loaded, tokens=512):
    return calibration_batches(loaded.tokenizer, CORPUS, seq_len=32, batch_size=4, max_tokens=tokens)


def _state(loaded):
    return {n: p.detach().clone() for n, p in loaded.model.named_parameters()}


def _layer_params(loaded, index):
    block = loaded.layers[index].block
    return {n for n, _ in loaded.model.named_parameters() if f"layers.{block}." in n}


def _corrupt_values(loaded, index, seed=0):
    """v <- M_g v per KV head g with a random invertible M_g: a linear corruption the output projection can absorb."""
    generator = torch.Generator().manual_seed(seed)
    layer = loaded.layers[index]
    w = loaded.adapter.read(layer)
    D = layer.head_dim
    for g in range(layer.num_kv_heads):
        M = torch.eye(D) + 0.5 * torch.randn(D, D, generator=generator) / D**0.5
        w.v[g] = M @ w.v[g]
    loaded.adapter.write(layer, w)


@torch.no_grad()
def _logit_error(student, teacher, batches):
    errors = []
    for ids, mask, _ in batches:
        s, t = student.model(ids, attention_mask=mask).logits, teacher.model(ids, attention_mask=mask).logits
        errors.append(float((s - t).norm() / t.norm()))
    return max(errors)


@pytest.mark.parametrize("targets", ["original", "same"])
def test_unchanged_layers_do_not_move(targets):
    teacher, student = _pair()
    _corrupt_values(student, 1)
    before = _state(student)
    table = reconstruct(student, teacher, _batches(student), LocalSpec(steps=3, targets=targets), progress=False)
    row = table.set_index("layer").loc[0]
    assert row["error_before"] == 0 and not row["changed"] and row["steps"] == 0
    after = _state(student)
    for name in _layer_params(student, 0):
        assert torch.equal(before[name], after[name]), name
    for name in before:  # nothing outside the attention layers moves
        if "self_attn" not in name:
            assert torch.equal(before[name], after[name]), name


def test_untouched_model_stays_bit_identical():
    teacher, student = _pair()
    before = _state(student)
    table = reconstruct(student, teacher, _batches(student), LocalSpec(steps=2), progress=False)
    assert not table["changed"].any()
    assert all(torch.equal(before[n], p) for n, p in student.model.named_parameters())


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_known_linear_corruption_is_restored(name):
    """A per-head invertible map on the values is absorbed exactly by the closed-form output-projection refit."""
    teacher, student = _pair(name)
    _corrupt_values(student, 0)
    batches = _batches(student)
    corrupted = _logit_error(student, teacher, batches)
    table = reconstruct(student, teacher, batches, LocalSpec(steps=0), progress=False)
    row = table.set_index("layer").loc[0]
    assert row["changed"] and row["error_after"] < 1e-3 * row["error_before"]
    assert _logit_error(student, teacher, batches) < 0.02 * corrupted


@pytest.mark.parametrize("method", ["mean", "svd"])
def test_kv_merges_get_closer_and_never_worse_on_held_out(method):
    teacher, student = _pair()
    batches = _batches(student)
    gqa.convert(student, 1, method=method, batches=batches)
    before = _logit_error(student, teacher, batches)
    table = reconstruct(student, teacher, batches, LocalSpec(steps=4, lr=1e-3), progress=False)
    assert (table["error_after"] <= table["error_before"]).all()
    assert student.layers[0].num_kv_heads == 1  # the layout is kept
    if method == "mean":  # the calibrated svd merge of this tiny model leaves nothing that generalises to held-out
        assert table["changed"].all()
        assert _logit_error(student, teacher, batches) < 0.8 * before
    else:
        assert _logit_error(student, teacher, batches) <= before * (1 + 1e-6)


def test_masked_heads_stay_dead_and_physical_layouts_work():
    teacher, masked = _pair()
    pruned = [{0, 3}, {1}]
    P.apply_mask(masked, pruned)
    reconstruct(masked, teacher, _batches(masked), LocalSpec(steps=3, lr=1e-3), progress=False)
    assert [dead_heads(masked, layer) for layer in masked.layers] == [[0, 3], [1]]
    physical = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    P.apply_physical(physical, P.physical_layout(physical.layers, pruned))
    shapes = [(layer.num_heads, layer.num_kv_heads) for layer in physical.layers]
    table = reconstruct(physical, teacher, _batches(physical), LocalSpec(steps=3, lr=1e-3), progress=False)
    assert [(layer.num_heads, layer.num_kv_heads) for layer in physical.layers] == shapes
    assert (table["error_after"] <= table["error_before"]).all() and table["changed"].all()


def test_a_student_not_derived_from_the_teacher_is_refused():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    other = from_model(tiny_model("llama", num_hidden_layers=3), tiny_tokenizer())
    with pytest.raises(HeadlabError, match="not derived"):
        reconstruct(other, teacher, _batches(other), progress=False)
    with pytest.raises(HeadlabError, match="tokenizers"):
        reconstruct(from_model(teacher.model, other_tokenizer()), teacher, _batches(other), progress=False)
    with pytest.raises(HeadlabError, match="lr"):
        reconstruct(teacher, teacher, _batches(other), LocalSpec(lr=0), progress=False)
