"""Pruning sweeps: perplexity, size, KV bytes and speed of a model pruned to several fractions in several orders
(Michel et al. 2019, Fig. 3-style curves), as a tidy table and a plot.

Each pruned model is made in memory (prune.pruned_in_place) and restored afterwards; no checkpoint is written.
With long_context lengths each pruned model's passkey retrieval is measured as well (headlab.measure.longctx's
passkey_columns); the fraction-0 row is the model before pruning.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.data import TextSpec, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.core.tables import write_run
from headlab.measure.costs import costs
from headlab.measure.evaluate import perplexity
from headlab.measure.longctx import check_passkey_lengths, passkey_columns, passkey_record
from headlab.pruning.choices import DEFAULT_FRACTIONS
from headlab.pruning.prune import MODES, PruneSpec, plan, pruned_in_place
from headlab.pruning.score_sources import DEFAULT_ORDERS, JOINT_ORDERS, ORDER_HELP, ORDERS
from headlab.pruning.scores import ScoreRequest, score_heads
from headlab.pruning.selection import allocate, calibration_scoring_batches, check_unit, joint_paths
from headlab.recovery.compensate import check_compensation, compensated, compensation_batches, output_statistics
from headlab.runtimes.lm_eval_bridge import metric_columns, run_tasks, task_columns, task_manager


@dataclass
class SweepResult:
    table: pd.DataFrame  # one row per (order, seed, fraction)
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SweepPlan:
    """Which pruned models a sweep measures: every fraction in every order.

    fractions: fractions of the heads (or KV groups) to prune, each in [0, 1) (sorted, duplicates dropped)
    orders: pruning orders (headlab.pruning.score_sources.ORDERS), duplicates dropped
    seeds: the seeds the random order averages over
    unit: "head" or "kv-group", what one pruning step removes
    per_layer: prune each fraction within every layer, not globally
    allow_empty_layer: allow removing every head of a layer
    mode: "physical" slices the heads out (the smaller model's speed; mask where physical is approximate), "mask"
        zeroes them
    method: the score source of the importance and iterative orders
    """

    fractions: Sequence[float] = DEFAULT_FRACTIONS
    orders: Sequence[str] = DEFAULT_ORDERS
    seeds: Sequence[int] = (0, 1, 2)
    unit: str = "head"
    per_layer: bool = False
    allow_empty_layer: bool = False
    mode: str = "physical"
    method: str = "grad"


@dataclass(frozen=True)
class TaskSpec:
    """lm-eval tasks run on every pruned model as well (headlab.runtimes.lm_eval_bridge), as "task/metric" columns.

    tasks: the task names
    include_path: a directory of local task YAMLs (None: lm-eval's own tasks only)
    limit: at most this many documents per task (None: all)
    """

    tasks: Sequence[str]
    include_path: str | Path | None = None
    limit: int | None = None

    def record(self) -> dict:
        """The sweep's meta.json `tasks` entry."""
        return {"names": list(self.tasks), "include_path": self.include_path, "limit": self.limit}


def check_sweep(fractions, orders, seeds) -> None:
    bad = [f for f in fractions if not 0 <= f < 1]
    if bad:
        raise HeadlabError(f"fractions= must lie in [0, 1), got {bad}")
    unknown = [o for o in orders if o not in ORDERS]
    if unknown:
        raise HeadlabError(f"unknown order(s) {', '.join(unknown)}; use {', '.join(ORDERS)}")
    if "random" in orders and not seeds:
        raise HeadlabError("the random order needs at least one seed")


@takes_text(split="calibration", seq_len=256, batch_size=4)
def sweep(
    loaded: LoadedModel,
    plan: SweepPlan = SweepPlan(),
    *,
    text: TextSpec,
    calibration_tokens: int = 1024,
    eval_tokens: int | None = 1024,
    compensate: str | None = None,
    scores: dict | None = None,
    tasks: TaskSpec | None = None,
    long_context: Sequence[int] | None = None,
    progress: bool = True,
    journal=None,
    low_memory: bool | None = None,
) -> SweepResult:
    """Perplexity (eval split) of the model with the lowest fraction f of heads pruned, for every f and order.

    plan: the fractions, orders and seeds, what is counted and how the heads are removed (SweepPlan).
    plan.mode "physical" slices the heads out (measured tokens/s is that of the smaller model); where physical pruning
    is approximate (q/k norms spanning heads) the sweep falls back to mask mode, which is exact. text: the corpus,
    its column, window length and batch size (a TextSpec; the loose keywords data, text_column, seq_len, batch_size
    also work); scores come from its calibration split (`calibration_tokens`), importance by `plan.method`,
    perplexity from its eval split (`eval_tokens`). compensate ("ridge" or "bias", headlab.recovery.compensate) adds
    a second row per pruned model with the output projection refitted on the calibration tokens (column
    compensation; "none" for the plain rows). `scores` ({order: per-layer [H_l] tensors}) gives an order's starting
    scores already computed with the same settings (e.g. the report's importance step), instead of computing them
    again. tasks: lm-eval tasks (a TaskSpec, headlab.runtimes.lm_eval_bridge) run on every pruned model too, as
    "task/metric" columns. long_context: lengths in tokens at which every pruned model's passkey retrieval is measured
    too (headlab.measure.longctx.passkey_columns: columns passkey_<length>, the fraction of prompts correct, and
    passkey_prompts; haystack from the eval split); None or empty: not measured. Slow: 6 prompts per length per model.
    low_memory: score gradients one sequence per backward pass with recomputed blocks (True), in whole batches
    (False), or as the memory available allows (None; headlab.measure.importance.choose_low_memory).
    journal (headlab.core.fsio.StepJournal): each (order, seed) is recorded there when done, and one already recorded by
    an interrupted run of the same sweep is read back instead of run again (`headlab sweep` resumes this way).
    """
    check_compensation(loaded, compensate)
    fractions = sorted(set(float(f) for f in plan.fractions))
    orders, seeds = list(dict.fromkeys(plan.orders)), list(dict.fromkeys(plan.seeds))
    unit, per_layer, method = plan.unit, plan.per_layer, plan.method
    tasks = tasks if tasks is not None and tasks.tasks else None  # no task names: no lm-eval
    long_context = tuple(dict.fromkeys(long_context)) if long_context else None  # none asked: not measured
    mode, manager = _check_sweep_options(loaded, fractions, orders, seeds, unit, plan.mode, text, tasks)
    if long_context:  # an encoder or a length beyond the model's positions fails before the first score pass
        check_passkey_lengths(loaded, long_context)
    text = text.resolved()  # one corpus for every score and perplexity pass
    request = ScoreRequest(
        text.but(split="calibration", max_tokens=calibration_tokens), progress, low_memory=low_memory
    )
    evaluation = text.but(split="eval", max_tokens=eval_tokens)
    grams = None
    if compensate is not None or "obs" in orders:  # obs selects from the Grams the refit uses
        grams = output_statistics(loaded, compensation_batches(loaded, text=request.text), progress=progress)
    measure = _Measure(loaded, mode, grams, evaluation)
    if tasks:  # lm-eval's metrics of each pruned model, beside its perplexity
        measure.extras.append(lambda: _task_values(loaded, tasks, text.batch_size, manager))
    if long_context:  # passkey retrieval of each pruned model, beside its perplexity
        measure.extras.append(lambda: passkey_columns(loaded, text, long_context))
    spec = PruneSpec(per_layer=per_layer, unit=unit, allow_empty_layer=plan.allow_empty_layer)
    total_heads = sum(layer.num_heads for layer in loaded.layers)
    start = time.perf_counter()
    runs = [(order, seed) for order in orders for seed in (seeds if order == "random" else [None])]
    with tqdm(total=len(runs) * len(fractions), desc="sweep", disable=not progress, unit="model") as bar:
        steps = {
            run: _joint_steps(loaded, run[0], fractions, spec, request, grams)
            if run[0] in JOINT_ORDERS
            else _order_steps(loaded, run[0], run[1] or 0, fractions, spec, method, request, (scores or {}).get(run[0]))
            for run in runs
        }  # generators: each order is scored when its turn comes
        compensations = [None] + ([compensate] if compensate else [])
        rows = list(_sweep_rows(steps, measure, compensations, total_heads, bar, journal))
    name = text.corpus_name
    meta = {
        **loaded.describe(),
        "mode": mode,
        "unit": unit,
        "per_layer": per_layer,
        "fractions": fractions,
        "orders": {o: ORDER_HELP[o] for o in orders},
        "seeds": seeds,
        "method": method,
        "compensate": compensate,
        "calibration": {"data": name, "split": "calibration", "max_tokens": calibration_tokens},
        "eval": {"data": name, "split": "eval", **_eval_settings(evaluation)},
        "total_heads": total_heads,
        "tasks": tasks.record() if tasks else None,
        "long_context": passkey_record(long_context) if long_context else None,
        "seconds": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
    }
    return SweepResult(pd.DataFrame(rows), meta)


def _sweep_rows(steps: dict, measure, compensations: list, total_heads: int, bar, journal=None):
    """One row per (order, seed, fraction, compensation): the pruned model's measurements (`measure`). With a
    `journal` (headlab.core.fsio.StepJournal) each (order, seed) is a step: its rows are recorded when it completes, and a
    step an interrupted run of the same sweep completed is read back instead of scored and measured again."""
    for (order, seed), fractions in steps.items():
        step = order if seed is None else f"{order}/seed {seed}"
        if journal is not None and journal.done(step):
            kept = journal.records[step]["rows"]
            bar.update(len({row["fraction"] for row in kept}))
            yield from kept
            continue
        rows = []
        for fraction, pruned in fractions:
            n = sum(len(p) for p in pruned)
            for compensation in compensations:
                row = {"order": order, "seed": seed, "fraction": fraction, "pruned_heads": n}
                row.update(fraction_pruned=n / total_heads, compensation=compensation or "none")
                rows.append({**row, **measure(pruned, compensation)})
            bar.update()
        if journal is not None:
            journal.finish(step, {"rows": rows})
        yield from rows


def _check_sweep_options(loaded, fractions, orders, seeds, unit, mode, text, tasks: TaskSpec | None):
    """Every sweep option check that needs no forward pass; (the mode the sweep runs in, the lm-eval task manager)."""
    check_sweep(fractions, orders, seeds)
    check_unit(loaded.layers, unit)
    if loaded.max_positions is not None and text.seq_len > loaded.max_positions:  # before the first score pass
        raise HeadlabError(f"seq_len={text.seq_len} exceeds the model's maximum positions ({loaded.max_positions})")
    manager = None
    if tasks:  # unknown names, bad YAMLs and a missing lm-eval fail here, before the first score pass
        manager = task_manager(list(tasks.tasks), tasks.include_path)
    if mode not in MODES:
        raise HeadlabError(f"unknown mode={mode!r}; use mask or physical")
    if mode == "physical" and loaded.adapter.norm_spans_heads:
        mode = "mask"  # physical is approximate here; the sweep reports exact masked perplexity instead
    return mode, manager


def _eval_settings(evaluation: TextSpec) -> dict:
    """The eval text's window settings as meta.json records them."""
    return {
        "seq_len": evaluation.seq_len,
        "batch_size": evaluation.batch_size,
        "max_tokens": evaluation.max_tokens,
        "text_column": evaluation.text_column,
    }


def _order_steps(loaded, order: str, seed: int, fractions, spec: PruneSpec, method: str, request, given):
    """(fraction, pruned heads) for each fraction of one order: scored once (or re-scored before each fraction for
    "iterative", with the heads pruned so far masked), then planned. `given`: starting scores already computed."""
    if given is not None:
        scores = [torch.as_tensor(s, dtype=torch.float64) for s in given]
    else:
        scores = score_heads(_order_source(order, method), loaded, _order_request(order, seed, request))
    pruned = [set() for _ in loaded.layers]
    for fraction in fractions:
        iterative = order == "iterative"
        if iterative and any(pruned):
            scores = score_heads(method, loaded, replace(request, pruned=pruned))
        pruned = plan(loaded.layers, scores, replace(spec, fraction=fraction), already=pruned if iterative else None)
        yield fraction, pruned


def _joint_steps(loaded, order: str, fractions, spec: PruneSpec, request, grams):
    """(fraction, pruned heads) of a joint selection: the layers' greedy paths built once, then for each fraction
    the global (or per-layer) budget's steps taken from them (headlab.pruning.selection)."""
    budget = "per-layer" if spec.per_layer else "global"
    batches = calibration_scoring_batches(loaded, request.text)
    paths, _ = joint_paths(
        loaded, select=order, budget=budget, unit=spec.unit, cap=None, allow_empty_layer=spec.allow_empty_layer,
        scoring_batches=batches, grams=grams, progress=request.progress,
    )  # fmt: skip
    for fraction in fractions:
        taken = allocate(loaded, paths, budget=budget, unit=spec.unit, fraction=fraction, count=None)
        yield fraction, [set(h for u in p.units[:k] for h in u) for p, k in zip(paths, taken)]


def _order_source(order: str, method: str) -> str:
    """The score source (headlab.pruning.scores registry) of a sweep order."""
    return method if order in ("importance", "iterative") else order


def _order_request(order: str, seed: int, request):
    if order == "ablation":
        return replace(
            request, text=request.text.but(max_tokens=None)
        )  # ablation's own budget (one forward pass set per head)
    if order == "random":
        return replace(request, seed=seed)
    return request


class _Measure:
    """Perplexity, costs and speed (and the `extras`' columns) of the model with a set of heads pruned (and compensated), made in memory and
    restored afterwards; cached by (heads, compensation) since random seeds and orders often agree."""

    def __init__(self, loaded, mode, grams, evaluation: TextSpec):
        self.loaded, self.mode, self.grams, self.evaluation = loaded, mode, grams, evaluation
        self.cache: dict[tuple, dict] = {}
        self.extras: list = []  # functions () -> more columns measured on the pruned model (--tasks, --long-context)

    def __call__(self, pruned, compensation=None) -> dict:
        key = (tuple(tuple(sorted(p)) for p in pruned), compensation)
        if key not in self.cache:
            self.cache[key] = self._measure(pruned, compensation)
        return self.cache[key]

    def _measure(self, pruned, compensation) -> dict:
        loaded, seq_len = self.loaded, self.evaluation.seq_len
        refit = compensated(loaded, pruned, self.grams, compensation) if compensation else contextlib.nullcontext()
        with refit, pruned_in_place(loaded, pruned, self.mode) as layout:
            result = perplexity(loaded, text=self.evaluation, progress=False)
            size = costs(loaded, context=seq_len)
            extra = {name: value for source in self.extras for name, value in source().items()}
        if self.mode == "mask":  # the model kept its shapes: report what the physical prune would cost
            with pruned_in_place(loaded, pruned, "physical") as layout:
                size = costs(loaded, context=seq_len)
        return {
            "perplexity": result.perplexity,
            "nll": result.nll,
            "tokens_per_s": result.tokens_per_s,
            "parameters": size["parameters"],
            "attention_parameters": size["attention_parameters"],
            "attention_flops_per_token": size["attention_flops_per_token"],
            "kv_bytes_per_token": size["kv_bytes_per_token"],
            "query_heads": size["query_heads"],
            "padding_heads": sum(len(lay.padding) for lay in layout),  # zero-output heads kept for equal groups
            "kv_heads": size["kv_heads"],
            **extra,
        }


def _task_values(loaded, tasks: TaskSpec | None, batch_size, manager) -> dict:
    """lm-eval task metrics of the model as it is now (pruned in place), as sweep columns; {} without tasks."""
    if not tasks:
        return {}
    # bootstrap_iters 1000: stderr of perplexity-type metrics by bootstrap, bounded (lm-eval's CLI default is 1e5).
    result = run_tasks(
        loaded,
        list(tasks.tasks),
        include_path=tasks.include_path,
        batch_size=batch_size,
        limit=tasks.limit,
        bootstrap_iters=1000,
        manager=manager,
    )
    return task_columns(result)


def sweep_files(result: SweepResult) -> tuple[dict, dict, dict]:
    """(tables, meta, figures) of a sweep's run directory: sweep.csv/.parquet, meta.json, sweep.png (+ sweep_tasks.png
    with task metrics)."""
    # seaborn/matplotlib load in about a second: imported only when the sweep draws its figure (saves start-up time elsewhere).
    from headlab.viz.plots import figure_bytes, plot_sweep, plot_sweep_tasks

    model = result.meta.get("model", "model")
    files = {"sweep.png": figure_bytes(plot_sweep(result.table, f"{model}: perplexity as heads are pruned"))}
    if metric_columns(result.table):
        files["sweep_tasks.png"] = figure_bytes(
            plot_sweep_tasks(result.table, f"{model}: lm-eval tasks as heads are pruned")
        )
    return {"sweep": result.table}, result.meta, files


def write_sweep(result: SweepResult, out, *, overwrite: bool = False) -> Path:
    """The sweep's run directory (sweep_files), atomically."""
    tables, meta, files = sweep_files(result)
    return write_run(Path(out), tables, meta, overwrite=overwrite, extra_files=files)
