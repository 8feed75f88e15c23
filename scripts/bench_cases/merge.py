"""Compression that keeps quality without training, on the embedded model: calibrated KV-head merging (3 -> 1)
against mean pooling, and pruning one query head per KV group (90 heads) with and without compensation. Training
(local reconstruction, uptraining) is the recovery case's (scripts/bench_cases/recovery.py)."""

from __future__ import annotations

TITLE = "Calibrated merging and pruning compensation, training-free (`convert-gqa --method svd`, `prune --compensate`)"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS = 2048, 512, 2048


def run(args) -> dict:
    import time

    import torch

    from headlab.core.data import calibration_batches, load_corpus
    from headlab.core.errors import HeadlabError
    from headlab.core.loading import load_model
    from headlab.kv import gqa
    from headlab.kv.merge import merge_kv_heads
    from headlab.measure.evaluate import perplexity
    from headlab.pruning import prune as P
    from headlab.pruning import scores as S
    from headlab.recovery.compensate import (
        apply_compensation,
        check_compensation,
        compensation_batches,
        output_statistics,
    )

    corpus = load_corpus(None)

    def ppl(loaded):
        return perplexity(
            loaded, corpus, split="eval", seq_len=SEQ_LEN, batch_size=4, max_tokens=EVAL_TOKENS, progress=False
        ).perplexity

    result = {
        "eval_tokens": EVAL_TOKENS,
        "seq_len": SEQ_LEN,
        "calib_tokens": CALIB_TOKENS,
        "threads": torch.get_num_threads(),
    }
    teacher = load_model(None, device=args.device)
    result["original"] = ppl(teacher)

    # 1. KV heads 3 -> 1
    mean = load_model(None, device=args.device)
    gqa.convert(mean, 1)
    result["mean"] = ppl(mean)
    del mean
    merged = load_model(None, device=args.device)
    batches = calibration_batches(merged.tokenizer, corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS)
    start = time.perf_counter()
    info = merge_kv_heads(merged, 1, batches, progress=False)
    result["svd_seconds"] = time.perf_counter() - start
    result["svd"] = ppl(merged)
    result["svd_plan"] = info
    for weighting in ("uniform",):
        other = load_model(None, device=args.device)
        merge_kv_heads(other, 1, batches, value_weighting=weighting, progress=False)
        result[f"svd_{weighting}"] = ppl(other)
        del other

    # 2. one query head per KV group (90 heads) by gradient importance, with and without compensation
    pruned_model = load_model(None, device=args.device)
    scores = S.importance_scores(
        pruned_model, data=corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS, progress=False
    )
    pruned = P.select_heads(pruned_model.layers, scores, count=90, uniform=True)
    with P.pruned_in_place(pruned_model, pruned, "mask"):
        result["pruned"] = ppl(pruned_model)
    start = time.perf_counter()
    grams = output_statistics(
        pruned_model,
        compensation_batches(pruned_model, corpus, seq_len=SEQ_LEN, max_tokens=CALIB_TOKENS),
        progress=False,
    )
    originals = [(layer, pruned_model.adapter.read(layer)) for layer in pruned_model.layers]
    table = apply_compensation(pruned_model, pruned, grams, "ridge")
    result["ridge_seconds"] = time.perf_counter() - start
    with P.pruned_in_place(pruned_model, pruned, "mask"):
        result["ridge"] = ppl(pruned_model)
    result["ridge_alphas"] = table["alpha"].value_counts(dropna=False).to_dict()
    result["ridge_error"] = [float(table["error_before"].mean()), float(table["error_after"].mean())]
    for layer, w in originals:
        pruned_model.adapter.write(layer, w)
    try:
        check_compensation(pruned_model, "bias")
        result["bias"] = None
    except HeadlabError as error:
        result["bias"] = f"n/a: {error}"
    # unregularised least squares (alpha = 0), to show why the ridge is there
    apply_compensation(pruned_model, pruned, grams, "ridge", alpha=0.0)
    with P.pruned_in_place(pruned_model, pruned, "mask"):
        result["ridge0"] = ppl(pruned_model)
    del pruned_model

    return result


def markdown(r: dict) -> str:
    def f(x):
        return f"{x:,.1f}" if isinstance(x, float) else str(x)

    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads), eval split, first {r['eval_tokens']:,} tokens, "
        f"seq-len {r['seq_len']}; calibration split, {r['calib_tokens']:,} tokens, for merging, importance and "
        "compensation.",
        "",
        "| model | perplexity | vs. reference |",
        "|---|---|---|",
        f"| original (3 KV heads) | {f(r['original'])} | |",
        f"| 3 -> 1 KV heads, mean pooling | {f(r['mean'])} | reference |",
        f"| 3 -> 1, calibrated merge (`--method svd`, attention-weighted values) | {f(r['svd'])} | "
        f"{r['mean'] / r['svd']:.0f}x lower (target: 40x); {r['svd_seconds']:.0f} s |",
        f"| 3 -> 1, calibrated merge, token-uniform value weighting | {f(r['svd_uniform'])} | "
        f"{r['mean'] / r['svd_uniform']:.0f}x lower |",
        f"| 90 of 270 heads pruned (one per KV group, gradient importance), no compensation | {f(r['pruned'])} | "
        "reference |",
        f"| same, `--compensate` (ridge refit of o_proj) | {f(r['ridge'])} | "
        f"{100 * (1 - r['ridge'] / r['pruned']):.0f}% lower (target: 50%); {r['ridge_seconds']:.0f} s |",
        f"| same, unregularised least squares (alpha = 0) | {f(r['ridge0'])} | |",
        f"| same, FLAP bias-only | {r['bias'] or 'measured'} | |",
        "",
        f"Ridge: alpha chosen per layer on held-out calibration windows {r['ridge_alphas']}; mean relative block-output "
        f"error on calibration {r['ridge_error'][0]:.3f} -> {r['ridge_error'][1]:.3f}.",
        "",
        "Recovery of these models by training (local reconstruction, uptraining): the recovery section.",
    ]
    return "\n".join(lines)
