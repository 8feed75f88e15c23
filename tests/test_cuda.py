"""CUDA in bfloat16 against CPU in float32 on tiny models: perplexity, statistics, importance, physical pruning,
GQA conversion, and the CLI with --device cuda --dtype bfloat16; the MLA conversion of a model on CUDA against the
same conversion on CPU. Skipped without a GPU (marker `cuda`; tests/test_head_cache.py has a cuda case too)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import TextSpec
from headlab.core.loading import from_model
from headlab.kv import gqa, mla
from headlab.measure.evaluate import perplexity
from headlab.measure.importance import head_importance
from headlab.measure.stats import head_statistics
from headlab.pruning import prune as P

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NAME = "llama"  # GQA (4 query heads, 2 KV heads)


def _pair(name=NAME, **overrides):
    """The same tiny model twice: CPU float32 and CUDA bfloat16."""
    model = tiny_model(name, **overrides)
    cpu = from_model(model, tiny_tokenizer())
    gpu = from_model(copy.deepcopy(model).to("cuda", torch.bfloat16), tiny_tokenizer())
    return cpu, gpu


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(SAMPLE_TEXT)
    return str(path)


def _logits(loaded):
    inputs = {k: v.to(loaded.device) for k, v in tiny_inputs(NAME, batch=2, seq=16).items()}
    with torch.no_grad():
        return loaded.model(**inputs).logits.float().cpu()  # [B, T, V]


def test_perplexity_close_to_cpu_float32(tmp_path):
    cpu, gpu = _pair()
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    corpus = _corpus(tmp_path)
    args = dict(seq_len=32, max_tokens=256, batch_size=2, progress=False)
    reference, result = perplexity(cpu, corpus, **args), perplexity(gpu, corpus, **args)
    assert result.scored_tokens == reference.scored_tokens
    assert abs(result.nll - reference.nll) / reference.nll < 0.02  # bfloat16 weights and activations


def test_statistics_close_to_cpu_float32(tmp_path):
    cpu, gpu = _pair()
    corpus = _corpus(tmp_path)
    args = dict(data=corpus, seq_len=32, batch_size=2, max_tokens=128, induction=False, progress=False)
    reference, result = head_statistics(cpu, **args), head_statistics(gpu, **args)
    keys = ["layer", "head", "statistic"]
    merged = reference.merge(result, on=keys, suffixes=("_cpu", "_cuda"))
    assert len(merged) == len(reference) == len(result)
    finite = merged["value_cpu"].notna()
    assert (merged.loc[finite, "value_cuda"].notna()).all()
    difference = (merged["value_cpu"] - merged["value_cuda"]).abs()[finite]
    scale = merged["value_cpu"].abs()[finite].clip(lower=1.0)
    assert float((difference / scale).max()) < 0.05


@pytest.mark.parametrize("method", ["grad", "taylor"])
def test_importance_finite_with_float32_accumulators(tmp_path, method):
    cpu, gpu = _pair()
    args = dict(data=_corpus(tmp_path), method=method, seq_len=32, batch_size=2, max_tokens=128, progress=False)
    reference, result = head_importance(cpu, **args), head_importance(gpu, **args)
    assert all(r.dtype == torch.float32 and bool(torch.isfinite(r).all()) for r in result.raw)
    a, b = torch.cat(reference.raw).double(), torch.cat(result.raw).double()
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.9
    checkpointed = head_importance(gpu, gradient_checkpointing=True, **args)
    for x, y in zip(result.raw, checkpointed.raw):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-6)  # bf16 kernels: recomputation may differ in rounding


def test_physical_pruning_equals_mask_on_cuda():
    _, gpu = _pair()
    pruned = [{1} if layer.index == 0 else {0, 2} for layer in gpu.layers]
    original = _logits(gpu)
    with P.pruned_in_place(gpu, pruned, "mask"):
        masked = _logits(gpu)
    with P.pruned_in_place(gpu, pruned, "physical") as layout:
        physical = _logits(gpu)
        assert [layer.num_heads for layer in gpu.layers] == [lay.num_heads for lay in layout]
    torch.testing.assert_close(_logits(gpu), original, atol=0, rtol=0)  # restored exactly
    scale = float(masked.abs().max())
    assert float((physical - masked).abs().max()) <= 0.02 * scale + 1e-2  # bfloat16 rounding only


def test_convert_gqa_on_cuda_matches_cpu():
    cpu, gpu = _pair()
    gqa.convert(cpu, 1, pool="mean")
    gqa.convert(gpu, 1, pool="mean")
    assert all(layer.num_kv_heads == 1 for layer in gpu.layers)
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    reference, result = _logits(cpu), _logits(gpu)
    assert float((result - reference).abs().max()) <= 0.02 * float(reference.abs().max()) + 1e-2


def test_cli_eval_on_cuda_bfloat16(tmp_path, capsys):
    model_dir = save_tiny(NAME, tmp_path / "model")
    corpus = _corpus(tmp_path)
    base = ["eval", "--model", model_dir, "--data", corpus, "--seq-len", "32", "--max-tokens", "256"]
    code, cpu_out, stderr = run_cli([*base, "--device", "cpu"], capsys)
    assert code == 0, stderr
    code, gpu_out, stderr = run_cli([*base, "--device", "cuda", "--dtype", "bfloat16"], capsys)
    assert code == 0, stderr

    def ppl(text):
        line = next(line for line in text.splitlines() if line.startswith("perplexity"))
        return float(line.split()[-1])

    assert abs(ppl(gpu_out) - ppl(cpu_out)) / ppl(cpu_out) < 0.05


def test_convert_mla_of_a_model_on_cuda_matches_cpu(tmp_path):
    """The conversion's algebra runs on the CPU beside the Grams whatever device the model is on (a model on CUDA
    once failed there on a bias-free layer); float32 on both sides, so only the Grams' summation order differs."""
    model = tiny_model(NAME)
    text = TextSpec(data=_corpus(tmp_path), split="calibration", seq_len=16, batch_size=4, max_tokens=256)
    results = []
    for device in ("cpu", "cuda"):
        loaded = from_model(copy.deepcopy(model).to(device), tiny_tokenizer())
        batches = text.batches(loaded.tokenizer, max_positions=64)
        converted, _ = mla.convert_to_mla(loaded, mla.plan_mla(loaded, budget="gqa"), batches, progress=False)
        results.append(_logits(converted))
    reference, result = results
    assert float((result - reference).abs().max()) <= 1e-3 * float(reference.abs().max()) + 1e-4
