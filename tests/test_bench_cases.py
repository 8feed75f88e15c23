"""The benchmark cases' report tables, from results written by hand (no model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CASES = Path(__file__).resolve().parents[1] / "scripts" / "bench_cases"


def _case(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_case_{name}", CASES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(method, setting, compensation, perplexity, outside, tokens, seconds):
    return {"method": method, "setting": setting, "compensation": compensation, "perplexity": perplexity,
            "perplexity_outside": outside, "calibration_tokens": tokens, "pruned": 90, "seconds": seconds}  # fmt: skip


def test_selection_table_has_a_row_per_method_and_calibration_size_with_the_outside_text():
    case = _case("selection")
    rows = [
        _row("obs", "90 uniform", True, 12.0, 9.0, 16384, 5.0),
        _row("obs", "135 global", True, 14.0, 10.0, 16384, 5.0),
        _row("obs", "90 uniform", False, 20.0, None, 16384, 5.0),
        _row("obs", "135 global", False, 30.0, None, 16384, 5.0),
        _row("grad", "90 uniform", True, 13.0, 11.0, 2048, 3.0),
        _row("grad", "135 global", True, 16.0, 12.0, 2048, 3.0),
    ]
    result = {
        "calibration": {"tokens": 16384, "seq_len": 256, "batch_size": 4, "compared_tokens": [2048]},
        "eval": {"tokens": 2048, "seq_len": 512},
        "spearman_setting": {"tokens": 512, "seq_len": 128},
        "original": 10.66,
        "original_outside": 7.6,
        "rows": rows,
        "spearman": {"grad": {"ablation": 0.35, "abs_ablation": 0.57}},
        "ablation_seconds": 300.0,
    }
    text = case.markdown(result)
    assert "| obs | 16,384 | 20.00 | 12.00 | 9.00 | 30.00 | 14.00 | 10.00 | 5 |" in text
    assert "| grad | 2,048 | - | 13.00 | 11.00 | - | 16.00 | 12.00 | 3 |" in text  # compensated rows only
    assert "outside the corpus" in text and "**7.60**" in text and "`prune`'s default: 16,384" in text
    assert "| grad | 0.350 | 0.570 |" in text
    # a result written before the outside text and the calibration column still renders (one size, no outside)
    earlier = {**result, "rows": [{k: v for k, v in r.items() if k not in ("perplexity_outside", "calibration_tokens")}
                                  for r in rows[:4]], "original_outside": None}  # fmt: skip
    assert "| obs | 16,384 | 20.00 | 12.00 | - | 30.00 | 14.00 | - | 5 |" in case.markdown(earlier)
