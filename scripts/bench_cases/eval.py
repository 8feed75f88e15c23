"""headlab eval against the sliding-window loop of the transformers docs ("Perplexity of fixed-length models")."""

from __future__ import annotations

import math

import torch

TITLE = "Perplexity: `headlab eval` against the transformers-docs sliding-window loop"
SEQ_LEN, STRIDE, MAX_TOKENS, BATCH = 512, 256, 2048, 4


def reference_perplexity(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """The docs' loop, one window per forward, with the scored labels counted directly (the docs undercount), in
    headlab's (lm-eval's) convention: a window is seq_len model inputs plus the scored token after them (the docs'
    max_length = seq_len + 1), and the last window starts early enough to be full."""
    nll_sum, counted, previous_end = 0.0, 0, 0
    window = seq_len + 1
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        begin = max(0, min(begin, end - window))  # the last window reaches back to a full window
        target_len = end - previous_end
        input_ids = ids[begin:end][None]
        labels = input_ids.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one
        nll_sum += float(loss) * scored
        counted += scored
        previous_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / counted), counted


def run(args) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark import median_time

    from headlab.core.data import load_corpus, split_text, tokenize
    from headlab.core.loading import load_model
    from headlab.measure.evaluate import _prefix_token, perplexity

    loaded = load_model(None, device=args.device)
    corpus = load_corpus(None)
    ids, _ = tokenize(loaded.tokenizer, split_text(corpus, "eval").text, MAX_TOKENS)
    ids = torch.cat([torch.tensor([_prefix_token(loaded.tokenizer)]), ids]).to(loaded.device)
    ours = {}

    def headlab_run():
        ours["result"] = perplexity(
            loaded, corpus, seq_len=SEQ_LEN, stride=STRIDE, batch_size=BATCH, max_tokens=MAX_TOKENS, progress=False
        )

    theirs = {}

    def reference_run():
        theirs["ppl"], theirs["count"] = reference_perplexity(loaded.model, ids, SEQ_LEN, STRIDE)

    headlab_s, headlab_all = median_time(headlab_run, args.repeats)
    reference_s, reference_all = median_time(reference_run, args.repeats)
    result = ours["result"]
    return {
        "seq_len": SEQ_LEN,
        "stride": STRIDE,
        "max_tokens": MAX_TOKENS,
        "batch_size": BATCH,
        "headlab_ppl": result.perplexity,
        "reference_ppl": theirs["ppl"],
        "relative_difference": abs(result.perplexity - theirs["ppl"]) / theirs["ppl"],
        "headlab_scored": result.scored_tokens,
        "reference_scored": theirs["count"],
        "headlab_s": headlab_s,
        "reference_s": reference_s,
        "headlab_runs": headlab_all,
        "reference_runs": reference_all,
        "speed_ratio": reference_s / headlab_s,
    }


def markdown(r: dict) -> str:
    return "\n".join(
        [
            f"Embedded model, eval split, first {r['max_tokens']} tokens, seq-len {r['seq_len']}, stride {r['stride']}; "
            f"headlab batches {r['batch_size']} windows per forward, the reference runs one.",
            "",
            "| implementation | perplexity | scored tokens | median s |",
            "|---|---|---|---|",
            f"| headlab eval | {r['headlab_ppl']:.6f} | {r['headlab_scored']} | {r['headlab_s']:.2f} |",
            f"| transformers-docs loop | {r['reference_ppl']:.6f} | {r['reference_scored']} | {r['reference_s']:.2f} |",
            "",
            f"Relative perplexity difference: {r['relative_difference']:.2e} (goal <= 1e-4). "
            f"Speed ratio (reference time / headlab time): **{r['speed_ratio']:.2f}x** (goal >= 1.0).",
        ]
    )
