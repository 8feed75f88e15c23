"""The `kv_policy` case's policies at 4,096 tokens on a CPU: the original, the default policy at half the cache, and
the two baselines it has to beat at the same budget (per-layer streaming, a random policy), five depths and two
prompts per depth (10 per task), the budget counted at 4,096 tokens. The GPU case (kv_policy_gpu) ran out of time
before the random policy; this measures it where no GPU is lent. HEADLAB_BENCH_POLICY_ONLY picks other rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import kv_policy as base  # noqa: E402  (the 2k case: methods and table)

TITLE = "Head-level KV-cache policy against its baselines at 4k tokens (CPU), training-free"
base.grid_defaults("4096", 2, only="policy, retrieval-streaming (default), 1/2|per-layer streaming|random policy")


def run(args) -> dict:
    return base.measure(args, case="kv_policy_4k")


markdown = base.markdown
