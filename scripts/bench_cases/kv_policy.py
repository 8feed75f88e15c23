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


def grid_defaults(lengths: str, samples: int, only: str | None = None, depths: str = "0,0.25,0.5,0.75,1") -> None:
    """A variant case's lengths, needle grid and rows (HEADLAB_BENCH_POLICY_LENGTHS, _DEPTHS, _SAMPLES, _ONLY), as
    defaults: a value already in the environment wins."""
    for key, value in (("LENGTHS", lengths), ("DEPTHS", depths), ("SAMPLES", str(samples)), ("ONLY", only)):
        if value is not None:
            os.environ.setdefault(f"HEADLAB_BENCH_POLICY_{key}", value)


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
        at = f" (commit {commit})" if commit else ""
        result["note"] = (f"Rows measured in this run: {', '.join(sorted(measured))}; the others are kept from the "
                          f"run of {payload.get('date')}{at}.")  # fmt: skip
    return result


class _Bench:
    """One run of the case: the teacher, its texts, the result being filled, and how to measure a row."""

    def __init__(self, args, dtype: str | None, case: str):
        import torch

        from headlab.core.data import TextSpec, load_corpus
        from headlab.core.loading import load_model
        from headlab.measure.costs import kv_bytes_per_token

        self.args, self.case = args, case
        self.lengths = _lengths()
        self.context = max(self.lengths)
        self.only = os.environ.get("HEADLAB_BENCH_POLICY_ONLY")
        corpus = load_corpus("broad")
        depths, samples = _grid()
        self.teacher = load_model(None, device=args.device, dtype=dtype)
        self.calibration = TextSpec(corpus, split="calibration", seq_len=512, batch_size=4)
        self.merge_batches = self.calibration.but(max_tokens=CALIB_TOKENS).batches(self.teacher.tokenizer)
        self.eval_text = TextSpec(corpus, split="eval", max_tokens=None)
        self.original_bytes = kv_bytes_per_token(self.teacher)
        self.original_cache: dict = {}
        self.result = {"lengths": list(self.lengths), "context": self.context, "sinks": SINKS, "window": WINDOW,
                       "tasks": list(TASKS), "depths": list(depths), "samples": samples,
                       "position_sequences": POSITION_SEQUENCES, "threads": torch.get_num_threads(),
                       "dtype": str(self.teacher.dtype).removeprefix("torch."), "device": args.device,
                       "rows": []}  # fmt: skip

    def wanted(self, prefix: str) -> bool:
        return self.only is None or any(prefix.startswith(p) or p.startswith(prefix) for p in self.only.split("|"))

    def scores_of(self, loaded, score):
        from headlab.kv.duo_gates import optimized_gates
        from headlab.kv.policy import kv_head_scores
        from headlab.measure.stats import STREAMING_WINDOWS, head_statistics, wide_statistics

        if score == "gates":
            return optimized_gates(loaded, self.calibration, sinks=SINKS, window=WINDOW, progress=False)[0]
        tidy = head_statistics(loaded, text=self.calibration.but(max_tokens=STATS_TOKENS), induction=False,
                               retrieval=score != "streaming", ov=False, progress=False)  # fmt: skip
        return kv_head_scores(wide_statistics(tidy), loaded, score, WINDOW, STREAMING_WINDOWS)

    def save(self, row: dict) -> None:
        from benchmark import checkpoint

        print(row, flush=True)  # printed whole, so a stopped run's log keeps it
        checkpoint(self.case, self.args, self.result)

    def measure(self, name, loaded, fraction_of_original, policy=None) -> dict:
        """One row (a policy row is saved once policy_row completes it)."""
        import time

        from headlab.kv.policy import measured_generate
        from headlab.measure.longctx import long_context
        from headlab.mechanisms.head_cache import head_policy

        start = time.perf_counter()
        record: list[dict] = []
        layers = policy.layers(loaded) if policy is not None else None
        r = self.result
        options = dict(text=self.eval_text, tasks=TASKS, lengths=self.lengths, depths=r["depths"],
                       samples=r["samples"], position_sequences_count=POSITION_SEQUENCES, progress=False,
                       generate=measured_generate(loaded, layers, record))  # fmt: skip
        if policy is None:
            measured = long_context(loaded, **options)
        else:
            with head_policy(loaded.model, loaded.layers, layers):
                measured = long_context(loaded, **options)
        accuracy = {f"{x.task}@{x.length}": float(x.accuracy) for x in measured.lengths.itertuples()}
        positions = {f"[{x.start}, {x.end})": float(x.nll) for x in measured.positions.itertuples()}
        cache = {int(x["length"]): x["cache_bytes"] / x["prompts"] for x in record}
        row = {"method": name, "kv_fraction": fraction_of_original, "accuracy": accuracy, "nll": positions,
               "cache_bytes_per_prompt": cache, "seconds": time.perf_counter() - start}  # fmt: skip
        r["rows"].append(row)
        if policy is None:
            self.save(row)
        return row

    def policy_row(self, name, loaded, score, budget, scale=1.0, rescore=None) -> None:
        import time

        from headlab.kv.policy import choose_policy

        if not self.wanted(name):
            return
        started = time.perf_counter()
        scores = self.scores_of(loaded, score)
        scoring = time.perf_counter() - started
        if rescore is not None:
            scores = rescore(scores)
        policy = choose_policy(scores, budget=budget, context=self.context, sinks=SINKS, window=WINDOW,
                               score=score)  # fmt: skip
        row = self.measure(name, loaded, None, policy)
        row["score_seconds"] = scoring  # the statistics pass, or the gates' training
        row["kv_fraction"] = scale * policy.kv_fraction()
        cache, original = row["cache_bytes_per_prompt"], self.original_cache
        row["kv_fraction_measured"] = {n: cache[n] / original[n] for n in original}
        row["full_kv_heads"] = policy.meta["full_kv_heads"]
        self.save(row)

    def policy_rows(self) -> None:
        teacher = self.teacher
        for budget, label in ((0.5, "1/2"), (0.25, "1/4")):
            self.policy_row(f"policy, retrieval-streaming (default), {label}", teacher, "retrieval-streaming", budget)
            self.policy_row(f"policy, retrieval score, {label}", teacher, "retrieval", budget)
        self.policy_row("policy, streaming score, 1/2", teacher, "streaming", 0.5)
        self.policy_row("policy, DuoAttention gates, 1/2", teacher, "gates", 0.5)
        self.policy_row("per-layer streaming (layer means of the default score), 1/2", teacher, "retrieval-streaming",
                        0.5, rescore=_layer_scores)  # fmt: skip
        self.policy_row("random policy (seed 0), 1/2", teacher, "streaming", 0.5, rescore=_random_scores)

    def structural_rows(self) -> None:
        """Per-layer GQA at half (and at two thirds with the policy on top), uniform MQA and MLA at the MQA budget."""
        import copy

        from headlab.core.loading import from_model
        from headlab.kv import gqa
        from headlab.kv.budget import BudgetSpec, allocation, apply_counts, layer_costs
        from headlab.kv.mla import convert_to_mla, plan_mla
        from headlab.measure.costs import kv_bytes_per_token

        teacher, merge_batches = self.teacher, self.merge_batches

        def fresh():
            return from_model(copy.deepcopy(teacher.model), teacher.tokenizer)

        if self.wanted("per-layer GQA"):
            spec = BudgetSpec(1.0, method="svd", search_tokens=SEARCH_TOKENS)
            search_batches = self.calibration.but(max_tokens=SEARCH_TOKENS).batches(teacher.tokenizer)
            costs = layer_costs(fresh(), spec, merge_batches, search_batches, progress=False)
            for fraction, then_policy in ((0.5, False), (2 / 3, True)):
                student = fresh()
                apply_counts(student, allocation(teacher, costs, fraction), spec, merge_batches, progress=False)
                kept = kv_bytes_per_token(student) / self.original_bytes
                if then_policy:
                    self.policy_row(f"per-layer GQA {kept:.2f} + policy 1/2", student, "retrieval-streaming", 0.5,
                                    kept)  # fmt: skip
                else:
                    self.measure(f"per-layer GQA (svd), {kept:.2f}", student, kept)
                del student
        if self.wanted("uniform MQA"):
            student = fresh()
            gqa.convert(student, 1, method="svd", batches=merge_batches)
            self.measure("uniform MQA (svd)", student, kv_bytes_per_token(student) / self.original_bytes)
            del student
        if self.wanted("MLA"):
            mla, _ = convert_to_mla(teacher, plan_mla(teacher, "mqa"), merge_batches, progress=False)
            self.measure("MLA at the MQA budget", mla, kv_bytes_per_token(mla) / self.original_bytes)


def measure(args, dtype: str | None = None, case: str = "kv_policy") -> dict:
    """The original (always: the policies' cache bytes are read against it), then the rows wanted."""
    bench = _Bench(args, dtype, case)
    bench.original_cache = bench.measure("original", bench.teacher, 1.0)["cache_bytes_per_prompt"]
    bench.policy_rows()
    bench.structural_rows()
    return _with_saved(bench.result, case)


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
