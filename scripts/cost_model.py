#!/usr/bin/env python
"""The cost model of docs/scaling.md: peak memory and time of headlab's commands from 135M to 405B, as formulas over
a model's shape and a machine's rates, checked against every point the benchmarks measured.

    python scripts/cost_model.py            # markdown: measured points against predictions, then 8B / 70B / 405B

Rates and fitted constants come from the saved benchmark results (benchmarks/results/scale.json: the 8B-shaped
runs with a plain copy and read of the checkpoint and a float32 GEMM rate, measured in the same run;
benchmarks/results/memory.json: the embedded model in memory). Hardware the project has not measured (an H200
node's disk, the GPU's achieved FLOP rate) enters as a stated assumption, named in the output.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# headlab itself first; scripts/ (benchmark's saved results) last, so none of its names shadows an installed package.
# The scale case is loaded by path (_scale_case): bench_cases/ holds modules named gguf, eval, memory, ...
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "scripts"))


def _scale_case():
    """scripts/bench_cases/scale.py as a module (once), without putting bench_cases/ on sys.path."""
    import importlib.util

    if "headlab_bench_case_scale" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "headlab_bench_case_scale", ROOT / "scripts" / "bench_cases" / "scale.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["headlab_bench_case_scale"]


GIB = 2**30
R0 = 0.48 * GIB  # Python, torch, transformers and headlab: the peak of the same commands on a tiny model
BF16 = 2
# Assumptions for hardware not measured here (stated wherever they are used):
H200_BYTES = 139 * GIB  # the device tool's H200 (about 139 GiB usable)
H200_FLOPS = 989e12  # dense bf16 peak of an H200 (NVIDIA's datasheet, without sparsity)
GPU_EFFICIENCY = 0.35  # achieved share of that peak for transformers' forward/backward (assumed, not measured)
NODE_DISK = 2e9  # bytes/s an H200 node reads and writes its checkpoint disk at (assumed NVMe)
HOST_BYTES = 24 * GIB  # this machine
# export-gguf converts and encodes a matrix a block of rows at a time, written as it goes
# (headlab.runtimes.gguf_export.ENCODE_BLOCK_BYTES of float32 rows, and their f16 encoding: half as much again)
EXPORT_BLOCK = 1.5 * 64 * 2**20
# A 16-bit weight's float32 row block that a CPU product upcasts at a time (headlab.core.cpu_matmul.BLOCK_ELEMENTS)
UPCAST_BLOCK = 4 * 2**24
# What importance's recomputing backward keeps per decoder block, in float32 hidden states (T x C x 4 bytes each):
# measured, not derived. The anonymous memory after each block's forward rose 9.5 MiB a block at T = 256 and
# C = 4,096 (32 layers of the 8B shape, 2026-12-06: 404 -> 699 MiB over 31 blocks; docs/scaling.md).
KEPT_PER_BLOCK = 2.4


@dataclass(frozen=True)
class Shape:
    """Sizes of a decoder-only model with untied embeddings (Llama-3.1 layout)."""

    name: str
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def layer_parameters(self) -> int:
        C, D = self.hidden, self.head_dim
        return 2 * C * self.heads * D + 2 * C * self.kv_heads * D + 3 * C * self.mlp + 2 * C

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:  # embeddings and the untied LM head, the layers, the final norm
        return 2 * self.embedding_parameters + self.layers * self.layer_parameters + self.hidden

    @property
    def attention_parameters(self) -> int:  # what uptraining trains by default (--train attention)
        C, D = self.hidden, self.head_dim
        return self.layers * (2 * C * self.heads * D + 2 * C * self.kv_heads * D)

    def matmul_parameters(self) -> int:
        """Parameters a token multiplies through (everything but the input embedding's lookup)."""
        return self.parameters - self.embedding_parameters


def shape(name: str, layers: int | None = None) -> Shape:
    from headlab.core.shapes import SHAPES

    s = SHAPES[name]
    return Shape(name, layers or s["num_hidden_layers"], s["hidden_size"], s["intermediate_size"],
                 s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], s["vocab_size"])  # fmt: skip


# ---- memory (bytes): four kinds of command --------------------------------------------------------------------------


def memory_in_memory(weights_file: float, converted: float, rows: int, seq_len: int, vocab: int) -> float:
    """R0 + W_file + W_converted + 2 x logits: the checkpoint's mapped pages (transformers 5 makes parameters views of
    them when the load keeps the stored dtype), a converted copy when --dtype differs, and the largest pass tensors,
    the float32 logits of one batch and their log-softmax or gradient."""
    return R0 + weights_file + converted + 2 * rows * seq_len * vocab * 4


def memory_streaming(s: Shape) -> float:
    """R0 + E: one tensor the size of the embedding matrix at a time (read, edited, written)."""
    return R0 + s.embedding_parameters * BF16


def memory_offloaded(s: Shape, max_memory: float, *, export: bool = False, unembedding: bool = False) -> float:
    """R0 + M + E (+ one encoded block of rows for export-gguf, which writes each matrix as it encodes it; + E for
    stats' unembedding beside the embedding in its OV-circuit scores): the commands that hold the embedding matrix
    whole (the export encodes it, stats computes with it). `eval` and `importance` do not: memory_offloaded_reader."""
    E = s.embedding_parameters * BF16
    extra = (E if unembedding else 0) + (EXPORT_BLOCK if export else 0)
    return R0 + max_memory + E + extra


def memory_offloaded_reader(s: Shape, max_memory: float, *, gradient: bool = False, tokens: int = 256) -> float:
    """R0 + M + U + k x T x V x 4 (+ L x KEPT_PER_BLOCK x T x C x 4 for a gradient pass): what `eval` and `importance`
    need with the blocks offloaded beyond M. Offloaded weights, the embedding and LM head included, are read through
    the checkpoint's mapped pages, which the kernel reclaims under pressure, so no weight enters; a CPU product of
    16-bit weights upcasts one float32 row block at a time (U); the pass holds the float32 logits and their
    log-softmax (k = 2), and a gradient pass their gradient too (k = 3) and what its recomputing backward keeps of
    every block. (This machine's offloaded runs; a GPU's readers are time_gpu_reader's.)"""
    logits = (3 if gradient else 2) * tokens * s.vocab * 4
    kept = s.layers * KEPT_PER_BLOCK * tokens * s.hidden * 4 if gradient else 0
    return R0 + max_memory + UPCAST_BLOCK + logits + kept


def memory_uptrain(s: Shape, processes: int = 1) -> dict[str, float]:
    """Per device: training (W_student + W_teacher + 6 T) / N plus one gathered layer under FSDP. The load: one
    process loads student and teacher whole onto its device (2W); under `--parallel fsdp` from safetensors
    checkpoints every rank reads its own rows of each tensor straight into its shards (2W / N, nothing whole in
    transit), and the trained student comes back whole to rank 0's host for saving (W, `host`; the teacher, unchanged,
    is not gathered)."""
    W = s.parameters * BF16
    T = s.attention_parameters
    training = (2 * W + 6 * T) / processes + (s.layer_parameters * BF16 if processes > 1 else 0)
    load = 2 * W / processes
    return {"training": training, "load": load, "peak": max(training, load), "host": W if processes > 1 else 0}


# ---- time (seconds) -------------------------------------------------------------------------------------------------


def time_through(s: Shape, rate: float, fixed: float, per_layer_byte: float, factor: float = 1.0) -> float:
    """t0 + a x W / rate + c x (layer bytes x L): the checkpoint's plain reference at its rate (a copy for what
    writes a checkpoint, a read for the readers) taken a times (a writer's disk traffic in copies; 1 for a reader),
    the command's fixed cost, and its per-layer work (computing, converting, re-reading; 0 for a writer) in proportion
    to the layer's bytes."""
    W = s.parameters * BF16
    return fixed + factor * W / rate + per_layer_byte * s.layer_parameters * BF16 * s.layers


def reader_flops(s: Shape, tokens: int, command: str) -> float:
    """2 N T for a forward pass (N the parameters a token multiplies through); importance's recomputing pass runs
    the forward twice and the input-gradient backward once (frozen weights: 2 N T), 6 N T in all."""
    passes = {"eval": 1, "stats": 1, "importance": 3}[command]
    return passes * 2 * s.matmul_parameters() * tokens


def time_gpu_reader(s: Shape, tokens: int, command: str, gpus: int = 1) -> float:
    """Load (the checkpoint read once per node at NODE_DISK) + FLOPs / (gpus x H200_FLOPS x GPU_EFFICIENCY)."""
    return s.parameters * BF16 / NODE_DISK + reader_flops(s, tokens, command) / (gpus * H200_FLOPS * GPU_EFFICIENCY)


def time_uptrain_step(s: Shape, tokens: int, gpus: int, flops: float) -> float:
    """Teacher forward 2NT, student forward 2NT, student backward: input gradients 2NT plus the trained (attention)
    weights' gradients 2 N_attn T; at `flops` per second per device over `gpus` devices."""
    N, A = s.matmul_parameters(), s.attention_parameters
    return (6 * N + 2 * A) * tokens / (gpus * flops)


# ---- the saved measurements -----------------------------------------------------------------------------------------


def rates(scale: dict) -> dict:
    """Copy and read rates (bytes/s) of the deepest depth measured, the float32 GEMM rate, and each timed command's
    fitted fixed cost and per-layer-byte cost (the scale case's time model) with the rate of its own reference at the
    deepest depth (`rate`: the copy or read timed just before it; this disk's rate differs severalfold between
    references minutes apart, so a prediction for the deepest shape uses the one its measurement was paired with)."""
    case = _scale_case()

    rows = scale["rows"]
    deepest = max(row["layers"] for row in rows if row["step"] == "copy (reference)")
    by = {(row["layers"], row["step"]): row for row in rows}
    copy = by[(deepest, "copy (reference)")]
    read = by.get((deepest, "read (reference)"))
    reference_rates = {"copy": copy["model_bytes"] / copy["seconds"],
                       "read": read["model_bytes"] / read["seconds"] if read else None}  # fmt: skip
    layer_bytes = scale["config"]["layer_bytes"]
    fits = {}
    for step in case.TIMED_STEPS:
        fit = case.time_fit(rows, step)
        if fit is not None:
            kind = case.TIMED_STEPS[step]
            paired = by.get((deepest, step), {}).get(f"paired_{kind}")
            rate = by[(deepest, step)]["model_bytes"] / paired if paired else reference_rates[kind]
            fits[step] = {"fixed": fit["fixed"], "per_layer_byte": fit["per_layer"] / layer_bytes,
                          "per_layer": fit["per_layer"], "factor": fit["factor"], "rate": rate}  # fmt: skip
    return {**reference_rates, "gemm": scale.get("gemm_gflops", 0) * 1e9, "fits": fits, "deepest": deepest}


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


def _seconds(x: float) -> str:
    if x < 120:
        return f"{x:,.0f} s"
    if x < 2 * 3600:
        return f"{x / 60:,.0f} min"
    return f"{x / 3600:,.1f} h"


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}"


def predicted_memory(kind: str, layers: int, offload: float = 64e6) -> float | None:
    """The formula's peak for a scale-case row (its step's kind, `scale._kind`) at the 8B shape with `layers` layers;
    None for the references and the generator."""
    s = shape("llama-3.1-8b", layers)
    if kind in ("convert", "prune"):
        return memory_streaming(s)
    if kind == "export":
        return memory_offloaded(s, offload, export=True)
    if kind == "stats":
        return memory_offloaded(s, offload, unembedding=True)
    if kind in ("eval", "importance"):
        return memory_offloaded_reader(s, offload, gradient=kind == "importance")
    if kind == "mla":
        return memory_offloaded(s, GIB)  # its calibration pass offloads beyond 1 GiB
    return None


def _bracket(capped: list[dict]) -> tuple[str, str, str] | None:
    """(measured, predicted, verdict) from a reader's runs in memory cgroups (the scale case's `_capped`): what it
    needs lies above the largest cap it was killed under and at most the smallest cap it finished under; finishing
    under 0.75x and failing under 1.25x the prediction bracket it within 25%. None without capped runs. (A resident
    set is no measure of the need here: it counts mapped checkpoint pages that the kernel can reclaim.)"""
    finished = [row for row in capped if row.get("outcome") == "finished"]
    failed = [row for row in capped if row.get("outcome") not in ("finished", None) and "cgroup" not in row["outcome"]]
    if not finished and not failed:
        return None
    predicted = capped[0]["predicted"]
    low = max(failed, key=lambda r: r["cap"]) if failed else None
    high = min(finished, key=lambda r: r["cap"]) if finished else None
    below = round(low["cap"] / predicted, 3) if low else None  # the caps' factors
    above = round(high["cap"] / predicted, 3) if high else None
    parts = [f"more than {_gib(low['cap'])} ({low['outcome']} under {below:g}x)"] if low else []
    parts += [f"at most {_gib(high['cap'])} (finished under {above:g}x)"] if high else []
    if above is not None and above <= 0.75:  # needs at most 0.75x: the prediction is a third or more too high
        verdict = "predicted more than 25% high"
    elif below is not None and below >= 1.25:  # needs more than 1.25x
        verdict = "predicted more than 25% low"
    elif below is not None and above is not None and 0.75 <= below < above <= 1.25:
        verdict = "within ±25%"
    else:
        verdict = "not bracketed within 25%"
    return ", ".join(parts), _gib(predicted), verdict


def measured_points(scale: dict, memory: dict, r: dict) -> list[tuple[str, str, str, str]]:
    """(point, measured, predicted, error) for every measured point the formulas cover."""
    case = _scale_case()

    points = []
    for row in memory.get("rows", []):  # the embedded model in memory, float32 as stored (nothing converted)
        if row["code"] != "after":
            continue
        rows, seq = {"convert-gqa": (1, 512)}.get(row["command"], (4, 256))
        predicted = memory_in_memory(memory["model_bytes"], 0, rows, seq, 49152)
        points.append((f"`{row['command']}`, embedded 135M in memory (float32)", _gib(row["peak_rss"]),
                       _gib(predicted), _error(predicted, row["peak_rss"])))  # fmt: skip
    capped = {}
    for row in scale["rows"]:
        if "cap" in row:
            capped.setdefault((row["layers"], row["step"].rsplit(", capped at", 1)[0]), []).append(row)
    for row in scale["rows"]:
        kind, layers = case._kind(row["step"]), row["layers"]
        predicted = predicted_memory(kind, layers)
        if predicted is None or "cap" in row:
            continue
        where = f"`{row['step']}`, 8B shape, {layers} layers"
        bracket = _bracket(capped.get((layers, row["step"]), []))
        if bracket is not None:
            points.append((where + ", in memory cgroups", *bracket))
        else:
            points.append((where, _gib(row["peak_rss"]), _gib(predicted), _error(predicted, row["peak_rss"])))
    for t in case.time_model(scale["rows"]):
        if not t["fitted"]:
            fitted = "t0 and a" if t["reference"] == "copy" else "t0 and c"
            points.append((f"`{t['step']}` time, {t['layers']} layers ({fitted} fitted at the two shallower depths)",
                           _seconds(t["measured"]), _seconds(t["predicted"]), _error(t["predicted"], t["measured"])))  # fmt: skip
    return points


def compute_share(r: dict, command: str, tokens: int = 256) -> float | None:
    """The share of a reader's fitted per-layer seconds c that its float32 products at the measured GEMM rate
    explain (reader_flops of one layer / GEMM rate / c); the rest is converting, copying and re-reading weights."""
    fit = r["fits"].get(f"{command}, offloaded, 256 tokens")
    if not fit or not r["gemm"] or fit["per_layer"] <= 0:
        return None
    one_layer = shape("llama-3.1-8b", 1).layer_parameters
    flops = {"eval": 1, "importance": 3}[command] * 2 * one_layer * tokens
    return flops / r["gemm"] / fit["per_layer"]


def _through(fit: dict) -> dict:
    """time_through's fitted arguments from a command's fit (rates()['fits'])."""
    return {"fixed": fit["fixed"], "per_layer_byte": fit["per_layer_byte"], "factor": fit["factor"]}


def predictions(r: dict) -> list[str]:
    """Markdown rows: each command kind at 8B, 70B and 405B on this machine, one H200 and eight."""
    lines = ["| command | where | 8B | 70B | 405B |", "|---|---|---|---|---|"]
    shapes = [shape(n) for n in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")]
    fit = r["fits"]["prune --streaming --mode physical"]

    def row(command, where, cells):
        lines.append(f"| {command} | {where} | " + " | ".join(cells) + " |")

    row("`convert-gqa` / `prune` / `expand-kv --streaming`", "this machine",
        [f"{_gib(memory_streaming(s))}; {_seconds(time_through(s, fit['rate'], **_through(fit)))}"
         for s in shapes])  # fmt: skip
    row("the same", "an H200 node (CPU work; disk at 2 GB/s)",
        [f"{_gib(memory_streaming(s))}; {_seconds(time_through(s, NODE_DISK / 2, **_through(fit)))}"
         for s in shapes])  # fmt: skip
    for command in ("eval", "importance"):
        reader = r["fits"].get(f"{command}, offloaded, 256 tokens")
        if reader is None or not r["read"]:
            continue
        row(f"`{command}` on 256 tokens, offloaded (`--max-memory 64MB`)", "this machine",
            [f"{_gib(memory_offloaded_reader(s, 64e6, gradient=command == 'importance'))}; "
             f"{_seconds(time_through(s, reader['rate'], **_through(reader)))}" for s in shapes])  # fmt: skip
    for command, tokens in (("eval", 65536), ("importance", 65536)):
        for gpus in (1, 8):
            cells = []
            for s in shapes:
                W = s.parameters * BF16
                if gpus > 1 and W + 2 * GIB <= H200_BYTES:  # torchrun: a whole copy per GPU, the windows shared
                    memory, seconds, how = W, time_gpu_reader(s, tokens, command, gpus), "torchrun"
                else:  # --device-map auto: the layers spread, run one GPU after the other (one process)
                    memory, seconds, how = W / gpus, time_gpu_reader(s, tokens, command, 1), "device map"
                fits = memory + 2 * GIB <= H200_BYTES  # 2 GiB of activations
                note = "" if fits else ": does not fit"
                cells.append(f"{_gib(memory)} a GPU{note}; {_seconds(seconds)}" + (f" ({how})" if gpus > 1 else ""))
            where = "one H200" if gpus == 1 else "8 H200s"
            row(f"`{command}` on {tokens:,} tokens, bf16", where, cells)
    for gpus in (1, 8):
        cells = []
        for s in shapes:
            m = memory_uptrain(s, gpus)
            step = time_uptrain_step(s, 32 * 2048, gpus, H200_FLOPS * GPU_EFFICIENCY)
            fits = m["peak"] <= H200_BYTES
            host = f", rank 0's host {_gib(m['host'])}" if m["host"] else ""
            cells.append(f"{_gib(m['training'])} a GPU training, {_gib(m['load'])} at load{host}"
                         + ("" if fits else ": does not fit") + f"; {_seconds(step)} a step")  # fmt: skip
        where = "one H200" if gpus == 1 else "8 H200s, `--parallel fsdp`"
        row("`uptrain` (attention trained), 32 x 2,048 tokens a step", where, cells)
    return lines


def main() -> None:
    from benchmark import saved_result

    scale, memory = saved_result("scale"), saved_result("memory")
    if not scale:
        sys.exit("benchmarks/results/scale.json is missing: run `python scripts/benchmark.py --case scale` first")
    r = rates(scale)
    shares = [f"{c} {v:.0%}" for c in ("eval", "importance") if (v := compute_share(r, c)) is not None]
    explained = f" Share of the readers' per-layer time that products at that rate explain: {', '.join(shares)}."
    print(
        f"Rates of this machine (scale benchmark, deepest run): copy {r['copy'] / 1e9:.2f} GB/s, read "
        f"{(r['read'] or 0) / 1e9:.2f} GB/s, float32 GEMM {r['gemm'] / 1e9:.0f} GFLOP/s."
        + (explained if shares else "")
        + "\n"
    )
    print("| point | measured | predicted | error |\n|---|---|---|---|")
    for point in measured_points(scale, memory, r):
        print("| " + " | ".join(point) + " |")
    print()
    print("\n".join(predictions(r)))


if __name__ == "__main__":
    main()
