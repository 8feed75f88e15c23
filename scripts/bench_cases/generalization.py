"""Calibration that generalizes, on the embedded model: the svd merge 3 -> 1 KV heads and MLA at the MQA budget,
calibrated on the Python reference alone (the former default) and on `broad` (the default), each measured on its
calibration corpus's eval split and on held-out domains it never saw (speeches, encyclopedia); then both
`broad`-calibrated models with the default recovery (`--recover local,uptrain`), with passkey retrieval at 2k tokens."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the recovery case builds the same edited models: reuse it

from headlab.recovery.choices import MLA_RECOVERY_GENERATED as MLA_GENERATED  # noqa: E402 - torch-free
from headlab.recovery.choices import MLA_RECOVERY_GENERATED_START as MLA_GENERATED_START  # noqa: E402

TITLE = "Generalization: calibration corpus, out-of-domain perplexity and recovery (`--data broad`, the default)"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS = 2048, 512, 2048
CALIBRATIONS = ("pydoc-topics", "broad")
PASSKEY = dict(lengths=(2048,), depths=(0.0, 0.5, 1.0), samples=2)  # 6 prompts, haystack: the prose domain's eval split
STEPS = int(os.environ.get("HEADLAB_BENCH_GEN_STEPS", 0)) or None  # None: the default recovery budget
# what each command's recovery adds to the Python defaults: convert-mla samples half of each batch from the teacher
COMMAND_DEFAULTS = {"svd": {}, "mla": {"generated": MLA_GENERATED, "generated_start": MLA_GENERATED_START}}


def perplexities(loaded, corpora: dict) -> dict:
    """Perplexity on the first EVAL_TOKENS eval-split tokens of each corpus at SEQ_LEN ({name: corpus})."""
    from headlab.measure.evaluate import perplexity

    return {
        name: perplexity(loaded, corpus, split="eval", seq_len=SEQ_LEN, batch_size=4, max_tokens=EVAL_TOKENS,
                         progress=False).perplexity  # fmt: skip
        for name, corpus in corpora.items()
    }


def retrieval(loaded, tasks=("passkey",), grid: dict | None = None) -> dict:
    """{task: [correct, prompts]} of the PASSKEY grid (or `grid`), the haystack from the prose domain's eval split."""
    from headlab.core.data import TextSpec, load_corpus
    from headlab.measure.longctx import long_context

    haystack = TextSpec(load_corpus("prose"), split="eval", max_tokens=None)
    measured = long_context(loaded, text=haystack, tasks=tasks, position_sequences_count=0, progress=False, **(grid or PASSKEY))
    return {row.task: [int(row.correct), int(row.prompts)] for row in measured.lengths.itertuples()}


def run(args) -> dict:
    import time

    import torch

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import load_corpus
    from headlab.core.loading import load_model
    from headlab.recovery.recover import RecoverySpec, recover
    from headlab.recovery.uptrain import UptrainConfig

    domains = ("pydoc-topics", "broad", *DEFAULT_EVAL_DOMAINS)
    corpora = {name: load_corpus(name) for name in domains}

    def ppl(loaded) -> dict:
        return perplexities(loaded, corpora)

    def passkey(loaded) -> list[int]:
        return retrieval(loaded)["passkey"]

    from recovery import _edited  # the edited models exactly as the recovery case (and the commands) build them

    teacher = load_model(None, device=args.device)
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS, "domains": domains,
              "threads": torch.get_num_threads(), "load": list(os.getloadavg()), "rows": []}  # fmt: skip
    result["rows"].append({"model": "original", "calibration": "", "ppl": ppl(teacher), "passkey": passkey(teacher)})
    print(result["rows"][-1], flush=True)
    for calibration in CALIBRATIONS:
        for name in ("svd", "mla"):
            start = time.perf_counter()
            edited = _edited(name, teacher, corpora[calibration], torch.device(args.device))
            row = {"model": name, "calibration": calibration, "build_seconds": time.perf_counter() - start}
            row["ppl"] = ppl(edited)
            if calibration == "broad":
                row["passkey"] = passkey(edited)
                result["rows"].append(row)
                print(row, flush=True)
                budget = {"steps": STEPS} if STEPS else {}
                spec = RecoverySpec(uptrain=UptrainConfig(**COMMAND_DEFAULTS[name], **budget))
                recipe = {"steps": spec.uptrain.steps, "lr": spec.uptrain.lr, "generated": spec.uptrain.generated}
                result.setdefault("recipes", {})[name] = recipe
                start = time.perf_counter()
                record = recover(edited, teacher, spec, data=corpora[calibration], progress=False)
                up, local = record["uptrain"], record["local"]
                row = {"model": f"{name} + recovery", "calibration": calibration,
                       "recovery_seconds": time.perf_counter() - start, "tokens": record["tokens_seen"],
                       "local_kept": local["kept"], "kept_step": up["kept_step"], "steps": up["steps_run"],
                       "refused": up["refused_worse_on_a_domain"], "heldout_before": up["heldout_domains_before"],
                       "heldout_after": up["heldout_domains_after"], "ppl": ppl(edited),
                       "passkey": passkey(edited)}  # fmt: skip
            result["rows"].append(row)
            print(row, flush=True)
            del edited
    return result


def _ratio(row: dict, original: dict, calibration: str, domain: str) -> float:
    """(out-of-domain / in-domain perplexity) of the model over the same ratio of the original: how much more the
    edit costs on text the calibration never saw than on the calibration corpus's own eval split."""
    return (row["ppl"][domain] / row["ppl"][calibration]) / (original["ppl"][domain] / original["ppl"][calibration])


def _recipes(r: dict) -> str:
    """The recoveries the result ran (results before 2026-12-07 ran the default of the time, not recorded)."""
    if "recipes" not in r:
        return "the default `--recover local,uptrain` of the time on `broad` (64 steps at lr 3e-5, calibration text)"

    def sampled(recipe: dict) -> str:
        return f", {recipe['generated']:.0%} of each batch sampled from the original" if recipe["generated"] else ""

    return "; ".join(
        f"{name}, `--recover local,uptrain` on `broad` as its command does by default: {recipe['steps']} steps at lr "
        f"{recipe['lr']:g}{sampled(recipe)}"
        for name, recipe in r["recipes"].items()
    )


def markdown(r: dict) -> str:
    original = r["rows"][0]
    held = [d for d in r["domains"] if d not in ("pydoc-topics", "broad")]
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads, load averages "
        f"{', '.join(f'{x:.1f}' for x in r['load'])} at the start), perplexity on the first {r['eval_tokens']:,} "
        f"eval-split tokens of each corpus at seq-len {r['seq_len']}; edits calibrated on {r['calib_tokens']:,} "
        f"calibration-split tokens of the corpus named; recovery: {_recipes(r)}. Passkey: 2,048-token prompts, "
        "depths 0, 0.5, 1 x 2 samples, haystack from the "
        "prose domain's eval split. `advantage`: (held-out / in-domain perplexity) over the original's same ratio (1 = the edit costs "
        "as much out of domain as in it).",
        "",
        "| model | calibrated on | " + " | ".join(r["domains"]) + " | " + " | ".join(f"advantage {d}" for d in held)
        + " | passkey @ 2k |",
        "|---|---|" + "---|" * (len(r["domains"]) + len(held) + 1),
    ]
    for row in r["rows"]:
        ratios = [
            f"{_ratio(row, original, row['calibration'], d):.2f}" if row["calibration"] else "1" for d in held
        ]
        key = row.get("passkey")
        lines.append(
            f"| {row['model']} | {row['calibration'] or '-'} | "
            + " | ".join(f"{row['ppl'][d]:.2f}" for d in r["domains"])
            + " | " + " | ".join(ratios) + f" | {f'{key[0]}/{key[1]}' if key else ''} |"
        )
    recovered = [row for row in r["rows"] if "recovery" in row["model"]]
    for row in recovered:
        lines.append("")
        lines.append(
            f"{row['model']}: {row['tokens']:,} tokens, {row['recovery_seconds']:.0f} s; local stage "
            f"{'kept' if row['local_kept'] else 'undone (a held-out domain got worse)'}; uptraining kept step "
            f"{row['kept_step']} of {row['steps']}, {len(row['refused'])} better-overall states refused for a worse "
            "domain; held-out calibration perplexity per domain before -> after: "
            + ", ".join(f"{d} {row['heldout_before'][d]:.1f} -> {row['heldout_after'][d]:.1f}" for d in
                        row["heldout_before"])  # fmt: skip
        )
    return "\n".join(lines)
