"""Recovery (`--recover local,uptrain`) on the embedded model: three edited models (3 -> 1 KV heads by the svd merge
and by mean pooling; 90 heads pruned uniformly with --compensate) x {none, local, uptrain, local then uptrain}:
eval perplexity against wall time, tokens seen and peak memory, each stage bounded in tokens and steps (the same
models on any machine; results from before step budgets recorded minutes instead, and are rendered as such)."""

from __future__ import annotations

import os

TITLE = "Recovery: local reconstruction and uptraining (`--recover local,uptrain`, `headlab uptrain`)"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS = 2048, 512, 2048
# The uptraining budget in steps of 4 x 128 tokens (128: about what 8 minutes bought on 2 shared cores before budgets
# were in steps); on a shared machine the load is recorded as load averages.
UPTRAIN_STEPS = int(os.environ.get("HEADLAB_BENCH_UPTRAIN_STEPS", 128))
# mean before pruned: a run stopped by a deadline still has both KV merges; mla (convert-mla --budget mqa) last.
MODELS = ("svd", "mean", "pruned", "mla")
# HEADLAB_BENCH_RECOVERY_MODELS=svd,mean reruns some models (e.g. on a quieter machine) and keeps the others' rows from
# the previous results file, marked as carried over with their own load averages.
RERUN = tuple(m for m in os.environ.get("HEADLAB_BENCH_RECOVERY_MODELS", ",".join(MODELS)).split(",") if m)
LOCAL = dict(local_tokens=1024, local_seq_len=256, local_batch_size=4)
UPTRAIN = dict(
    steps=UPTRAIN_STEPS, seq_len=128, batch_size=4, heldout_tokens=1024, eval_tokens=0, gradient_checkpointing=False
)
COMMANDS = {
    "svd": "headlab convert-gqa --kv-heads 1 --method svd --calibration-tokens 2048",
    "mean": "headlab convert-gqa --kv-heads 1",
    "pruned": "headlab prune --count 90 --uniform --compensate --calibration-tokens 2048 --seq-len 512",
    "mla": "headlab convert-mla --budget mqa --calibration-tokens 2048",
}
RECOVER = {
    "none": "",
    "local": " --recover local",
    "uptrain": " --recover uptrain --recover-steps {steps}",
    "local+uptrain": " --recover local,uptrain --recover-steps {steps}",
}
# Results recorded before budgets were in steps: each stage was bounded in minutes.
RECOVER_MINUTES = {
    "none": "",
    "local": " --recover local --recover-minutes {local}",
    "uptrain": " --recover uptrain --recover-minutes {up}",
    "local+uptrain": " --recover local,uptrain --recover-minutes {both}",
}


def _edited(name, teacher, corpus, device):
    """The edited model `name`, built from a copy of the original as the matching command does."""
    import copy

    from headlab.core.data import calibration_batches
    from headlab.core.loading import from_model
    from headlab.kv import gqa
    from headlab.pruning import prune as P
    from headlab.pruning.scores import importance_scores
    from headlab.pruning.selection import select_heads
    from headlab.recovery.compensate import apply_compensation, compensation_batches, output_statistics

    if name == "mla":  # a new deepseek_v3 model beside the teacher, latent norms off (as recovery trains it)
        from headlab.kv.mla import convert_to_mla, plan_mla

        batches = calibration_batches(teacher.tokenizer, corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS)
        return convert_to_mla(teacher, plan_mla(teacher, "mqa"), batches, progress=False)[0]
    student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer, spec=name)
    if name == "svd":
        batches = calibration_batches(student.tokenizer, corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS)
        gqa.convert(student, 1, method="svd", batches=batches)
    elif name == "mean":
        gqa.convert(student, 1)
    else:
        scores = importance_scores(
            student, data=corpus, seq_len=SEQ_LEN, batch_size=4, max_tokens=CALIB_TOKENS, progress=False
        )
        pruned = select_heads(student.layers, scores, count=90, uniform=True)
        batches = compensation_batches(student, corpus, seq_len=SEQ_LEN, max_tokens=CALIB_TOKENS)
        apply_compensation(student, pruned, output_statistics(student, batches, progress=False), "ridge")
        P.apply_mask(student, pruned)
    return student


def _stage(student, teacher, corpus, stages, device):
    """One recovery run through headlab.recovery.recover, with its wall time and peak memory."""
    import time

    from benchmark import PeakMemory

    from headlab.recovery.recover import RecoverySpec, recover
    from headlab.recovery.uptrain import UptrainConfig

    spec = RecoverySpec(stages=stages, uptrain=UptrainConfig(**UPTRAIN), **LOCAL)
    start = time.perf_counter()
    with PeakMemory(device) as memory:
        record = recover(student, teacher, spec, data=corpus, progress=False)
    out = {"seconds": time.perf_counter() - start, "peak_extra_bytes": memory.extra}
    if "uptrain" in record:
        up = record["uptrain"]
        out.update(
            tokens=up["tokens_seen"],
            steps=up["steps_run"],
            kept_step=up["kept_step"],
            heldout=[up["heldout_perplexity_before"], up["heldout_perplexity_after"]],
            lr=up["config"]["lr"],
            curve=record["tables"]["curve"][["step", "lr", "loss", "heldout_perplexity", "seconds"]].to_dict("records"),
        )
    if "local" in record:
        out["local"] = {k: record["local"][k] for k in ("layers_changed", "error_before", "error_after", "seconds")}
        out["local_tokens"] = record["local"]["calibration"]["tokens"]
    return out


def run(args) -> dict:
    import copy

    import torch

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.measure.evaluate import perplexity

    corpus = load_corpus(None)
    domains = {name: load_corpus(name) for name in DEFAULT_EVAL_DOMAINS}
    device = torch.device(args.device)

    def ppl(loaded, data=corpus):
        return perplexity(
            loaded, data, split="eval", seq_len=SEQ_LEN, batch_size=4, max_tokens=EVAL_TOKENS, progress=False
        ).perplexity

    def ppls(loaded) -> dict:
        """perplexity (the corpus) and perplexity_<domain> (each out-of-domain text), the same eval settings."""
        return {
            "perplexity": ppl(loaded),
            **{f"perplexity_{name}": ppl(loaded, text) for name, text in domains.items()},
        }

    teacher = load_model(None, device=args.device)
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "threads": torch.get_num_threads(), "models": {}}
    result.update(uptrain_steps=UPTRAIN_STEPS, local=LOCAL, uptrain=UPTRAIN, domains=list(DEFAULT_EVAL_DOMAINS))
    result["load_average_start"] = list(os.getloadavg())  # the machine is shared: how busy it was, per model below
    original = ppls(teacher)
    result["original"] = original.pop("perplexity")
    result["original_domains"] = {name: original[f"perplexity_{name}"] for name in DEFAULT_EVAL_DOMAINS}
    result["unfinished"] = list(RERUN)
    previous = _previous() if set(RERUN) != set(MODELS) else {}
    for name in MODELS:
        if name not in RERUN:
            if name in previous.get("models", {}):
                result["models"][name] = previous["models"][name]
                result.setdefault("load_average", {})[name] = previous.get("load_average", {}).get(name)
                result.setdefault("carried_over", []).append(name)
            continue
        edited = _edited(name, teacher, corpus, device)
        rows = {"none": {**ppls(edited), "seconds": 0.0, "tokens": 0, "peak_extra_bytes": 0}}
        local = from_model(copy.deepcopy(edited.model), edited.tokenizer, spec=name)
        rows["local"] = _stage(local, teacher, corpus, ["local"], device)
        rows["local"].update(ppls(local))
        up = from_model(copy.deepcopy(edited.model), edited.tokenizer, spec=name)
        rows["uptrain"] = _stage(up, teacher, corpus, ["uptrain"], device)
        rows["uptrain"].update(ppls(up))
        del up, edited
        # local then uptrain: the local row's model uptrained (the pipeline's order; local is not run twice)
        both = _stage(local, teacher, corpus, ["uptrain"], device)
        both.update(ppls(local))
        both["seconds"] += rows["local"]["seconds"]
        both["peak_extra_bytes"] = max(both["peak_extra_bytes"], rows["local"]["peak_extra_bytes"])
        both["local_tokens"] = rows["local"].get("local_tokens", 0)
        rows["local+uptrain"] = both
        result["models"][name] = rows
        result.setdefault("load_average", {})[name] = list(os.getloadavg())
        result["unfinished"].remove(name)
        del local
        _save_partial(result)
    return result


def _previous() -> dict:
    """The previous run's result (for the models this run does not measure again), or {}."""
    from benchmark import saved_result

    return saved_result("recovery")


def _save_partial(result: dict) -> None:
    """The harness writes results when a case ends; on a machine this loaded, each finished model is kept at once
    (in the harness's format), so an interrupted run still reports what it measured."""
    import json
    import time

    from benchmark import RESULTS, machine

    payload = {
        "command": "python scripts/benchmark.py --case recovery",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "result": result,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


# (today, floor, aim) per model; mla: issue 21's "at the MQA budget, after recovery <= 2x the original" (21.3).
GOALS = {"svd": (85.7, 43, 21.6), "mean": (18632, 200, 43), "pruned": (15.3, 13.5, 12), "mla": (None, 21.3, 21.3)}
LABELS = {
    "svd": "3 -> 1 KV heads, svd merge",
    "mean": "3 -> 1 KV heads, mean pooling",
    "pruned": "90 heads pruned (uniform) + compensation",
    "mla": "MLA at the MQA budget (convert-mla --budget mqa)",
}


def _sharing(r: dict) -> str:
    """How busy the shared machine was (1-, 5- and 15-minute load averages on its cores), as recorded."""
    if "load_average_start" not in r:
        return "The CPU was shared with other jobs (8 on 2 cores in that run)."
    ends = "; ".join(
        f"{name} {' / '.join(f'{v:.1f}' for v in load)}" for name, load in r.get("load_average", {}).items() if load
    )
    start = " / ".join(f"{v:.1f}" for v in r["load_average_start"])
    return f"The CPU was shared with other jobs: load average (1 / 5 / 15 min) {start} at the start" + (
        f", and after each model: {ends}." if ends else "."
    )


def _budget(r: dict) -> str:
    """How the run bounded its stages: steps (today), or minutes (results recorded before step budgets)."""
    if "uptrain_steps" in r:
        return (
            f"each stage bounded in tokens and steps: local reconstruction's calibration tokens, then "
            f"{r['uptrain_steps']} uptraining steps (`HEADLAB_BENCH_UPTRAIN_STEPS={r['uptrain_steps']}`)"
        )
    return (
        f"recorded before budgets were in steps: each stage bounded at {r['local_minutes']:g} min (local) and "
        f"{r['uptrain_minutes']:g} min (uptraining) of wall time; the steps each row ran are listed below, and "
        "`--recover-steps` with that count is today's way to ask for them"
    )


def _command(r: dict, name: str, kind: str) -> str:
    if "uptrain_steps" in r:
        return COMMANDS[name] + RECOVER[kind].format(steps=r["uptrain_steps"])
    minutes = {"local": r["local_minutes"], "up": r["uptrain_minutes"]}
    minutes["both"] = minutes["local"] + minutes["up"]
    return COMMANDS[name] + RECOVER_MINUTES[kind].format(**minutes)


def _domains_note(r: dict) -> list[str]:
    """The out-of-domain columns explained, with the original's values (results from before them have none)."""
    original = ", ".join(f"{name} {r['original_domains'][name]:.2f}" for name in r["domains"])
    return [
        "",
        f"Columns {', '.join(r['domains'])}: eval-split perplexity of those built-in held-out domains "
        f"(docs/evaluation.md, Out-of-domain perplexity), same settings; original: {original}.",
    ]


def _domain_cells(r: dict, row: dict) -> str:
    """The row's out-of-domain perplexities as table cells ('-' where a carried-over row has none)."""
    values = [row.get(f"perplexity_{name}") for name in r.get("domains", [])]
    return "".join(f"{v:,.2f} | " if v is not None else "- | " for v in values)


def markdown(r: dict) -> str:
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} torch threads, CPU shared with other jobs), eval split, first "
        f"{r['eval_tokens']:,} tokens at seq-len {r['seq_len']}; original: {r['original']:.2f}. Recovery on the "
        f"calibration split only; {_budget(r)}. "
        f"{_sharing(r)} Local: "
        f"{r['local']['local_tokens']:,} calibration tokens. Uptraining: default recipe (KL, attention only, warmup + "
        f"cosine, clip 1.0), {r['uptrain']['batch_size']} x {r['uptrain']['seq_len']} tokens per step, best state by "
        f"held-out calibration perplexity ({r['uptrain']['heldout_tokens']:,} tokens).",
        *(
            [f"Not measured (the run was stopped before it reached them): {', '.join(r['unfinished'])}.", ""]
            if r.get("unfinished")
            else []
        ),
        *(
            [
                f"Carried over from the previous run (not measured again; load average there as listed): "
                f"{', '.join(r['carried_over'])}.",
                "",
            ]
            if r.get("carried_over")
            else []
        ),  # fmt: skip
        *(_domains_note(r) if r.get("domains") else []),
        "",
        "| model | recovery | perplexity | "
        + "".join(f"{name} | " for name in r.get("domains", []))
        + "wall time | tokens seen | peak memory (extra) | goal floor / aim | command |",
        "|---|---|---|" + "---|" * len(r.get("domains", [])) + "---|---|---|---|---|",
    ]
    for name, rows in r["models"].items():
        _, floor, aim = GOALS[name]
        for kind, row in rows.items():
            command = _command(r, name, kind)
            tokens = row.get("tokens", 0) + row.get("local_tokens", 0)
            lines.append(
                f"| {LABELS[name]} | {kind} | {row['perplexity']:,.2f} | {_domain_cells(r, row)}"
                f"{row['seconds']:.0f} s | {tokens:,} | "
                f"{row['peak_extra_bytes'] / 2**20:,.0f} MiB | <= {floor:g} / <= {aim:g} | `{command}` |"
            )
    lines += [
        "",
        "Tokens seen: uptraining tokens plus local reconstruction's calibration tokens (each pass reads the same "
        "tokens again). Peak memory: growth of the resident set during the row, in one process (a later row reuses "
        "memory an earlier one freed, so read it as a lower bound). Held-out calibration perplexity before -> after "
        "uptraining (the kept state), and steps run:",
        "",
    ]
    for name, rows in r["models"].items():
        for kind in ("uptrain", "local+uptrain"):
            row = rows[kind]
            lines.append(
                f"- {LABELS[name]}, {kind}: {row['heldout'][0]:,.2f} -> {row['heldout'][1]:,.2f} in {row['steps']} "
                f"steps (kept step {row['kept_step']}, lr {row['lr']:g})"
            )
    return "\n".join(lines)
