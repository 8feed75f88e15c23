"""Random-weight checkpoints of real shapes (headlab.core.shapes), on tiny sizes: the published fields survive, the
shards split by bytes and the values do not depend on the split, norms are ones, the checkpoint loads and runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model
from headlab.core.shapes import SHAPES, shape_config, write_random_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=49152)  # fmt: skip  # the embedded tokenizer's ids must fit


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_published_fields_and_cut_layers(shape):
    config = shape_config(shape, layers=8)
    assert config.num_hidden_layers == 8 and config.hidden_size == SHAPES[shape]["hidden_size"]
    assert config.num_key_value_heads == 8 and config.head_dim == 128
    assert config.rope_parameters["rope_type"] == SHAPES[shape]["rope_parameters"]["rope_type"]


def test_tiny_llama3_shape_is_sharded_loads_and_runs(tmp_path):
    one = write_random_checkpoint("llama-3.1-8b", tmp_path / "one", layers=2, dtype="float32", **TINY)
    many = write_random_checkpoint("llama-3.1-8b", tmp_path / "many", layers=2, dtype="float32",
                                   shard_bytes=4 * 2**20, **TINY)  # fmt: skip
    assert one["shards"] == 1 and many["shards"] > 2
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == many["bytes"] == one["bytes"]
    a, b = _tensors(tmp_path / "one"), _tensors(tmp_path / "many")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)  # same values, any split
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    weight = a["model.layers.0.self_attn.q_proj.weight"]
    assert weight.shape == (4 * 16, 64) and abs(float(weight.std()) - 0.02) < 0.002
    assert one["parameters"] == sum(t.numel() for t in a.values())
    loaded = load_model(str(tmp_path / "many"), device="cpu")
    assert [(la.num_heads, la.num_kv_heads, la.head_dim) for la in loaded.layers] == [(4, 2, 16)] * 2
    assert loaded.model.config.rope_parameters["rope_type"] == "llama3"
    ids = loaded.tokenizer("Attention heads read keys.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = loaded.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def test_bad_shapes_are_refused():
    with pytest.raises(HeadlabError, match="unknown shape"):
        shape_config("llama-9000")
    with pytest.raises(HeadlabError, match="layers=0"):
        shape_config("qwen3-8b", layers=0)
