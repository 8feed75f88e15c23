"""Perplexity against a slow, obvious implementation; size and KV-cache arithmetic."""

from __future__ import annotations

import math
import re

import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.costs import kv_cache_bytes, model_info, parameter_counts
from headlab.data import Corpus, split_text
from headlab.evaluate import perplexity
from headlab.loading import from_model


def slow_perplexity(model, ids: list[int], seq_len: int, stride: int) -> tuple[float, int]:
    """One forward per scored token with the context the sliding-window rule gives it: the obvious definition."""
    step = min(stride, seq_len - 1)
    nll, count = 0.0, 0
    previous_end, begin = 1, 0
    while True:
        end = min(begin + seq_len, len(ids))
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin:end]])).logits[0]
        for t in range(max(previous_end, begin + 1), end):
            nll -= float(torch.log_softmax(logits[t - 1 - begin].double(), -1)[ids[t]])
            count += 1
        previous_end = max(previous_end, end)
        if end == len(ids):
            return math.exp(nll / count), count
        begin += step


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
