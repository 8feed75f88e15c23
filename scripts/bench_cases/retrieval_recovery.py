"""Recovery with retrieval windows on the embedded model: the svd merge 3 -> 1 KV heads calibrated on `broad`, then
the default recovery (local + 64 uptraining steps) with every LONG_EVERY-th step a synthetic key-value needle prompt
of LONG_SEQ_LEN tokens over the calibration text, distilled on the answer (`--long-kind retrieval`); perplexity on
four corpora and passkey at 2k (a template never trained on), against the generalization case's rows for the same
model without retrieval windows."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization case's settings and the edited models

TITLE = "Recovery with retrieval windows (`uptrain --long-kind retrieval`): passkey after the svd merge"
LONG_SEQ_LEN = int(os.environ.get("HEADLAB_BENCH_RETRIEVAL_LEN", 2048))
LONG_EVERY = int(os.environ.get("HEADLAB_BENCH_RETRIEVAL_EVERY", 2))
MODELS = tuple(os.environ.get("HEADLAB_BENCH_RETRIEVAL_MODELS", "svd").split(","))


def run(args) -> dict:
    import time

    import torch
    from generalization import CALIB_TOKENS, EVAL_TOKENS, perplexities, retrieval
    from recovery import _edited

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import load_corpus
    from headlab.core.loading import load_model
    from headlab.recovery.recover import RecoverySpec, recover
    from headlab.recovery.uptrain import UptrainConfig

    domains = ("pydoc-topics", "broad", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}

    def ppl(loaded) -> dict:
        return perplexities(loaded, corpora)

    def tasks(loaded) -> dict:
        return retrieval(loaded, ("passkey", "niah_multikey"))

    teacher = load_model(None, device=args.device)
    result = {"long_seq_len": LONG_SEQ_LEN, "long_every": LONG_EVERY, "domains": domains, "rows": [],
              "threads": torch.get_num_threads(), "load": list(os.getloadavg())}  # fmt: skip
    result["rows"].append({"model": "original", "ppl": ppl(teacher), "tasks": tasks(teacher)})
    print(result["rows"][-1], flush=True)
    for name in MODELS:
        edited = _edited(name, teacher, corpora["broad"], torch.device(args.device))
        config = UptrainConfig(long_seq_len=LONG_SEQ_LEN, long_every=LONG_EVERY, long_kind="retrieval")
        start = time.perf_counter()
        record = recover(edited, teacher, RecoverySpec(uptrain=config), data=corpora["broad"], progress=False)
        up = record["uptrain"]
        row = {"model": f"{name} + recovery with retrieval windows", "seconds": time.perf_counter() - start,
               "tokens": record["tokens_seen"], "local_kept": record["local"]["kept"], "kept_step": up["kept_step"],
               "steps": up["steps_run"], "ppl": ppl(edited), "tasks": tasks(edited)}  # fmt: skip
        result["rows"].append(row)
        print(row, flush=True)
        del edited
    result["calib_tokens"], result["eval_tokens"] = CALIB_TOKENS, EVAL_TOKENS
    return result


def markdown(r: dict) -> str:
    from benchmark import saved_result

    before = {row["model"]: row for row in saved_result("generalization").get("rows", [])}
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads, load averages "
        f"{', '.join(f'{x:.1f}' for x in r['load'])} at the start); the generalization case's settings (perplexity on "
        f"the first {r['eval_tokens']:,} eval tokens of each corpus at seq-len 512; 2k prompts at depths 0, 0.5, 1 "
        f"x 2 samples over the prose domain's eval split). Retrieval windows: every {r['long_every']}th uptraining "
        f"step one {r['long_seq_len']:,}-token key-value needle prompt (RULER niah_single / niah_multikey in turn) "
        "over the calibration text, KL to the original on the answer; passkey is never trained on. Rows marked "
        "(generalization) come from that case's saved run.",
        "",
        "| model | " + " | ".join(r["domains"]) + " | passkey @ 2k | multi-key @ 2k |",
        "|---|" + "---|" * (len(r["domains"]) + 2),
    ]

    def line(name: str, ppl: dict, passkey, multikey) -> str:
        cells = " | ".join(f"{ppl[d]:.2f}" if d in ppl else "" for d in r["domains"])
        show = lambda pair: f"{pair[0]}/{pair[1]}" if pair else ""  # noqa: E731
        return f"| {name} | {cells} | {show(passkey)} | {show(multikey)} |"

    for row in r["rows"]:
        lines.append(line(row["model"], row["ppl"], row["tasks"].get("passkey"), row["tasks"].get("niah_multikey")))
        if row["model"] == "original":
            for old in ("svd", "svd + recovery"):
                if old in before:
                    lines.append(line(f"{old} (generalization)", before[old]["ppl"], before[old].get("passkey"), None))
    for row in r["rows"][1:]:
        lines.append(
            f"\n{row['model']}: {row['tokens']:,} tokens, {row['seconds']:.0f} s; local stage "
            f"{'kept' if row['local_kept'] else 'undone'}; uptraining kept step {row['kept_step']} of {row['steps']}."
        )
    return "\n".join(lines)
