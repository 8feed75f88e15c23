"""llama.cpp against transformers on the same checkpoints: the embedded model, a uniform prune, a per-layer prune,
a 3 -> 1 KV conversion and an MLA conversion at the MQA budget (also after the default recovery), each exported to
GGUF (f32) and scored on the eval split by both runtimes; the embedded model also as Q8_0 (headlab's numpy quantizer)
and Q4_K_M (llama.cpp's), whose distance from transformers is the quantization's, and Q4_K_M with an importance
matrix (export-gguf --imatrix); the per-layer prune and both MLA models too; each quantized type also with GPTQ
rounding (export-gguf --gptq) beside round to nearest. Every quantized file is also scored on held-out text. HEADLAB_BENCH_GGUF_MODELS=<comma list of model numbers, from 0> runs some models only and keeps the
saved rows of the others; HEADLAB_BENCH_GGUF_TYPES=<comma list of QUANTIZED names> runs those file types only (of
the models run), keeping the saved rows of the others."""

from __future__ import annotations

TITLE = "GGUF export: llama.cpp perplexity against transformers on the same checkpoint (f32, Q8_0, Q4_K_M)"
# Output types per model (by its number in `variants`); the others are exported in f32 only. "+imatrix": with
# export-gguf --imatrix, "+gptq": with --gptq, "+smooth": with --smooth (each from IMATRIX_TOKENS of the default
# corpus's calibration part, windows of 512).
QUANTIZED = ("f32", "q8_0", "q8_0+gptq", "q8_0+smooth", "q4_k_m", "q4_k_m+imatrix", "q4_k_m+imatrix+gptq",
             "q4_k_m+imatrix+smooth")
OUTTYPES = {0: QUANTIZED, 2: QUANTIZED, 4: QUANTIZED, 5: QUANTIZED}  # the original, the per-layer prune (deci), MLA
# (deepseek2), MLA after recovery
MAX_TOKENS, SEQ_LEN = 4096, 256  # 16 windows: 512 tokens left a quantized file's distance within noise
IMATRIX_TOKENS = 8192  # export-gguf's --calibration-tokens default
# Text the calibration never saw, for every quantized row: an importance matrix or GPTQ fitted to its corpus should
# not only help there, and a rounding's distance on one text is partly that text's (headlab.core.corpora: held out
# of the default corpus).
HELD_OUT = "speeches"


def _to_mla(loaded, recovered: bool = False):
    """convert-mla --budget mqa as the command saves it: the latent norms folded back in (llama.cpp applies them);
    `recovered`: first the default recovery on the default corpus (`--recover local,uptrain`), which trains the
    norm-free model as the command does."""
    from headlab.core.data import calibration_batches
    from headlab.kv.mla import convert_to_mla, fold_latent_norm, plan_mla
    from headlab.recovery.recover import RecoverySpec, recover

    batches = calibration_batches(loaded.tokenizer, None, seq_len=512, batch_size=4, max_tokens=2048)
    mla, _ = convert_to_mla(loaded, plan_mla(loaded, "mqa"), batches, progress=False)
    if recovered:  # convert_to_mla leaves `loaded` untouched: it is the teacher
        recover(mla, loaded, RecoverySpec(), progress=False)
    fold_latent_norm(mla.model)
    return mla


def variants(loaded):
    """(label, edit) pairs; an edit changes `loaded` in place or returns the new model it built. Heads are chosen by
    index: agreement between runtimes does not depend on which heads go."""
    from headlab.kv.gqa import convert
    from headlab.pruning.prune import apply_physical, physical_layout, prepare_config

    def prune(pruned):
        def edit(model):
            layout = physical_layout(model.layers, pruned(model.layers))
            apply_physical(model, layout)
            prepare_config(model, layout)

        return edit

    return [
        ("original", lambda model: None),
        ("uniform prune (1 query head per KV group)", prune(lambda layers: [{0, 3, 6} for _ in layers])),
        (
            "per-layer prune (KV group 0 of even layers)",
            prune(lambda layers: [{0, 1, 2} if layer.index % 2 == 0 else set() for layer in layers]),
        ),
        ("3 -> 1 KV heads (mean pooling)", lambda model: convert(model, 1)),
        ("MLA 64+64 (convert-mla --budget mqa)", _to_mla),
        ("MLA 64+64 + recovery (--recover local,uptrain)", lambda model: _to_mla(model, recovered=True)),
    ]


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    from headlab.core.data import calibration_batches
    from headlab.core.loading import LoadedModel, from_model, load_model
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs, eval_windows, unavailable

    missing = unavailable()
    if missing:
        return {"skipped": missing, "rows": []}
    import os

    chosen = os.environ.get("HEADLAB_BENCH_GGUF_MODELS")
    types = [name for name in os.environ.get("HEADLAB_BENCH_GGUF_TYPES", "").split(",") if name]
    rows = []
    if chosen or types:  # the rows of the models and types not run now stay
        from benchmark import saved_result

        labels = [label for index, (label, _) in enumerate(variants(None)) if not chosen or str(index) in chosen.split(",")]
        run_now = lambda row: row["model"] in labels and (not types or _type_name(row) in types)  # noqa: E731
        rows = [row for row in saved_result("gguf").get("rows", []) if not run_now(row)]
    for index, (label, edit) in enumerate(variants(None)):
        if chosen and str(index) not in chosen.split(","):
            continue
        loaded = load_model(None, device="cpu")
        built = edit(loaded)  # a new model (MLA), or a record of an in-place edit
        loaded = built if isinstance(built, LoadedModel) else loaded
        loaded = from_model(loaded.model, loaded.tokenizer)
        windows = eval_windows(loaded, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN)
        held_out = None
        for name in OUTTYPES.get(index, ("f32",)):
            if types and name not in types:
                continue
            outtype, *flags = name.split("+")
            weighted, rounded, smoothed = "imatrix" in flags, "gptq" in flags, "smooth" in flags
            batches = (
                calibration_batches(loaded.tokenizer, seq_len=512, max_tokens=IMATRIX_TOKENS) if flags else None
            )
            with tempfile.TemporaryDirectory() as tmp:
                record = export_gguf(loaded, Path(tmp) / "m.gguf", outtype=outtype, progress=False,
                                     imatrix=batches if weighted else None, gptq=batches if rounded else None,
                                     smooth=batches if smoothed else None)  # fmt: skip
                result = compare_logprobs(loaded, Path(tmp) / "m.gguf", windows)
                if outtype != "f32":  # every quantized file also on held-out text
                    held_out = held_out or eval_windows(loaded, HELD_OUT, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN)
                    outside = compare_logprobs(loaded, Path(tmp) / "m.gguf", held_out)
                    result["held_out"] = {"corpus": HELD_OUT, **outside}
            rows.append(
                {
                    "model": label,
                    "architecture": record["architecture"],
                    "heads": sum(record["head_count"]),
                    "kv_heads": sum(record["head_count_kv"]),
                    "outtype": record["outtype"],
                    "imatrix": weighted,
                    "gptq": rounded,
                    "smooth": smoothed,
                    "bytes": record["bytes"],
                    "tensor_type_counts": record["tensor_type_counts"],
                    "quantization": record["quantization"],
                    **result,
                }
            )
        del loaded
    order = {label: index for index, (label, _) in enumerate(variants(None))}
    kinds = {name: index for index, name in enumerate(QUANTIZED)}
    rows.sort(key=lambda row: (order.get(row["model"], len(order)), kinds.get(_type_name(row), len(kinds))))
    return {"max_tokens": MAX_TOKENS, "seq_len": SEQ_LEN, "rows": rows}


def _type_name(row: dict) -> str:
    """The row's QUANTIZED name ("q4_k_m+imatrix+gptq")."""
    flags = [flag for flag in ("imatrix", "gptq", "smooth") if row.get(flag)]
    return "+".join([row.get("outtype", "f32"), *flags])


def _file_label(row: dict) -> str:
    return _type_name(row).replace("+", " + ")


def markdown(r: dict) -> str:
    if r.get("skipped"):
        return f"Not measured: {r['skipped']}"
    lines = [
        f"Embedded SmolLM2-135M and edits of it, exported with `headlab export-gguf --outtype TYPE`, eval split, first "
        f"{r['max_tokens']} tokens in windows of {r['seq_len']} (prefix token first); llama.cpp (llama-cpp-python, "
        "CPU, f32 KV cache, logits of every position) against transformers (float32, sdpa) on the same token ids. "
        "For a quantized file the difference is the quantization's (f32 shows the runtimes agree).",
        "",
        *([r["note"], ""] if r.get("note") else []),
        "| model | llama.cpp arch | query / KV heads | file | ppl transformers | ppl llama.cpp | relative diff | "
        "worst abs logit diff | max abs logit |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        size = f", {row['bytes'] / 2**20:.1f} MiB" if row.get("bytes") else ""
        lines.append(
            f"| {row['model']} | {row['architecture']} | {row['heads']} / {row['kv_heads']} | "
            f"{_file_label(row)}{size} | "
            f"{row['perplexity_transformers']:.4f} | "
            f"{row['perplexity_llamacpp']:.4f} | {100 * row['relative_difference']:.4f}% | "
            f"{row['max_abs_logit_diff']:.2e} | {row['max_abs_logit']:.1f} |"
        )
    outside = [row for row in r["rows"] if row.get("held_out")]
    if outside:
        lines += [
            "",
            f"The quantized files on text the calibration never saw (`{outside[0]['held_out']['corpus']}`, held out of "
            "the default corpus, same windows), beside the eval split: llama.cpp's perplexity against transformers' "
            "on the same tokens.",
            "",
            "| model | file | eval split: relative diff | held out: ppl transformers | held out: ppl llama.cpp | "
            "held out: relative diff |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in outside:
            other = row["held_out"]
            lines.append(
                f"| {row['model']} | {_file_label(row)} | "
                f"{100 * row['relative_difference']:.2f}% | {other['perplexity_transformers']:.4f} | "
                f"{other['perplexity_llamacpp']:.4f} | {100 * other['relative_difference']:.2f}% |"
            )
    quantized = [row for row in r["rows"] if row.get("quantization")]
    if quantized:
        lines += ["", "Tensors by stored type in the quantized files (read back with the gguf package's reader):", ""]
        for row in quantized:
            by = row["quantization"]
            weighted, rounded = by.get("imatrix"), by.get("gptq")
            who = (
                f"llama.cpp {by['ftype']} from {by['from']}, ggml {by['ggml']} ({by['commit']})"
                + (f", importance matrix of {weighted['tokens']} calibration tokens" if weighted else "")
                if by["by"] == "llama.cpp"
                else f"headlab with gguf {by.get('gguf')}"
            )
            if rounded:
                who += (
                    f"; GPTQ on {rounded['tokens']} calibration tokens: {rounded['matrices']} matrices, output error "
                    f"{rounded['output_error_vs_nearest']:.3f}x round to nearest's"
                    + (f", {rounded['written_as_rounded']} kept by llama.cpp's quantizer"
                       if "written_as_rounded" in rounded else "")
                )  # fmt: skip
            counts = ", ".join(f"{n} {name}" for name, n in row["tensor_type_counts"].items())
            fallback = len(by.get("fallback_matrices") or {})
            lines.append(
                f"- {row['model']}, {_file_label(row)} ({who}): {counts}"
                + (f"; {fallback} matrices in a fallback type (rows not a multiple of the block)" if fallback else "")
            )
    return "\n".join(lines)
