"""The report's "what the heads do" tables from hand-made statistics and attribution tables: which heads count as a
type, the order they are named in, and the attribution ranking's means, shares and ranks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from headlab.reporting.heads import TYPE_THRESHOLD, attribution_ranking, head_types, viewer_links


def _wide() -> pd.DataFrame:
    rows = [(layer, head, head // 2) for layer in range(2) for head in range(4)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "kv_head"])
    frame["induction"] = [0.1, 0.9, 0.5, 0.2, 0.6, 0.0, 0.3, 0.9]
    frame["retrieval"] = [0.0, 0.02, 0.005, 0.011, 0.0, 0.0, 0.0, 0.0]
    frame["successor"] = np.nan  # no tokenizer: not scored
    frame["detect_diagonal"] = [0.0] * 7 + [0.7]
    return frame


def test_head_types_count_heads_at_the_threshold_and_name_the_strongest_first():
    types = head_types(_wide()).set_index("statistic")
    assert list(types.index) == ["induction", "retrieval", "detect_diagonal"]  # successor all NaN: left out
    induction = types.loc["induction"]
    assert induction["heads"] == 4 and induction["threshold"] == TYPE_THRESHOLD  # 0.9, 0.5, 0.6, 0.9
    # ties (0.9) go to the earlier layer, then the lower head
    assert induction["top_heads"] == "L0H1 (0.90), L1H3 (0.90), L1H0 (0.60)"
    retrieval = types.loc["retrieval"]
    assert retrieval["heads"] == 2 and retrieval["threshold"] == pytest.approx(0.01)  # 0.02 and 0.011
    assert types.loc["detect_diagonal", "type"] == "pattern diagonal" and types.loc["detect_diagonal", "heads"] == 1


def test_attribution_ranking_by_hand():
    dla = pd.DataFrame(
        {
            "layer": [0, 0, 0, 0],
            "head": [0, 1, 0, 1],
            "kv_head": [0, 0, 0, 0],
            "name": ["L0H0", "L0H1", "L0H0", "L0H1"],
            "position": [0, 0, 1, 1],
            "contribution": [1.0, -3.0, -0.5, 1.0],
        }
    )
    ranking = attribution_ranking(dla).set_index("name")
    assert ranking.loc["L0H0", "mean_contribution"] == pytest.approx(0.25)
    assert ranking.loc["L0H1", "mean_contribution"] == pytest.approx(-1.0)
    assert ranking.loc["L0H1", "mean_abs_contribution"] == pytest.approx(2.0)
    assert ranking.loc["L0H0", "positive"] == pytest.approx(0.5)
    assert list(ranking.index) == ["L0H0", "L0H1"] and list(ranking["rank"]) == [1, 2]


def test_viewer_links_name_each_head_once():
    assert viewer_links(["L1H2", "L0H0", "L1H2"]) == [
        ("L1H2", "heads/viewer.html#L1H2"),
        ("L0H0", "heads/viewer.html#L0H0"),
    ]
