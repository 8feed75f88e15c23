"""Per-layer KV budgets on the embedded model (`convert-gqa --kv-budget F --method svd`): each layer keeps 3 or 1 KV
heads, placed by the measured per-layer costs, against the uniform layouts (GQA-3, MQA) and against the same counts
placed evenly over the depth (what a user without costs would pick), training-free, at a third, a half and two
thirds of the KV cache; and with `--allow-empty-layer` (a layer may lose its attention, which llama.cpp's deci then
caches nothing for) at a third, a sixth and an eighth. Perplexity on the calibration corpus's eval split and on two
held-out domains."""

from __future__ import annotations

TITLE = "Per-layer KV budgets (`convert-gqa --kv-budget`), training-free"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS, SEARCH_TOKENS = 2048, 512, 2048, 1024
FRACTIONS = (1 / 3, 1 / 2, 2 / 3)
EMPTY_FRACTIONS = (1 / 3, 1 / 6, 1 / 8)  # with layers left without attention (llama.cpp bytes)
# Layouts also refined (refine_counts, text NLL, ROUNDS rounds): (fraction, attention-free layers allowed)
REFINED, ROUNDS = ((1 / 2, False), (1 / 3, True)), 2


def _evenly(counts: list[int]) -> list[int]:
    """The same multiset of counts with the larger ones spread evenly over the layers (Bresenham-style)."""
    n, high = len(counts), max(counts)
    k = counts.count(high)
    return [high if (i + 1) * k // n > i * k // n else min(counts) for i in range(n)]


def run(args) -> dict:
    import copy
    import time
    from dataclasses import replace

    import torch

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv import gqa
    from headlab.kv.budget import BudgetSpec, allocation, apply_counts, layer_costs, refine_counts
    from headlab.measure.costs import kv_bytes_per_token
    from headlab.measure.evaluate import perplexity

    domains = ("broad", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}

    def ppl(loaded) -> dict:
        return {
            name: perplexity(loaded, corpora[name], split="eval", seq_len=SEQ_LEN, batch_size=4,
                             max_tokens=EVAL_TOKENS, progress=False).perplexity  # fmt: skip
            for name in domains
        }

    teacher = load_model(None, device=args.device)
    text = TextSpec(corpora["broad"], split="calibration", seq_len=SEQ_LEN, batch_size=4)
    merge_batches = text.but(max_tokens=CALIB_TOKENS).batches(teacher.tokenizer)
    search_batches = text.but(max_tokens=SEARCH_TOKENS).batches(teacher.tokenizer)
    spec = BudgetSpec(1.0, method="svd", search_tokens=SEARCH_TOKENS, allow_empty_layer=True)
    start = time.perf_counter()
    work = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    every = layer_costs(work, spec, merge_batches, search_batches, progress=False)  # with the 0-head rows
    costs = every[every.kv_heads > 0]
    cost_seconds = time.perf_counter() - start
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
              "search_tokens": SEARCH_TOKENS, "domains": domains, "threads": torch.get_num_threads(),
              "cost_seconds": cost_seconds, "costs": every.to_dict("records"), "rows": []}  # fmt: skip
    layers = len(teacher.layers)

    def measure(name: str, fraction: float, counts: list[int]) -> None:
        student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        record = apply_counts(student, counts, spec, merge_batches, progress=False)
        predicted = sum(
            float(every[(every.layer == i) & (every.kv_heads == g)].loss_increase.iloc[0]) for i, g in enumerate(counts)
        )
        # the bytes llama.cpp caches: a layer without attention holds none (transformers keeps a padding head)
        first = teacher.layers[0]
        element = kv_bytes_per_token(teacher) // (2 * first.num_kv_heads * first.head_dim * layers)
        row = {"layout": name, "fraction": fraction, "counts": counts,
               "kv_bytes_per_token": record["kv_numbers_per_token_without_padding"] * element,
               "kv_bytes_per_token_transformers": kv_bytes_per_token(student),
               "predicted_loss_increase": predicted, "ppl": ppl(student)}  # fmt: skip
        result["rows"].append(row)
        print(row, flush=True)

    result["rows"].append({"layout": "original (GQA-3)", "fraction": 1.0, "counts": [3] * layers,
                           "kv_bytes_per_token": kv_bytes_per_token(teacher), "predicted_loss_increase": 0.0,
                           "ppl": ppl(teacher)})  # fmt: skip
    student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    gqa.convert(student, 1, method="svd", batches=merge_batches)
    result["rows"].append({"layout": "uniform MQA (svd)", "fraction": 1 / 3, "counts": [1] * layers,
                           "kv_bytes_per_token": kv_bytes_per_token(student), "predicted_loss_increase": None,
                           "ppl": ppl(student)})  # fmt: skip
    del student

    def refined(name: str, fraction: float, counts: list[int], empty: bool) -> None:
        if (fraction, empty) not in REFINED:
            return
        start = time.perf_counter()
        work = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        chosen, rounds = refine_counts(work, replace(spec, fraction=fraction, allow_empty_layer=empty,
                                                     refine_rounds=ROUNDS), counts, merge_batches, search_batches,
                                       progress=False)  # fmt: skip
        del work
        seconds = time.perf_counter() - start
        measure(f"{name}, refined ({ROUNDS} rounds)", fraction, chosen)
        result["rows"][-1]["refinement"] = {"rounds": rounds, "seconds": seconds}

    for fraction in FRACTIONS:
        counts = allocation(teacher, costs, fraction)
        measure("per-layer (measured costs)", fraction, counts)
        if len(set(counts)) > 1:
            measure("per-layer (same counts, evenly spread)", fraction, _evenly(counts))
        refined("per-layer (measured costs)", fraction, counts, False)
    for fraction in EMPTY_FRACTIONS:
        counts = allocation(teacher, every, fraction)
        measure("per-layer, attention-free layers allowed", fraction, counts)
        refined("per-layer, attention-free layers allowed", fraction, counts, True)
    return result


def markdown(r: dict) -> str:
    # imported here, as run() imports headlab: the case module loads without torch
    from headlab.kv.budget import describe_rounds

    lines = [
        f"Embedded SmolLM2-135M (30 layers x 3 KV heads, float32, {r['threads']} threads). Each layer keeps 3 or 1 KV "
        f"heads; svd merge calibrated on {r['calib_tokens']:,} `broad` calibration tokens; per-layer costs measured "
        f"once on {r['search_tokens']:,} calibration tokens ({r['cost_seconds']:.0f} s, one forward pass per layer) "
        f"and reused for every budget. Perplexity on the first {r['eval_tokens']:,} eval-split tokens at seq-len "
        f"{r['seq_len']}; `predicted`: the sum of the chosen per-layer loss increases (nats/token). `KV cache kept`: "
        "what llama.cpp caches (a layer without attention holds nothing there; transformers keeps one zero-output "
        "padding head for it).",
        "",
        "| layout | KV cache kept | layers at 3 heads | predicted | " + " | ".join(r["domains"]) + " |",
        "|---|---|---|---|" + "---|" * len(r["domains"]),
    ]
    original = r["rows"][0]["kv_bytes_per_token"]
    for row in r["rows"]:
        full = [i for i, g in enumerate(row["counts"]) if g == 3]
        where = "all" if len(full) == len(row["counts"]) else (", ".join(map(str, full)) or "none")
        free = [i for i, g in enumerate(row["counts"]) if g == 0]
        where += f"; no attention: {', '.join(map(str, free))}" if free else ""
        predicted = "" if row["predicted_loss_increase"] is None else f"{row['predicted_loss_increase']:.3f}"
        lines.append(
            f"| {row['layout']} | {row['kv_bytes_per_token'] / original:.3f} | {where} | {predicted} | "
            + " | ".join(f"{row['ppl'][d]:.2f}" for d in r["domains"]) + " |"
        )
    for row in (row for row in r["rows"] if "refinement" in row):
        steps = describe_rounds(row["refinement"]["rounds"])
        lines.append(f"\n{row['layout']} at {row['fraction']:.3g} (`--refine-rounds`, calibration NLL of the whole "
                     f"layout): {steps} ({row['refinement']['seconds']:.0f} s).")  # fmt: skip
    return "\n".join(lines)
