"""The `kv_policy` case's rows the GPU case (kv_policy_gpu) ran out of time before, at 8,192 tokens on a CPU beside
the original: the random policy (the default run) and, with HEADLAB_BENCH_POLICY_ONLY="per-layer GQA|uniform
MQA|MLA", the structural rows (per-layer GQA, per-layer GQA + the policy, uniform MQA, MLA), at the GPU run's length,
grid (five depths, two prompts each: 10 per task) and budget count (8,192 tokens), so its rows read against the GPU
table's. A run of some rows keeps the saved others; the original is always measured (the policies' cache bytes are
read against it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import kv_policy as base  # noqa: E402  (the 2k case: methods and table)

TITLE = (
    "Head-level KV-cache policy against a random policy and structural compression at 8k tokens (CPU), training-free"
)
base.grid_defaults("8192", 2, only="random policy")


def run(args) -> dict:
    return base.measure(args, case="kv_policy_8k")


markdown = base.markdown
