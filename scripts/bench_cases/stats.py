"""headlab stats (sdpa + chunked statistics) against a plain sdpa forward and against eager output_attentions maps
reduced to the same statistics; peak memory of a long sequence, each measurement in a fresh subprocess."""

from __future__ import annotations

import json

import torch

TITLE = "Head statistics: `headlab stats` against a plain forward and against eager output_attentions"
BATCH, SEQ_LEN, LONG = 4, 512, 4096


def eager_statistics(model, layers, input_ids, attention_mask):
    """The usual approach: eager attention with output_attentions (every layer's [B, H, T, T] map at once), then
    the same per-head reductions on the full maps."""
    from headlab.capture import AttentionChunk
    from headlab.stats import StatisticsCollector

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

    from headlab.capture import capture_attention
    from headlab.loading import load_model
    from headlab.stats import StatisticsCollector

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


def run(args) -> dict:
    import sys as _sys
    from pathlib import Path

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark import median_time

    from headlab.capture import capture_attention
    from headlab.data import calibration_batches
    from headlab.loading import load_model
    from headlab.stats import StatisticsCollector

    loaded = load_model(None, device=args.device)
    model, layers = loaded.model, loaded.layers
    batches = calibration_batches(loaded.tokenizer, None, seq_len=SEQ_LEN, batch_size=BATCH, max_tokens=BATCH * SEQ_LEN)
    input_ids, attention_mask, _ = next(iter(batches))
    input_ids, attention_mask = input_ids.to(loaded.device), attention_mask.to(loaded.device)

    def plain():
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)

    ours = {}

    def headlab_stats():
        collector = StatisticsCollector(layers)
        with torch.no_grad(), capture_attention(model, layers, collector.on_chunk, collector.on_output):
            model(input_ids=input_ids, attention_mask=attention_mask)
        ours["means"] = collector.means()

    theirs = {}

    def eager():
        model.set_attn_implementation("eager")
        try:
            theirs["means"] = eager_statistics(model, layers, input_ids, attention_mask)
        finally:
            model.set_attn_implementation("sdpa")

    memory = {mode: _peak(mode, LONG, args.device) for mode in ("plain", "stats")}
    plain_s, plain_all = median_time(plain, args.repeats)
    stats_s, stats_all = median_time(headlab_stats, args.repeats)
    eager_s, eager_all = median_time(eager, args.repeats)
    difference = max(
        float((ours["means"][i][name][0] - theirs["means"][i][name][0]).abs().nan_to_num(0).max())
        for i in theirs["means"]
        for name in theirs["means"][i]
    )
    return {
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "long_tokens": LONG,
        "plain_s": plain_s,
        "stats_s": stats_s,
        "eager_s": eager_s,
        "plain_runs": plain_all,
        "stats_runs": stats_all,
        "eager_runs": eager_all,
        "overhead": stats_s / plain_s,
        "speedup_vs_eager": eager_s / stats_s,
        "max_difference_vs_eager": difference,
        "memory": memory,
        "memory_ratio": memory["stats"]["growth"] / memory["plain"]["growth"],
    }


def markdown(r: dict) -> str:
    mib = 2**20
    m = r["memory"]
    return "\n".join(
        [
            f"Embedded model, float32, one calibration batch of {r['batch']} x {r['seq_len']} tokens. The eager "
            "reference runs attn_implementation='eager' with output_attentions=True (all layers' maps at once) and "
            "reduces the full maps with the same accumulators.",
            "",
            "| run | median s | ratio to plain sdpa |",
            "|---|---|---|",
            f"| plain sdpa forward | {r['plain_s']:.2f} | 1.00 |",
            f"| headlab stats (sdpa + chunked statistics) | {r['stats_s']:.2f} | {r['overhead']:.2f} |",
            f"| eager + output_attentions + same statistics | {r['eager_s']:.2f} | {r['eager_s'] / r['plain_s']:.2f} |",
            "",
            f"Overhead over the plain forward: **{r['overhead']:.2f}x** (goal <= 1.3). Speed-up over the eager "
            f"approach: **{r['speedup_vs_eager']:.2f}x** (goal >= 1.2). Largest difference of any statistic between "
            f"the two: {r['max_difference_vs_eager']:.1e}.",
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
    )
