"""Real shapes on this machine: random-weight Llama-3.1-8B-shaped checkpoints (bf16, `scripts/make_shape.py`) at 8,
16 and 32 layers, and the streaming commands that edit them (`convert-gqa --streaming` 8 -> 4 KV heads at every
depth; 8 -> 2 and 8 -> 1, and `expand-kv --streaming` 4 -> 8, at 32 layers), each a fresh process timed as a whole
with its peak resident set (GNU time's maximum RSS), against the bytes of one decoder layer and of the embeddings.
Outputs are deleted after each command; set HEADLAB_SCALE_DIR to a disk with about 50 GB free."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TITLE = "Real shapes: the 8B-shaped checkpoint on this machine (`convert-gqa --streaming`, `expand-kv --streaming`)"
SHAPE = "llama-3.1-8b"
DEPTHS = tuple(int(x) for x in os.environ.get("HEADLAB_SCALE_LAYERS", "8,16,32").split(","))
ROOT = Path(__file__).resolve().parents[2]


def _timed(command: list[str]) -> dict:
    """Wall seconds and peak RSS (bytes) of one command as a fresh process (GNU time -f '%e %M')."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%e %M", *command], capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        seconds, kilobytes = report.read().split()[-2:]
    return {"command": " ".join(command), "seconds": float(seconds), "wall": wall, "peak_rss": int(kilobytes) * 1024}


def _headlab(*args: str) -> list[str]:
    return [sys.executable, "-m", "headlab", *args]


def run(args) -> dict:
    from headlab.core.shapes import SHAPES

    shape = SHAPES[SHAPE]
    work = Path(os.environ.get("HEADLAB_SCALE_DIR") or tempfile.mkdtemp(prefix="headlab-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for layers in DEPTHS:
            source, out = work / f"src-{layers}", work / f"out-{layers}"
            make = [sys.executable, str(ROOT / "scripts" / "make_shape.py"), SHAPE, "--layers", str(layers),
                    "--out", str(source), "--overwrite"]  # fmt: skip
            rows.append({"layers": layers, "step": "make_shape", **_timed(make)})
            print(rows[-1], flush=True)
            files = sorted(source.glob("*.safetensors"))
            model_bytes = sum(p.stat().st_size for p in files)
            kv_counts = (4, 2, 1) if layers == max(DEPTHS) else (4,)
            for kv in kv_counts:
                convert = _headlab("convert-gqa", "--model", str(source), "--streaming", "--kv-heads", str(kv),
                                   "--out", str(out), "--overwrite")  # fmt: skip
                rows.append({"layers": layers, "step": f"convert-gqa --streaming 8 -> {kv}", "model_bytes": model_bytes,
                             **_timed(convert)})  # fmt: skip
                print(rows[-1], flush=True)
                if kv == 4 and layers == max(DEPTHS):
                    back = work / "expanded"
                    expand = _headlab("expand-kv", "--model", str(out), "--streaming", "--kv-heads", "8",
                                      "--out", str(back), "--overwrite")  # fmt: skip
                    rows.append({"layers": layers, "step": "expand-kv --streaming 4 -> 8", **_timed(expand)})
                    print(rows[-1], flush=True)
                    shutil.rmtree(back, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(source, ignore_errors=True)
    finally:
        if "HEADLAB_SCALE_DIR" not in os.environ:
            shutil.rmtree(work, ignore_errors=True)
    return {"shape": SHAPE, "config": _sizes(shape), "rows": rows, "load": list(os.getloadavg())}


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
        "resident set (file pages of memory-mapped safetensors included).",
        "",
        "| layers | command | model on disk | wall s | peak RSS | within the limit |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        size = f"{row['model_bytes'] / gib:.1f} GiB" if "model_bytes" in row else ""
        ok = "yes" if row["peak_rss"] <= limit else "no"
        if row["step"] == "make_shape":  # the benchmark's own generator (one 2 GiB shard), not an editing command
            ok = "(the generator)"
        lines.append(
            f"| {row['layers']} | `{row['step']}` | {size} | {row['seconds']:.0f} | {row['peak_rss'] / gib:.2f} GiB | "
            f"{ok} |"
        )
    converts = [row for row in r["rows"] if row["step"] == "convert-gqa --streaming 8 -> 4"]
    if len(converts) > 1:
        per_layer = ", ".join(f"{row['layers']}: {row['seconds'] / row['layers']:.1f} s" for row in converts)
        lines.append(f"\n`convert-gqa --streaming 8 -> 4` seconds per layer (linear time is a constant): {per_layer}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(None), indent=2))
