"""headlab.recovery.recover's record helpers, on records written by hand."""

from __future__ import annotations

from headlab.recovery.recover import before_after


def test_before_after_has_one_row_per_stage_measure():
    record = {
        "local": {"error_before": 0.5, "error_after": 0.25, "seconds": 2.0},
        "uptrain": {
            "heldout_perplexity_before": 30.0,
            "heldout_perplexity_after": 20.0,
            "perplexity_before": 40.0,
            "perplexity_after": 35.0,
            "seconds": 9.0,
        },
    }
    table = before_after(record)
    assert list(table.columns) == ["stage", "measure", "before", "after", "seconds"]
    assert table[["stage", "before", "after", "seconds"]].values.tolist() == [
        ["local", 0.5, 0.25, 2.0],
        ["uptrain", 30.0, 20.0, 9.0],
        ["uptrain", 40.0, 35.0, 9.0],
    ]
    assert table["measure"].str.contains("held-out").tolist() == [True, True, False]
    assert before_after({"uptrain": record["uptrain"]})["stage"].tolist() == ["uptrain", "uptrain"]
    assert before_after({}).empty
