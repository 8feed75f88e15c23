"""`headlab speed` on a tiny model: every point measured, the KV bytes held equal the cache's arithmetic, a KV
conversion holds proportionally fewer bytes, and llama.cpp (when installed) adds batch-1 rows."""

from __future__ import annotations

import pandas as pd
from test_gguf import LLAMACPP, kv_converted, tiny

from headlab.speed import SpeedSpec, measure_model, relative_to_first


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
        assert len(cpp) == 2 * 2 and (cpp["batch"] == 1).all() and (cpp["decode_tokens_per_s"] > 0).all()
