"""16-bit models on this CPU: torch's own bfloat16 kernels against headlab's float32 products
(headlab.core.cpu_matmul), in the same run, with the float32 model as the quality reference. The embedded model
loaded with `--dtype bfloat16`: `eval` on 512 eval-split tokens and `importance` on 128 calibration tokens, each a
fresh process timed as a whole (start-up included), under HEADLAB_CPU_MATMUL=native and =float32."""

from __future__ import annotations

TITLE = "16-bit models on a CPU without bfloat16 kernels: torch's kernels against float32 products"
MODES = {  # label -> (--dtype, HEADLAB_CPU_MATMUL)
    "float32 model": ("float32", "native"),
    "bfloat16, torch's kernels": ("bfloat16", "native"),
    "bfloat16, float32 products": ("bfloat16", "float32"),
}
COMMANDS = {
    "eval": ["eval", "--max-tokens", "512", "--seq-len", "256", "--domains", "none", "--json"],
    "importance": ["importance", "--max-tokens", "128", "--seq-len", "128", "--batch-size", "1", "--out", "{out}"],
}


def _run(argv: list[str], dtype: str, products: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import time

    import pandas as pd

    with tempfile.TemporaryDirectory(prefix="headlab-cpu-half-") as tmp:
        out = os.path.join(tmp, "out")
        args = [a.replace("{out}", out) for a in argv] + ["--dtype", dtype]
        env = {**os.environ, "HEADLAB_CPU_MATMUL": products, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"headlab {' '.join(args)} failed: {done.stderr[-2000:]}")
        if "--json" in args:
            return {"seconds": seconds, "perplexity": json.loads(done.stdout)["perplexity"]}
        table = pd.read_csv(os.path.join(out, "importance.csv"))
        return {"seconds": seconds, "scores": table["importance"].tolist()}


def run(args) -> dict:
    rows = []
    for command, argv in COMMANDS.items():
        for label, (dtype, products) in MODES.items():
            rows.append({"command": command, "mode": label, **_run(argv, dtype, products)})
            print({k: v for k, v in rows[-1].items() if k != "scores"}, flush=True)
    return {"rows": rows}


def markdown(r: dict) -> str:
    from scipy.stats import spearmanr

    lines = [
        "The embedded model (SmolLM2-135M) on this AVX2 CPU, 2 torch threads; each command a fresh process, start-up "
        "included (one run each: the bfloat16 kernels take minutes). `eval`: 512 eval-split tokens, seq-len 256; "
        "`importance`: 128 calibration tokens, one window. Quality against the float32 model: perplexity, and the "
        "Spearman correlation of the 270 head scores.",
        "",
        "| command | mode | seconds | vs. torch's bfloat16 kernels | perplexity | Spearman vs float32 |",
        "|---|---|---|---|---|---|",
    ]
    for command in COMMANDS:
        rows = {row["mode"]: row for row in r["rows"] if row["command"] == command}
        native = rows["bfloat16, torch's kernels"]["seconds"]
        reference = rows["float32 model"]
        for mode, row in rows.items():
            ppl = f"{row['perplexity']:.3f}" if "perplexity" in row else ""
            rho = ""
            if "scores" in row and mode != "float32 model":
                rho = f"{spearmanr(row['scores'], reference['scores']).statistic:.4f}"
            lines.append(f"| {command} | {mode} | {row['seconds']:.1f} | {native / row['seconds']:.2f}x | {ppl} | "
                         f"{rho} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    print(json.dumps(run(None), indent=2))
