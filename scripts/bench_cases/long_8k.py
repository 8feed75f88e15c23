"""The `long` case's rungs at 8,192 tokens on the CPU: the full-rank MLA, the MLA at the MQA budget and the pruned
rung training-free, and (HEADLAB_BENCH_LONG_RECOVER=1 HEADLAB_BENCH_LONG_MODELS=svd,mla_mqa,pruned, a second run that
adds its rows) the recovered rungs. Depths 0, 0.5 and 1, two prompts each per task, so 6 prompts per cell, as in the
2k and 4k CPU tables; the original and the svd merge are in `long_gpu` at 8k with 20 prompts. An MLA prompt at 8k
takes about a minute on 2 cores since MLA runs sdpa's fused kernel there (headlab.core.cpu_attention)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import long as base  # noqa: E402  (the CPU case: rungs, grid and table)

TITLE = "Long-context retrieval and NLL by position of the MLA, pruned and recovered rungs at 8k tokens (CPU)"
run = base.variant("long_8k", lengths="8192", depths="0,0.5,1", samples="2", models="mla_gqa,mla_mqa,pruned")

markdown = base.markdown
