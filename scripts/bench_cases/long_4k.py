"""The `long` case's full-rank MLA and pruned rungs at 4,096 tokens on the CPU (the GPU run, `long_gpu`, stopped
before them): depths 0, 0.5 and 1, two prompts each per task, so 6 prompts per cell, as in the 2k CPU table; the
original and the svd merge are in `long_gpu` at 4k with 20 prompts. An MLA prompt at 4k takes about a minute on
2 cores."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import long as base  # noqa: E402  (the CPU case: rungs, grid and table)

TITLE = "Long-context retrieval and NLL by position of the full-rank MLA and pruned rungs at 4k tokens (CPU)"
os.environ.setdefault("HEADLAB_BENCH_LONG_LENGTHS", "4096")
os.environ.setdefault("HEADLAB_BENCH_LONG_DEPTHS", "0,0.5,1")
os.environ.setdefault("HEADLAB_BENCH_LONG_SAMPLES", "2")
os.environ.setdefault("HEADLAB_BENCH_LONG_MODELS", "mla_gqa,pruned")


def run(args) -> dict:
    return base.measure(args, "long_4k", dtype="float32")


markdown = base.markdown
