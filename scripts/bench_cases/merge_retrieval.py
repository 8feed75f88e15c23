"""Where the svd merge loses retrieval: 3 -> 1 KV heads everywhere against per-layer layouts that leave some layers
unmerged (`headlab.kv.budget.apply_counts`, the per-layer conversion of `convert-gqa --kv-budget`), training-free.
Kept whole: the layers holding the heads of highest retrieval score (`retrieval_head_scores` on passkey prompts over
the calibration split of `broad`, never the evaluation's haystack), and each half of the network in turn. Columns:
KV numbers per token, perplexity on the generalization case's corpora, passkey and multi-key accuracy at 2k
(haystack: the prose domain's eval split). If retrieval lived in the retrieval heads' layers, keeping those whole
would restore it; the rows say whether it does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization case's corpora, windows and prompts

TITLE = "Where the svd merge loses retrieval: per-layer layouts against 3 -> 1 everywhere (training-free)"
DOMAINS = ("broad", "speeches", "encyclopedia")
TASKS = ("passkey", "niah_multikey")
TOP_LAYERS = (2, 5)  # rows keeping the layers of the highest retrieval scores whole


def _top_layers(scores, count: int) -> list[int]:
    """The `count` layers whose best head has the highest retrieval score, in layer order."""
    best = sorted(range(len(scores)), key=lambda i: -float(scores[i].max()))
    return sorted(best[:count])


def layouts(layers: int, top: dict[int, list[int]]) -> dict[str, list[int]]:
    """Row label -> the layers kept whole (every other layer merged 3 -> 1)."""
    half = layers // 2
    rows = {"3 -> 1 everywhere": []}
    rows |= {f"top-{n} retrieval layers kept ({', '.join(map(str, kept))})": kept for n, kept in top.items()}
    rows[f"layers 0-{half - 1} merged, {half}-{layers - 1} kept"] = list(range(half, layers))
    rows[f"layers {half}-{layers - 1} merged, 0-{half - 1} kept"] = list(range(half))
    return rows


def run(args) -> dict:
    import copy

    import torch
    from generalization import perplexities, retrieval
    from recovery import CALIB_TOKENS, SEQ_LEN

    from headlab.core.data import TextSpec, calibration_batches, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv.budget import BudgetSpec, apply_counts
    from headlab.pruning.scores import retrieval_head_scores

    corpora = {name: load_corpus(name) for name in DOMAINS}
    teacher = load_model(None, device=args.device)
    layers = len(teacher.layers)
    text = TextSpec(corpora["broad"], split="calibration", batch_size=2)
    scores = retrieval_head_scores(teacher, text=text, length=1024, count=8, progress=False)
    top = {n: _top_layers(scores, n) for n in TOP_LAYERS}
    kv_original = sum(2 * layer.num_kv_heads * layer.head_dim for layer in teacher.layers)
    rows = [{"layout": "original", "kept": list(range(layers)), "kv_numbers": kv_original,
             "perplexity": perplexities(teacher, corpora), "retrieval": retrieval(teacher, TASKS)}]  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    batches = calibration_batches(teacher.tokenizer, corpora["broad"], seq_len=SEQ_LEN, batch_size=4,
                                  max_tokens=CALIB_TOKENS)  # fmt: skip
    for label, kept in layouts(layers, top).items():
        student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer, spec="svd")
        counts = [layer.num_kv_heads if layer.index in kept else 1 for layer in student.layers]
        record = apply_counts(student, counts, BudgetSpec(fraction=1.0, method="svd"), batches, progress=False,
                              record_layout=False)  # fmt: skip
        rows.append({"layout": label, "kept": kept, "kv_numbers": record["kv_numbers_per_token_without_padding"],
                     "perplexity": perplexities(student, corpora), "retrieval": retrieval(student, TASKS)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del student
    top_heads = sorted(((float(s[h]), i, h) for i, s in enumerate(scores) for h in range(len(s))), reverse=True)[:8]
    return {"domains": list(DOMAINS), "tasks": list(TASKS), "threads": torch.get_num_threads(), "rows": rows,
            "top_heads": [{"layer": i, "head": h, "score": v} for v, i, h in top_heads]}  # fmt: skip


def markdown(r: dict) -> str:
    original = r["rows"][0]["kv_numbers"]
    heads = ", ".join(f"{t['layer']}.{t['head']} ({t['score']:.2f})" for t in r["top_heads"])
    lines = [
        "Embedded SmolLM2-135M (float32, CPU), svd merge calibrated on `broad`, training-free. Perplexity on the first "
        "2,048 eval-split tokens of each corpus at seq-len 512; retrieval: 2,048-token prompts, 6 per task, haystack "
        f"from the prose domain's eval split. Highest retrieval scores (layer.head): {heads}.",
        "",
        "| layout | KV numbers / token (share) | "
        + " | ".join(r["domains"])
        + " | "
        + " | ".join(f"{t} @ 2k" for t in r["tasks"])
        + " |",
        "|---|---|" + "---|" * (len(r["domains"]) + len(r["tasks"])),
    ]
    for row in r["rows"]:
        accuracy = [f"{row['retrieval'][t][0]}/{row['retrieval'][t][1]}" for t in r["tasks"]]
        lines.append(
            f"| {row['layout']} | {row['kv_numbers']:,} ({row['kv_numbers'] / original:.0%}) | "
            + " | ".join(f"{row['perplexity'][d]:.1f}" for d in r["domains"])
            + " | " + " | ".join(accuracy) + " |"
        )  # fmt: skip
    return "\n".join(lines)
