"""The head-level KV-cache policy (`headlab kv-policy`) beside structural compression at equal KV bytes, on the
embedded model, training-free: retrieval accuracy (passkey and multi-key needles) and NLL by position at 2k tokens
(HEADLAB_BENCH_POLICY_LENGTHS=4096,8192 on a GPU), with the policy's cache bytes measured on a real cache.

Rows: the original; the policy chosen by the default retrieval-then-streaming ranking, by the retrieval score alone and
by the streaming score alone at half the cache; by DuoAttention's gates trained on passkey prompts (headlab's
`gates` score, GATE_STEPS steps) at half the cache; the first two at a quarter; two baselines at half the cache, a
per-layer streaming policy (whole layers full or streaming, by their mean default score) and a random one (seeded);
per-layer GQA at half the cache (convert-gqa --kv-budget 0.5 --method svd); uniform MQA (svd) and MLA at the MQA
budget, a third of the cache; and the retrieval policy at half on top of per-layer GQA at two thirds (a third in
all). HEADLAB_BENCH_POLICY_DEPTHS and _SAMPLES override the needle grid; HEADLAB_BENCH_POLICY_ONLY ("|"-separated
method prefixes, e.g. "per-layer streaming|random") measures the original and those rows and keeps the saved rest."""

from __future__ import annotations

import os

TITLE = "Head-level KV-cache policy against structural compression (`kv-policy`), training-free"
CALIB_TOKENS, SEARCH_TOKENS, STATS_TOKENS = 2048, 1024, 4096
SINKS, WINDOW = 4, 256
TASKS = ("passkey", "niah_multikey")
DEPTHS, SAMPLES, POSITION_SEQUENCES = (0.0, 0.5, 1.0), 2, 1


def _lengths() -> tuple[int, ...]:
    value = os.environ.get("HEADLAB_BENCH_POLICY_LENGTHS", "2048")
    return tuple(int(n) for n in value.split(","))


def _grid() -> tuple[tuple[float, ...], int]:
    """Needle depths and prompts per depth: DEPTHS and SAMPLES, or HEADLAB_BENCH_POLICY_DEPTHS / _SAMPLES."""
    depths = os.environ.get("HEADLAB_BENCH_POLICY_DEPTHS")
    samples = os.environ.get("HEADLAB_BENCH_POLICY_SAMPLES")
    return (tuple(float(d) for d in depths.split(",")) if depths else DEPTHS), int(samples or SAMPLES)


def _layer_scores(scores):
    """Every KV head scored by its layer's mean: the policy then keeps or streams whole layers (a per-layer
    streaming policy at the same budget, the baseline the head-level choice has to beat)."""
    return scores.assign(score=scores.groupby("layer")["score"].transform("mean"))


def _random_scores(scores, seed: int = 0):
    """Scores drawn uniformly at random (seeded): a random policy at the same budget."""
    import numpy as np

    return scores.assign(score=np.random.default_rng(seed).random(len(scores)))


def run(args) -> dict:
    return measure(args, case="kv_policy")


def _kind(method: str) -> int:
    """Where a row sits in the table: the original, then the policies, then the structural methods."""
    return 0 if method == "original" else 1 if method.startswith(("policy", "per-layer streaming", "random")) else 2


def _with_saved(result: dict, case: str) -> dict:
    """With HEADLAB_BENCH_POLICY_ONLY, the saved rows of the methods this run left out (same lengths and grid),
    the measured ones replacing theirs: a run of some rows adds to the table."""
    if os.environ.get("HEADLAB_BENCH_POLICY_ONLY") is None:
        return result
    from benchmark import saved_payload

    payload = saved_payload(case)
    saved = payload.get("result", {})
    grid = ("lengths", "context", "sinks", "window", "depths", "samples")
    if any(saved.get(key) != result[key] for key in grid):
        return result
    measured = {row["method"] for row in result["rows"]}
    kept = [row for row in saved.get("rows", []) if row["method"] not in measured]
    result["rows"] = sorted(kept + result["rows"], key=lambda row: _kind(row["method"]))
    if kept:
        commit = payload.get("machine", {}).get("commit")
        result["note"] = (f"Rows measured in this run: {', '.join(sorted(measured))}; the others are kept from the "
                          f"run of {payload.get('date')}" + (f" (commit {commit})" if commit else "") + ".")  # fmt: skip
    return result


def measure(args, dtype: str | None = None, case: str = "kv_policy") -> dict:
    import copy
    import time

    import torch
    from benchmark import checkpoint

    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv import gqa
    from headlab.kv.budget import BudgetSpec, allocation, apply_counts, layer_costs
    from headlab.kv.duo_gates import optimized_gates
    from headlab.kv.mla import convert_to_mla, plan_mla
    from headlab.kv.policy import choose_policy, kv_head_scores, measured_generate
    from headlab.measure.costs import kv_bytes_per_token
    from headlab.measure.longctx import long_context
    from headlab.measure.stats import STREAMING_WINDOWS, head_statistics, wide_statistics
    from headlab.mechanisms.head_cache import head_policy

    lengths = _lengths()
    context = max(lengths)
    only = os.environ.get("HEADLAB_BENCH_POLICY_ONLY")

    def wanted(prefix: str) -> bool:
        return only is None or any(prefix.startswith(p) or p.startswith(prefix) for p in only.split("|"))

    corpus = load_corpus("broad")
    depths, samples = _grid()
    teacher = load_model(None, device=args.device, dtype=dtype)
    calibration = TextSpec(corpus, split="calibration", seq_len=512, batch_size=4)
    merge_batches = calibration.but(max_tokens=CALIB_TOKENS).batches(teacher.tokenizer)
    eval_text = TextSpec(corpus, split="eval", max_tokens=None)
    original_bytes = kv_bytes_per_token(teacher)
    result = {"lengths": list(lengths), "context": context, "sinks": SINKS, "window": WINDOW, "tasks": list(TASKS),
              "depths": list(depths), "samples": samples, "position_sequences": POSITION_SEQUENCES,
              "threads": torch.get_num_threads(), "dtype": str(teacher.dtype).removeprefix("torch."),
              "device": args.device, "rows": []}  # fmt: skip

    def scores_of(loaded, score):
        if score == "gates":
            return optimized_gates(loaded, calibration, sinks=SINKS, window=WINDOW, progress=False)[0]
        tidy = head_statistics(loaded, text=calibration.but(max_tokens=STATS_TOKENS), induction=False,
                               retrieval=score != "streaming", ov=False, progress=False)  # fmt: skip
        return kv_head_scores(wide_statistics(tidy), loaded, score, WINDOW, STREAMING_WINDOWS)

    def measure(name, loaded, fraction_of_original, policy=None):
        """One row; printed whole (policy rows once policy_row completes them), so a stopped run's log keeps it."""
        start = time.perf_counter()
        record: list[dict] = []
        layers = policy.layers(loaded) if policy is not None else None
        options = dict(text=eval_text, tasks=TASKS, lengths=lengths, depths=depths, samples=samples,
                       position_sequences_count=POSITION_SEQUENCES, progress=False,
                       generate=measured_generate(loaded, layers, record))  # fmt: skip
        if policy is None:
            measured = long_context(loaded, **options)
        else:
            with head_policy(loaded.model, loaded.layers, layers):
                measured = long_context(loaded, **options)
        accuracy = {f"{r.task}@{r.length}": float(r.accuracy) for r in measured.lengths.itertuples()}
        positions = {f"[{r.start}, {r.end})": float(r.nll) for r in measured.positions.itertuples()}
        cache = {int(r["length"]): r["cache_bytes"] / r["prompts"] for r in record}
        row = {"method": name, "kv_fraction": fraction_of_original, "accuracy": accuracy, "nll": positions,
               "cache_bytes_per_prompt": cache, "seconds": time.perf_counter() - start}  # fmt: skip
        result["rows"].append(row)
        if policy is None:
            print(row, flush=True)
            checkpoint(case, args, result)
        return row

    original = measure("original", teacher, 1.0)
    original_cache = original["cache_bytes_per_prompt"]

    def policy_row(name, loaded, score, budget, scale=1.0, rescore=None):
        if not wanted(name):
            return
        started = time.perf_counter()
        scores = scores_of(loaded, score)
        scoring = time.perf_counter() - started
        if rescore is not None:
            scores = rescore(scores)
        policy = choose_policy(scores, budget=budget, context=context, sinks=SINKS, window=WINDOW,
                               score=score)  # fmt: skip
        row = measure(name, loaded, None, policy)
        row["score_seconds"] = scoring  # the statistics pass, or the gates' training
        row["kv_fraction"] = scale * policy.kv_fraction()
        row["kv_fraction_measured"] = {n: row["cache_bytes_per_prompt"][n] / original_cache[n] for n in original_cache}
        row["full_kv_heads"] = policy.meta["full_kv_heads"]
        print(row, flush=True)
        checkpoint(case, args, result)

    for budget, label in ((0.5, "1/2"), (0.25, "1/4")):
        policy_row(f"policy, retrieval-streaming (default), {label}", teacher, "retrieval-streaming", budget)
        policy_row(f"policy, retrieval score, {label}", teacher, "retrieval", budget)
    policy_row("policy, streaming score, 1/2", teacher, "streaming", 0.5)
    policy_row("policy, DuoAttention gates, 1/2", teacher, "gates", 0.5)
    policy_row("per-layer streaming (layer means of the default score), 1/2", teacher, "retrieval-streaming", 0.5,
               rescore=_layer_scores)  # fmt: skip
    policy_row("random policy (seed 0), 1/2", teacher, "streaming", 0.5, rescore=_random_scores)
    if not wanted("per-layer GQA") and not wanted("uniform MQA") and not wanted("MLA"):
        return _with_saved(result, case)

    spec = BudgetSpec(1.0, method="svd", search_tokens=SEARCH_TOKENS)
    search_batches = calibration.but(max_tokens=SEARCH_TOKENS).batches(teacher.tokenizer)
    costs = layer_costs(from_model(copy.deepcopy(teacher.model), teacher.tokenizer), spec, merge_batches,
                        search_batches, progress=False)  # fmt: skip
    for fraction, then_policy in ((0.5, False), (2 / 3, True)) if wanted("per-layer GQA") else ():
        student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        apply_counts(student, allocation(teacher, costs, fraction), spec, merge_batches, progress=False)
        kept = kv_bytes_per_token(student) / original_bytes
        if then_policy:
            policy_row(f"per-layer GQA {kept:.2f} + policy 1/2", student, "retrieval-streaming", 0.5, kept)
        else:
            measure(f"per-layer GQA (svd), {kept:.2f}", student, kept)
        del student
    if wanted("uniform MQA"):
        student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
        gqa.convert(student, 1, method="svd", batches=merge_batches)
        measure("uniform MQA (svd)", student, kv_bytes_per_token(student) / original_bytes)
        del student
    if wanted("MLA"):
        mla, _ = convert_to_mla(teacher, plan_mla(teacher, "mqa"), merge_batches, progress=False)
        measure("MLA at the MQA budget", mla, kv_bytes_per_token(mla) / original_bytes)
    return _with_saved(result, case)


def markdown(r: dict) -> str:
    lengths = r["lengths"]
    columns = [f"{task}@{n}" for n in lengths for task in r["tasks"]]
    buckets = list(r["rows"][0]["nll"])
    prompts = len(r["depths"]) * r["samples"]
    lines = [
        f"Embedded SmolLM2-135M (30 layers x 3 KV heads, {r.get('dtype', 'float32')}, {r.get('device', 'cpu')}, "
        f"{r['threads'] or 'default'} threads), training-free. Policies: "
        f"streaming KV heads keep {r['sinks']} sinks + {r['window']} recent tokens, the budget counted at "
        f"{r['context']:,} tokens; scores from 4,096 `broad` calibration tokens and four 1k passkey prompts. "
        f"Structural rows: svd merges calibrated on 2,048 calibration tokens. Retrieval: {prompts} prompts per task "
        f"and length (depths {', '.join(f'{d:g}' for d in r['depths'])}), haystacks from the `broad` eval split; NLL "
        f"by position over {r['position_sequences']} eval sequences of {max(lengths):,} tokens. `KV kept`: the "
        "cache's bytes over the original's at the context: measured on the real cache for policies (in brackets), "
        "from the layout for structural methods." + (f" {r['note']}" if r.get("note") else ""),
        "",
        "| method | KV kept | " + " | ".join(columns) + " | " + " | ".join(f"NLL {b}" for b in buckets) + " |",
        "|---|---|" + "---|" * (len(columns) + len(buckets)),
    ]
    for row in r["rows"]:
        kept = f"{row['kv_fraction']:.3f}"
        if "kv_fraction_measured" in row:
            kept += " (" + ", ".join(f"{v:.3f}" for v in row["kv_fraction_measured"].values()) + ")"
        accuracy = " | ".join(f"{row['accuracy'].get(c, float('nan')):.2f}" for c in columns)
        nll = " | ".join(f"{row['nll'][b]:.3f}" for b in buckets)
        lines.append(f"| {row['method']} | {kept} | {accuracy} | {nll} |")
    timed = [row for row in r["rows"] if "score_seconds" in row]
    if timed:  # rows measured since the scores were timed
        lines += ["", "Seconds to score (the statistics pass, or the gates' training), on the machine above: "
                  + "; ".join(f"{row['method']} {row['score_seconds']:,.0f} s" for row in timed) + "."]  # fmt: skip
    return "\n".join(lines)
