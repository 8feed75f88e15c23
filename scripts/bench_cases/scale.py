"""Real shapes on this machine: random-weight Llama-3.1-8B-shaped checkpoints (bf16, `scripts/make_shape.py`) at 8,
16 and 32 layers, and the commands that edit or read them, each a fresh process timed as a whole with its peak
resident set (GNU time's maximum RSS), against the bytes of one decoder layer and of the embeddings:
- convert: `convert-gqa --streaming` 8 -> 4 KV heads at every depth; 8 -> 2 and 8 -> 1, and `expand-kv --streaming`
  4 -> 8, at the deepest;
- prune: `prune --streaming --mode physical` of named heads (uneven layers) at every depth;
- mla: `convert-mla --streaming` to latent 448 + rope 64 (a quarter of the GQA-8 cache), 256 calibration tokens,
  at the deepest;
- export: `export-gguf` f16 with `--device-map auto --max-memory 64MB` (every block offloaded to disk) at every depth;
- eval, importance: on 256 tokens under the same offloading, at every depth, and again in memory cgroups capped at
  1.25x and 0.75x the cost model's prediction (`_capped`: finishing under the one and failing under the other
  brackets what they need within 25%, which a resident set full of reclaimable mapped pages cannot show);
- info, stats: at the deepest (stats on 256 tokens, offloaded).
Each depth also times a plain copy and a plain read of the checkpoint, and each timed command gets its own copy or
read just before it (TIMED_STEPS: the time model's reference; this disk's rate drifts within minutes). Where the page
cache can be dropped (root), it is dropped before each timed command, so every command reads from disk as a model
larger than memory must (HEADLAB_SCALE_COLD=0 keeps it); a command's seconds include flushing what it wrote (sync).
Every command's resident set less the pages it maps from the checkpoint is sampled too (every 0.5 s: short peaks,
such as a streaming edit's one embedding-sized tensor, fall between samples; GNU time's peak does not miss them).
HEADLAB_SCALE_STEPS=prune,export,... runs some steps and HEADLAB_SCALE_LAYERS=32 some depths, and the saved rows of
the others are kept; HEADLAB_SCALE_REPEATS=3 runs each timed step three times and keeps the medians
(HEADLAB_SCALE_REPEATED=prune: that step alone; the steps at the deepest depth run are the deepest-only ones).
Outputs are deleted after each command; set HEADLAB_SCALE_DIR to a disk with about 50 GB free."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TITLE = "Real shapes: the 8B-shaped checkpoint on this machine (streaming edits, offloaded reads)"
SHAPE = "llama-3.1-8b"
DEPTHS = tuple(int(x) for x in os.environ.get("HEADLAB_SCALE_LAYERS", "8,16,32").split(","))
STEPS = ("copy", "read", "convert", "prune", "mla", "export", "info", "eval", "stats", "importance")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1 memory controller: the capped runs of the readers
COLD = os.environ.get("HEADLAB_SCALE_COLD", "1") != "0"
# The time model (markdown, time_model): the commands run at every depth, each with the plain operation on the same
# bytes that is its reference: a copy (read once, written once) for what writes a checkpoint, a read for the readers.
TIMED_STEPS = {
    "convert-gqa --streaming 8 -> 4": "copy",
    "prune --streaming --mode physical": "copy",
    "export-gguf f16, offloaded": "copy",
    "eval, offloaded, 256 tokens": "read",
    "importance, offloaded, 256 tokens": "read",
}
CHOSEN = tuple(os.environ.get("HEADLAB_SCALE_STEPS", ",".join(STEPS)).split(","))
# Runs of each timed step (each after its own reference); the time model uses their medians (this machine's disk and
# cores vary by more than 25% between runs minutes apart)
REPEATS = int(os.environ.get("HEADLAB_SCALE_REPEATS", "1"))
# Which timed steps repeat (default: every one), e.g. HEADLAB_SCALE_REPEATED=prune: the others run once
REPEATED = tuple(os.environ.get("HEADLAB_SCALE_REPEATED", ",".join(STEPS)).split(","))
OFFLOAD = ("--device-map", "auto", "--max-memory", "64MB")  # every block to disk: the embeddings alone are 0.98 GiB
TOKENS = ("--max-tokens", "256", "--seq-len", "256", "--batch-size", "1")
# Query heads pruned by `prune --streaming`: a whole KV group (4 heads) of layer 0, two heads of layer 1 (padded)
PRUNED_HEADS = "0:0,1,2,3;1:5,9"
READERS = ("info", "eval", "stats", "importance")
# The readers also run capped at these multiples of the cost model's memory (`_capped`); HEADLAB_SCALE_CAPS="" skips
CAPPED = ("eval", "importance")
CAP_FACTORS = tuple(float(x) for x in os.environ.get("HEADLAB_SCALE_CAPS", "1.25,0.75").split(",") if x)
ROOT = Path(__file__).resolve().parents[2]


def _cold() -> bool:
    """Flush and drop the page cache (root only); whether it was dropped."""
    if not COLD:
        return False
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


class _MemorySampler(threading.Thread):
    """Samples, every `interval` seconds, the resident set of a process and its descendants from /proc/<pid>/smaps:
    the whole, and the part that is pages mapped from files under `mapped_dir` (the checkpoint: clean file pages the
    kernel can reclaim whenever it needs the memory, so they are no part of what the command needs). Keeps the peak
    of the rest, `peak_need` (the resident set less the checkpoint's pages), with the breakdown at that moment."""

    def __init__(self, pid: int, mapped_dir: Path, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.prefix, self.interval = pid, str(mapped_dir), interval
        self.done = threading.Event()
        self.peak = {"peak_need": 0, "anonymous_at_peak": 0, "checkpoint_pages_at_peak": 0, "samples": 0}

    def _pids(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            try:
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                pass
        return pids

    def sample(self) -> dict:
        """{"rss", "anonymous", "checkpoint_pages"} in bytes, summed over the process tree now."""
        total = {"rss": 0, "anonymous": 0, "checkpoint_pages": 0}
        for pid in self._pids():
            try:
                text = Path(f"/proc/{pid}/smaps").read_text()
            except OSError:  # the process ended between the listing and the read
                continue
            mapped = False
            for line in text.splitlines():
                field, _, rest = line.partition(":")
                if " " in field:  # a mapping's header: "start-end perms offset dev inode [path]"
                    mapped = line.split(None, 5)[-1].startswith(self.prefix) if line.count(" ") >= 5 else False
                elif field == "Rss":
                    kib = int(rest.split()[0]) * 1024
                    total["rss"] += kib
                    total["checkpoint_pages"] += kib if mapped else 0
                elif field == "Anonymous":
                    total["anonymous"] += int(rest.split()[0]) * 1024
        return total

    def run(self) -> None:
        while not self.done.wait(self.interval):
            now = self.sample()
            need = now["rss"] - now["checkpoint_pages"]
            self.peak["samples"] += 1
            if need > self.peak["peak_need"]:
                self.peak.update(peak_need=need, anonymous_at_peak=now["anonymous"],
                                 checkpoint_pages_at_peak=now["checkpoint_pages"])  # fmt: skip


def _cgroup(limit: int | None):
    """A fresh cgroup-v1 memory group capped at `limit` bytes (page cache charged and reclaimed under the cap, no
    swap here), or None where it cannot be made (not root, no v1 memory controller)."""
    if limit is None:
        return None
    group = CGROUP / f"headlab-scale-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    except OSError:
        return None
    return group


def _release(group: Path) -> bool:
    """Kill what is left in the group, remove it; whether the kernel's OOM killer fired in it."""
    killed = "oom_kill 0" not in (group / "memory.oom_control").read_text()
    for _ in range(50):
        pids = (group / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        group.rmdir()
    return killed


def _timed(command: list[str], mapped_dir: Path | None = None, cap: int | None = None,
           timeout: float | None = None) -> dict:  # fmt: skip
    """Wall seconds and peak RSS (bytes) of one command as a fresh process (GNU time -f '%e %M'), started on a cold
    page cache where it can be dropped; its seconds include the sync that writes its output to disk. With
    `mapped_dir`, also the sampled peak of its resident set less the pages it maps from files there
    (_MemorySampler). With `cap`, the command runs in a memory cgroup of that many bytes and may fail: the row says
    whether it finished, was killed for memory, or ran past `timeout` seconds."""
    cold = _cold()
    group = _cgroup(cap)
    if cap is not None and group is None:
        return {"command": " ".join(command), "cap": cap, "outcome": "no cgroup (not root?)", "cold": cold}
    enter = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "capped"] if group else []
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        process = subprocess.Popen([*enter, "/usr/bin/time", "-o", report.name, "-f", "%e %M", *command],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        sampler = _MemorySampler(process.pid, mapped_dir) if mapped_dir is not None else None
        if sampler:
            sampler.start()
        try:
            _, stderr = process.communicate(timeout=timeout)
            outcome = "finished" if process.returncode == 0 else f"exit {process.returncode}"
        except subprocess.TimeoutExpired:
            outcome = f"ran past {timeout:.0f} s"
            _release(group) if group else process.kill()
            _, stderr = process.communicate()
        wall = time.perf_counter() - start
        if sampler:
            sampler.done.set()
            sampler.join()
        if group is not None and _release(group):
            outcome = "killed for memory"
        if cap is None and outcome != "finished":
            raise RuntimeError(f"{' '.join(command)} failed: {stderr[-2000:]}")
        fields = report.read().split()
        start = time.perf_counter()
        os.sync()
        flush = time.perf_counter() - start
    row = {"command": " ".join(command), "seconds": wall + flush, "flush": flush, "wall": wall + flush, "cold": cold}
    if outcome == "finished" and len(fields) >= 2:
        row.update(seconds=float(fields[-2]) + flush, peak_rss=int(fields[-1]) * 1024)
    if cap is not None:
        row.update(cap=cap, outcome=outcome)
    if sampler:
        row.update(sampler.peak)
    return row


def _headlab(*args: str) -> list[str]:
    return [sys.executable, "-m", "headlab", *args]


def run(args) -> dict:
    from benchmark import saved_result

    from headlab.core.shapes import SHAPES

    shape = SHAPES[SHAPE]
    work = Path(os.environ.get("HEADLAB_SCALE_DIR") or tempfile.mkdtemp(prefix="headlab-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    # rows of steps not run, and of depths not run, are carried over from the saved run
    saved = saved_result("scale").get("rows", [])
    kept = [row for row in saved if _kind(row["step"]) not in CHOSEN or row["layers"] not in DEPTHS]
    saved_references = {
        (_kind(r["step"]), r["layers"]): r["seconds"] for r in saved if _kind(r["step"]) in ("copy", "read")
    }
    for row in kept:  # a carried-over timed row keeps its own run's reference, not this run's
        reference = TIMED_STEPS.get(row["step"])
        if reference and f"paired_{reference}" not in row and (reference, row["layers"]) in saved_references:
            row[f"paired_{reference}"] = saved_references[(reference, row["layers"])]
    rows = []
    try:
        for layers in DEPTHS:
            source = work / f"src-{layers}"
            make = [sys.executable, str(ROOT / "scripts" / "make_shape.py"), SHAPE, "--layers", str(layers),
                    "--out", str(source), "--overwrite"]  # fmt: skip
            rows.append({"layers": layers, "step": "make_shape", **_timed(make)})
            print(rows[-1], flush=True)
            model_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
            out = work / f"out-{layers}"
            for step, command in _commands(source, out, layers):
                rows.append(_repeated(step, command, layers, model_bytes, source, out, work))
                print(rows[-1], flush=True)
                if _kind(step) in CAPPED and "peak_need" in rows[-1]:
                    rows += _capped(step, command, layers, rows[-1]["seconds"], work)
            shutil.rmtree(source, ignore_errors=True)
    finally:
        if "HEADLAB_SCALE_DIR" not in os.environ:
            shutil.rmtree(work, ignore_errors=True)
    made = {row["layers"] for row in rows}
    kept = [row for row in kept if row["step"] != "make_shape" or row["layers"] not in made]
    return {"shape": SHAPE, "config": _sizes(shape), "rows": _ordered(kept + rows), "load": list(os.getloadavg()),
            "steps_run": list(CHOSEN), "depths_run": list(DEPTHS), "gemm_gflops": gemm_gflops()}  # fmt: skip


def _repeated(step: str, command: list[str], layers: int, model_bytes: int, source: Path, out: Path,
              work: Path) -> dict:  # fmt: skip
    """One command's row: a timed step (TIMED_STEPS) runs REPEATS times, each just after its own reference (this
    disk's rate drifts within minutes), and keeps the median seconds of each (`seconds_runs`, `paired_*_runs`: every
    run) and the largest peaks; any other step runs once."""
    reference = TIMED_STEPS.get(step)
    runs = []
    for _ in range(REPEATS if reference and _kind(step) in REPEATED else 1):
        run = {}
        if reference in CHOSEN:
            run[f"paired_{reference}"] = _timed(_reference(reference, source, out))["seconds"]
            _clean(work)
        runs.append({**run, **_timed(command, mapped_dir=work)})
        _clean(work)
    row = {"layers": layers, "step": step, "model_bytes": model_bytes, **runs[0]}
    if len(runs) > 1:
        for key in ("seconds", f"paired_{reference}"):
            if key in row:
                row[f"{key}_runs"] = [r[key] for r in runs]
                row[key] = statistics.median(row[f"{key}_runs"])
        for key in ("peak_rss", "peak_need"):
            if key in row:
                peak = max(runs, key=lambda r: r.get(key, 0))
                row.update({k: peak[k] for k in (key, "anonymous_at_peak", "checkpoint_pages_at_peak") if k in peak})
    return row


def _clean(work: Path) -> None:
    for leftover in work.glob("out-*"):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()


def _reference(kind: str, source: Path, out: Path) -> list[str]:
    """The plain operation on the checkpoint's bytes: copy (every byte read once and written once, nothing computed;
    the reference of what writes a checkpoint) or read (every byte read once, nothing written; the readers')."""
    if kind == "copy":
        return [sys.executable, "-c", "import shutil, sys; shutil.copytree(*sys.argv[1:])", str(source), str(out)]
    return ["sh", "-c", 'cat "$@" > /dev/null', "read", *map(str, sorted(source.glob("*.safetensors")))]


def _capped(step: str, command: list[str], layers: int, seconds: float, work: Path) -> list[dict]:
    """The reader again in a memory cgroup capped at each factor of CAP_FACTORS times the cost model's prediction
    (scripts/cost_model.py): finishing under 1.25x and failing under 0.75x puts what it needs within 25% of the
    prediction, with no reading of resident sets. A capped run that thrashes (re-reading evicted weights) is stopped
    at 3x the uncapped time plus a minute."""
    import cost_model

    predicted = cost_model.predicted_memory(_kind(step), layers)
    rows = []
    for factor in CAP_FACTORS:
        cap = int(factor * predicted)
        timed = _timed(command, mapped_dir=work, cap=cap, timeout=3 * seconds + 60)
        rows.append({"layers": layers, "step": f"{step}, capped at {factor:g}x", "predicted": predicted, **timed})
        print(rows[-1], flush=True)
        _clean(work)
    return rows


def gemm_gflops(repeats: int = 5) -> float:
    """Median float32 GFLOP/s of this process's torch threads on one MLP-sized product of the shape, [256, 4096] @
    [4096, 14336]: the compute rate of the time model's readers (float32 products, headlab.core.cpu_matmul)."""
    import statistics

    import torch

    x, w = torch.randn(256, 4096), torch.randn(14336, 4096)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return 2 * 256 * 4096 * 14336 / statistics.median(times) / 1e9


def _kind(step: str) -> str:
    """The HEADLAB_SCALE_STEPS name of a row's step ("convert-gqa --streaming 8 -> 4" -> "convert")."""
    command = step.split()[0].rstrip(",")
    kinds = {"convert-gqa": "convert", "expand-kv": "convert", "convert-mla": "mla", "export-gguf": "export"}
    return kinds.get(command, "make" if command == "make_shape" else command)


def _ordered(rows: list[dict]) -> list[dict]:
    order = ["make", *STEPS]
    return sorted(rows, key=lambda row: (row["layers"], order.index(_kind(row["step"]))))


def _commands(source: Path, out: Path, layers: int):
    """(step label, command) of the chosen steps at this depth; outputs go to `out` (deleted after each)."""
    deepest = layers == max(DEPTHS)
    for reference in ("copy", "read"):
        if reference in CHOSEN:
            yield f"{reference} (reference)", _reference(reference, source, out)
    if "convert" in CHOSEN:
        for kv in (4, 2, 1) if deepest else (4,):
            # at the deepest, the 4-head output stays (as kept-<layers>) for expand-kv to read back
            target = out.with_name(f"kept-{layers}") if kv == 4 and deepest else out
            yield f"convert-gqa --streaming 8 -> {kv}", _headlab("convert-gqa", "--model", str(source), "--streaming",
                                                                 "--kv-heads", str(kv), "--out", str(target))  # fmt: skip
            if target != out:
                yield "expand-kv --streaming 4 -> 8", _headlab("expand-kv", "--model", str(target), "--streaming",
                                                               "--kv-heads", "8", "--out", str(out))  # fmt: skip
                shutil.rmtree(target, ignore_errors=True)
    if "prune" in CHOSEN:
        yield "prune --streaming --mode physical", _headlab("prune", "--streaming", "--model", str(source), "--heads",
                                                            PRUNED_HEADS, "--mode", "physical", "--out", str(out))  # fmt: skip
    if "mla" in CHOSEN and deepest:  # a quarter of the GQA-8 cache: latent 448 + rope 64 numbers per token per layer
        yield "convert-mla --streaming 448+64", _headlab("convert-mla", "--streaming", "--model", str(source),
                                                         "--kv-lora-rank", "448", "--rope-dim", "64",
                                                         "--calibration-tokens", "256", "--seq-len", "256",
                                                         "--out", str(out))  # fmt: skip
    if "export" in CHOSEN:
        yield "export-gguf f16, offloaded", _headlab("export-gguf", "--model", str(source), *OFFLOAD, "--no-verify",
                                                     "--out", str(out) + ".gguf")  # fmt: skip
    if "info" in CHOSEN and deepest:
        yield "info", _headlab("info", "--model", str(source))
    if "eval" in CHOSEN:
        yield "eval, offloaded, 256 tokens", _headlab("eval", "--model", str(source), *OFFLOAD, *TOKENS,
                                                      "--domains", "none")  # fmt: skip
    if "stats" in CHOSEN and deepest:
        yield "stats, offloaded, 256 tokens", _headlab("stats", "--model", str(source), *OFFLOAD, *TOKENS,
                                                       "--out", str(out))  # fmt: skip
    if "importance" in CHOSEN:
        yield "importance, offloaded, 256 tokens", _headlab("importance", "--model", str(source), *OFFLOAD, *TOKENS,
                                                            "--out", str(out))  # fmt: skip


def _cold_runs(rows: list[dict], step: str) -> tuple[dict, list[dict]]:
    """The reference's seconds (TIMED_STEPS: a plain copy or read) by depth and `step`'s rows at those depths, by
    depth, of runs on a dropped page cache (flush included): one regime, so rows of older warm-cache runs never enter
    the model. The reference is the one timed just before the command (`paired_copy`, `paired_read`) where the run
    has it, else the depth's reference row."""
    kind = TIMED_STEPS[step]
    rows = [row for row in rows if row.get("cold") and "cap" not in row]
    plain = {row["layers"]: row["seconds"] for row in rows if _kind(row["step"]) == kind}
    paired = f"paired_{kind}"
    runs = sorted((row for row in rows if row["step"] == step and (paired in row or row["layers"] in plain)),
                  key=lambda r: r["layers"])  # fmt: skip
    return {row["layers"]: row.get(paired, plain.get(row["layers"])) for row in runs}, runs


def _fit(references: dict, runs: list[dict], kind: str) -> dict | None:
    """t(L) = t0 + a x reference(L) + c x L with two of the three unknowns solved from the two shallowest depths (the
    third fixed by the kind of command). A writer ("copy") moves the checkpoint through the disk and its time beyond
    t0 tracks the plain copy's: 2.4x, 1.9x and 2.1x the copy's seconds at 8, 16 and 32 layers (2026-12-04), disk time
    and not per-layer work, so c = 0 and a is fitted. A reader ("read") reads the checkpoint once and computes per
    layer: a = 1 and c is fitted. None without two depths (or two equal references, for a writer)."""
    if len(runs) < 2:
        return None
    (l1, t1, r1), (l2, t2, r2) = ((r["layers"], r["seconds"], references[r["layers"]]) for r in runs[:2])
    if kind == "copy":
        if abs(r2 - r1) < 1e-9:
            return None
        factor = (t2 - t1) / (r2 - r1)
        return {"fixed": t1 - factor * r1, "factor": factor, "per_layer": 0.0}
    per_layer = ((t2 - r2) - (t1 - r1)) / (l2 - l1)
    return {"fixed": t1 - r1 - per_layer * l1, "factor": 1.0, "per_layer": per_layer}


def time_fit(rows: list[dict], step: str) -> dict | None:
    """t0, a and c of `step`'s t(L) = t0 + a x reference(L) + c x L (`_fit`), solved from its two shallowest depths;
    None without two."""
    return _fit(*_cold_runs(rows, step), TIMED_STEPS[step])


def time_model(rows: list[dict]) -> list[dict]:
    """Predicted against measured seconds of the commands that move the checkpoint through: t(L) = t0 + a x
    reference(L) + c x L, with reference(L) the seconds of the plain copy (commands that write a checkpoint) or read
    (the readers) of the same bytes, timed just before the command (this disk's rate drifts within minutes), t0 the
    command's fixed cost (start-up, the embeddings' own work); a writer's a (its disk traffic in copies) or a
    reader's per-layer work c solved with t0 from the two shallowest depths (`_fit`); the deeper rows are
    predictions."""
    table = []
    for step, kind in TIMED_STEPS.items():
        references, runs = _cold_runs(rows, step)
        fit = _fit(references, runs, kind)
        if fit is None or len(runs) < 3:
            continue
        for i, row in enumerate(runs):
            predicted = fit["fixed"] + fit["factor"] * references[row["layers"]] + fit["per_layer"] * row["layers"]
            table.append({"step": step, "layers": row["layers"], "reference": kind,
                          "reference_seconds": references[row["layers"]], **fit, "predicted": predicted,
                          "measured": row["seconds"], "fitted": i < 2})  # fmt: skip
    return table


def _time_model(rows: list[dict]) -> list[str]:
    table = time_model(rows)
    if not table:
        return []
    lines = [
        "",
        "Time model: seconds = t0 + a x the reference's seconds at that depth (a plain copy of the checkpoint for "
        "what writes one, a plain read for the readers; timed just before the command, cold cache: the disk rate) + "
        "layers x c. Writers: c = 0, their time beyond t0 a multiple a of the copy's (disk traffic); readers: a = 1, "
        "c their per-layer work. The two unknowns are solved from the two shallowest depths; deeper rows are "
        "predictions.",
        "",
        "| command | layers | reference s | t0 s | a | c s/layer | predicted s | measured s | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        error = "(fitted)" if t["fitted"] else f"{t['predicted'] / t['measured'] - 1:+.0%}"
        lines.append(f"| `{t['step']}` | {t['layers']} | {t['reference']} {t['reference_seconds']:.0f} | "
                     f"{t['fixed']:.1f} | {t['factor']:.2f} | {t['per_layer']:.2f} | {t['predicted']:.0f} | "
                     f"{t['measured']:.0f} | {error} |")  # fmt: skip
    return lines


def _sizes(shape: dict) -> dict:
    """Bytes (bf16) of one decoder layer and of the embedding matrix of the shape (headlab.core.shapes.SHAPES)."""
    C, H, G, D, I, V = (shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "intermediate_size", "vocab_size"))  # fmt: skip
    layer = 2 * C * H * D + 2 * C * G * D + 3 * C * I + 2 * C  # q, o; k, v; gate, up, down; two norms
    return {"layer_bytes": 2 * layer, "embedding_bytes": 2 * V * C, "hidden": C, "heads": H, "kv_heads": G}


def markdown(r: dict) -> str:
    sizes = r["config"]
    layer, embed = sizes["layer_bytes"], sizes["embedding_bytes"]
    limit = 2 * (layer + embed)
    gib = 2**30
    lines = [
        f"Random-weight {r['shape']} shape (bf16 on disk, `scripts/make_shape.py`; {sizes['heads']} query and "
        f"{sizes['kv_heads']} KV heads, hidden {sizes['hidden']}) on this 2-core, 24 GiB machine (load averages "
        f"{', '.join(f'{x:.1f}' for x in r['load'])} at the end). One decoder layer is {layer / gib:.2f} GiB, the "
        f"embedding matrix {embed / gib:.2f} GiB (the untied lm_head as much again); the goal's limit, 2 x (one layer "
        f"+ the embeddings), is {limit / gib:.2f} GiB. Each command is a fresh process; peak RSS is GNU time's maximum "
        "resident set (file pages of memory-mapped safetensors included); a row run several times (HEADLAB_SCALE_REPEATS) "
        "gives the median seconds, each run after its own reference, and its largest peaks.",
        "",
        "| layers | command | model on disk | wall s | peak RSS | less the mapped checkpoint | within the limit |",
        "|---|---|---|---|---|---|---|",
    ]
    capped = []
    for row in r["rows"]:
        if "cap" in row:
            capped.append(row)
            continue
        size = f"{row['model_bytes'] / gib:.1f} GiB" if "model_bytes" in row else ""
        ok = "yes" if row["peak_rss"] <= limit else "no"
        if row["step"] == "make_shape":  # the benchmark's own generator (one 2 GiB shard), not an editing command
            ok = "(the generator)"
        elif _kind(row["step"]) in ("copy", "read"):
            ok = "(the disk-rate reference)"
        elif _kind(row["step"]) in READERS:  # the goal's limit is for commands that edit weights
            ok = "(reads; no limit set)"
        need = f"{row['peak_need'] / gib:.2f} GiB" if "peak_need" in row else ""
        runs = row.get("seconds_runs", [])
        wall = f"{row['seconds']:.0f}" + (f" (median of {', '.join(f'{x:.0f}' for x in runs)})" if runs else "")
        lines.append(
            f"| {row['layers']} | `{row['step']}` | {size} | {wall} | {row['peak_rss'] / gib:.2f} GiB | {need} | {ok} |"
        )
    lines.append(
        "\nThe sampled column (every 0.5 s, from /proc/<pid>/smaps; empty for rows of older runs) is the resident "
        "set less the pages mapped from the checkpoint's files: clean file pages, which the kernel drops whenever "
        "it needs the memory, so no part of what the command needs."
    )
    if capped:
        lines += [
            "",
            "The readers again, each in a memory cgroup capped at a multiple of the cost model's prediction "
            "(`scripts/cost_model.py`; page cache charged to the group and reclaimed under the cap; a run that "
            "thrashes is stopped at 3x the uncapped time plus a minute):",
            "",
            "| layers | command | predicted | cap | outcome | wall s |",
            "|---|---|---|---|---|---|",
        ]
        for row in capped:
            lines.append(f"| {row['layers']} | `{row['step']}` | {row['predicted'] / gib:.2f} GiB | "
                         f"{row['cap'] / gib:.2f} GiB | {row['outcome']} | {row['seconds']:.0f} |")  # fmt: skip
    if r.get("steps_run") and set(r["steps_run"]) != set(STEPS) or r.get("depths_run", list(DEPTHS)) != list(DEPTHS):
        depths = ", ".join(str(d) for d in r.get("depths_run", DEPTHS))
        lines.append(f"\nThe last run measured the steps {', '.join(r['steps_run'])} at {depths} layers; the other "
                     "rows are carried over from earlier runs (HEADLAB_SCALE_STEPS, HEADLAB_SCALE_LAYERS).")  # fmt: skip
    lines += _time_model(r["rows"])
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(None), indent=2))
