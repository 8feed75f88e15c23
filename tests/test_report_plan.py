"""report.plan_report: which steps a report runs and which KV-head count it pools to, worked out by hand from each
tiny model's layout (H query heads, G KV heads per layer), without running any step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from models import tiny_model

from headlab.core.loading import from_model
from headlab.pruning.sweep import TaskSpec
from headlab.reporting import report

EVERY_STEP = ["info", "stats", "importance", "gallery", "heads", "sweep", "gqa", "recovery", "speed"]


def plan(name: str, settings: report.Settings = report.PRESETS["full"], **options) -> report.ReportPlan:
    loaded = from_model(tiny_model(name), spec=f"tiny-{name}")
    options = {"data": None, "text_column": None, "tasks": None, **options}
    return report.plan_report(loaded, settings, out=Path("out"), **options)


@pytest.mark.parametrize(
    "name, target, groupings",
    [
        # G=2: the only proper divisor is 1, where similarity grouping equals contiguous, so it is dropped.
        ("llama", 1, ("contiguous",)),
        # G=4: the largest proper divisor is 2, and 1 < 2 < 4, so both groupings stay.
        ("llama_mha", 2, ("contiguous", "similarity")),
    ],
)
def test_gqa_models_pool_to_the_largest_proper_divisor(name, target, groupings):
    result = plan(name)
    assert result.can_gqa and result.target == target and result.recovering
    assert result.settings.groupings == groupings
    assert [step for step, _ in result.steps] == EVERY_STEP
    assert f"--kv-heads {target}" in result.commands["gqa_groups"]
    assert result.model_flag == f"tiny-{name}"


def test_a_model_that_cannot_share_kv_heads_skips_grouping_and_recovery():
    result = plan("gpt2")  # GPT-2's fused c_attn cannot hold fewer KV heads
    assert not result.can_gqa and result.target is None and not result.recovering
    assert [step for step, _ in result.steps] == [s for s in EVERY_STEP if s not in ("gqa", "recovery")]


def test_no_recovery_steps_means_no_recovery_step_but_grouping_stays():
    result = plan("llama", replace(report.PRESETS["quick"], recovery_steps=0))
    assert result.can_gqa and result.target == 1 and not result.recovering
    assert "recovery" not in [step for step, _ in result.steps] and "gqa" in [step for step, _ in result.steps]


def test_tasks_add_their_flags_to_the_sweep_command_only():
    result = plan("llama", tasks=TaskSpec(["arc_easy", "piqa"], include_path="my tasks"))
    assert result.commands["sweep"].endswith("--tasks arc_easy,piqa --include-path 'my tasks'")
    assert "--tasks" not in result.commands["stats"]
    limited = plan("llama", tasks=TaskSpec(["piqa"], limit=5))
    assert limited.commands["sweep"].endswith("--tasks piqa --task-limit 5")


def test_every_step_names_what_it_writes():
    """STEP_OUTPUTS is what a rerun clears and what a demo directory may hold (report_entries): a new step must add
    its folder there, or a demo would refuse to replace its own previous output."""
    assert {name for name, _ in report.REPORT_STEPS} | {"figures"} == set(report.STEP_OUTPUTS)
    assert {"heads", "long_context", "meta.json", "report.html"} <= report.report_entries()
