"""The `long` case's recovered rungs at 4,096 and 8,192 tokens on the CPU: 3 -> 1 KV heads by the svd merge, MLA at
the MQA budget, 90 heads pruned with compensation and MLA at the GQA budget, each after the default recovery (local
reconstruction, then 64 uptraining steps: the recovery case's `_stage`, as the 2k table's recovered rows), then
passkey and multi-key at both lengths from one recovered model. Depths 0, 0.5 and 1, two prompts each per task, so 6
prompts per cell, as in the training-free 4k and 8k CPU tables (`long_4k`, `long_8k`); 25-45 minutes a rung on 2
cores. A run keeps the saved rows of the rungs it does not measure: HEADLAB_BENCH_LONG_MODELS=mla_gqa adds one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import long as base  # noqa: E402  (the CPU case: rungs, grid and table)

TITLE = "Long-context retrieval and NLL by position of the recovered rungs at 4k and 8k tokens (CPU)"
# The CLI's default budget (headlab.recovery.choices.DEFAULT_STEPS), which the 2k table's recovered rows used too; set
# before the recovery case is imported, since it reads the budget once.
os.environ.setdefault("HEADLAB_BENCH_UPTRAIN_STEPS", "64")
run = base.variant(
    "long_recovered",
    lengths="4096,8192",
    depths="0,0.5,1",
    samples="2",
    models="svd,mla_mqa,pruned,mla_gqa",
    recover="1",
)

markdown = base.markdown
