"""Per-layer KV budgets with a retrieval cost (`convert-gqa --kv-budget 0.5 --method svd --retrieval-weight W`) on
the embedded model, training-free: the layout placed by calibration NLL alone against the layouts placed by NLL plus
W x the answer NLL of synthetic retrieval prompts (needle and multi-key over the calibration split of `broad`), for
several W from one cost measurement, at the same bytes. Perplexity on the calibration corpus's eval split and two
held-out domains; passkey (a template the cost never sees) at 512 and 2,048 tokens and multi-key at 2,048, haystack
from the prose domain's eval split."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization case's retrieval grid

TITLE = "Per-layer KV budgets with a retrieval cost (`convert-gqa --kv-budget --retrieval-weight`), training-free"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS, SEARCH_TOKENS = 2048, 512, 2048, 1024
FRACTION, WEIGHTS = 0.5, (0.0, 0.25, 1.0, 4.0)
COPY_WEIGHTS = (1.0,)  # weights of the copy cost (its own measurement, the same prompts' count and length)
REFINED, ROUNDS = (0.0, 1.0), 2  # weights whose layout is also refined (refine_counts), and its rounds
SHORT = dict(lengths=(512,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=2)  # 10 prompts
LONG = dict(lengths=(2048,), depths=(0.0, 0.5, 1.0), samples=2)  # 6 prompts per task


def run(args) -> dict:
    import copy
    import time
    from dataclasses import replace

    import torch
    from generalization import retrieval

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import TextSpec, load_corpus, split_text
    from headlab.core.loading import from_model, load_model
    from headlab.kv.budget import BudgetSpec, allocation, apply_counts, layer_costs, refine_counts, weighted_costs
    from headlab.measure.costs import kv_bytes_per_token
    from headlab.measure.evaluate import perplexity

    domains = ("broad", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}

    def measured(loaded) -> dict:
        ppl = {}
        for name in domains:
            ppl[name] = perplexity(loaded, corpora[name], split="eval", seq_len=SEQ_LEN, batch_size=4,
                                   max_tokens=EVAL_TOKENS, progress=False).perplexity  # fmt: skip
        short = retrieval(loaded, grid=SHORT)["passkey"]
        long = retrieval(loaded, tasks=("passkey", "niah_multikey"), grid=LONG)
        return {"ppl": ppl, "passkey_512": short, "passkey_2k": long["passkey"], "multikey_2k": long["niah_multikey"]}

    teacher = load_model(None, device=args.device)
    text = TextSpec(corpora["broad"], split="calibration", seq_len=SEQ_LEN, batch_size=4)
    merge_batches = text.but(max_tokens=CALIB_TOKENS).batches(teacher.tokenizer)
    search_batches = text.but(max_tokens=SEARCH_TOKENS).batches(teacher.tokenizer)
    spec = BudgetSpec(FRACTION, method="svd", search_tokens=SEARCH_TOKENS, retrieval_weight=1.0)
    haystack = split_text(corpora["broad"], "calibration").text
    start = time.perf_counter()
    work = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    costs = layer_costs(work, spec, merge_batches, search_batches, progress=False, retrieval_text=haystack)
    del work
    result = {"threads": torch.get_num_threads(), "domains": domains, "fraction": FRACTION,
              "retrieval_len": spec.retrieval_len, "retrieval_prompts": spec.retrieval_prompts,
              "cost_seconds": time.perf_counter() - start, "costs": costs.to_dict("records"), "rows": [],
              "kv_heads": teacher.layers[0].num_kv_heads}  # fmt: skip
    row = {"layout": "original (GQA-3)", "weight": None, "kv_bytes_per_token": kv_bytes_per_token(teacher)}
    result["rows"].append(row | measured(teacher))
    print(result["rows"][-1], flush=True)

    def layout_row(layout: str, weight: float, counts: list[int], **extra) -> None:
        student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        apply_counts(student, counts, spec, merge_batches, progress=False)
        row = {"layout": layout, "weight": weight, "counts": counts, "kv_bytes_per_token": kv_bytes_per_token(student)}
        result["rows"].append(row | extra | measured(student))
        print(result["rows"][-1], flush=True)

    for weight in WEIGHTS:
        counts = allocation(teacher, weighted_costs(costs, weight), FRACTION)
        layout_row("per-layer, text NLL" if weight == 0 else f"per-layer, text + {weight:g} x retrieval NLL", weight,
                   counts)  # fmt: skip
        if weight not in REFINED:
            continue
        start = time.perf_counter()
        refined_spec = replace(spec, retrieval_weight=weight, refine_rounds=ROUNDS)
        work = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        refined, rounds = refine_counts(work, refined_spec, counts, merge_batches, search_batches, False, haystack)
        del work
        refinement = {"rounds": rounds, "seconds": time.perf_counter() - start}
        name = f"{result['rows'][-1]['layout']}, refined ({ROUNDS} rounds)"
        if refined == counts:  # no round kept: the additive layout is the refined one, measured above
            result["rows"][-1]["refinement"] = refinement
            continue
        layout_row(name, weight, refined, refinement=refinement)
    # The copy cost (--retrieval-kind copy): the same weight on the NLL of copied random tokens instead of answers.
    start = time.perf_counter()
    copy_spec = replace(spec, retrieval_kind="copy")
    work = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    copy_costs = layer_costs(work, copy_spec, merge_batches, search_batches, progress=False)
    del work
    result["copy_cost_seconds"] = time.perf_counter() - start
    for weight in COPY_WEIGHTS:
        counts = allocation(teacher, weighted_costs(copy_costs, weight), FRACTION)
        layout_row(f"per-layer, text + {weight:g} x copy NLL (`--retrieval-kind copy`)", weight, counts)
    return result


def markdown(r: dict) -> str:
    # imported here, as run() imports headlab: the case module loads without torch
    from headlab.kv.budget import describe_rounds

    original = r["rows"][0]["kv_bytes_per_token"]
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads), svd merge calibrated on 2,048 `broad` calibration "
        f"tokens, budget {r['fraction']:g} of the KV cache. Per-layer costs measured once ({r['cost_seconds']:.0f} s): "
        f"text NLL on 1,024 calibration tokens and the answer NLL of {r['retrieval_prompts']} retrieval prompts of "
        f"{r['retrieval_len']:,} tokens (needle and multi-key over the calibration split)"
        + (f"; the copy rows' costs: the NLL of the copied tokens of as many random-token sequences of that length "
           f"({r['copy_cost_seconds']:.0f} s)" if "copy_cost_seconds" in r else "")
        + ". Perplexity on the first "
        "2,048 eval-split tokens at seq-len 512; passkey at 512 (10 prompts) and 2,048 tokens (6), multi-key at "
        "2,048 (6), haystack from the prose domain's eval split.",
        "",
        "| layout | KV cache kept | layers at 3 heads | " + " | ".join(r["domains"])
        + " | passkey @ 512 | passkey @ 2k | multi-key @ 2k |",
        "|---|---|---|" + "---|" * (len(r["domains"]) + 3),
    ]  # fmt: skip
    for row in r["rows"]:
        counts = row.get("counts")
        whole = r.get("kv_heads", max(counts or [0]))  # the original's KV heads per layer
        kept = "all" if counts is None else ", ".join(str(i) for i, g in enumerate(counts) if g == whole) or "none"
        accuracy = [f"{row[k][0]}/{row[k][1]}" for k in ("passkey_512", "passkey_2k", "multikey_2k")]
        lines.append(
            f"| {row['layout']} | {row['kv_bytes_per_token'] / original:.3f} | {kept} | "
            + " | ".join(f"{row['ppl'][d]:.2f}" for d in r["domains"]) + " | " + " | ".join(accuracy) + " |"
        )  # fmt: skip
    refined = [row for row in r["rows"] if "refinement" in row]
    if refined:
        lines.append("")
        lines.append("Refinement (`--refine-rounds`, measured cost J = calibration NLL + w x retrieval NLL of the "
                     "whole layout; a round's layout is kept only when J falls):")  # fmt: skip
        for row in refined:
            steps = describe_rounds(row["refinement"]["rounds"])
            lines.append(f"- {row['layout']}: {steps} ({row['refinement']['seconds']:.0f} s).")
    return "\n".join(lines)
