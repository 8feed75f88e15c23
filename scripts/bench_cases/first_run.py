"""A new user's first prune and sweep on the embedded model: wall time of `headlab prune --count 90 --uniform` and
`headlab sweep` with no other options (each a fresh process, model already in headlab's cache), and the perplexity
of the default prune with --compensate at the calibration default against the previous default (16,384 tokens, one
sequence per backward pass with recomputed blocks). Aim: each command at most 2 minutes on an idle machine.

Environment: HEADLAB_FIRST_RUN_PREVIOUS=0 skips the previous default's prune (several minutes idle).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TITLE = "Calibration budget: a first `headlab prune` and `headlab sweep` on the embedded model"
PREVIOUS = ["--calibration-tokens", "16384", "--low-memory"]  # the default before docs/selection.md's change


def _timed(args: list[str]) -> tuple[float, str]:
    """Wall seconds of `headlab ARGS` in a fresh process, and its standard output."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})  # fmt: skip
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"headlab {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, done.stdout


def _load() -> str:
    with open("/proc/loadavg") as handle:
        return " / ".join(handle.read().split()[:3])


def run(args) -> dict:
    result = {"prune": [], "sweep": [], "load": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for _ in range(args.repeats):
            result["prune"].append(_timed(["prune", "--count", "90", "--uniform", "--out", str(out / "p"),
                                           "--overwrite"])[0])  # fmt: skip
            result["sweep"].append(_timed(["sweep", "--out", str(out / "s"), "--overwrite"])[0])
            result["load"].append(_load())
        settings = [("new default", []), ("previous default", PREVIOUS)]
        if os.environ.get("HEADLAB_FIRST_RUN_PREVIOUS", "1") == "0":
            settings = settings[:1]
        result["perplexity"] = {}
        for name, extra in settings:
            wall, stdout = _timed(["prune", "--count", "90", "--uniform", "--compensate", "--json", *extra,
                                   "--out", str(out / "c"), "--overwrite"])  # fmt: skip
            meta = json.loads(stdout)
            result["perplexity"][name] = {"seconds": wall, "before": meta["perplexity_before"],
                                          "after": meta["perplexity_after"],
                                          "calibration_tokens": meta["selection"]["calibration_tokens"]}  # fmt: skip
    return result


def markdown(result: dict) -> str:
    lines = [
        "Embedded SmolLM2-135M (float32, CPU). Each command a fresh process with the model already in headlab's "
        "cache; wall time of the whole process. Aim: at most 2 minutes each on an idle machine.",
        "",
        "| command | runs | median wall s | min | max | load average (1 / 5 / 15 min) |",
        "|---|---|---|---|---|---|",
    ]
    for name, command in (("prune", "headlab prune --count 90 --uniform"), ("sweep", "headlab sweep")):
        times = result[name]
        load = "; ".join(result.get("load", [])) or result.get("load_note", "")
        lines.append(f"| `{command}` | {len(times)} | {statistics.median(times):.0f} | {min(times):.0f} | "
                     f"{max(times):.0f} | {load} |")  # fmt: skip
    lines += [
        "",
        "`headlab prune --count 90 --uniform --compensate`, perplexity on the eval split's first 1,024 tokens at "
        "seq-len 256 (prune's own eval settings):",
        "",
        "| calibration | tokens | perplexity before | after | change against the previous default |",
        "|---|---|---|---|---|",
    ]
    ppl = result["perplexity"]
    reference = ppl.get("previous default", {}).get("after")
    for name, row in ppl.items():
        change = "" if reference is None else f"{(row['after'] / reference - 1) * 100:+.1f}%"
        lines.append(f"| {name} | {row['calibration_tokens']:,} | {row['before']:.2f} | {row['after']:.2f} | "
                     f"{change} |")  # fmt: skip
    if result.get("notes"):
        lines += [""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"
