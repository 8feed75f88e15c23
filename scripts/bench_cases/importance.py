"""Head importance on the embedded model: the `grad` pass against a plain sdpa forward over the same batches, its
peak memory, and how well grad and taylor rank heads like exact ablation (Spearman correlation)."""

from __future__ import annotations

import os
import statistics
import time

import torch

TITLE = "Head importance: cost of the `grad` pass, and grad / taylor against exact ablation"
SEQ_LEN, BATCH, TIMED_TOKENS = 256, 4, 1024  # the timing: grad pass vs plain forward
# Ablation runs one forward-pass set per head (270 here): 4 windows of 128 tokens take about 5 minutes on 2 idle cores.
ABLATION_SEQ_LEN, ABLATION_TOKENS = 128, 512
PER_MACHINE = True  # the time ratio depends on the CPU kind: one result per machine kind


def summary(r: dict) -> tuple[list[str], list[str]]:
    """The cross-machine table's columns: the grad pass over a plain forward, median and min-of-runs."""
    header = ["grad / plain forward (median)", "(min-of-runs)", "chunked vs whole logits"]
    cells = [
        f"{r['ratio']:.2f}x",
        f"{r['ratio_min']:.2f}x" if "ratio_min" in r else "-",
        f"{r['grad_vs_whole_logits_max_relative_difference']:.1e}"
        if "grad_vs_whole_logits_max_relative_difference" in r
        else "-",
    ]
    return header, cells


def spearman(a, b) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (average ranks for ties)."""
    import pandas as pd

    ra, rb = pd.Series(list(a)).rank(), pd.Series(list(b)).rank()
    return float(ra.corr(rb))


def run(args) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark import PeakMemory, machine, machine_kind, median_time, previous_result

    from headlab.core.data import calibration_batches
    from headlab.core.loading import load_model
    from headlab.measure import importance
    from headlab.measure.importance import head_importance, scoring_batches

    loaded = load_model(None, device=args.device)
    model, device = loaded.model, loaded.device
    timed = list(
        calibration_batches(loaded.tokenizer, None, seq_len=SEQ_LEN, batch_size=BATCH, max_tokens=TIMED_TOKENS)
    )
    prepared = scoring_batches(loaded, timed)

    def forward():
        with torch.no_grad():
            for batch in prepared:
                model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    grad_result = {}

    def grad_pass(chunked=True):
        def measure():
            score = importance.sequence_nll
            importance.sequence_nll = lambda model, batch, device: score(model, batch, device, chunked=chunked)
            try:
                grad_result[chunked] = head_importance(loaded, timed, method="grad", progress=False)
            finally:
                importance.sequence_nll = score
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return measure

    # Interleaved so all three see the same machine load; medians and minima over the repeats.
    runs = {"forward": forward, "grad": grad_pass(True), "grad_whole_logits": grad_pass(False)}
    times = {name: [] for name in runs}
    for function in runs.values():
        function()  # warm-up
    for _ in range(args.repeats):
        for name, function in runs.items():
            times[name].append(median_time(function, 1, warmup=0)[0])
    timing = {
        name: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "ratio_median": statistics.median(values) / statistics.median(times["forward"]),
            "ratio_min": min(values) / min(times["forward"]),
            "runs": values,
        }
        for name, values in times.items()
    }
    default_path = "grad" if importance.CHUNKED_LOSS else "grad_whole_logits"
    chunked_raw = torch.tensor(grad_result[True].table["importance_raw"].to_numpy())
    whole_raw = torch.tensor(grad_result[False].table["importance_raw"].to_numpy())
    with PeakMemory(device) as forward_memory:
        forward()
    with PeakMemory(device) as grad_memory:
        grad_pass(True)()
    with PeakMemory(device) as whole_memory:
        grad_pass(False)()
    timing_result = {
        "seq_len": SEQ_LEN,
        "batch_size": BATCH,
        "repeats": args.repeats,
        "timed_tokens": int(sum(int(batch[1].sum()) for batch in timed)),
        "timing": timing,
        "forward_s": timing["forward"]["median_s"],
        # the headline ratio is the path head_importance takes by default (importance.CHUNKED_LOSS)
        "default_path": default_path,
        "grad_s": timing[default_path]["median_s"],
        "ratio": timing[default_path]["ratio_median"],
        "ratio_min": timing[default_path]["ratio_min"],
        "grad_vs_whole_logits_max_relative_difference": float(
            ((chunked_raw - whole_raw).abs() / whole_raw.abs().max()).max()
        ),
        "forward_peak_extra_bytes": forward_memory.extra,
        "grad_peak_extra_bytes": grad_memory.extra,
        "grad_whole_logits_peak_extra_bytes": whole_memory.extra,
        "memory_kind": "CUDA allocator peak" if device.type == "cuda" else "peak RSS above the loaded model",
    }
    if os.environ.get("HEADLAB_BENCH_TIMING_ONLY"):
        # The ablation agreement takes minutes per run; keep the last run's figures, labelled with their date.
        saved = previous_result("importance", machine_kind(machine(), args.device))
        if saved is not None:
            agreement = ("ablation_", "spearman_", "method_seconds", "heads", "agreement_")
            kept = {k: v for k, v in saved["result"].items() if k.startswith(agreement)}
            kept.setdefault("agreement_date", saved["date"])
            return {**kept, **timing_result}
        return timing_result
    large = grad_result[True].table["importance_raw"]

    small = dict(seq_len=ABLATION_SEQ_LEN, batch_size=2, max_tokens=ABLATION_TOKENS, progress=False)
    results, seconds = {}, {}
    for method in ("grad", "taylor", "ablation"):
        start = time.perf_counter()
        results[method] = head_importance(loaded, method=method, **small)
        seconds[method] = time.perf_counter() - start
    ablation = results["ablation"].table["importance_raw"]
    return {
        **timing_result,
        "ablation_tokens": results["ablation"].meta["tokens"],
        "ablation_seq_len": ABLATION_SEQ_LEN,
        "ablation_scored": results["ablation"].meta["scored_tokens"],
        "method_seconds": seconds,
        "spearman_grad_ablation": spearman(results["grad"].table["importance_raw"], ablation),
        "spearman_taylor_ablation": spearman(results["taylor"].table["importance_raw"], ablation),
        "spearman_grad_taylor": spearman(
            results["grad"].table["importance_raw"], results["taylor"].table["importance_raw"]
        ),
        "spearman_grad2048_ablation": spearman(large, ablation),
        # grad and taylor are absolute values; ablation is signed (masking a head can lower the loss).
        "spearman_grad_abs_ablation": spearman(results["grad"].table["importance_raw"], ablation.abs()),
        "spearman_taylor_abs_ablation": spearman(results["taylor"].table["importance_raw"], ablation.abs()),
        "ablation_negative_heads": int((ablation < 0).sum()),
        "heads": len(ablation),
    }


def _timing_rows(r: dict) -> list[str]:
    mib = 2**20
    t = r.get("timing")
    if t is None:  # a result written before the interleaved runs
        return [
            f"| plain sdpa forward | {r['forward_s']:.2f} | | 1.00 | | {r['forward_peak_extra_bytes'] / mib:.0f} MiB |",
            f"| grad importance | {r['grad_s']:.2f} | | {r['ratio']:.2f} | | {r['grad_peak_extra_bytes'] / mib:.0f} MiB |",
        ]
    names = {
        "forward": ("plain sdpa forward", "forward_peak_extra_bytes"),
        "grad": ("grad importance (chunked loss)", "grad_peak_extra_bytes"),
        "grad_whole_logits": ("grad importance, whole [B, T, V] logits", "grad_whole_logits_peak_extra_bytes"),
    }
    return [
        f"| {names[k][0]}{' (default)' if k == r.get('default_path') else ''} | {v['median_s']:.2f} | {v['min_s']:.2f} | {v['ratio_median']:.2f} | {v['ratio_min']:.2f} | "
        f"{r[names[k][1]] / mib:.0f} MiB |"
        for k, v in t.items()
    ]


def markdown(r: dict) -> str:
    lines = [
        f"Embedded model (SmolLM2-135M, float32, sdpa), calibration split, {r['timed_tokens']} tokens in windows of "
        f"{r['seq_len']}, {r['batch_size']} windows per batch. The `grad` pass is `head_importance(method='grad')`"
        " end to end (per-sequence gates, parameters frozen, forward + backward to the gates only); the reference "
        "is a plain `torch.no_grad()` forward of the same batches. Runs are interleaved"
        + (f", {r['repeats']} repeats after a warm-up" if "repeats" in r else "")
        + ".",
        "",
        "| pass | median s | min s | ratio (medians) | ratio (minima) | peak memory above the loaded model |",
        "|---|---|---|---|---|---|",
        *_timing_rows(r),
        "",
        f"Time ratio grad (default path) / forward: **{r['ratio']:.2f}x** median"
        + (f", **{r['ratio_min']:.2f}x** min-of-runs" if "ratio_min" in r else "")
        + f" (floor <= 2.2x, aim <= 2.0x). Memory: {r['memory_kind']}"
        + (
            "; on CPU that is the growth of the process's resident set during the pass, measured after the "
            "timed runs, so memory the allocator kept from earlier passes does not show (the forward's figure "
            "is a lower bound)."
            if r["memory_kind"].startswith("peak RSS")
            else "."
        ),
    ]
    if "grad_vs_whole_logits_max_relative_difference" in r:
        lines += [
            "",
            "Chunked loss against whole logits, same batches: largest difference of a raw score, relative to the "
            f"largest score: {r['grad_vs_whole_logits_max_relative_difference']:.1e}.",
        ]
    if "spearman_grad_ablation" in r:
        lines += _agreement(r)
    return "\n".join(lines)


def _agreement(r: dict) -> list[str]:
    s = r["method_seconds"]
    return [
        "",
        f"Agreement with exact ablation ({r['heads']} heads; all three methods on the first {r['ablation_tokens']} "
        f"calibration tokens, windows of {r['ablation_seq_len']}, {r['ablation_scored']} scored tokens; raw scores"
        + (f"; measured {r['agreement_date']}" if "agreement_date" in r else "")
        + "). Ablation is the exact loss increase with one head masked, the ground truth the gradient proxies "
        "approximate; it is bounded to few tokens here because it costs one forward-pass set per head.",
        "",
        "| pair | Spearman rho |",
        "|---|---|",
        f"| grad vs ablation | {r['spearman_grad_ablation']:.3f} |",
        f"| taylor vs ablation | {r['spearman_taylor_ablation']:.3f} |",
        f"| grad vs taylor | {r['spearman_grad_taylor']:.3f} |",
        f"| grad ({r['timed_tokens']} tokens) vs ablation ({r['ablation_tokens']} tokens) | "
        f"{r['spearman_grad2048_ablation']:.3f} |",
        *(
            [
                f"| grad vs abs(ablation) | {r['spearman_grad_abs_ablation']:.3f} |",
                f"| taylor vs abs(ablation) | {r['spearman_taylor_abs_ablation']:.3f} |",
                "",
                f"{r['ablation_negative_heads']} of {r['heads']} heads lower the loss when masked (negative "
                "ablation score); grad and taylor are absolute values, hence the abs(ablation) rows.",
            ]
            if "spearman_grad_abs_ablation" in r
            else []
        ),
        "",
        f"Wall time on {r['ablation_tokens']} tokens: grad {s['grad']:.1f} s, taylor {s['taylor']:.1f} s, "
        f"ablation {s['ablation']:.1f} s.",
    ]
