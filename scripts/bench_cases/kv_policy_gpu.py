"""The `kv_policy` case on a GPU (scripts/gpu_check.sh): the same methods at 4k and 8k tokens, the policies' budget
counted at 8,192 tokens, five depths and two prompts per depth (10 per task and length), float32 like the CPU rows.
Run it with --device cuda."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import kv_policy as base  # noqa: E402  (the CPU case: methods and table)

TITLE = "Head-level KV-cache policy against structural compression at 4k and 8k tokens (GPU), training-free"
base.grid_defaults("4096,8192", 2)


def run(args) -> dict:
    return base.measure(args, dtype="float32", case="kv_policy_gpu")


markdown = base.markdown
