"""The `long` case on a GPU (scripts/gpu_check.sh): the same rungs, tasks and NLL by position at 2k, 4k and 8k
tokens, five depths and four prompts per depth, in float32 like the CPU rows. Run it with --device cuda; on CPU
an 8k prompt takes about 100 s (docs/long-context.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import long as base  # noqa: E402  (the CPU case: rungs, grid and table)

TITLE = "Long-context retrieval and NLL by position of the compressed models at 2k-8k tokens (GPU)"
run = base.variant("long_gpu", lengths="2048,4096,8192", depths="0,0.25,0.5,0.75,1", samples="4")

markdown = base.markdown


def figures(r: dict) -> dict:
    """The needle heatmap of every rung at the longest length."""
    import pandas as pd

    from headlab.viz.plots import plot_needle_heatmap

    longest = max(r["lengths"])
    cells = pd.concat(
        [pd.DataFrame(row["cells"]).assign(model=base._label(row["model"])) for row in r["rows"]], ignore_index=True
    )
    title = f"retrieval of the compressed rungs at {longest:,} tokens (exact match)"
    return {"long_needles_gpu": plot_needle_heatmap(cells[cells["length"] == longest], title)}
