"""The original and the default head-level policy at half the cache at 8,192 tokens on a GPU (scripts/gpu_check.sh),
on 50 prompts per task (five depths, ten prompts each; the first four of each depth are kv_policy_8k_prompts'), to
read #32's "within 5 points" goal with the sampling noise that 20 CPU prompts leave cut in half. Float32 like the
CPU rows. Run it with --device cuda."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import kv_policy as base  # noqa: E402  (the 2k case: methods and table)

TITLE = "Head-level KV-cache policy at half the cache at 8k tokens with 50 prompts per task (GPU), training-free"
base.grid_defaults("8192", 10, only="policy, retrieval-streaming (default), 1/2")


def run(args) -> dict:
    return base.measure(args, dtype="float32", case="kv_policy_8k_gpu")


markdown = base.markdown
