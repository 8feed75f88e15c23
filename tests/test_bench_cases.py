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


def _benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_script", CASES.parent / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_machine_kinds_name_the_cpu_or_the_gpu():
    benchmark = _benchmark()
    assert benchmark.machine_kind({"cpu": "Intel(R) Xeon(R) Processor", "cuda": None}) == "intel-xeon-processor"
    assert benchmark.machine_kind({"cpu": "AMD EPYC", "cuda": None}) == "amd-epyc"
    gpu = {"cpu": "AMD EPYC", "cuda": "NVIDIA H200"}
    assert benchmark.machine_kind(gpu, "cuda") == "nvidia-h200"
    assert benchmark.machine_kind(gpu, "cpu") == "amd-epyc"  # a CPU run on a GPU machine is a CPU result


def test_a_per_machine_case_keeps_and_shows_every_machine_kind(tmp_path, monkeypatch):
    """Running a per-machine case on a second kind of machine adds a section; the first kind's result stays."""
    import json
    from types import SimpleNamespace

    benchmark = _benchmark()
    monkeypatch.setattr(benchmark, "RESULTS", tmp_path)
    case = SimpleNamespace(
        TITLE="Speed",
        PER_MACHINE=True,
        markdown=lambda r: f"ratio {r['ratio']}",
        summary=lambda r: (["ratio"], [f"{r['ratio']:.2f}x"]),
    )
    for cpu, ratio in (("AMD EPYC", 1.18), ("Intel(R) Xeon(R) Processor", 1.21)):
        info = {"cpu": cpu, "cores": 2, "torch_threads": 2, "cuda": None, "torch": "2", "transformers": "5",
                "headlab": "0.1", "commit": "abc1234"}  # fmt: skip
        path = benchmark.result_path("speed", case, benchmark.machine_kind(info))
        payload = {"command": "python scripts/benchmark.py --case speed", "date": "2026-12-02", "machine": info}
        path.write_text(json.dumps({**payload, "result": {"ratio": ratio}}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speed@amd-epyc.json", "speed@intel-xeon-processor.json"]
    text = "\n".join(benchmark._render_case("speed", case))
    assert "| AMD EPYC | 2026-12-02 | 1.18x |" in text and "| Intel(R) Xeon(R) Processor | 2026-12-02 | 1.21x |" in text
    assert "### AMD EPYC" in text and "ratio 1.21" in text and "commit abc1234" in text
    assert benchmark.previous_result("speed", "intel-xeon-processor")["result"]["ratio"] == 1.21
    assert benchmark.previous_result("speed", "nvidia-h200") is not None  # another kind's, for machine-free parts


def _demo_run(wall, steps):
    return {"wall_seconds": wall, "report_seconds": wall - 5, "steps": steps}


def test_demo_table_shows_idle_and_loaded_runs_and_whether_their_tables_agree():
    case = _case("demo")
    steps = {"info": 0.01, "stats": 4.0, "recovery": 60.0, "figures": 10.0}
    result = {
        "first_run": _demo_run(200.0, steps),
        "idle": [_demo_run(170.0, steps), _demo_run(180.0, steps), _demo_run(190.0, steps)],
        "loaded": _demo_run(360.0, {k: 2 * v for k, v in steps.items()}),
        "busy_processes": 2,
        "load_average_after_loaded_run": [3.9, 2.5, 1.2],
        "differences": [],
        "compared": ["stats", "sweep"],
    }
    text = case.markdown(result)
    assert "| run | wall time | info | stats | recovery | figures |" in text
    assert "| idle 2 | 180 s | 0 s | 4 s | 60 s | 10 s |" in text
    assert "| under load | 360 s | 0 s | 8 s | 120 s | 20 s |" in text
    assert "Idle median 180 s (3.0 min); under load 360 s (2.0x the idle time)" in text
    assert "every table is identical apart from timings" in text and "200 s in all" in text
    text = case.markdown({**result, "differences": ["sweep/sweep.csv"]})
    assert "these tables differ: sweep/sweep.csv" in text


def test_recovery_table_renders_step_budgets_and_the_earlier_minutes_budgets():
    case = _case("recovery")
    row = {"perplexity": 20.0, "seconds": 100.0, "tokens": 65536, "peak_extra_bytes": 2**20, "local_tokens": 1024,
           "heldout": [40.0, 25.0], "steps": 128, "kept_step": 120, "lr": 3e-5}  # fmt: skip
    rows = {"none": {**row, "tokens": 0}, "local": row, "uptrain": row, "local+uptrain": row}
    base = {"eval_tokens": 2048, "seq_len": 512, "threads": 2, "original": 10.66, "models": {"svd": rows},
            "local": {"local_tokens": 1024}, "uptrain": {"batch_size": 4, "seq_len": 128, "heldout_tokens": 1024}}  # fmt: skip
    text = case.markdown({**base, "uptrain_steps": 128})
    assert "--recover local,uptrain --recover-steps 128`" in text and "HEADLAB_BENCH_UPTRAIN_STEPS=128" in text
    earlier = case.markdown({**base, "local_minutes": 2.0, "uptrain_minutes": 8.0})
    assert "--recover local,uptrain --recover-minutes 10.0`" in earlier and "before budgets were in steps" in earlier


def test_gguf_table_shows_each_file_type_with_its_size_and_stored_types():
    """The gguf case: one row per exported file (type and size), the quantized files' tensor types listed below; a
    result saved before the quantized rows (no outtype, no bytes) still renders as f32."""
    case = _case("gguf")
    base = {"model": "original", "architecture": "llama", "heads": 270, "kv_heads": 90, "perplexity_transformers": 9.7,
            "perplexity_llamacpp": 9.7, "relative_difference": 0.0, "max_abs_logit_diff": 1e-4, "max_abs_logit": 42.0}  # fmt: skip
    quantized = {**base, "outtype": "q4_k_m", "bytes": 100 * 2**20, "perplexity_llamacpp": 10.2,
                 "relative_difference": 0.05, "tensor_type_counts": {"f32": 61, "q4_k": 30, "q5_0": 180},
                 "quantization": {"by": "llama.cpp", "ftype": "Q4_K_M", "from": "f32", "ggml": "0.25.3",
                                  "commit": "0c1e570", "fallback_matrices": {"blk.0.attn_q.weight": "q5_0"}}}  # fmt: skip
    text = case.markdown({"max_tokens": 512, "seq_len": 256, "rows": [base, quantized]})
    assert "| original | llama | 270 / 90 | f32 | 9.7000 | 9.7000 | 0.0000% |" in text
    assert "| original | llama | 270 / 90 | q4_k_m, 100.0 MiB | 9.7000 | 10.2000 | 5.0000% |" in text
    listed = "- original, q4_k_m (llama.cpp Q4_K_M from f32, ggml 0.25.3 (0c1e570)): 61 f32, 30 q4_k, 180 q5_0; 1 "
    assert listed in text


def test_kv_policy_table_shows_measured_and_layout_fractions():
    """The kv_policy case: one row per method; a policy row shows its budget fraction and, in brackets, the fraction
    measured on the real cache at each length; accuracy per task and length, NLL per position bucket."""
    case = _case("kv_policy")
    base = {"lengths": [2048], "context": 2048, "sinks": 4, "window": 256, "tasks": ["passkey", "niah_multikey"],
            "depths": [0.0, 0.5, 1.0], "samples": 2, "position_sequences": 1, "threads": 2}  # fmt: skip
    nll = {"[0, 512)": 3.5, "[512, 2048)": 3.2}
    rows = [
        {"method": "original", "kv_fraction": 1.0, "accuracy": {"passkey@2048": 0.5, "niah_multikey@2048": 1.0},
         "nll": nll},
        {"method": "policy, retrieval score, 1/2", "kv_fraction": 0.495, "kv_fraction_measured": {2048: 0.5012},
         "accuracy": {"passkey@2048": 0.5, "niah_multikey@2048": 0.8333}, "nll": nll},
    ]  # fmt: skip
    text = case.markdown({**base, "rows": rows})
    assert "| method | KV kept | passkey@2048 | niah_multikey@2048 | NLL [0, 512) | NLL [512, 2048) |" in text
    assert "| policy, retrieval score, 1/2 | 0.495 (0.501) | 0.50 | 0.83 | 3.500 | 3.200 |" in text
    assert "| original | 1.000 | 0.50 | 1.00 | 3.500 | 3.200 |" in text


def test_long_runtimes_table_counts_same_answers_and_lists_each_difference():
    case = _case("long_runtimes")
    base = {"lengths": [1024], "depths": [0.0, 0.5, 1.0], "samples": 2, "tasks": ["passkey"], "threads": 2}
    row = {"model": "original", "task": "passkey", "length": 1024, "prompts": 6, "same_answer": 5,
           "correct_transformers": 4, "correct_llamacpp": 3}  # fmt: skip
    difference = {"model": "original", "task": "passkey", "length": 1024, "depth": 0.5, "answers": "12345",
                  "transformers": "12345", "llamacpp": "12346"}  # fmt: skip
    text = case.markdown({**base, "rows": [row], "differences": [difference]})
    assert "| original | passkey | 1,024 | 5/6 | 4/6 | 3/6 |" in text
    assert "- original, passkey at 1,024, depth 0.5 (answer 12345): transformers `12345`, llama.cpp `12346`" in text
    assert "Every prompt" in case.markdown({**base, "rows": [row], "differences": []})


def test_a_kv_policy_run_of_some_rows_keeps_the_saved_rest_in_table_order(tmp_path, monkeypatch):
    """HEADLAB_BENCH_POLICY_ONLY: the measured rows replace theirs, the other saved rows stay, policies before the
    structural methods, and the table says which rows are whose; another grid keeps nothing."""
    import json
    import sys

    benchmark = _benchmark()
    monkeypatch.setattr(benchmark, "RESULTS", tmp_path)
    monkeypatch.setitem(sys.modules, "benchmark", benchmark)
    monkeypatch.setenv("HEADLAB_BENCH_POLICY_ONLY", "random policy")
    case = _case("kv_policy")
    grid = {"lengths": [2048], "context": 2048, "sinks": 4, "window": 256, "depths": [0.0, 0.5, 1.0], "samples": 2}
    saved_rows = [{"method": m, "n": 0} for m in ("original", "policy, streaming score, 1/2", "uniform MQA (svd)")]
    payload = {"date": "2026-12-03", "machine": {"commit": "abc1234"}, "result": {**grid, "rows": saved_rows}}
    (tmp_path / "kv_policy.json").write_text(json.dumps(payload))
    measured = [{"method": "original", "n": 1}, {"method": "random policy (seed 0), 1/2", "n": 1}]
    merged = case._with_saved({**grid, "rows": list(measured)}, "kv_policy")
    assert [(r["method"], r["n"]) for r in merged["rows"]] == [
        ("original", 1),
        ("policy, streaming score, 1/2", 0),
        ("random policy (seed 0), 1/2", 1),
        ("uniform MQA (svd)", 0),
    ]
    assert "kept from the run of 2026-12-03 (commit abc1234)" in merged["note"]
    other = case._with_saved({**grid, "samples": 4, "rows": list(measured)}, "kv_policy")
    assert other["rows"] == measured and "note" not in other


def test_checkpoint_writes_the_rows_so_far_and_the_finished_run_replaces_them(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    benchmark = _benchmark()
    monkeypatch.setattr(benchmark, "RESULTS", tmp_path)
    monkeypatch.setattr(benchmark, "machine", lambda: {"commit": "abc1234"})
    benchmark.checkpoint("long_gpu", SimpleNamespace(device="cuda"), {"rows": [{"model": "original"}]})
    saved = json.loads(benchmark.partial_path("long_gpu").read_text())
    assert saved["command"] == "python scripts/benchmark.py --case long_gpu --device cuda"
    assert saved["result"]["rows"] == [{"model": "original"}] and saved["machine"]["commit"] == "abc1234"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long_gpu.partial.json"]  # no scratch file left


def test_scale_time_model_solves_a_writers_fixed_cost_and_copies_from_two_depths_and_predicts_the_third():
    case = _case("scale")
    step = "prune --streaming --mode physical"
    rows = [{"layers": layers, "step": "copy (reference)", "seconds": copy, "peak_rss": 1, "cold": True}
            for layers, copy in ((8, 10.0), (16, 20.0), (32, 40.0))]  # fmt: skip
    # t = 5 + 2.5 x copy at 8 and 16 layers (a writer: disk traffic, no per-layer term); the 32-layer run took
    # 100 s against a predicted 105
    rows += [{"layers": layers, "step": step, "seconds": seconds, "peak_rss": 1, "cold": True}
             for layers, seconds in ((8, 30.0), (16, 55.0), (32, 100.0))]  # fmt: skip
    # a row of another regime (a warm page cache, an older run) never enters the fit
    rows.append({"layers": 64, "step": step, "seconds": 1.0, "peak_rss": 1})
    table = case.time_model(rows)
    assert [(t["layers"], t["fitted"]) for t in table] == [(8, True), (16, True), (32, False)]
    deepest = table[-1]
    assert abs(deepest["fixed"] - 5.0) < 1e-9 and abs(deepest["factor"] - 2.5) < 1e-9 and deepest["per_layer"] == 0
    assert abs(deepest["predicted"] - 105.0) < 1e-9
    assert case.time_fit(rows, step) == {"fixed": deepest["fixed"], "factor": deepest["factor"], "per_layer": 0.0}
    text = "\n".join(case._time_model(rows))
    assert "| `prune --streaming --mode physical` | 32 | copy 40 | 5.0 | 2.50 | 0.00 | 105 | 100 | +5% |" in text
    assert case.time_model(rows[:5]) == []  # two depths fit the model and leave nothing to predict


_HOLDS = """
import mmap, sys, time
from pathlib import Path
anonymous = bytearray(int(sys.argv[1]) * 2**20)
anonymous[:: 4096] = b"x" * len(anonymous[:: 4096])  # touch every page
with open(sys.argv[2], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    total = sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page of the file resident
    time.sleep(1.5)
"""


def _holding(tmp_path, anonymous_mib: int) -> list[str]:
    import sys

    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\1" * (64 * 2**20))
    return [sys.executable, "-c", _HOLDS, str(anonymous_mib), str(weights)]


def test_scale_sampler_separates_the_mapped_checkpoint_from_what_the_command_needs(tmp_path, monkeypatch):
    case = _case("scale")
    monkeypatch.setattr(case, "COLD", False)
    row = case._timed(_holding(tmp_path, 96), mapped_dir=tmp_path)
    assert row["samples"] >= 1
    # the 64 MiB file mapped and read whole, counted apart; the 96 MiB bytearray is anonymous and in the need
    assert 60 * 2**20 <= row["checkpoint_pages_at_peak"] <= 65 * 2**20
    assert 96 * 2**20 <= row["anonymous_at_peak"] <= row["peak_need"] < row["peak_rss"]
    assert row["peak_need"] + row["checkpoint_pages_at_peak"] <= row["peak_rss"] + 4 * 2**20


def test_scale_capped_run_reports_a_kill_for_memory_and_a_finish_without_raising(tmp_path, monkeypatch):
    import pytest

    case = _case("scale")
    monkeypatch.setattr(case, "COLD", False)
    monkeypatch.setattr(case, "CGROUP", tmp_path / "no-cgroup-here")
    assert case._timed(["true"], cap=2**30)["outcome"] == "no cgroup (not root?)"  # no controller: said, not raised
    monkeypatch.undo()
    monkeypatch.setattr(case, "COLD", False)
    if case._cgroup(2**30) is None:
        pytest.skip("no writable cgroup-v1 memory controller (needs root)")
    case._release(case._cgroup(2**30))
    killed = case._timed(_holding(tmp_path, 256), mapped_dir=tmp_path, cap=128 * 2**20, timeout=60)
    assert killed["outcome"] == "killed for memory" and "peak_rss" not in killed
    # 48 MiB anonymous, the interpreter and the 64 MiB file read whole exceed a 96 MiB cap: the file's clean pages
    # are reclaimed under it, and the run finishes
    finished = case._timed(_holding(tmp_path, 48), mapped_dir=tmp_path, cap=96 * 2**20, timeout=60)
    assert finished["outcome"] == "finished" and finished["peak_rss"] > 0
    assert not list(case.CGROUP.glob("headlab-scale-*"))  # every group removed


def test_scale_time_model_times_readers_against_a_read_and_prefers_the_reference_taken_just_before():
    case = _case("scale")
    step = "eval, offloaded, 256 tokens"
    rows = [{"layers": layers, "step": "read (reference)", "seconds": read, "peak_rss": 1, "cold": True}
            for layers, read in ((8, 4.0), (16, 8.0), (32, 99.0))]  # fmt: skip
    # t = 3 + read + 1 x layers; at 32 layers the read just before the command took 16 s (the depth's row: 99 s)
    rows += [{"layers": 8, "step": step, "seconds": 15.0, "peak_rss": 1, "cold": True},
             {"layers": 16, "step": step, "seconds": 27.0, "peak_rss": 1, "cold": True},
             {"layers": 32, "step": step, "seconds": 50.0, "peak_rss": 1, "cold": True, "paired_read": 16.0}]  # fmt: skip
    # a capped run of the same step is another measurement (a memory bracket), never a point of the time model
    rows.append({"layers": 32, "step": step, "seconds": 1.0, "cold": True, "cap": 1, "outcome": "finished"})
    (deepest,) = [t for t in case.time_model(rows) if not t["fitted"]]
    assert deepest["reference"] == "read" and deepest["reference_seconds"] == 16.0 and deepest["factor"] == 1.0
    assert abs(deepest["per_layer"] - 1.0) < 1e-9 and abs(deepest["fixed"] - 3.0) < 1e-9
    assert abs(deepest["predicted"] - 51.0) < 1e-9 and deepest["measured"] == 50.0


def test_scale_repeats_a_timed_step_after_its_own_reference_and_keeps_medians_and_the_largest_peak(
    tmp_path, monkeypatch
):
    """HEADLAB_SCALE_REPEATS: reference, command, reference, command, ... in that order; the row's seconds and its
    reference are the medians of the runs (by hand: median(30, 10, 20) = 20, median(5, 9, 7) = 7), its peaks the
    largest run's; a step with no reference runs once."""
    case = _case("scale")
    monkeypatch.setattr(case, "REPEATS", 3)
    monkeypatch.setattr(case, "CHOSEN", ("copy", "prune"))
    order, results = [], iter([5.0, 30.0, 9.0, 10.0, 7.0, 20.0])
    peaks = iter([100, 300, 200])

    def fake_timed(command, mapped_dir=None, cap=None, timeout=None):
        order.append("command" if mapped_dir is not None else "reference")
        row = {"seconds": next(results)}
        if mapped_dir is not None:
            row.update(peak_rss=next(peaks), peak_need=1)
        return row

    monkeypatch.setattr(case, "_timed", fake_timed)
    monkeypatch.setattr(case, "_reference", lambda kind, source, out: ["cp"])
    row = case._repeated("prune --streaming --mode physical", ["prune"], 8, 1, tmp_path, tmp_path, tmp_path)
    assert order == ["reference", "command"] * 3
    assert row["seconds_runs"] == [30.0, 10.0, 20.0] and row["seconds"] == 20.0
    assert row["paired_copy_runs"] == [5.0, 9.0, 7.0] and row["paired_copy"] == 7.0
    assert row["peak_rss"] == 300 and row["layers"] == 8
    order.clear()
    results, peaks = iter([4.0]), iter([50])
    once = case._repeated("info", ["info"], 8, 1, tmp_path, tmp_path, tmp_path)
    assert order == ["command"] and once["seconds"] == 4.0 and "seconds_runs" not in once


def test_kv_budget_recovered_table_sets_the_per_layer_rows_beside_the_uniform_ones_with_the_ratio():
    """Rows for the saved uniform runs and the per-layer layout before and after recovery; the closing ratio is
    per-layer over uniform after recovery, by hand: 30 / 60 = 0.50x, 90 / 60 = 1.50x."""
    case = _case("kv_budget_recovered")
    domains = ("broad", "speeches")
    uniform = {"original": {"ppl": {"broad": 20.0, "speeches": 20.0}, "passkey": [3, 6]},
               "svd + recovery": {"ppl": {"broad": 60.0, "speeches": 60.0}, "passkey": [0, 6]}}  # fmt: skip
    result = {"domains": domains, "counts": [3, 1, 0], "threads": 2, "tokens": 1000, "recovery_seconds": 5.0,
              "local_kept": True, "kept_step": 4, "steps": 8, "uniform": uniform,
              "before": {"ppl": {"broad": 100.0, "speeches": 100.0}, "passkey": [0, 6]},
              "after": {"ppl": {"broad": 30.0, "speeches": 90.0}, "passkey": [1, 6]}}  # fmt: skip
    text = case.markdown(result)
    assert "3 KV heads in layers 0, no attention in 2" in text
    assert "| uniform MQA (svd) + recovery | 60.00 | 60.00 | 0/6 |" in text
    assert "| per-layer, a third + recovery | 30.00 | 90.00 | 1/6 |" in text
    assert text.rstrip().endswith("broad 0.50x, speeches 1.50x.")


def test_recovery_recipe_table_prints_every_domain_and_the_held_out_ratios():
    """A row per recipe with its setting, every domain's perplexity after recovery, and after / before on the two
    held-out domains computed from the row's own training-free numbers (by hand: 55 / 110 = 0.5, 100 / 200 = 0.5)."""
    case = _case("recovery_recipe")
    before = {"pydoc-topics": 100.0, "broad": 160.0, "speeches": 110.0, "encyclopedia": 200.0}
    rows = [
        {"recipe": "default", "overrides": {}, "before": before, "passkey": [0, 6], "seconds": 900.0,
         "after": {"pydoc-topics": 20.0, "broad": 55.0, "speeches": 55.0, "encyclopedia": 100.0}},
        {"recipe": "lr", "overrides": {"lr": 6e-5}, "before": before, "passkey": [1, 6], "seconds": 901.0,
         "after": {"pydoc-topics": 21.0, "broad": 56.0, "speeches": 66.0, "encyclopedia": 150.0}},
        {"recipe": "sampled", "model": "mla", "overrides": {"generated": 0.5}, "passkey": [0, 6], "seconds": 800.0,
         "before": {**before, "speeches": 88.0}, "after": {**before, "speeches": 44.0}},
    ]  # fmt: skip
    table = case.markdown({"domains": list(before), "threads": 2, "rows": rows, "note": "ran beside each other"})
    lines = table.splitlines()
    assert "ran beside each other" in lines
    header = next(line for line in lines if line.startswith("| recipe"))
    assert all(domain in header for domain in before)
    default = next(line for line in lines if line.startswith("| default"))
    assert "| 0.500, 0.500 |" in default and "| 0/6 |" in default and "| - |" in default
    changed = next(line for line in lines if line.startswith("| lr"))
    assert "`lr=6e-05`" in changed and "| 0.600, 0.750 |" in changed and "| 66.00 |" in changed
    mla = next(line for line in lines if "sampled" in line)  # another start model: named, its own before (44 / 88)
    assert mla.startswith("| MLA at the MQA budget: sampled |") and "| 0.500, 1.000 |" in mla


def test_merge_retrieval_table_gives_each_layouts_share_of_the_cache_and_both_tasks():
    """A row per layout: its KV numbers with the share of the original's (by hand: 3,840 / 11,520 = 33%), every
    corpus's perplexity and both retrieval tasks; the layouts keep the top retrieval layers and each half whole."""
    import torch

    case = _case("merge_retrieval")
    layouts = case.layouts(30, {2: [17, 18]})
    assert layouts["3 -> 1 everywhere"] == [] and layouts["top-2 retrieval layers kept (17, 18)"] == [17, 18]
    assert layouts["layers 0-14 merged, 15-29 kept"] == list(range(15, 30))
    assert case._top_layers([torch.tensor([0.1, 0.9]), torch.tensor([0.2, 0.0]), torch.tensor([0.5, 0.3])], 2) == [0, 2]
    ppl = {"broad": 27.8, "speeches": 22.1, "encyclopedia": 44.5}
    rows = [
        {"layout": "original", "kv_numbers": 11520, "perplexity": ppl,
         "retrieval": {"passkey": [3, 6], "niah_multikey": [5, 6]}},
        {"layout": "3 -> 1 everywhere", "kv_numbers": 3840, "perplexity": {k: 4 * v for k, v in ppl.items()},
         "retrieval": {"passkey": [0, 6], "niah_multikey": [0, 6]}},
    ]  # fmt: skip
    table = case.markdown({"domains": list(ppl), "tasks": ["passkey", "niah_multikey"], "rows": rows,
                           "top_heads": [{"layer": 17, "head": 3, "score": 0.67}]})  # fmt: skip
    merged = next(line for line in table.splitlines() if line.startswith("| 3 -> 1"))
    assert "| 3,840 (33%) |" in merged and "| 111.2 |" in merged and "| 0/6 | 0/6 |" in merged
    assert "17.3 (0.67)" in table and "passkey @ 2k | niah_multikey @ 2k" in table


def test_the_q8_classes_case_quantizes_only_the_named_matrices_and_restores_the_plan():
    from headlab.runtimes.gguf_export import ExportPlan

    case = _case("gguf_classes")
    plan = ExportPlan(None, "llama", [2], [1], 8, None, keep_f32=("attn_kv_a_mqa.weight",))
    before = ExportPlan.kept_f32
    with case._quantizing_only(case.FFN):
        assert not plan.kept_f32("blk.0.ffn_up.weight") and not plan.kept_f32("blk.3.ffn_down.weight")
        assert plan.kept_f32("blk.0.attn_q.weight") and plan.kept_f32("token_embd.weight")
        assert plan.kept_f32("blk.0.attn_kv_a_mqa.weight")  # the plan's own f32 list still holds
    with case._quantizing_only(None):  # every matrix: the plan's own choice
        assert not plan.kept_f32("blk.0.attn_q.weight") and plan.kept_f32("blk.0.attn_kv_a_mqa.weight")
    assert ExportPlan.kept_f32 is before
    row = {"model": "original", "quantized": "feed-forward only", "classes": ["ffn_up.weight"],
           "perplexity_transformers": 30.0, "perplexity_llamacpp": 30.3, "signed_difference": 0.01,
           "max_abs_logit_diff": 1.5}  # fmt: skip
    text = case.markdown({"max_tokens": 4096, "seq_len": 256, "rows": [row]})
    assert "| original | feed-forward only (ffn_up) | 30.0000 | 30.3000 | +1.000% | 1.50 |" in text


def test_recovery_bf16_table_gives_each_row_and_the_speed_ratios():
    case = _case("recovery_bf16")
    domains = ("pydoc-topics", "broad", "speeches", "encyclopedia")
    before = dict(zip(domains, (100.0, 160.0, 100.0, 200.0)))

    def row(name, after, seconds, uptrain_seconds, step):
        return {"row": name, "bf16": name != "float32", "before": before, "after": dict(zip(domains, after)),
                "seconds": seconds, "uptrain_seconds": uptrain_seconds, "median_step_seconds": step}  # fmt: skip

    result = {"domains": domains, "rows": [row("float32", (20, 50, 50, 100), 600, 500, 8.0),
                                           row("bfloat16 autocast", (21, 52, 55, 90), 400, 250, 4.0)]}  # fmt: skip
    text = case.markdown(result)
    assert "| float32 | 20.00 | 50.00 | 50.00 | 100.00 | 0.500, 0.500 | 600 | 500 | 8.00 |" in text
    assert "| bfloat16 autocast | 21.00 | 52.00 | 55.00 | 90.00 | 0.550, 0.450 | 400 | 250 | 4.00 |" in text
    assert "recovery 1.50x faster, uptraining 2.00x, median step 2.00x" in text
    assert case.markdown({"skipped": "needs a CPU", "rows": []}) == "Not measured: needs a CPU"
