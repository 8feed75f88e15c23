"""Quantized files on more text: the gguf case's original, per-layer prune and MLA at the MQA budget, each exported
as Q8_0 rounded to nearest, with `--smooth` (alpha 0.5) and with `--smooth --smooth-alpha auto`, and as Q4_K_M with
an importance matrix (also with GPTQ rounding), scored by llama.cpp against transformers on 16,384 eval tokens and
16,384 held-out tokens (`speeches`). At q8_0 a file's distance is a few tenths of a percent, about the spread between
roundings of one model on the gguf case's 4,096 tokens; four times the text resolves which rounding is better.
HEADLAB_BENCH_GGUF_16K_MODELS=<comma list of the gguf case's model numbers> (default 0,2,4) and
HEADLAB_BENCH_GGUF_16K_FILES=<comma list of FILES keys> run some only, keeping the saved rows of the others."""

from __future__ import annotations

import os
from pathlib import Path

TITLE = (
    "Quantized GGUF files in llama.cpp on 16,384 tokens: Q8_0 roundings (nearest, SmoothQuant, per-input alpha), Q4_K_M"
)
MAX_TOKENS, SEQ_LEN = 16384, 256
# file label -> (outtype, --imatrix, --gptq, --smooth-alpha or None for no smoothing)
FILES = {
    "q8_0": ("q8_0", False, False, None),
    "q8_0 --smooth": ("q8_0", False, False, 0.5),
    "q8_0 --smooth --smooth-alpha auto": ("q8_0", False, False, "auto"),
    "q4_k_m --imatrix": ("q4_k_m", True, False, None),
    "q4_k_m --imatrix --gptq": ("q4_k_m", True, True, None),
}
CALIBRATION_TOKENS = 8192  # export-gguf --calibration-tokens' default


def run(args) -> dict:
    import tempfile

    from benchmark import load_case, saved_result  # the gguf case by path: `import gguf` is the gguf package

    from headlab.core.data import calibration_batches
    from headlab.core.loading import LoadedModel, from_model, load_model
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs, eval_windows, unavailable

    missing = unavailable()
    if missing:
        return {"skipped": missing, "rows": []}
    chosen = os.environ.get("HEADLAB_BENCH_GGUF_16K_MODELS", "0,2,4").split(",")
    files = [name for name in os.environ.get("HEADLAB_BENCH_GGUF_16K_FILES", "").split(",") if name] or list(FILES)
    variants = load_case(Path(__file__).resolve().parent / "gguf.py").variants  # the gguf case's models
    labels = [label for index, (label, _) in enumerate(variants(None)) if str(index) in chosen]
    rows = [row for row in saved_result("gguf_16k").get("rows", [])
            if not (row["model"] in labels and row["file"] in files)]  # fmt: skip
    for index, (label, edit) in enumerate(variants(None)):
        if str(index) not in chosen:
            continue
        loaded = load_model(None, device="cpu")
        built = edit(loaded)
        loaded = built if isinstance(built, LoadedModel) else loaded
        loaded = from_model(loaded.model, loaded.tokenizer)
        texts = {"eval": eval_windows(loaded, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN),
                 "speeches": eval_windows(loaded, "speeches", max_tokens=MAX_TOKENS, seq_len=SEQ_LEN)}  # fmt: skip
        batches = calibration_batches(loaded.tokenizer, seq_len=512, max_tokens=CALIBRATION_TOKENS)
        for name in files:
            outtype, weighted, rounded, alpha = FILES[name]
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "m.gguf"
                record = export_gguf(loaded, path, outtype=outtype, progress=False,
                                     imatrix=batches if weighted else None,
                                     gptq=batches if rounded else None,
                                     smooth=None if alpha is None else batches, smooth_alpha=alpha or 0.5)  # fmt: skip
                scores = {text: compare_logprobs(loaded, path, windows) for text, windows in texts.items()}
            smoothing = record.get("smoothing") or {}
            rows.append({"model": label, "file": name, "chosen_alpha": smoothing.get("chosen_alpha"),
                         **{text: {key: score[key] for key in ("perplexity_transformers", "perplexity_llamacpp",
                                                               "relative_difference", "scored_tokens")}
                            for text, score in scores.items()}})  # fmt: skip
            print(
                label, name, {text: f"{100 * s['relative_difference']:.3f}%" for text, s in scores.items()}, flush=True
            )
        del loaded
    order = {label: index for index, (label, _) in enumerate(variants(None))}
    rows.sort(key=lambda row: (order.get(row["model"], len(order)), list(FILES).index(row["file"])))
    return {"max_tokens": MAX_TOKENS, "seq_len": SEQ_LEN, "calibration_tokens": CALIBRATION_TOKENS, "rows": rows}


def markdown(r: dict) -> str:
    if r.get("skipped"):
        return f"Not measured: {r['skipped']}"
    lines = [
        f"`headlab export-gguf --outtype TYPE` with each option ({r['calibration_tokens']} calibration tokens of the "
        "default corpus for the smoothing and the importance matrix); llama.cpp's perplexity over transformers' on "
        "the same tokens: the first "
        f"{r['max_tokens']} tokens of the eval split and of the held-out `speeches` text, windows of {r['seq_len']}.",
        "",
        *([r["note"], ""] if r.get("note") else []),
        "| model | file | eval: ppl transformers | eval: relative diff | speeches: ppl transformers | "
        "speeches: relative diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        ev, held = row["eval"], row["speeches"]
        lines.append(f"| {row['model']} | {row['file']} | {ev['perplexity_transformers']:.4f} | "
                     f"{100 * ev['relative_difference']:+.3f}% | {held['perplexity_transformers']:.4f} | "
                     f"{100 * held['relative_difference']:+.3f}% |")  # fmt: skip
    return "\n".join(lines)
