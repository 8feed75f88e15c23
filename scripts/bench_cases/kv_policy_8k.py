"""The `kv_policy` case's rows the GPU case (kv_policy_gpu) ran out of time before, at 8,192 tokens on a CPU beside
the original: the random policy (the default run) and, with HEADLAB_BENCH_POLICY_ONLY="per-layer GQA|uniform
MQA|MLA", the structural rows (per-layer GQA, per-layer GQA + the policy, uniform MQA, MLA), at the GPU run's length,
grid (five depths, two prompts each: 10 per task) and budget count (8,192 tokens), so its rows read against the GPU
table's. A run of some rows keeps the saved others; the original is always measured (the policies' cache bytes are
read against it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import kv_policy as base  # noqa: E402  (the 2k case: methods and table)

TITLE = (
    "Head-level KV-cache policy against a random policy and structural compression at 8k tokens (CPU), training-free"
)
os.environ.setdefault("HEADLAB_BENCH_POLICY_LENGTHS", "8192")
os.environ.setdefault("HEADLAB_BENCH_POLICY_DEPTHS", "0,0.25,0.5,0.75,1")
os.environ.setdefault("HEADLAB_BENCH_POLICY_SAMPLES", "2")
os.environ.setdefault("HEADLAB_BENCH_POLICY_ONLY", "random policy")


def run(args) -> dict:
    return base.measure(args, case="kv_policy_8k")


markdown = base.markdown
