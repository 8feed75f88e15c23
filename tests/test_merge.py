"""Calibrated KV-head merging (headlab.kv.merge): exact on planted cases (copies, invertible maps, complex rotations per
rotary frequency pair), the closed form against brute force, better than mean pooling, vanilla reload everywhere."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GQA_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer
from transformers import AutoModelForCausalLM

from headlab.core.data import Corpus
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.kv.merge import _subspace, merge_kv_heads, merge_plan

LINEAR_KEYS = ["llama", "mistral", "qwen2", "phi3"]  # keys without a per-head norm: the complex merge applies


class OneBatch:
    """Calibration batches made of one fixed batch of tiny inputs."""

    def __init__(self, inputs):
        self.inputs = inputs

    def __iter__(self):
        yield self.inputs["input_ids"], self.inputs["attention_mask"], None


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _plant(loaded, seed=0):
    """Make KV head 1 of every layer a function of KV head 0 that merging can represent exactly: values an
    invertible linear map of head 0's, keys head 0's times a random complex number per rotary frequency pair (and
    an invertible map on non-rotary dimensions)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in loaded.layers:
            w = loaded.adapter.read(layer)
            D = w.head_dim
            rd = loaded.adapter.rotary_dim(layer, loaded.model.config)
            half = rd // 2
            A = torch.randn(D, D, generator=generator) / D**0.5 + torch.eye(D)
            w.v[1] = A @ w.v[0]
            if w.v_bias is not None:
                w.v_bias[1] = A @ w.v_bias[0]
            z = torch.complex(torch.randn(half, generator=generator), torch.randn(half, generator=generator))
            re, im = w.k[0, :half], w.k[0, half:rd]
            w.k[1, :half] = z.real[:, None] * re - z.imag[:, None] * im
            w.k[1, half:rd] = z.imag[:, None] * re + z.real[:, None] * im
            if w.k_bias is not None:
                rb, ib = w.k_bias[0, :half], w.k_bias[0, half:rd]
                w.k_bias[1, :half] = z.real * rb - z.imag * ib
                w.k_bias[1, half:rd] = z.imag * rb + z.real * ib
            if rd < D:
                B = torch.randn(D - rd, D - rd, generator=generator) / D**0.5 + torch.eye(D - rd)
                w.k[1, rd:] = B @ w.k[0, rd:]
                if w.k_bias is not None:
                    w.k_bias[1, rd:] = B @ w.k_bias[0, rd:]
            loaded.adapter.write(layer, w)


@pytest.mark.parametrize(
    "name, overrides",
    [("llama", {}), ("qwen2", {}), ("phi3", {}), ("mistral", {}), ("llama", {"head_dim": 12}), ("phi3", {"pr": 0.5})],
)
def test_planted_heads_merge_losslessly(name, overrides):
    """Members that are invertible maps (values) or complex scalings per frequency (keys) of another merge exactly."""
    overrides = dict(overrides)
    extra = {}
    if overrides.pop("pr", None):
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model = tiny_model(name, **overrides, **extra)
    loaded = from_model(model)
    if extra:
        assert loaded.adapter.rotary_dim(loaded.layers[0], model.config) == 8  # the non-rotary path is exercised
    _plant(loaded)
    inputs = tiny_inputs(name, batch=4, seq=24)
    before = _logits(model, inputs)
    info = merge_kv_heads(loaded, 1, OneBatch(inputs), progress=False)
    assert (info["keys"], info["values"]) == ("svd", "svd")
    assert model.config.num_key_value_heads == 1 and loaded.layers[0].num_kv_heads == 1
    torch.testing.assert_close(_logits(model, inputs), before, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", LINEAR_KEYS)
def test_planted_merge_is_exact_on_unseen_inputs(name):
    """Exactness is algebraic, not a fit to the calibration batch: other inputs give the same logits too."""
    model = tiny_model(name)
    loaded = from_model(model)
    _plant(loaded, seed=3)
    original = copy.deepcopy(model)
    merge_kv_heads(loaded, 1, OneBatch(tiny_inputs(name, batch=4, seq=32)), progress=False)
    other = tiny_inputs(name, batch=2, seq=20, seed=11)
    torch.testing.assert_close(_logits(model, other), _logits(original, other), atol=2e-4, rtol=0)


def test_subspace_is_the_constrained_optimum():
    """tr(c^T S B S c) at the closed form beats random feasible c (c^T S c = I), and the constraint holds."""
    generator = torch.Generator().manual_seed(0)
    n, d = 12, 4
    X = torch.randn(50, n, generator=generator, dtype=torch.float64)
    S = X.T @ X
    Y = torch.randn(n, n, generator=generator, dtype=torch.float64)
    B = Y @ Y.T
    c = _subspace(S, B, d)
    torch.testing.assert_close(c.T @ S @ c, torch.eye(d, dtype=torch.float64), atol=1e-9, rtol=0)
    best = torch.trace(c.T @ S @ B @ S @ c)
    for _ in range(200):
        r = torch.randn(n, d, generator=generator, dtype=torch.float64)
        L = torch.linalg.cholesky(r.T @ S @ r)
        r = r @ torch.linalg.inv(L).T  # now r^T S r = I
        assert torch.trace(r.T @ S @ B @ S @ r) <= best + 1e-8


def test_subspace_rank_deficient_pads_with_zeros():
    S = torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    c = _subspace(S, torch.eye(4, dtype=torch.float64), 3)
    assert c.shape == (4, 3) and torch.all(c[:, 2] == 0) and torch.all(c[2:] == 0)


@pytest.mark.parametrize("name", GQA_TYPES)
def test_svd_merge_beats_mean_pooling(name):
    """On random (unplanted) tiny models the calibrated merge is closer to the original than mean pooling, or equal
    where both parts fall back to mean pooling (gated hybrids)."""
    model = tiny_model(name)
    inputs = tiny_inputs(name, batch=4, seq=32)
    reference = _logits(model, inputs)
    mean_model = copy.deepcopy(model)
    gqa.convert(from_model(mean_model), 1)
    loaded = from_model(model)
    plan = merge_plan(loaded)
    merge_kv_heads(loaded, 1, OneBatch(inputs), progress=False)
    mean_error = float((_logits(mean_model, inputs) - reference).pow(2).mean())
    svd_error = float((_logits(model, inputs) - reference).pow(2).mean())
    if plan["keys"] == "mean" and plan["values"] == "mean":
        assert svd_error == pytest.approx(mean_error, rel=1e-4)
    else:
        assert svd_error < 0.7 * mean_error


@pytest.mark.parametrize("name", GQA_TYPES)
def test_every_gqa_architecture_converts_with_svd_and_reloads(name, tmp_path):
    """convert_checkpoint --method svd on each GQA family: saved, reloaded with vanilla transformers (verified inside
    save_checkpoint), one KV head, same logits as the model in memory."""
    model = tiny_model(name)
    loaded = from_model(model, tiny_tokenizer())
    corpus = Corpus("sample", [SAMPLE_TEXT])
    record = gqa.convert_checkpoint(
        loaded,
        1,
        tmp_path / "svd",
        gqa.PoolSpec(method="svd"),
        data=corpus,
        evaluate=False,
        seq_len=32,
        calibration_tokens=128,
        progress=False,
    )
    assert record["conversion"]["method"] == "svd" and record["conversion"]["merge"]["calibration_tokens"] > 0
    assert record["verification"]["loader"].startswith("transformers.")
    if name in ("gemma3", "qwen3_5"):  # multimodal wrappers: the reload check inside save_checkpoint covers them
        return
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "svd", dtype=torch.float32).eval()
    assert reloaded.config.get_text_config().num_key_value_heads == 1
    inputs = tiny_inputs(name)
    torch.testing.assert_close(_logits(reloaded, inputs), _logits(model, inputs), atol=1e-4, rtol=0)


def test_similarity_grouping_with_svd(tmp_path):
    """Grouping by similarity permutes heads first; the merge then works on the contiguous groups."""
    model = tiny_model("llama_mha")
    loaded = from_model(model)
    inputs = tiny_inputs("llama_mha", batch=4, seq=32)
    conversion = gqa.convert(
        loaded, 2, grouping="similarity", groups=[[[0, 3], [1, 2]]] * 2, method="svd", batches=OneBatch(inputs)
    )
    assert conversion.method == "svd" and conversion.permuted_layers == 2
    assert model.config.num_key_value_heads == 2


def test_svd_needs_batches_and_a_known_method():
    loaded = from_model(tiny_model("llama"))
    with pytest.raises(ValueError):
        gqa.convert(loaded, 1, method="svd")
    from headlab.core.errors import HeadlabError

    with pytest.raises(HeadlabError):
        gqa.convert(loaded, 1, method="pca")


# ---- the embedded model ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_svd_merge_beats_mean_pooling_and_reloads(tmp_path):
    from transformers import AutoTokenizer

    from headlab.core.loading import load_model
    from headlab.measure.evaluate import perplexity

    loaded = load_model(None, device="cpu")
    common = dict(max_tokens=256, seq_len=128, batch_size=4, calibration_tokens=512, progress=False)
    record = gqa.convert_checkpoint(loaded, 1, tmp_path / "svd", gqa.PoolSpec(method="svd"), **common)
    after = record["perplexity_after"]["perplexity"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "svd", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "svd")
    again = perplexity(from_model(model, tokenizer), max_tokens=256, seq_len=128, progress=False)
    assert again.perplexity == pytest.approx(after, rel=1e-4)
    mean = load_model(None, device="cpu")
    gqa.convert(mean, 1)
    mean_ppl = perplexity(mean, max_tokens=256, seq_len=128, progress=False).perplexity
    assert after < mean_ppl / 10


def test_cli_convert_gqa_svd(tmp_path, capsys):
    from tiny_text import run_cli, save_tiny

    save_tiny("qwen2", tmp_path / "src")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    args = ["convert-gqa", "--model", tmp_path / "src", "--kv-heads", "1", "--method", "svd", "--data", corpus]
    args += ["--seq-len", "32", "--max-tokens", "128", "--calibration-tokens", "128", "--out", tmp_path / "mqa"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "svd merge (keys svd, values svd" in out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa")
    assert model.config.num_key_value_heads == 1
