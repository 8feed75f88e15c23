"""headlab eval against lm-evaluation-harness itself (issue 18's table): word perplexity, byte perplexity and bits per
byte of the same text on the embedded model, the model with 90 heads pruned (uniform, physical) and the model
converted to 1 KV head (svd merge), with the relative differences and the wall time of each tool."""

from __future__ import annotations

TITLE = "Perplexity: `headlab eval` against lm-evaluation-harness (`loglikelihood_rolling`) on edited models"
MAX_TOKENS, MAX_LENGTH, BATCH, CALIB_TOKENS, PRUNED = 2048, 512, 4, 1024, 90
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def run(args) -> dict:
    import itertools
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark import median_time

    from headlab.core.data import Corpus, calibration_batches, load_corpus, split_text, tokenize
    from headlab.core.loading import load_model
    from headlab.kv import gqa
    from headlab.measure.evaluate import perplexity
    from headlab.pruning.prune import pruned_in_place, select_heads
    from headlab.pruning.scores import importance_scores
    from headlab.runtimes.lm_eval_bridge import ROLLING_TASK, lm_eval_rolling_perplexity

    loaded = load_model(None, device=args.device)
    corpus = load_corpus(None)
    _, text = tokenize(loaded.tokenizer, split_text(corpus, "eval").text, MAX_TOKENS)
    document = Corpus("bench", [text])  # the exact text both tools score, as one document
    scratch = Path(tempfile.mkdtemp(prefix="lm_eval_agreement-"))
    runs = itertools.count()  # a fresh task directory per lm-eval run: its data-set cache is keyed by path
    rows = []

    def measure(name: str):
        ours, theirs = {}, {}

        def headlab_run():
            ours["r"] = perplexity(
                loaded, document, split="all", seq_len=MAX_LENGTH, batch_size=BATCH, max_tokens=None, progress=False
            )

        def lm_eval_run():
            directory = scratch / f"run-{next(runs)}"
            theirs["r"] = lm_eval_rolling_perplexity(loaded, [text], directory, max_length=MAX_LENGTH, batch_size=BATCH)

        headlab_s, _ = median_time(headlab_run, args.repeats, warmup=0)
        lm_eval_s, _ = median_time(lm_eval_run, args.repeats, warmup=0)
        row = {"model": name, "headlab_s": headlab_s, "lm_eval_s": lm_eval_s, "scored_tokens": ours["r"].scored_tokens}
        for metric in METRICS:
            a, b = getattr(ours["r"], metric), theirs["r"].value(ROLLING_TASK, metric)
            row.update({f"headlab_{metric}": a, f"lm_eval_{metric}": b, f"rel_diff_{metric}": abs(a - b) / abs(b)})
        rows.append(row)

    measure("embedded SmolLM2-135M")
    calibration = dict(data=None, seq_len=MAX_LENGTH, batch_size=BATCH, max_tokens=CALIB_TOKENS, progress=False)
    scores = importance_scores(loaded, **calibration)
    pruned = select_heads(loaded.layers, scores, count=PRUNED, uniform=True)
    with pruned_in_place(loaded, pruned, "physical"):
        measure(f"{PRUNED} heads pruned (importance, uniform, physical)")
    batches = calibration_batches(
        loaded.tokenizer, corpus, seq_len=MAX_LENGTH, batch_size=BATCH, max_tokens=CALIB_TOKENS
    )
    gqa.convert(loaded, 1, method="svd", batches=batches)
    measure("3 -> 1 KV heads (svd merge)")
    return {
        "max_tokens": MAX_TOKENS,
        "max_length": MAX_LENGTH,
        "batch_size": BATCH,
        "calib_tokens": CALIB_TOKENS,
        "repeats": args.repeats,
        "rows": rows,
    }


def markdown(r: dict) -> str:
    lines = [
        f"Embedded SmolLM2-135M (float32, CPU), the first {r['max_tokens']:,} tokens of the eval split as one "
        f"document, max_length {r['max_length']}, batch {r['batch_size']}; lm-eval 0.4.13 runs its own HFLM wrapper "
        "around the same in-memory model through a local `loglikelihood_rolling` task (headlab.runtimes.lm_eval_bridge). "
        f"Pruning scores: gradient importance on {r['calib_tokens']:,} calibration tokens; the svd merge is calibrated "
        f"on as many. Times: median of {r['repeats']} run(s) each, lm-eval's including its task set-up; the machine "
        "was shared with other jobs.",
        "",
        "| model | word ppl headlab | word ppl lm-eval | rel. diff | byte ppl rel. diff | bits/byte headlab | "
        "bits/byte lm-eval | rel. diff | headlab s | lm-eval s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['headlab_word_perplexity']:,.4f} | {row['lm_eval_word_perplexity']:,.4f} | "
            f"{row['rel_diff_word_perplexity']:.1e} | {row['rel_diff_byte_perplexity']:.1e} | "
            f"{row['headlab_bits_per_byte']:.6f} | {row['lm_eval_bits_per_byte']:.6f} | "
            f"{row['rel_diff_bits_per_byte']:.1e} | {row['headlab_s']:.1f} | {row['lm_eval_s']:.1f} |"
        )
    return "\n".join(lines)
