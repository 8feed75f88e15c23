"""Peak resident memory of `prune` (physical, 90 heads, uniform), `convert-gqa` (in memory) and `importance` on the
embedded model, as a multiple of the model's parameter bytes: /usr/bin/time's maximum resident set size of each
command, run with this checkout's code and with a reference checkout (HEADLAB_MEMORY_BEFORE, default /work/main)
in the same run."""

from __future__ import annotations

TITLE = "Peak memory: prune, convert-gqa and importance against the model's bytes"
GOAL = 2.5
COMMANDS = {
    "prune": [
        "prune",
        "--count",
        "90",
        "--uniform",
        "--mode",
        "physical",
        "--calibration-tokens",
        "1024",
        "--max-tokens",
        "512",
        "--out",
        "{out}",
    ],
    "convert-gqa": ["convert-gqa", "--kv-heads", "1", "--max-tokens", "512", "--out", "{out}"],
    "importance": ["importance", "--max-tokens", "1024", "--out", "{out}"],
}


REPEATS = 3  # each command runs this often per checkout: the resident file pages vary between runs (page cache)


def _peak_rss(root: str, argv: list[str]) -> tuple[int, int, float]:
    """Peak resident set size, peak anonymous part (bytes) and wall seconds of `headlab ARGV` run with the code under
    `root`, sampled from /proc every 5 ms. A loaded model is mostly file pages (transformers maps the safetensors
    file), which the kernel may or may not keep resident; the anonymous part is what the process itself allocated."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="headlab-memory-") as tmp:
        args = [a.replace("{out}", os.path.join(tmp, "out")) for a in argv]
        env = {**os.environ, "PYTHONPATH": root, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
        code = "import sys; from headlab.cli import main; main(sys.argv[1:])"
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        peak = anon = 0
        while proc.poll() is None:
            try:
                status = open(f"/proc/{proc.pid}/status").read()
                peak = max(peak, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024)
                anon = max(anon, int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) * 1024)
            except (OSError, AttributeError):
                pass  # the process is exiting
            time.sleep(0.005)
        stderr = proc.stderr.read()
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"headlab {' '.join(args)} failed: {stderr[-2000:]}")
    return peak, anon, seconds


def run(args) -> dict:
    import os
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from headlab.core.loading import embedded_checkpoint
    from headlab.core.reload_stream import model_bytes

    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint())
    size = model_bytes(model)
    del model
    here = str(Path(__file__).resolve().parents[2])
    before = os.environ.get("HEADLAB_MEMORY_BEFORE", "/work/main")
    rows = []
    for name, argv in COMMANDS.items():
        for label, root in (("before", before), ("after", here)):
            if label == "before" and not Path(root, "headlab").is_dir():
                continue
            runs = [_peak_rss(root, argv) for _ in range(REPEATS)]
            peaks = sorted(r[0] for r in runs)
            row = {
                "command": name,
                "code": label,
                "peak_rss": peaks[len(peaks) // 2],
                "ratio": peaks[len(peaks) // 2] / size,
            }
            row.update(
                max_ratio=peaks[-1] / size, min_ratio=peaks[0] / size, anon=sorted(r[1] for r in runs)[len(runs) // 2]
            )
            row["seconds"] = sorted(r[2] for r in runs)[len(runs) // 2]
            rows.append(row)
    return {"model_bytes": size, "goal": GOAL, "rows": rows, "commands": {k: " ".join(v) for k, v in COMMANDS.items()}}


def markdown(result: dict) -> str:
    mib = 2**20
    lines = [
        f"Model: embedded SmolLM2-135M, {result['model_bytes'] / mib:.0f} MiB of float32 parameters. Peak = "
        "the kernel's high-water mark of the resident set (VmHWM) of the whole command (Python, torch and transformers "
        f"included), median of {REPEATS} runs with their range; anonymous = the peak of its RssAnon part (what the process "
        "allocated, as opposed to the model's mapped file pages). "
        f"goal <= {result['goal']}x. `before` = the reference checkout, `after` = this branch, same run, "
        "on a CPU machine shared with other jobs (seconds are indicative only).",
        "",
        "| command | code | peak RSS (median) | x model bytes | range | peak anonymous | seconds |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['command']} | {row['code']} | {row['peak_rss'] / mib:,.0f} MiB | {row['ratio']:.2f}x | "
            f"{row.get('min_ratio', row['ratio']):.2f}-{row.get('max_ratio', row['ratio']):.2f}x | "
            f"{row.get('anon', 0) / mib:,.0f} MiB | {row['seconds']:.0f} |"
        )
    if not any(row["code"] == "before" for row in result["rows"]):
        lines += [
            "",
            "No `before` rows: the reference checkout was not run in this measurement (set HEADLAB_MEMORY_BEFORE to "
            "a checkout of the previous code to add them). The issue measured the previous code's `prune --count 90 "
            "--uniform --mode physical` at 2.85 GiB resident, 5.7x the model's bytes.",
        ]
    lines += ["", "Commands (`headlab ...`, `{out}` a temporary directory):", ""]
    lines += [f"- {name}: `{command}`" for name, command in result["commands"].items()]
    return "\n".join(lines)
