"""#31's "not worse after recovery": the per-layer layout at a third of the KV cache (`convert-gqa --kv-budget 0.333
--method svd --allow-empty-layer`, the kv_budget case's row) before and after the default recovery (local
reconstruction, then 64 uptraining steps on `broad`), against uniform MQA by the svd merge after the same recovery
(the generalization case's saved `svd + recovery` row: same merge calibration, same recovery, same evaluation).
Perplexity on the first 2,048 eval-split tokens of the generalization case's four corpora; passkey at 2k."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization and kv_budget cases' settings

TITLE = "Per-layer KV budget at a third of the cache after recovery, against uniform MQA after recovery"
FRACTION = 1 / 3


def run(args) -> dict:
    import copy

    import torch
    from benchmark import saved_result
    from generalization import perplexities, retrieval
    from kv_budget import CALIB_TOKENS, SEARCH_TOKENS, SEQ_LEN

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv.budget import BudgetSpec, allocation, apply_counts, layer_costs
    from headlab.recovery.recover import RecoverySpec, recover

    domains = ("pydoc-topics", "broad", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}
    teacher = load_model(None, device=args.device)
    text = TextSpec(corpora["broad"], split="calibration", seq_len=SEQ_LEN, batch_size=4)
    merge_batches = text.but(max_tokens=CALIB_TOKENS).batches(teacher.tokenizer)
    search_batches = text.but(max_tokens=SEARCH_TOKENS).batches(teacher.tokenizer)
    spec = BudgetSpec(FRACTION, method="svd", search_tokens=SEARCH_TOKENS, allow_empty_layer=True)
    costs = layer_costs(from_model(copy.deepcopy(teacher.model), teacher.tokenizer), spec, merge_batches,
                        search_batches, progress=False)  # fmt: skip
    counts = allocation(teacher, costs, FRACTION)
    student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    apply_counts(student, counts, spec, merge_batches, progress=False)
    before = {"ppl": perplexities(student, corpora), "passkey": retrieval(student)["passkey"]}
    print({"counts": counts, **before}, flush=True)
    start = time.perf_counter()
    record = recover(student, teacher, RecoverySpec(), data=corpora["broad"], progress=False)
    seconds = time.perf_counter() - start
    up = record["uptrain"]
    after = {"ppl": perplexities(student, corpora), "passkey": retrieval(student)["passkey"]}
    print(after, flush=True)
    uniform = {row["model"]: row for row in saved_result("generalization").get("rows", []) if row["calibration"] in
               ("broad", "")}  # fmt: skip
    return {"domains": domains, "fraction": FRACTION, "counts": counts, "before": before, "after": after,
            "recovery_seconds": seconds, "tokens": record["tokens_seen"], "local_kept": record["local"]["kept"],
            "kept_step": up["kept_step"], "steps": up["steps_run"], "refused": up["refused_worse_on_a_domain"],
            "threads": torch.get_num_threads(), "load": list(os.getloadavg()),
            "uniform": {name: uniform[name] for name in ("original", "svd", "svd + recovery") if name in uniform}}  # fmt: skip


def markdown(r: dict) -> str:
    domains = r["domains"]
    free = [i for i, g in enumerate(r["counts"]) if g == 0]
    full = [i for i, g in enumerate(r["counts"]) if g == 3]
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads). Per-layer layout at a third of the KV cache "
        f"(llama.cpp's bytes), svd merge and costs as in the per-layer budget table: 3 KV heads in layers "
        f"{', '.join(map(str, full)) or 'none'}, no attention in {', '.join(map(str, free)) or 'none'}, 1 elsewhere. "
        f"Recovery: the default (local reconstruction, then uptraining on `broad`): {r['tokens']:,} tokens, "
        f"{r['recovery_seconds']:.0f} s; local stage {'kept' if r['local_kept'] else 'not kept'}; uptraining kept "
        f"step {r['kept_step']} of {r['steps']}. Uniform rows: the generalization case's saved run (same merge "
        "calibration, recovery and evaluation). Perplexity on the first 2,048 eval-split tokens at seq-len 512; "
        "passkey: 2,048-token prompts, 6 per row.",
        "",
        "| model | " + " | ".join(domains) + " | passkey @ 2k |",
        "|---|" + "---|" * len(domains) + "---|",
    ]

    def line(name: str, ppl: dict, passkey) -> str:
        key = f"{passkey[0]}/{passkey[1]}" if passkey else ""
        return f"| {name} | " + " | ".join(f"{ppl[d]:.2f}" for d in domains) + f" | {key} |"

    labels = {"original": "original", "svd": "uniform MQA (svd)", "svd + recovery": "uniform MQA (svd) + recovery"}
    for name, label in labels.items():
        if name in r["uniform"]:
            lines.append(line(label, r["uniform"][name]["ppl"], r["uniform"][name].get("passkey")))
    lines.append(line("per-layer, a third", r["before"]["ppl"], r["before"]["passkey"]))
    lines.append(line("per-layer, a third + recovery", r["after"]["ppl"], r["after"]["passkey"]))
    if "svd + recovery" in r["uniform"]:
        ratios = ", ".join(
            f"{d} {r['after']['ppl'][d] / r['uniform']['svd + recovery']['ppl'][d]:.2f}x" for d in domains
        )
        lines.append(f"\nPer-layer after recovery over uniform MQA after recovery: {ratios}.")
    return "\n".join(lines)
