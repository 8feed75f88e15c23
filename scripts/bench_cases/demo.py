"""`headlab demo` end to end (the README's first command, once installed): wall time on an idle machine and beside two
busy processes on the same cores, each step's seconds, and whether both runs wrote the same tables (timings aside)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TITLE = "`headlab demo`: the main job, on an idle machine and under load"
BUSY = 2  # processes spinning beside the loaded run (one per core here)
# The step directories whose tables must not depend on the machine's load (speed measures it, so it is left out).
COMPARED = ("stats", "importance", "attention", "sweep", "gqa_sweep", "gqa_groups", "recovery")
TIMINGS = {"tokens_per_s", "seconds"}


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _demo(out: Path, cache: Path) -> dict:
    """One `headlab demo --out OUT` in a fresh process with headlab's model cache at `cache`: its wall time and the
    per-step seconds it recorded."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "headlab", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1", "HEADLAB_CACHE": str(cache)},
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"headlab demo exited {done.returncode}: {done.stderr[-2000:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {"wall_seconds": wall, "report_seconds": meta["total_seconds"], "steps": meta["seconds"]}


def _differences(a: Path, b: Path) -> list[str]:
    """Tables of the two runs that differ in any value that is not a timing."""
    import pandas as pd

    differ = []
    for step in COMPARED:
        for csv in sorted((a / step).glob("*.csv")):
            left, right = pd.read_csv(csv), pd.read_csv(b / step / csv.name)
            timing = [c for c in left.columns if c in TIMINGS or c.endswith("_seconds")]
            try:
                pd.testing.assert_frame_equal(left.drop(columns=timing), right.drop(columns=timing))
            except AssertionError:
                differ.append(f"{step}/{csv.name}")
    return differ


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"  # empty: the first run converts the embedded model into it, as a new user's does
        warm = _demo(tmp / "warm", cache)
        idle = [_demo(tmp / f"idle{i}", cache) for i in range(max(1, args.repeats))]
        stop = multiprocessing.Event()
        busy = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(BUSY)]
        for process in busy:
            process.start()
        try:
            loaded = _demo(tmp / "loaded", cache)
            load = list(os.getloadavg())
        finally:
            stop.set()
            for process in busy:
                process.join()
        return {
            "first_run": warm,
            "idle": idle,
            "loaded": loaded,
            "busy_processes": BUSY,
            "load_average_after_loaded_run": load,
            "differences": _differences(tmp / "idle0", tmp / "loaded"),
            "compared": [step for step in COMPARED if (tmp / "idle0" / step).is_dir()],  # the steps the demo ran
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def markdown(r: dict) -> str:
    idle = _median([run["wall_seconds"] for run in r["idle"]])
    loaded = r["loaded"]["wall_seconds"]
    steps = list(r["loaded"]["steps"])
    lines = [
        f"`headlab demo` (the README's first command after the install) on the embedded model, each run a fresh "
        f"process with the model already in headlab's cache; idle: median of {len(r['idle'])} run(s); under load: "
        f"beside {r['busy_processes']} busy processes on the same cores (load average "
        f"{' / '.join(f'{v:.1f}' for v in r['load_average_after_loaded_run'])} after it). The demo runs the quick "
        f"preset less its recovery step (`--full`: the full preset). Aim: about a minute idle. A new user's first "
        f"run also converts the embedded GGUF file into headlab's cache (an empty cache here): "
        f"{r['first_run']['wall_seconds']:.0f} s in all.",
        "",
        "| run | wall time | " + " | ".join(steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for label, run in [*((f"idle {i + 1}", run) for i, run in enumerate(r["idle"])), ("under load", r["loaded"])]:
        cells = " | ".join(f"{run['steps'].get(step, 0):.0f} s" for step in steps)
        lines.append(f"| {label} | {run['wall_seconds']:.0f} s | {cells} |")
    same = (
        "every table is identical apart from timings"
        if not r["differences"]
        else f"these tables differ: {', '.join(r['differences'])}"
    )
    lines += [
        "",
        f"Idle median {idle:.0f} s ({idle / 60:.1f} min); under load {loaded:.0f} s ({loaded / idle:.1f}x the idle "
        f"time); exit code 0 both. Tables of the idle and the loaded run "
        f"({', '.join(r['compared'])}): {same}.",
    ]
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines)
