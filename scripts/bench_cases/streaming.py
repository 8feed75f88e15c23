"""Layer-by-layer conversion: peak memory of `convert-gqa --streaming` against the in-memory `convert-gqa` (load,
pool, save, verify by reloading) on the embedded model, each in a fresh subprocess; both outputs compared tensor
for tensor."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

TITLE = "Layer-by-layer KV conversion (`convert-gqa --streaming`) against the in-memory conversion"
KV_HEADS = 1
SHARD_BYTES = 64 * 2**20
DEEP_LAYERS = 120  # about 4x the embedded model's parameters
GLIBC_RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _anonymous_rss() -> int:
    """Anonymous resident memory (RssAnon): what the process allocated, without the file pages that reading a
    memory-mapped safetensors file maps in (the kernel can drop those at will)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _build_deep(path: str, layers: int) -> None:
    """A random checkpoint with the embedded model's config but `layers` blocks (a larger model of the same shape)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from headlab.core.loading import embedded_checkpoint

    config = AutoConfig.from_pretrained(embedded_checkpoint())
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_checkpoint()).save_pretrained(path)  # load_model wants one
    print(json.dumps({"layers": layers}))


def _child(mode: str, source: str, out: str) -> None:
    import torch
    from benchmark import PeakMemory

    source = Path(source)

    class AnonymousPeak(PeakMemory):
        rss = staticmethod(_anonymous_rss)

    with PeakMemory(torch.device("cpu")) as resident, AnonymousPeak(torch.device("cpu")) as anonymous:
        start = time.perf_counter()
        if mode == "in_memory":
            from headlab.core.loading import load_model
            from headlab.kv.gqa import convert_checkpoint

            convert_checkpoint(load_model(str(source), device="cpu"), KV_HEADS, out, evaluate=False, progress=False)
        else:
            from headlab.kv.streaming import convert_streaming

            convert_streaming(source, KV_HEADS, out, max_shard_bytes=SHARD_BYTES, progress=False)
        seconds = time.perf_counter() - start
    model_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    print(
        json.dumps({"seconds": seconds, "growth": resident.extra, "anon": anonymous.extra, "model_bytes": model_bytes})
    )


def _measure(mode: str, source: Path, out: Path, env: dict | None = None) -> dict:
    from benchmark import in_fresh_process

    return in_fresh_process("streaming", f"_child({mode!r}, {str(source)!r}, {str(out)!r})", env)


def _identical(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    from headlab.core.streaming import checkpoint_files

    def tensors(directory):
        found = {}
        for name in checkpoint_files(directory):
            with safe_open(str(directory / name), "pt") as handle:
                found.update({k: handle.get_tensor(k) for k in handle.keys()})
        return found

    x, y = tensors(a), tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(args) -> dict:
    from benchmark import in_fresh_process

    from headlab.core.loading import embedded_checkpoint

    models = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        in_fresh_process("streaming", f"_build_deep({str(tmp / 'deep')!r}, {DEEP_LAYERS})")
        for name, source in (
            ("embedded (30 layers)", embedded_checkpoint()),
            (f"deep ({DEEP_LAYERS} layers)", tmp / "deep"),
        ):
            runs = {mode: _measure(mode, source, tmp / f"{mode}-out") for mode in ("in_memory", "streaming")}
            identical = _identical(tmp / "in_memory-out", tmp / "streaming-out")
            for mode in runs:
                shutil.rmtree(tmp / f"{mode}-out")
            # glibc keeps freed heap memory for reuse; with every tensor-sized block mmapped, it goes back at once,
            # which separates live data from allocator retention.
            runs["streaming_mmap"] = _measure("streaming", source, tmp / "mmap-out", GLIBC_RETURN_FREED)
            shutil.rmtree(tmp / "mmap-out")
            ratio = runs["streaming"]["growth"] / runs["in_memory"]["growth"]
            models.append({"model": name, "runs": runs, "identical": identical, "memory_ratio": ratio})
    return {"kv_heads": KV_HEADS, "shard_bytes": SHARD_BYTES, "models": models}


def markdown(r: dict) -> str:
    mib = 2**20
    rows = []
    for entry in r["models"]:
        m, s = entry["runs"]["in_memory"], entry["runs"]["streaming"]
        size = f"{entry['model']}, {m['model_bytes'] / mib:,.0f} MiB"
        rows += [
            f"| {size} | in memory | {m['growth'] / mib:,.0f} | {m['growth'] / m['model_bytes']:.2f} | "
            f"{m['anon'] / mib:,.0f} | {m['seconds']:.1f} | |",
            f"| {size} | `--streaming` | {s['growth'] / mib:,.0f} | {s['growth'] / s['model_bytes']:.2f} | "
            f"{s['anon'] / mib:,.0f} | {s['seconds']:.1f} | {entry['identical']} |",
        ]
        g = entry["runs"].get("streaming_mmap")
        if g:
            rows.append(
                f"| {size} | `--streaming`, `MALLOC_MMAP_THRESHOLD_=65536` | {g['growth'] / mib:,.0f} | "
                f"{g['growth'] / g['model_bytes']:.2f} | {g['anon'] / mib:,.0f} | {g['seconds']:.1f} | |"
            )
    ratios = ", ".join(f"{e['memory_ratio']:.2f}x" for e in r["models"])
    return "\n".join(
        [
            f"The embedded model and a random model of its shape with {DEEP_LAYERS} layers (float32 safetensors), 3 -> "
            f"{r['kv_heads']} KV heads (mean pooling), each conversion in a fresh process, measured once. In memory: "
            "`convert-gqa --no-eval` (load, pool, save, reload check); streaming: `convert-gqa --streaming "
            f"--max-shard-size {r['shard_bytes'] // mib}MiB`. Memory is the peak growth of the resident set (sampled "
            "every millisecond) over the process before the conversion, and of its anonymous part (RssAnon): "
            "transformers maps safetensors files into memory, so a loaded model is mostly file pages.",
            "",
            "| model | conversion | peak resident growth (MiB) | x model size | of which anonymous (MiB) | seconds | "
            "tensors identical to in memory |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Streaming / in memory: **{ratios}**. The streaming conversion holds one output shard plus one attention "
            "layer (or the largest single tensor: here the 113 MiB embedding matrix, above the 64 MiB shard size). "
            "Its peak still grows a little with the model because glibc keeps freed heap blocks for reuse; with "
            "`MALLOC_MMAP_THRESHOLD_=65536` (every tensor-sized block mmapped and returned when freed) the anonymous "
            "peak is about that live data, the same for both sizes. The in-memory path holds the model and, while "
            "checking the saved files, a reloaded copy: 2.3-2.7x the model.",
        ]
    )
