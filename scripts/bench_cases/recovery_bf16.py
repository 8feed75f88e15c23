"""The default recovery in float32 and in bfloat16 autocast (student and teacher) on a CPU with native bfloat16
kernels: the svd merge 3 -> 1 KV heads calibrated on `broad` (the recovery_recipe case's start), then
`--recover local,uptrain` with every setting at its default but `bf16`; perplexity on the four corpora of the
generalization case before and after, the recovery's wall time and the median uptraining step, both rows in one
run. What decides `UptrainConfig.bf16`'s default on such CPUs (headlab.recovery.uptrain.default_bf16)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the generalization case's settings and the edited models

TITLE = "Recovery in bfloat16 autocast on a CPU with bfloat16 kernels (svd 3 -> 1, `broad`, default budget)"
ROWS = {"float32": False, "bfloat16 autocast": True}


def run(args) -> dict:
    import statistics

    import torch
    from generalization import perplexities
    from recovery import _edited

    from headlab.core import cpu_matmul
    from headlab.core.data import load_corpus
    from headlab.core.loading import load_model
    from headlab.recovery.recover import RecoverySpec, recover
    from headlab.recovery.uptrain import UptrainConfig

    if args.device != "cpu" or not cpu_matmul.native_half_matmul():
        return {"skipped": "needs a CPU with native bfloat16 kernels (AVX512-BF16 or AMX)", "rows": []}
    domains = ("pydoc-topics", "broad", "speeches", "encyclopedia")
    corpora = {name: load_corpus(name) for name in domains}
    teacher = load_model(None, device=args.device)
    rows = []
    for name, bf16 in ROWS.items():
        edited = _edited("svd", teacher, corpora["broad"], torch.device(args.device))
        before = perplexities(edited, corpora)
        record = recover(edited, teacher, RecoverySpec(uptrain=UptrainConfig(bf16=bf16)), data=corpora["broad"],
                         progress=False)  # fmt: skip
        curve = record["tables"]["curve"]
        elapsed = curve["seconds"].diff().dropna()  # the held-out checks' steps are the slow outliers
        rows.append({"row": name, "bf16": bf16, "before": before, "after": perplexities(edited, corpora),
                     "seconds": record["seconds"], "uptrain_seconds": record["uptrain"]["seconds"],
                     "median_step_seconds": statistics.median(elapsed), "steps": record["uptrain"]["steps_run"],
                     "kept_step": record["uptrain"]["kept_step"], "local_kept": record["local"]["kept"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del edited
    return {"domains": domains, "threads": torch.get_num_threads(), "rows": rows}


def markdown(r: dict) -> str:
    if r.get("skipped"):
        return f"Not measured: {r['skipped']}"
    domains, (fp32, bf16) = r["domains"], r["rows"]
    lines = [
        "Embedded SmolLM2-135M (float32 weights, CPU with AVX512-BF16), svd 3 -> 1 calibrated on `broad` (before: "
        + ", ".join(f"{d} {fp32['before'][d]:.1f}" for d in domains)
        + "), then the default recovery (local reconstruction, 64 uptraining steps of 4 x 256 tokens) in float32 and "
        "in bfloat16 autocast of student and teacher, one after the other in one run; perplexity on the first 2,048 "
        "eval-split tokens of each corpus at seq-len 512. Step: the median uptraining step (held-out checks add to a "
        "few steps).",
        "",
        "| uptraining | " + " | ".join(domains) + " | after / before (speeches, encyclopedia) | recovery s | "
        "uptraining s | median step s |",
        "|---|" + "---|" * len(domains) + "---|---|---|---|",
    ]
    if r.get("note"):
        lines[1:1] = ["", r["note"]]
    for row in r["rows"]:
        ratios = ", ".join(f"{row['after'][d] / row['before'][d]:.3f}" for d in ("speeches", "encyclopedia"))
        lines.append(
            f"| {row['row']} | "
            + " | ".join(f"{row['after'][d]:.2f}" for d in domains)
            + f" | {ratios} | {row['seconds']:.0f} | {row['uptrain_seconds']:.0f} | {row['median_step_seconds']:.2f} |"
        )
    lines += [
        "",
        f"bfloat16 over float32: recovery {fp32['seconds'] / bf16['seconds']:.2f}x faster, uptraining "
        f"{fp32['uptrain_seconds'] / bf16['uptrain_seconds']:.2f}x, median step "
        f"{fp32['median_step_seconds'] / bf16['median_step_seconds']:.2f}x.",
    ]
    return "\n".join(lines)
