"""The report's "what the heads do": the head types the detectors find in the statistics table, the heads that move
the correct next-token logit most by direct logit attribution on eval text, and the attention viewer of that text,
which the report links head by head (TransformerLens's names, `viewer.html#L3H2`).

Pure functions of saved tables here (no torch); `headlab.reporting.report` runs the model parts (attribution, the
viewer).
"""

from __future__ import annotations

import pandas as pd

from headlab.core.tables import head_name
from headlab.kv.methods import RETRIEVING

# A head counts as a type when at least half of what the score measures goes the type's way: half its attention
# mass for the attention scores, half the tokens tested for the OV scores. The retrieval score is attention on one
# needle token among ~1,000, so it takes the KV policy's bar instead (RETRIEVING, ten times uniform attention).
TYPE_THRESHOLD = 0.5

# statistic column -> (head type, what the score measures); docs/commands/stats.md gives each formula and source
HEAD_TYPES = {
    "prev_share": ("previous-token", "attention mass on the previous token"),
    "duplicate_token": ("duplicate-token", "attention from a repeated token to its earlier copy"),
    "induction": ("induction", "attention to the token after the earlier copy of the current token"),
    "successor": ("successor", "share of ordinal pairs (Monday -> Tuesday, 3 -> 4) whose OV top output is the next"),
    "copy_suppression": ("copy suppression", "share of frequent tokens whose own OV logit is among the 10 lowest"),
    "retrieval": ("retrieval", "attention on the needle token copied while answering a passkey prompt"),
    "sink_first": ("attention sink", "attention mass on the first token"),
}
TOP_HEADS = 3  # heads named per type
TOP_ATTRIBUTION = 10  # heads listed by attribution


def _threshold(column: str) -> float:
    return RETRIEVING if column == "retrieval" else TYPE_THRESHOLD


def head_types(wide: pd.DataFrame, top: int = TOP_HEADS) -> pd.DataFrame:
    """One row per head type the statistics table scores (HEAD_TYPES, then each `detect_<name>` pattern column):
    `type, statistic, meaning, threshold, heads` (how many heads score at least the threshold), `top_heads`
    ("L3H2 (0.91), ..." by score, the strongest first) and `top_score`. Types whose column is absent or all NaN
    (an encoder's induction, a model without a tokenizer's successor) are left out."""
    kinds = dict(HEAD_TYPES)
    for column in (c for c in wide.columns if c.startswith("detect_")):
        kinds[column] = (f"pattern {column.removeprefix('detect_')}", "TransformerLens detect_head score")
    rows = []
    for column, (kind, meaning) in kinds.items():
        if column not in wide:
            continue
        values = pd.to_numeric(wide[column], errors="coerce")
        scored = wide.assign(score=values).dropna(subset=["score"])
        if scored.empty:
            continue
        best = scored.sort_values(["score", "layer", "head"], ascending=[False, True, True]).head(top)
        names = [f"{head_name(int(r.layer), int(r.head))} ({r.score:.2f})" for r in best.itertuples()]
        rows.append({"type": kind, "statistic": column, "meaning": meaning, "threshold": _threshold(column),
                     "heads": int((scored["score"] >= _threshold(column)).sum()), "top_heads": ", ".join(names),
                     "top_score": float(best["score"].iloc[0])})  # fmt: skip
    columns = ["type", "statistic", "meaning", "threshold", "heads", "top_heads", "top_score"]
    return pd.DataFrame(rows, columns=columns)


def attribution_ranking(dla: pd.DataFrame) -> pd.DataFrame:
    """Per head, over every position of a direct-logit-attribution table (headlab.measure.attribution, positions
    "all"): `mean_contribution` (mean DLA to the correct next token's logit), `mean_abs_contribution`, `positive`
    (share of positions where the head raises the correct logit), and `rank` by mean contribution (1 = raises the
    correct token most); sorted by rank."""
    grouped = dla.groupby(["layer", "head", "kv_head", "name"], sort=False)["contribution"]
    table = pd.DataFrame(
        {
            "mean_contribution": grouped.mean(),
            "mean_abs_contribution": grouped.apply(lambda v: v.abs().mean()),
            "positive": grouped.apply(lambda v: float((v > 0).mean())),
        }
    ).reset_index()
    table["rank"] = table["mean_contribution"].rank(ascending=False, method="first").astype(int)
    return table.sort_values("rank").reset_index(drop=True)


def viewer_links(names, page: str = "heads/viewer.html") -> list[tuple[str, str]]:
    """(head name, link) pairs into the report's attention viewer, which opens at the head a link names."""
    return [(name, f"{page}#{name}") for name in dict.fromkeys(names)]
