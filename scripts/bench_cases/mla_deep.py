"""Deep MLA budgets and a low-rank query on the embedded model: MLA at 48 KV numbers per token per layer (12.5% of the
source's 384, X-EcoMLA's SmolLM-135M configuration), training-free and after the default recovery, on the calibration
corpus (`broad`), the Python reference and two held-out domains, with passkey at 2k; and the GQA-budget MLA with the
query through q_lora_rank 288 and 144 against one full q_proj, training-free."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization case's measures

TITLE = "Deep MLA budgets (`convert-mla --budget 48`) and a low-rank query (`--q-lora-rank`)"
from generalization import CALIB_TOKENS, EVAL_TOKENS, SEQ_LEN  # noqa: E402 - the same measures as that case

DEEP_BUDGET = 48
QUERY_RANKS = (None, 288, 144)  # at the GQA budget; None: one full q_proj
STEPS = int(os.environ.get("HEADLAB_BENCH_GEN_STEPS", 0)) or None  # None: the default recovery budget
COMMAND = "headlab convert-mla --budget 48 [--recover local,uptrain]; headlab convert-mla --budget gqa --q-lora-rank R"


def run(args) -> dict:
    import time

    import torch
    from generalization import COMMAND_DEFAULTS, perplexities, retrieval

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import calibration_batches, load_corpus
    from headlab.core.loading import load_model
    from headlab.kv.mla import convert_to_mla, plan_mla
    from headlab.recovery.recover import RecoverySpec, recover
    from headlab.recovery.uptrain import UptrainConfig

    domains = ("broad", "pydoc-topics", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}

    def ppl(loaded, names=domains) -> dict:
        return perplexities(loaded, {name: corpora[name] for name in names})

    def passkey(loaded) -> list[int]:
        return retrieval(loaded)["passkey"]

    def params(model) -> int:
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    teacher = load_model(None, device=args.device)
    batches = calibration_batches(teacher.tokenizer, corpora["broad"], seq_len=SEQ_LEN, batch_size=4,
                                  max_tokens=CALIB_TOKENS)  # fmt: skip
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS, "domains": domains,
              "threads": torch.get_num_threads(), "load": list(os.getloadavg()), "deep": [], "query": []}  # fmt: skip
    result["deep"].append({"model": "original", "numbers": 384, "ppl": ppl(teacher), "passkey": passkey(teacher)})
    print(result["deep"][-1], flush=True)

    start = time.perf_counter()
    mla, record = convert_to_mla(teacher, plan_mla(teacher, DEEP_BUDGET), batches, progress=False)
    split = f"{record['plan']['kv_lora_rank']}+{record['plan']['rope_dim']}"
    row = {"model": f"MLA {split}", "numbers": DEEP_BUDGET, "build_seconds": time.perf_counter() - start,
           "search": record["rope_dim_search"], "steps": {k: v.get("calibration_nll") for k, v in
                                                          record["steps"].items()}}  # fmt: skip
    row |= {"ppl": ppl(mla), "passkey": passkey(mla)}
    result["deep"].append(row)
    print(row, flush=True)
    sampled = COMMAND_DEFAULTS["mla"]  # convert-mla's recovery: half of each batch sampled from the teacher
    spec = RecoverySpec(uptrain=UptrainConfig(**sampled, **({"steps": STEPS} if STEPS else {})))
    start = time.perf_counter()
    recovered = recover(mla, teacher, spec, data=corpora["broad"], progress=False)
    result["recipe"] = {"steps": spec.uptrain.steps, "lr": spec.uptrain.lr, **sampled}
    result["default_budget"] = STEPS is None  # HEADLAB_BENCH_GEN_STEPS unset
    up, local = recovered["uptrain"], recovered["local"]
    row = {"model": f"MLA {split} + recovery", "numbers": DEEP_BUDGET, "recovery_seconds": time.perf_counter() - start,
           "tokens": recovered["tokens_seen"], "local_kept": local["kept"], "kept_step": up["kept_step"],
           "steps_run": up["steps_run"], "ppl": ppl(mla), "passkey": passkey(mla)}  # fmt: skip
    result["deep"].append(row)
    print(row, flush=True)
    del mla

    plain = ("broad", *DEFAULT_EVAL_DOMAINS)
    for rank in QUERY_RANKS:
        plan = plan_mla(teacher, "gqa", q_lora_rank=rank)
        model, record = convert_to_mla(teacher, plan, batches, progress=False)
        row = {"q_lora_rank": rank, "parameters": params(model.model), "ppl": ppl(model, plain),
               "query_step": record["steps"].get("query_rank")}  # fmt: skip
        result["query"].append(row)
        print(row, flush=True)
        del model
    result["source_parameters"] = params(teacher.model)
    return result


def _recipe(r: dict) -> str:
    """The recovery the result measured (results before 2026-12-07 ran the default of the time, not recorded)."""
    recipe = r.get("recipe")
    if recipe is None:
        return "the default `--recover local,uptrain` of the time (64 steps at lr 3e-5, calibration text alone)"
    sampled = f", {recipe['generated']:.0%} of each batch sampled from the original" if recipe["generated"] else ""
    default = " (convert-mla's default)" if r.get("default_budget", True) else ""
    return f"`--recover local,uptrain`, {recipe['steps']} steps at lr {recipe['lr']:g}{sampled}{default}"


def markdown(r: dict) -> str:
    original = r["deep"][0]
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads, load averages "
        f"{', '.join(f'{x:.1f}' for x in r['load'])} at the start); perplexity on the first {r['eval_tokens']:,} "
        f"eval-split tokens of each corpus at seq-len {r['seq_len']}; conversions calibrated on {r['calib_tokens']:,} "
        f"calibration-split tokens of `broad` (the default); recovery: {_recipe(r)} on "
        "`broad`. Passkey: 2,048-token prompts, depths 0, 0.5, 1 x 2 samples, haystack from the prose domain's eval "
        "split. `x original`: perplexity over the original's on the same corpus.",
        "",
        "| model | KV numbers / token / layer | " + " | ".join(r["domains"]) + " | x original (each domain) | "
        "passkey @ 2k |",
        "|---|---|" + "---|" * (len(r["domains"]) + 2),
    ]
    for row in r["deep"]:
        ratio = " / ".join(f"{row['ppl'][d] / original['ppl'][d]:.2f}" for d in r["domains"])
        key = row["passkey"]
        lines.append(
            f"| {row['model']} | {row['numbers']} | " + " | ".join(f"{row['ppl'][d]:.2f}" for d in r["domains"])
            + f" | {ratio} | {key[0]}/{key[1]} |"
        )
    deep = r["deep"][1]
    lines += [
        "",
        "Rope-dim search at 48 (calibration NLL): "
        + ", ".join(f"{t['kv_lora_rank']}+{t['rope_dim']} {t['calibration_nll']:.3f}" for t in deep["search"])
        + ". Calibration NLL along the steps (source -> after): "
        + ", ".join(f"{k} {v[0]:.3f} -> {v[1]:.3f}" for k, v in deep["steps"].items() if v) + ".",
    ]
    rec = r["deep"][2]
    lines.append(
        f"Recovery: {rec['tokens']:,} tokens, {rec['recovery_seconds']:.0f} s; local stage "
        f"{'kept' if rec['local_kept'] else 'undone'}; uptraining kept step {rec['kept_step']} of {rec['steps_run']}."
    )
    plain = list(r["query"][0]["ppl"])
    lines += [
        "",
        "Low-rank query at the GQA budget (320 + 64), training-free:",
        "",
        "| query | parameters | " + " | ".join(plain) + " | query step: attention-output rel. error |",
        "|---|---|" + "---|" * (len(plain) + 1),
    ]
    for row in r["query"]:
        step, rank = row["query_step"], row["q_lora_rank"]
        name = "one q_proj" if rank is None else f"q_lora_rank {rank}"
        error = "" if step is None else f"{step['attention_output_rel_error_mean']:.3f}"
        ppls = " | ".join(f"{row['ppl'][d]:.2f}" for d in plain)
        lines.append(f"| {name} | {row['parameters']:,} | {ppls} | {error} |")
    lines.append(f"\nThe source has {r['source_parameters']:,} parameters.")
    if r.get("note"):
        lines.append(f"\n(This result was {r['note']}.)")
    return "\n".join(lines)
