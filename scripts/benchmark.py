#!/usr/bin/env python
"""Benchmarks: headlab against reference implementations measured in the same run; writes BENCHMARKS.md.

Each case is a module in scripts/bench_cases/ with `TITLE`, `run(args) -> dict` and `markdown(result) -> str`.
Results are kept per case in benchmarks/results/<case>.json, so running one case (`--case eval`) refreshes its
section and keeps the others. A case whose figures depend on the machine (`PER_MACHINE = True`: the stats and
importance speed ratios) keeps one file per machine kind, benchmarks/results/<case>@<kind>.json (the CPU model, or
the GPU's name with --device cuda), and its section shows every kind measured. Timings are medians over --repeats
runs; ratios compare runs made in this process.

    python scripts/benchmark.py                 # every case
    python scripts/benchmark.py --case eval     # one case
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "scripts" / "bench_cases"
RESULTS = ROOT / "benchmarks" / "results"


def median_time(function, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of `function()` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def in_fresh_process(case: str, call: str, env: dict | None = None) -> dict:
    """Run `bench_cases/<case>.py`'s `call` (e.g. "_child('plain', 'cpu')") in a new Python process (with extra
    environment variables `env`), so memory peaks of earlier measurements do not carry over; the child prints one
    JSON line last, which is returned."""
    import subprocess

    code = f"import sys; sys.path[:0] = [{str(CASES)!r}, {str(CASES.parent)!r}]; import {case}; {case}.{call}"
    environment = {**os.environ, **(env or {})}
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


class PeakMemory:
    """Peak memory while the block runs, above what the process held when it started: on CPU the resident set
    sampled every millisecond from /proc/self/statm (ru_maxrss cannot be used: loading a model peaks higher than a
    forward); on CUDA the allocator's peak. `extra` is the growth in bytes."""

    def __init__(self, device):
        self.device, self.peak, self.base = device, 0, 0
        self.kind = "cuda" if device.type == "cuda" else "rss"

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        import threading

        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.base = self.peak = self.rss()
        self.running = True

        def sample():
            while self.running:
                self.peak = max(self.peak, self.rss())
                time.sleep(0.001)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
            self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _commit() -> str | None:
    """The checkout's commit, with "+changes" when the working tree differs from it (None outside git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine() -> dict:
    import torch
    import transformers

    import headlab

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "commit": _commit(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "headlab": headlab.__version__,
    }


def _device_name(info: dict, device: str) -> str:
    """What a run measured: the GPU's name for a CUDA run, else the CPU model."""
    return info["cuda"] if device.startswith("cuda") and info.get("cuda") else info["cpu"]


def machine_kind(info: dict, device: str = "cpu") -> str:
    """A file-name slug for the kind of machine a result was measured on (_device_name: "Intel(R) Xeon(R)
    Processor" -> "intel-xeon-processor")."""
    name = re.sub(r"\((r|tm)\)", " ", _device_name(info, device).lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def result_path(name: str, module, kind: str) -> Path:
    return RESULTS / (f"{name}@{kind}.json" if getattr(module, "PER_MACHINE", False) else f"{name}.json")


def saved_payload(name: str) -> dict:
    """The saved run of a (not per-machine) case, benchmarks/results/<name>.json (command, date, machine, result), or
    {}."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def saved_result(name: str) -> dict:
    """The saved result of a (not per-machine) case, or {}: what a run of some of a case's models carries over for
    the others."""
    return saved_payload(name).get("result", {})


def previous_result(name: str, kind: str) -> dict | None:
    """The last saved result of case `name`: this machine kind's if there is one, else any kind's (newest first)."""
    own = RESULTS / f"{name}@{kind}.json"
    paths = [own] if own.is_file() else sorted(RESULTS.glob(f"{name}@*.json"), key=lambda p: p.stat().st_mtime)[::-1]
    return json.loads(paths[0].read_text()) if paths else None


def _measured_line(result: dict) -> str:
    info = result["machine"]
    commit = f", commit {info['commit']}" if info.get("commit") else ""
    return (
        f"Measured {result['date']} on {info['cpu']} ({info['cores']} cores"
        f"{', ' + str(info['torch_threads']) + ' torch threads' if info.get('torch_threads') else ''}"
        f"{', ' + info['cuda'] if info['cuda'] else ''}), torch {info['torch']}, "
        f"transformers {info['transformers']}, headlab {info['headlab']}{commit}."
    )


def _measured_where(result: dict) -> str:
    """_device_name of a saved result (its command says --device cuda for a CUDA run)."""
    return _device_name(result["machine"], "cuda" if "--device cuda" in result["command"] else "cpu")


def _result_block(heading: str, module, result: dict) -> list[str]:
    return [
        heading,
        "",
        f"Reproduce: `{result['command']}`  ",
        _measured_line(result),
        "",
        module.markdown(result["result"]).rstrip(),
        "",
    ]


def _render_case(name: str, module) -> list[str]:
    if not getattr(module, "PER_MACHINE", False):
        path = RESULTS / f"{name}.json"
        return _result_block(f"## {module.TITLE}", module, json.loads(path.read_text())) if path.is_file() else []
    results = [json.loads(path.read_text()) for path in sorted(RESULTS.glob(f"{name}@*.json"))]
    if not results:
        return []
    lines = [f"## {module.TITLE}", ""]
    if hasattr(module, "summary"):
        header, _ = module.summary(results[0]["result"])
        lines += [
            "Every machine kind measured (one section each below):",
            "",
            "| machine | date | " + " | ".join(header) + " |",
            "|---|---|" + "---|" * len(header),
        ]
        for result in results:
            cells = module.summary(result["result"])[1]
            lines.append(f"| {_measured_where(result)} | {result['date']} | " + " | ".join(cells) + " |")
        lines.append("")
    for result in results:
        lines += _result_block(f"### {_measured_where(result)}", module, result)
    return lines


def _payload(name: str, args, result: dict, info: dict) -> dict:
    command = f"python scripts/benchmark.py --case {name}" + (
        f" --device {args.device}" if args.device != "cpu" else ""
    )
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": info, "result": result}


def partial_path(name: str) -> Path:
    return RESULTS / f"{name}.partial.json"


def checkpoint(name: str, args, result: dict) -> None:
    """A case's result so far, in benchmarks/results/<name>.partial.json, written as each row finishes (atomically):
    what a run stopped by a time limit leaves (scripts/gpu_check.sh brings it back). The finished run removes it."""
    path = partial_path(name)
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(_payload(name, args, result, machine()), indent=2, default=str) + "\n")
    scratch.replace(path)


def load_case(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_cases.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases() -> dict:
    return {path.stem: path for path in sorted(CASES.glob("*.py")) if not path.stem.startswith("_")}


def render() -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `scripts/benchmark.py` from `benchmarks/results/*.json`; every ratio compares two "
        "implementations measured in the same run on the same machine. Timings are medians; this machine is "
        "shared and noisy, so read ratios, not absolute seconds.",
        "",
    ]
    for name, path in cases().items():
        lines += _render_case(name, load_case(path))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=sorted(cases()), help="run only these cases")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--render-only", action="store_true", help="rewrite BENCHMARKS.md from saved results")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        for name in args.case or sorted(cases()):
            print(f"== {name}", flush=True)
            module = load_case(cases()[name])
            result = module.run(args)
            info = machine()
            path = result_path(name, module, machine_kind(info, args.device))
            path.write_text(json.dumps(_payload(name, args, result, info), indent=2) + "\n")
            partial_path(name).unlink(missing_ok=True)
            print(module.markdown(result))
    for name in args.case or sorted(cases()):
        draw_figures(name, load_case(cases()[name]))
    (ROOT / "BENCHMARKS.md").write_text(render())


def draw_figures(name: str, module) -> None:
    """A case's `figures(result) -> {file stem: Figure}`, drawn from its saved results into docs/images (the docs
    page that quotes the case shows them), also with --render-only."""
    path = RESULTS / f"{name}.json"
    if not hasattr(module, "figures") or not path.is_file():
        return
    from headlab.viz.plots import save_figure

    for stem, figure in module.figures(json.loads(path.read_text())["result"]).items():
        print(f"  docs/images/{stem}.png", flush=True)
        save_figure(figure, ROOT / "docs" / "images" / f"{stem}.png")


if __name__ == "__main__":
    main()
