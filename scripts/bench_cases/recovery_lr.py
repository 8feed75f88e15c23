"""The default uptraining learning rate, chosen on held-out calibration text (never the eval split): the svd-merged
and the mean-pooled 3 -> 1 embedded model, uptrained with each candidate lr for the same steps; held-out
calibration perplexity per step."""

from __future__ import annotations

import os

TITLE = "Uptraining learning rate (evidence for `headlab.recovery.uptrain.DEFAULT_LR`)"
LRS = (1e-5, 3e-5, 1e-4, 3e-4)
STEPS = 8  # a step budget, not minutes, so that the load of a shared machine cannot bias the comparison
SETTINGS = dict(seq_len=128, batch_size=4, heldout_tokens=1024, heldout_every=2, eval_tokens=0)
SETTINGS.update(gradient_checkpointing=False)
CALIB_TOKENS = 2048


def run(args) -> dict:
    import copy

    import torch

    from headlab.core.data import calibration_batches, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv import gqa
    from headlab.recovery.uptrain import uptrain

    corpus = load_corpus(None)
    teacher = load_model(None, device=args.device)
    result = {"threads": torch.get_num_threads(), "steps": STEPS, "settings": SETTINGS, "runs": {}}
    result["load_average_start"] = list(os.getloadavg())  # step budgets: load slows the run, it does not bias it
    for name in ("svd", "mean"):
        edited = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        if name == "svd":
            batches = calibration_batches(edited.tokenizer, corpus, seq_len=512, batch_size=4, max_tokens=CALIB_TOKENS)
            gqa.convert(edited, 1, method="svd", batches=batches)
        else:
            gqa.convert(edited, 1)
        runs = []
        candidates = [(lr, 0.1, 1.0) for lr in (LRS if name == "svd" else LRS[1:])]
        for lr, warmup, clip in candidates + [(1e-4, 0.0, 0.0)] * (name == "svd"):
            student = from_model(copy.deepcopy(edited.model), edited.tokenizer)
            up = uptrain(
                student,
                teacher,
                data=corpus,
                steps=STEPS,
                lr=lr,
                warmup=warmup,
                clip=clip,
                progress=False,
                **SETTINGS,
            )
            curve = up.curve.dropna(subset=["heldout_perplexity"])
            runs.append(
                {
                    "lr": lr,
                    "warmup": warmup,
                    "clip": clip,
                    "heldout": curve["heldout_perplexity"].tolist(),
                    "steps": curve["step"].tolist(),
                    "kept_step": up.meta["kept_step"],
                    "seconds": up.meta["seconds"],
                }
            )
            del student
        result["runs"][name] = runs
    return result


def _load(r: dict) -> str:
    load = r.get("load_average_start")
    return f", load average {' / '.join(f'{v:.1f}' for v in load)} at the start" if load else ""


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [
        f"{r['steps']} steps of {s['batch_size']} x {s['seq_len']} calibration tokens (KL, attention only, "
        f"{r['threads']} torch threads, CPU shared with other jobs{_load(r)}); held-out calibration perplexity "
        f"({s['heldout_tokens']:,} tokens, the calibration part's tail) at the steps listed. The eval split is not "
        "used. The svd model's last row is the old recipe (no warmup, no clipping).",
        "",
        "| model | lr | warmup / clip | held-out perplexity by step | best |",
        "|---|---|---|---|---|",
    ]
    for name, runs in r["runs"].items():
        for run in runs:
            path = " -> ".join(f"{v:,.1f}" for v in run["heldout"])
            lines.append(
                f"| 3 -> 1, {name} | {run['lr']:g} | {run['warmup']:g} / {run['clip']:g} | {path} | "
                f"{min(run['heldout']):,.1f} (step {run['kept_step']}) |"
            )
    return "\n".join(lines)
