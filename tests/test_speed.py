"""`headlab speed` on a tiny model: every point measured, the KV bytes held equal the cache's arithmetic, a KV
conversion holds proportionally fewer bytes, a KV-cache policy's real cache holds what its streaming heads keep, and
llama.cpp (when installed) adds a row per point; its batched sequences decode what one sequence alone decodes, and a
copied cache is the prefilled one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_gguf import LLAMACPP, kv_converted, needs_llamacpp, tiny

from headlab.core.errors import HeadlabError
from headlab.kv.policy import CachePolicy
from headlab.runtimes.gguf_export import export_gguf
from headlab.runtimes.speed import SpeedSpec, measure_model, relative_to_first


def test_speed_table_measures_every_point_and_the_kv_bytes_held():
    spec = SpeedSpec(contexts=(16, 32), batches=(1, 2), decode_tokens=2, prefill_limit=32)
    frames = [measure_model(tiny(), "gqa", spec, progress=False)]
    frames.append(measure_model(kv_converted(tiny()), "mqa", spec, progress=False))
    table = relative_to_first(pd.concat(frames, ignore_index=True))
    hf = table[table["runtime"] == "transformers"]
    assert len(hf) == 2 * 2 * 2 and (hf["decode_tokens_per_s"] > 0).all()
    # 2 layers x (K and V) x G KV heads x 16 dims x 4 bytes per token per sequence, the cache ending at `context`
    expected = 2 * 2 * hf["kv_heads"] // 2 * 16 * 4 * hf["context"] * hf["batch"]
    assert (hf["kv_cache_bytes"] == expected).all()
    assert set(hf["cache_fill"]) == {"prefill", "synthetic"}  # 32 x 2 tokens exceed the prefill limit
    assert (hf.loc[hf["model"] == "mqa", "kv_ratio"] == 0.5).all()
    if LLAMACPP is None:
        cpp = table[table["runtime"] == "llama.cpp"]
        assert len(cpp) == 2 * 2 * 2 and (cpp["decode_tokens_per_s"] > 0).all()
        assert set(cpp["batch"]) == {1, 2}
        # 2 x (32 - 2 - 1) tokens exceed the prefill limit of 32: one sequence prefilled, its cache copied
        assert set(cpp["cache_fill"]) == {"prefill", "copied"}
        # f16 cells allocated for the context (padded to 256 per sequence): K and V, 2 layers, G x 16 dims, 2 bytes
        expected = 2 * 2 * cpp["kv_heads"] // 2 * 16 * 2 * 256 * cpp["batch"]
        assert (cpp["kv_cache_bytes"] == expected).all()
        assert (cpp.loc[cpp["model"] == "mqa", "kv_ratio"] == 0.5).all()


def test_speed_under_a_policy_holds_sinks_and_window_for_its_streaming_heads():
    """KV head 1 of each layer streams with 2 sinks + a 4-token window: after decoding it holds sinks + window - 1 = 5
    slots per sequence (what the next query can see), KV head 0 the whole context; prefilled and synthetic caches
    alike."""
    loaded = tiny()
    table = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "kv_head": [0, 1, 0, 1],
            "head_dim": 16,
            "score": [1.0, 0.0, 1.0, 0.0],
            "policy": ["full", "streaming", "full", "streaming"],
        }  # fmt: skip
    )
    policy = CachePolicy(table, sinks=2, window=4, context=32)
    spec = SpeedSpec(contexts=(16, 32), batches=(1, 2), decode_tokens=2, prefill_limit=32, runtimes=("transformers",))
    measured = relative_to_first(measure_model(loaded, "gqa", spec, progress=False, policy=policy))
    under = measured[measured["model"] == "gqa + kv-policy"]
    assert len(under) == 4 and set(under["kv_cache"]) == {"kv-policy"} and (under["decode_tokens_per_s"] > 0).all()
    assert set(under["cache_fill"]) == {"prefill", "synthetic"}
    # 2 layers x (K and V) x 16 dims x 4 bytes x batch x (the full head's context + the streaming head's 5 slots)
    expected = 2 * 2 * 16 * 4 * under["batch"] * (under["context"] + 5)
    assert (under["kv_cache_bytes"] == expected).all()
    assert np.allclose(under["kv_ratio"], (under["context"] + 5) / (2 * under["context"]))


def test_speed_refuses_a_policy_for_another_layout():
    table = pd.DataFrame({"layer": [0], "kv_head": [0], "head_dim": 16, "score": [1.0], "policy": ["streaming"]})
    spec = SpeedSpec(contexts=(16,), batches=(1,), decode_tokens=2, runtimes=("transformers",))
    with pytest.raises(HeadlabError, match="policy covers layers"):
        measure_model(tiny(), "gqa", spec, progress=False, policy=CachePolicy(table, sinks=2, window=4, context=16))


@needs_llamacpp
def test_llamacpp_sequences_decode_as_one_sequence_does(tmp_path):
    """Three sequences in one context: the second (other tokens) decodes what a context of its own decodes, and the
    third, a copy of the first's cache, decodes exactly what the first does."""
    from headlab.runtimes.llamacpp import Sequences

    loaded = tiny()
    path = tmp_path / "m.gguf"
    export_gguf(loaded, path, outtype="f32", progress=False)
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randint(300, (2, 12), generator=generator).tolist()
    token = 7
    runner = Sequences(path, per_sequence=32, count=3)
    try:
        runner.prefill(0, first)
        runner.prefill(1, second)
        runner.copy(0, 2)
        runner.step([token, token, token], 12)
        batched = [runner.logits(s) for s in range(3)]
    finally:
        runner.close()
    alone = Sequences(path, per_sequence=32, count=1)
    try:
        alone.prefill(0, second)
        alone.step([token], 12)
        single = alone.logits(0)
    finally:
        alone.close()
    np.testing.assert_array_equal(batched[2], batched[0])
    np.testing.assert_allclose(batched[1], single, rtol=0, atol=1e-4 * max(1.0, float(np.abs(single).max())))
    assert np.abs(batched[1] - batched[0]).max() > 1e-3  # other tokens, other logits: the streams are separate
    with torch.no_grad():
        reference = loaded.model(input_ids=torch.tensor([second + [token]])).logits[0, -1].numpy()
    np.testing.assert_allclose(single, reference, rtol=0, atol=1e-3 * max(1.0, float(np.abs(reference).max())))


@needs_llamacpp
def test_llamacpp_sequences_refuse_an_unloadable_file(tmp_path):
    from headlab.core.errors import HeadlabError
    from headlab.runtimes.llamacpp import Sequences

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF not really")
    with pytest.raises(HeadlabError, match="cannot load"):
        Sequences(path, per_sequence=32, count=2)
