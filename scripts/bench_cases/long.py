"""Long-context quality of the compressed rungs (`headlab longeval`): passkey and multi-key needle accuracy with 95%
Wilson intervals, and NLL by position, for the original embedded model; 3 -> 1 KV heads by the svd merge; MLA at the
GQA and the MQA budgets; 90 heads pruned uniformly with --compensate (each built as recovery's benchmark builds it,
from the calibration split); optionally each after recovery (HEADLAB_BENCH_LONG_RECOVER=1: local reconstruction, then
uptraining with the recovery case's step budget, HEADLAB_BENCH_UPTRAIN_STEPS). Haystacks and NLL sequences come from
the eval split. A run keeps the saved rows of the models it does not measure, so the recovered rungs can be added by
a second run (HEADLAB_BENCH_LONG_MODELS=svd,mla_mqa HEADLAB_BENCH_LONG_RECOVER=1).

CPU defaults are sized for 2 cores (2,048 tokens, depths 0, 0.5, 1, 2 prompts per cell); a GPU run takes 2k, 4k, 8k
and five depths. HEADLAB_BENCH_LONG_LENGTHS, _DEPTHS, _SAMPLES, _MODELS override them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the recovery case builds the same rungs: reuse it

TITLE = "Long-context retrieval and NLL by position of the compressed models (`headlab longeval`)"
TASKS = ("passkey", "niah_multikey")
MODELS = ("original", "svd", "mla_gqa", "mla_mqa", "pruned")
LABELS = {
    "original": "original (GQA, 3 KV heads)",
    "svd": "3 -> 1 KV heads, svd merge",
    "mla_gqa": "MLA, GQA budget (384 numbers)",
    "mla_mqa": "MLA, MQA budget (128 numbers)",
    "pruned": "90 heads pruned + compensation",
}


def variant(case: str, **grid: str):
    """`run` of a case that measures the rungs on another grid: `grid` gives the defaults of the HEADLAB_BENCH_LONG_*
    settings (lengths, depths, samples, models; an environment setting still wins), float32 on any device."""
    for key, value in grid.items():
        os.environ.setdefault(f"HEADLAB_BENCH_LONG_{key.upper()}", value)
    return lambda args: measure(args, case, dtype="float32")


def _grid(device: str) -> tuple[list[int], list[float], int]:
    gpu = device.startswith("cuda")
    lengths = os.environ.get("HEADLAB_BENCH_LONG_LENGTHS", "2048,4096,8192" if gpu else "2048")
    depths = os.environ.get("HEADLAB_BENCH_LONG_DEPTHS", "0,0.25,0.5,0.75,1" if gpu else "0,0.5,1")
    samples = int(os.environ.get("HEADLAB_BENCH_LONG_SAMPLES", 4 if gpu else 2))
    return [int(x) for x in lengths.split(",")], [float(x) for x in depths.split(",")], samples


def _model(name, teacher, corpus):
    """The rung `name`, built from the original as recovery's benchmark case builds it."""
    from recovery import CALIB_TOKENS, SEQ_LEN, _edited

    if name == "original":
        return teacher
    if name == "mla_gqa":
        from headlab.core.data import calibration_batches
        from headlab.kv.mla import convert_to_mla, plan_mla

        batches = calibration_batches(teacher.tokenizer, corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS)
        return convert_to_mla(teacher, plan_mla(teacher, "gqa"), batches, progress=False)[0]
    return _edited({"mla_mqa": "mla"}.get(name, name), teacher, corpus, None)


def _saved_rows(case: str, lengths: list[int]) -> list[dict]:
    """The rows of an earlier run of `case` on the same lengths, so a run of some models adds to the table rather
    than replacing it."""
    from benchmark import saved_result

    earlier = saved_result(case)
    return list(earlier.get("rows", [])) if earlier.get("lengths") == lengths else []


def run(args) -> dict:
    return measure(args, "long")


def measure(args, case: str, dtype: str | None = None) -> dict:
    """The case's rows for every rung in HEADLAB_BENCH_LONG_MODELS, in `dtype` (default: load_model's for the
    device), keeping the saved rows of `case` for the rungs not measured. Each row is printed whole as it is
    measured (JSON) and checkpointed (benchmark.checkpoint), so a run stopped by a time limit still leaves its finished
    rows."""
    import json
    import time

    import torch
    from benchmark import checkpoint

    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import load_model
    from headlab.measure.longctx import long_context

    corpus = load_corpus(None)
    lengths, depths, samples = _grid(args.device)
    models = os.environ.get("HEADLAB_BENCH_LONG_MODELS", ",".join(MODELS)).split(",")
    recover = os.environ.get("HEADLAB_BENCH_LONG_RECOVER") == "1"
    from recovery import UPTRAIN_STEPS  # the uptraining budget of recovered rows (HEADLAB_BENCH_UPTRAIN_STEPS)
    teacher = load_model(None, device=args.device, dtype=dtype)
    text = TextSpec(corpus, split="eval", max_tokens=None)
    result = {"lengths": lengths, "depths": depths, "samples": samples, "tasks": list(TASKS), "recover": recover,
              "threads": torch.get_num_threads(), "dtype": str(teacher.dtype), "device": args.device,
              "load": os.getloadavg(), "rows": _saved_rows(case, lengths)}  # fmt: skip
    if recover:
        result["uptrain_steps"] = UPTRAIN_STEPS
    for name in models:
        start = time.perf_counter()
        model = _model(name, teacher, corpus)
        build = time.perf_counter() - start
        stages = [("", model)]
        if recover and name != "original":
            from recovery import _stage

            recovery = _stage(model, teacher, corpus, ("local", "uptrain"), torch.device(args.device))
            recovery.pop("curve", None)  # the recovery case keeps the curves; a row keeps what the table's note needs
            stages = [(" + recovery", model)]
        for suffix, loaded in stages:
            start = time.perf_counter()
            measured = long_context(loaded, text=text, tasks=TASKS, lengths=lengths, depths=depths, samples=samples,
                                    position_sequences_count=1, progress=False)  # fmt: skip
            row = {"model": name + suffix, "build_seconds": build, "seconds": time.perf_counter() - start,
                   "lengths": measured.lengths.to_dict("records"), "positions": measured.positions.to_dict("records"),
                   "cells": measured.cells.to_dict("records"),
                   "per_prompt_seconds": float(measured.prompts["seconds"].median())}  # fmt: skip
            if suffix:
                row["recovery"] = recovery
            result["rows"] = [r for r in result["rows"] if r["model"] != row["model"]] + [row]
            print("row", json.dumps(row, default=float), flush=True)
            checkpoint(case, args, result)
    return result


def _label(model: str) -> str:
    """A row's label: LABELS of its rung, with " + recovery" for a recovered one."""
    return LABELS.get(model.split(" +")[0], model) + (" + recovery" if "+" in model else "")


def markdown(r: dict) -> str:
    lengths = r["lengths"]
    cells = [f"{t} @ {n:,}" for n in lengths for t in r["tasks"]]
    buckets = [f"[{p['start']:,}, {p['end']:,})" for p in r["rows"][0]["positions"]]
    where = f"{r['dtype'].removeprefix('torch.')}, {r['device']}"
    if r.get("load"):  # absent from rows recovered from a stopped run's log
        where += f", {r['threads']} threads; load averages {', '.join(f'{x:.1f}' for x in r['load'])} at the start"
    lines = [
        f"Embedded SmolLM2-135M ({where}), haystacks from the eval split; each "
        f"accuracy is correct/prompts over depths {', '.join(f'{d:g}' for d in r['depths'])} x {r['samples']} "
        "prompts, with its 95% Wilson interval; NLL by position over one eval-split sequence of the longest length.",
        "",
        "| model | " + " | ".join(cells) + " | " + " | ".join(f"NLL {b}" for b in buckets) + " | s / prompt |",
        "|---|" + "---|" * (len(cells) + len(buckets) + 1),
    ]
    if r.get("note"):
        lines[0] += " " + r["note"]
    if any("+" in row["model"] for row in r["rows"]):
        lines[0] += (f" Recovered rows: local reconstruction, then {r.get('uptrain_steps', 'the recovery case')} "
                     "uptraining steps of 4 x 128 calibration tokens (the recovery case's `_stage`).")  # fmt: skip
    for row in r["rows"]:
        by = {(x["task"], x["length"]): x for x in row["lengths"]}
        acc = [by[(t, n)] for n in lengths for t in r["tasks"]]
        accuracy = [f"{x['correct']}/{x['prompts']} [{x['ci_low']:.0%}, {x['ci_high']:.0%}]" for x in acc]
        nll = [f"{p['nll']:.3f}" for p in row["positions"]]
        lines.append(f"| {_label(row['model'])} | "
                     + " | ".join(accuracy + nll) + f" | {row['per_prompt_seconds']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def figures(r: dict) -> dict:
    """The needle heatmap of every rung at the shortest length (docs/long-context.md): models on rows, depths across,
    a panel per task."""
    import pandas as pd

    from headlab.viz.plots import plot_needle_heatmap

    shortest = min(r["lengths"])
    cells = pd.concat(
        [pd.DataFrame(row["cells"]).assign(model=_label(row["model"])) for row in r["rows"]], ignore_index=True
    )
    cells = cells[cells["length"] == shortest]
    return {"long_needles": plot_needle_heatmap(cells, "retrieval of the compressed rungs (exact match)")}
