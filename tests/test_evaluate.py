"""Perplexity against a slow, obvious implementation; size and KV-cache arithmetic."""

from __future__ import annotations

import math
import re

import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core.data import Corpus, split_text
from headlab.core.loading import from_model
from headlab.measure.costs import kv_cache_bytes, model_info, parameter_counts
from headlab.measure.evaluate import perplexity


def slow_perplexity(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """One forward per scored token with the context lm-eval's rolling rule gives it: tokens 1..max_length are
    predicted from the start of the stream; later tokens come in blocks of `stride` (the last block shorter), and
    each token of a block ending at e is predicted from the stream tokens [e - max_length, t)."""
    nll, last = 0.0, len(ids) - 1
    for t in range(1, len(ids)):
        if t <= max_length:
            begin = 0
        else:
            block_end = min(max_length + math.ceil((t - max_length) / stride) * stride, last)
            begin = block_end - max_length
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin:t]])).logits[0, -1]
        nll -= float(torch.log_softmax(logits.double(), -1)[ids[t]])
    return math.exp(nll / last), last


@pytest.mark.parametrize("seq_len,stride,batch_size", [(32, 32, 4), (32, 8, 3), (16, 16, 1)])
def test_perplexity_matches_slow_loop(seq_len, stride, batch_size):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    corpus = Corpus("sample", [SAMPLE_TEXT])
    result = perplexity(
        from_model(model, tokenizer),
        corpus,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size,
        max_tokens=150,
        progress=False,
    )
    text = split_text(corpus, "eval").text[:150]
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    expected, count = slow_perplexity(model, ids, seq_len, stride)
    assert result.scored_tokens == count == 150
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    total_ll = -result.nll * count
    assert result.word_perplexity == pytest.approx(math.exp(-total_ll / len(re.split(r"\s+", text))), rel=1e-9)
    assert result.bits_per_byte == pytest.approx(-total_ll / (len(text.encode()) * math.log(2)), rel=1e-9)


def test_masked_lm_loss_runs_on_encoder():
    model, tokenizer = tiny_model("bert"), tiny_tokenizer(encoder=True)
    result = perplexity(
        from_model(model, tokenizer), Corpus("s", [SAMPLE_TEXT]), seq_len=32, max_tokens=120, progress=False
    )
    again = perplexity(
        from_model(model, tokenizer), Corpus("s", [SAMPLE_TEXT]), seq_len=32, max_tokens=120, progress=False
    )
    assert result.objective.startswith("masked-lm")
    assert result.perplexity == again.perplexity  # fixed-seed masking
    assert 0.1 * 120 < result.scored_tokens < 0.25 * 120


def test_kv_cache_formula_by_hand():
    # Llama-2-70B: 80 layers, 8 KV heads, d_head 128, fp16 -> 320 KiB per token (REFERENCE.md)
    assert kv_cache_bytes([(8, 128)] * 80, tokens=1, batch=1, bytes_per_element=2) == 320 * 1024


def _real_cache_bytes(model, seq: int) -> int:
    input_ids = torch.randint(10, 100, (1, seq))
    with torch.no_grad():
        cache = model(input_ids, use_cache=True).past_key_values
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.dim() == 4:
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("name", ["llama", "llama_mha", "qwen3", "phi3", "gpt2"])
def test_info_matches_a_real_cache(name):
    model = tiny_model(name)
    info = model_info(from_model(model), context=10, batch=1)
    assert info["kv_bytes"] == _real_cache_bytes(model, 10)
    ladder = {step["variant"]: step for step in info["ladder"]}
    assert ladder["MQA"]["kv_bytes_per_token"] * 4 == ladder["MHA"]["kv_bytes_per_token"]
    assert sum(step["current"] for step in info["ladder"]) == 1


def test_parameter_counts_count_tied_weights_once():
    model = tiny_model("llama", tie_word_embeddings=True)
    counts = parameter_counts(from_model(model))
    assert counts["parameters"] == sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights
    # q [4*16, 64] + k, v [2*16, 64] + o [64, 4*16] per layer, 2 layers
    assert counts["attention_parameters"] == 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64)


# Text without whitespace: lm-eval counts one word per whitespace-separated run, so word perplexity leaves float range.
CHINESE = "注意力头读取键和值，其中一些很重要。剪枝会删除注意力头，而困惑度衡量这种变化的代价。" * 12
JAPANESE = "注意ヘッドはキーと値を読み取り、その一部は重要です。枝刈りはヘッドを取り除きます。" * 12


@pytest.mark.parametrize("text", [CHINESE, JAPANESE], ids=["chinese", "japanese"])
def test_text_without_whitespace_keeps_lm_evals_word_count_and_reports_inf(text):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    corpus = Corpus("cjk", [text])
    result = perplexity(from_model(model, tokenizer), corpus, seq_len=32, batch_size=4, max_tokens=200, progress=False)
    scored = split_text(corpus, "eval").text[: result.scored_tokens]  # one token per character here
    assert result.words == len(re.split(r"\s+", scored)) == 1  # lm-eval's count
    assert result.word_perplexity == math.inf  # exp(NLL of 200 tokens / 1 word) is beyond float64
    total_ll = -result.nll * result.scored_tokens
    assert math.isfinite(result.bits_per_byte) and math.isfinite(result.perplexity)
    assert result.bits_per_byte == pytest.approx(-total_ll / (len(scored.encode()) * math.log(2)), rel=1e-9)


@pytest.mark.parametrize("text", [CHINESE, JAPANESE], ids=["chinese", "japanese"])
def test_commands_run_on_text_without_whitespace(text, tmp_path, capsys):
    from tiny_text import run_cli, save_tiny

    model = save_tiny("llama", tmp_path / "m")
    corpus = tmp_path / "cjk.txt"
    corpus.write_text(text * 4, encoding="utf-8")
    common = ["--model", model, "--device", "cpu", "--data", corpus, "--seq-len", "32", "--max-tokens", "256"]
    code, out, err = run_cli(["eval", *common], capsys)
    assert code == 0, err
    assert re.search(r"word perplexity\s+inf", out)
    code, _, err = run_cli(["prune", *common, "--heads", "0:0", "--out", tmp_path / "p"], capsys)
    assert code == 0, err
    sweep = ["sweep", *common, "--calibration-tokens", "64", "--fractions", "0,0.5", "--orders", "random"]
    code, _, err = run_cli([*sweep, "--seeds", "0", "--out", tmp_path / "s"], capsys)
    assert code == 0, err
