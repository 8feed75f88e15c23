"""headlab stats (sdpa + chunked statistics) against a plain sdpa forward and against eager output_attentions maps
reduced to the same statistics; peak memory of a long sequence, each measurement in a fresh subprocess."""

from __future__ import annotations

import json

import torch

TITLE = "Head statistics: `headlab stats` against a plain forward and against eager output_attentions"
BATCH, SEQ_LEN, LONG = 4, 512, 4096
PER_MACHINE = True  # the ratio depends on the CPU kind (cache sizes, GEMM speed): one result per machine kind


def summary(r: dict) -> tuple[list[str], list[str]]:
    """The cross-machine table's columns: the overhead over a plain forward, median and min-of-runs."""
    header = ["stats / plain forward (median)", "(min-of-runs)", "vs eager reference", "memory ratio"]
    cells = [
        f"{r['overhead']:.2f}x",
        f"{r['overhead_min']:.2f}x" if "overhead_min" in r else "-",
        f"{r['max_difference_vs_eager']:.1e}",
        f"{r['memory_ratio']:.2f}x",
    ]
    return header, cells


def eager_statistics(model, layers, input_ids, attention_mask):
    """The usual approach: eager attention with output_attentions (every layer's [B, H, T, T] map at once), then
    the same per-head reductions on the full maps."""
    from headlab.measure.stats import StatisticsCollector
    from headlab.mechanisms.capture import AttentionChunk

    collector = StatisticsCollector(layers)
    with torch.no_grad():
        attentions = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        T = input_ids.shape[1]
        valid = attention_mask.bool()
        visible = (torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()[None] & valid[:, None, :])[
            :, None
        ]  # [B, 1, T, T]
        for layer, A in zip(layers, attentions):
            collector.on_chunk(AttentionChunk(layer, A.float(), visible, 0, valid, valid))
    return collector.means()


def _peak_child(mode: str, tokens: int, device: str = "cpu") -> None:
    """Run one forward of `tokens` tokens (plain sdpa or with statistics) and print the peak resident-set growth
    over the resident set before it, sampled every millisecond (ru_maxrss cannot be used: loading the model peaks
    higher than a forward). On CUDA the growth is the allocator's peak over what the loaded model holds."""
    from benchmark import PeakMemory

    from headlab.core.loading import load_model
    from headlab.measure.stats import StatisticsCollector
    from headlab.mechanisms.capture import capture_attention

    loaded = load_model(None, device=device)
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0)).to(loaded.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        loaded.model(input_ids=ids[:, :16], attention_mask=mask[:, :16])  # warm the allocator and kernels
    with PeakMemory(loaded.device) as memory, torch.no_grad():
        if mode == "plain":
            loaded.model(input_ids=ids, attention_mask=mask)
        else:
            collector = StatisticsCollector(loaded.layers)
            with capture_attention(loaded.model, loaded.layers, collector.on_chunk, collector.on_output):
                loaded.model(input_ids=ids, attention_mask=mask)
    kind = {"kind": "cuda"} if memory.kind == "cuda" else {}
    print(json.dumps({"baseline": memory.base, "peak": memory.peak, "growth": memory.extra, **kind}))


def _peak(mode: str, tokens: int, device: str = "cpu") -> dict:
    from benchmark import in_fresh_process

    return in_fresh_process("stats", f"_peak_child({mode!r}, {tokens}, {device!r})")


def _float64_errors(loaded, input_ids, attention_mask) -> dict:
    """Per statistic, the largest |headlab on the float32 model - eager maps of a float64 copy| over heads: the error
    of the whole float32 pass (model and statistics) against float64 arithmetic."""
    import copy

    from headlab.measure.stats import StatisticsCollector
    from headlab.mechanisms.capture import capture_attention

    model, layers = loaded.model, loaded.layers
    collector = StatisticsCollector(layers)
    with torch.no_grad(), capture_attention(model, layers, collector.on_chunk, collector.on_output):
        model(input_ids=input_ids, attention_mask=attention_mask)
    ours = collector.means()
    wide = copy.deepcopy(model).double()
    wide.set_attn_implementation("eager")
    from headlab.core.arch import attention_layers

    reference = eager_statistics(wide, attention_layers(wide), input_ids, attention_mask)
    del wide
    return {
        name: max(float((ours[i][name][0] - reference[i][name][0]).abs().nan_to_num(0).max()) for i in reference)
        for name in reference[next(iter(reference))]
    }


def _ratios(times: dict, reference: str = "plain") -> dict:
    """Per run: median seconds, min seconds, and both ratios to the reference run's median and min."""
    import statistics

    out = {}
    for name, runs in times.items():
        out[name] = {
            "median_s": statistics.median(runs),
            "min_s": min(runs),
            "ratio_median": statistics.median(runs) / statistics.median(times[reference]),
            "ratio_min": min(runs) / min(times[reference]),
            "runs": runs,
        }
    return out


def run(args) -> dict:
    import sys as _sys
    import time
    from pathlib import Path

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from headlab.core.data import calibration_batches
    from headlab.core.loading import load_model
    from headlab.measure.stats import StatisticsCollector
    from headlab.mechanisms.capture import capture_attention, output_from_chunks

    loaded = load_model(None, device=args.device)
    model, layers = loaded.model, loaded.layers
    batches = calibration_batches(loaded.tokenizer, None, seq_len=SEQ_LEN, batch_size=BATCH, max_tokens=BATCH * SEQ_LEN)
    input_ids, attention_mask, _ = next(iter(batches))
    input_ids, attention_mask = input_ids.to(loaded.device), attention_mask.to(loaded.device)
    synchronize = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    logits = {}

    def plain():
        with torch.no_grad():
            logits["plain"] = model(input_ids=input_ids, attention_mask=attention_mask).logits
        synchronize()

    ours = {}

    def headlab_stats(output):
        def measure():
            collector = StatisticsCollector(layers)
            with (
                torch.no_grad(),
                capture_attention(model, layers, collector.on_chunk, collector.on_output, output=output),
            ):
                logits[output] = model(input_ids=input_ids, attention_mask=attention_mask).logits
            synchronize()
            ours[output] = collector.means()

        return measure

    theirs = {}

    def eager():
        model.set_attn_implementation("eager")
        try:
            theirs["means"] = eager_statistics(model, layers, input_ids, attention_mask)
        finally:
            model.set_attn_implementation("sdpa")
        synchronize()

    memory = {mode: _peak(mode, LONG, args.device) for mode in ("plain", "stats")}
    # Interleaved: every repeat runs each variant once, so all see the same load on a shared machine.
    runs = {"plain": plain, "chunks": headlab_stats("chunks"), "sdpa": headlab_stats("sdpa"), "eager": eager}
    times = {name: [] for name in runs}
    for function in runs.values():
        function()  # warm-up
    for _ in range(args.repeats):
        for name, function in runs.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    timing = _ratios(times)
    real = attention_mask.bool()

    def difference(means):
        return max(
            float((means[i][name][0] - theirs["means"][i][name][0]).abs().nan_to_num(0).max())
            for i in theirs["means"]
            for name in theirs["means"][i]
        )

    auto = "chunks" if output_from_chunks("auto", loaded.device) else "sdpa"
    return {
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "long_tokens": LONG,
        "repeats": args.repeats,
        "timing": timing,
        "auto_output": auto,
        "plain_s": timing["plain"]["median_s"],
        "stats_s": timing[auto]["median_s"],
        "eager_s": timing["eager"]["median_s"],
        "overhead": timing[auto]["ratio_median"],
        "overhead_min": timing[auto]["ratio_min"],
        "speedup_vs_eager": timing["eager"]["median_s"] / timing[auto]["median_s"],
        "max_difference_vs_eager": difference(ours[auto]),
        "max_difference_vs_eager_sdpa_output": difference(ours["sdpa"]),
        "max_logit_difference": {
            output: float((logits[output][real] - logits["plain"][real]).abs().max()) for output in ("chunks", "sdpa")
        },
        "float64_errors": _float64_errors(loaded, input_ids[:1], attention_mask[:1]),
        "memory": memory,
        "memory_ratio": memory["stats"]["growth"] / memory["plain"]["growth"],
    }


def markdown(r: dict) -> str:
    mib = 2**20
    m = r["memory"]
    t = r.get("timing")
    if t is None:  # a result written before the interleaved runs
        rows = [
            f"| plain sdpa forward | {r['plain_s']:.2f} | | 1.00 | |",
            f"| headlab stats | {r['stats_s']:.2f} | | {r['overhead']:.2f} | |",
            f"| eager + output_attentions + same statistics | {r['eager_s']:.2f} | | {r['eager_s'] / r['plain_s']:.2f} | |",
        ]
    else:
        names = {
            "plain": "plain sdpa forward",
            "chunks": "headlab stats, output from the chunks (P x V)",
            "sdpa": "headlab stats, output from a second sdpa call",
            "eager": "eager + output_attentions + same statistics",
        }
        rows = [
            f"| {names[k]}{' (auto)' if k == r['auto_output'] else ''} | {v['median_s']:.2f} | {v['min_s']:.2f} | "
            f"{v['ratio_median']:.2f} | {v['ratio_min']:.2f} |"
            for k, v in t.items()
        ]
    lines = [
        f"Embedded model, float32, one calibration batch of {r['batch']} x {r['seq_len']} tokens. The eager "
        "reference runs attn_implementation='eager' with output_attentions=True (all layers' maps at once) and "
        "reduces the full maps with the same accumulators. "
        + (f"The variants run interleaved, {r['repeats']} repeats each after a warm-up." if t else ""),
        "",
        "| run | median s | min s | ratio to plain (medians) | ratio to plain (minima) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Overhead over the plain forward: **{r['overhead']:.2f}x** median"
        + (f", **{r['overhead_min']:.2f}x** min-of-runs" if "overhead_min" in r else "")
        + f" (floor <= 1.3, aim <= 1.15). Speed-up over the eager approach: **{r['speedup_vs_eager']:.2f}x**. "
        f"Largest difference of any statistic from the eager reference: {r['max_difference_vs_eager']:.1e}.",
    ]
    if "max_logit_difference" in r:
        d = r["max_logit_difference"]
        lines += [
            "",
            f"Logits of real tokens against the plain forward: {d['chunks']:.1e} with the output from the chunks, "
            f"{d['sdpa']:.1e} with the output from sdpa. Float32 pass against a float64 copy of the model (eager "
            "maps, one sequence), largest error over heads per statistic: "
            + ", ".join(f"{k} {v:.1e}" for k, v in r["float64_errors"].items())
            + ".",
        ]
    lines += [
        "",
        f"Peak memory, batch 1 x {r['long_tokens']} tokens, growth of the peak "
        + ("CUDA allocation" if m["plain"].get("kind") == "cuda" else "resident set")
        + " over the loaded model (fresh process per measurement):",
        "",
        "| run | peak RSS growth (MiB) |",
        "|---|---|",
        f"| plain sdpa forward | {m['plain']['growth'] / mib:.0f} |",
        f"| headlab stats | {m['stats']['growth'] / mib:.0f} |",
        "",
        f"Ratio: **{r['memory_ratio']:.2f}x** (goal <= 1.5).",
    ]
    return "\n".join(lines)
