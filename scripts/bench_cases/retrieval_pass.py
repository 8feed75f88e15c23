"""The retrieval score's pass on long passkey prompts: headlab computes only the attention chunks holding answer rows
(`AttentionCapture.rows`), against the same pass computing every chunk (the former code, reproduced by handing the
capture every chunk) and against a plain sdpa forward of the same prompts; the three interleaved per repeat, medians.
HEADLAB_BENCH_RETRIEVAL_LENGTHS (default 4096,8192) sets the prompt lengths."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

TITLE = "Retrieval score at long prompts: answer chunks only, against every chunk and a plain forward"
PER_MACHINE = True  # the ratio depends on the CPU kind (how much of a forward attention is)


def _lengths() -> tuple[int, ...]:
    return tuple(int(n) for n in os.environ.get("HEADLAB_BENCH_RETRIEVAL_LENGTHS", "4096,8192").split(","))


@contextlib.contextmanager
def every_chunk():
    """The capture computing every query chunk whatever rows the pass reads (the code before row selection)."""
    from headlab.mechanisms.capture import AttentionCapture

    chosen = AttentionCapture._chunk_starts
    AttentionCapture._chunk_starts = lambda self, Tq, rows: chosen(self, Tq, None)
    try:
        yield
    finally:
        AttentionCapture._chunk_starts = chosen


def _one_length(loaded, text, length: int, repeats: int, synchronize) -> dict:
    from headlab.measure.stats import retrieval_batches, retrieval_sequences, retrieval_statistics

    sequences, _ = retrieval_sequences(loaded, text, length=length)
    scores = {}

    def plain():
        with torch.no_grad():
            for input_ids, attention_mask, _ in retrieval_batches(sequences, batch_size=text.batch_size):
                loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
        synchronize()

    def score(name, context):
        def measure():
            with context():
                values, _ = retrieval_statistics(loaded, text=text, length=length, progress=False)
            synchronize()
            scores[name] = torch.stack([values[index] for index in sorted(values)])

        return measure

    runs = {"plain": plain, "answer chunks": score("answer chunks", contextlib.nullcontext),
            "every chunk": score("every chunk", every_chunk)}  # fmt: skip
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, function in runs.items():  # interleaved: each repeat sees the same load
            begin = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - begin)
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    difference = (scores["answer chunks"] - scores["every chunk"]).abs().nan_to_num(0).max().item()
    return {"length": length, "prompts": len(sequences), "median_s": median, "runs": times,
            "speedup": median["every chunk"] / median["answer chunks"],
            "over_plain": median["answer chunks"] / median["plain"],
            "every_chunk_over_plain": median["every chunk"] / median["plain"],
            "max_score_difference": difference}  # fmt: skip


def run(args) -> dict:
    from headlab.core.data import TextSpec
    from headlab.core.loading import load_model

    loaded = load_model(None, device=args.device)
    text = TextSpec().resolved()  # the embedded corpus's calibration part, as `headlab stats` reads it
    synchronize = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    rows = [_one_length(loaded, text, length, args.repeats, synchronize) for length in _lengths()]
    return {"repeats": args.repeats, "rows": rows}


def markdown(r: dict) -> str:
    lines = [
        f"Medians of {r['repeats']} interleaved runs; the four passkey prompts of the retrieval score per length.",
        "",
        "| prompt tokens | plain forward | answer chunks (headlab) | every chunk (before) | speed-up | "
        "headlab / plain | largest score difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        s = row["median_s"]
        lines.append(
            f"| {row['length']:,} | {s['plain']:.1f} s | {s['answer chunks']:.1f} s | {s['every chunk']:.1f} s | "
            f"{row['speedup']:.2f}x | {row['over_plain']:.2f}x | {row['max_score_difference']:.1e} |"
        )
    return "\n".join(lines)
