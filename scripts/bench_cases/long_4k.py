"""The `long` case's MLA and pruned rungs at 4,096 tokens on the CPU (the GPU run, `long_gpu`, stopped
before them): depths 0, 0.5 and 1, two prompts each per task, so 6 prompts per cell, as in the 2k CPU table; the
original and the svd merge are in `long_gpu` at 4k with 20 prompts. An MLA prompt at 4k takes about 25 s on
2 cores since MLA runs sdpa's fused kernel there (headlab.core.cpu_attention; a minute before)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import long as base  # noqa: E402  (the CPU case: rungs, grid and table)

TITLE = "Long-context retrieval and NLL by position of the MLA and pruned rungs at 4k tokens (CPU)"
run = base.variant("long_4k", lengths="4096", depths="0,0.5,1", samples="2", models="mla_gqa,mla_mqa,pruned")

markdown = base.markdown
