"""Pruning sweeps: perplexity, size, KV bytes and speed of a model pruned to several fractions in several orders
(Michel et al. 2019, Fig. 3-style curves), as a tidy table and a plot.

Each pruned model is made in memory (prune.pruned_in_place) and restored afterwards; no checkpoint is written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.compensate import check_compensation, compensated, compensation_batches, output_statistics
from headlab.costs import costs
from headlab.data import Corpus, load_corpus
from headlab.errors import HeadlabError
from headlab.evaluate import perplexity
from headlab.importance import METHODS as IMPORTANCE_METHODS
from headlab.loading import LoadedModel
from headlab.prune import MODES, PruneSpec, check_unit, plan, pruned_in_place
from headlab.scores import ScoreRequest, score_heads
from headlab.tables import write_run

ORDERS = ("importance", "iterative", "random", "entropy", "ablation")
# Gradient importance methods for the importance orders: the registry's, less those that are orders themselves.
METHODS = tuple(m for m in IMPORTANCE_METHODS if m not in ORDERS)
DEFAULT_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
DEFAULT_ORDERS = ("importance", "random", "entropy")
ORDER_HELP = {
    "importance": "gradient importance (Michel et al.), lowest first, scored once",
    "iterative": "gradient importance re-scored with the heads pruned so far masked, before each fraction",
    "random": "uniformly random scores, averaged over --seeds",
    "entropy": "mean attention entropy, most diffuse (highest entropy) first",
    "ablation": "loss increase when each head alone is removed, lowest first",
}


@dataclass
class SweepResult:
    table: pd.DataFrame  # one row per (order, seed, fraction)
    meta: dict = field(default_factory=dict)


def check_sweep(fractions, orders, seeds) -> None:
    bad = [f for f in fractions if not 0 <= f < 1]
    if bad:
        raise HeadlabError(f"--fractions must lie in [0, 1), got {bad}")
    unknown = [o for o in orders if o not in ORDERS]
    if unknown:
        raise HeadlabError(f"unknown order(s) {', '.join(unknown)}; use {', '.join(ORDERS)}")
    if "random" in orders and not seeds:
        raise HeadlabError("the random order needs at least one seed")


def sweep(
    loaded: LoadedModel,
    *,
    fractions=DEFAULT_FRACTIONS,
    orders=DEFAULT_ORDERS,
    seeds=(0, 1, 2),
    unit: str = "head",
    per_layer: bool = False,
    allow_empty_layer: bool = False,
    mode: str = "physical",
    data=None,
    text_column: str | None = None,
    calibration_tokens: int = 1024,
    eval_tokens: int | None = 1024,
    seq_len: int = 256,
    batch_size: int = 4,
    method: str = "grad",
    progress: bool = True,
    compensate: str | None = None,
    scores: dict | None = None,
) -> SweepResult:
    """Perplexity (eval split) of the model with the lowest fraction f of heads pruned, for every f and order.

    mode="physical" slices the heads out (measured tokens/s is that of the smaller model); where physical pruning
    is approximate (q/k norms spanning heads) the sweep falls back to mask mode, which is exact. Scores come from
    the calibration split; importance by `method`. compensate ("ridge" or "bias", headlab.compensate) adds a second
    row per pruned model with the output projection refitted on `calibration_tokens` calibration tokens (column
    compensation; "none" for the plain rows). `scores` ({order: per-layer [H_l] tensors}) gives an order's starting
    scores already computed with the same settings (e.g. the report's importance step), instead of computing them again.
    """

    # More than 12 parameters: the Python face of every `headlab sweep` option (API compatibility); inside, the
    # calibration settings become one ScoreRequest and the evaluation settings one dict.
    check_compensation(loaded, compensate)
    fractions = sorted(set(float(f) for f in fractions))
    orders, seeds = list(dict.fromkeys(orders)), list(dict.fromkeys(seeds))
    check_sweep(fractions, orders, seeds)
    check_unit(loaded.layers, unit)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:  # fail before the first score pass
        raise HeadlabError(f"--seq-len {seq_len} exceeds the model's maximum positions ({loaded.max_positions})")
    if mode not in MODES:
        raise HeadlabError(f"unknown --mode {mode!r}; use mask or physical")
    if mode == "physical" and loaded.adapter.norm_spans_heads:
        mode = "mask"  # physical is approximate here; the sweep reports exact masked perplexity instead
    corpus = data if isinstance(data, Corpus) else load_corpus(data, text_column)  # resolved once for every pass
    request = ScoreRequest(corpus, text_column, seq_len, batch_size, calibration_tokens, progress)
    eval_kwargs = dict(seq_len=seq_len, batch_size=batch_size, max_tokens=eval_tokens, text_column=text_column)
    grams = None
    if compensate is not None:
        batches = compensation_batches(
            loaded,
            corpus,
            text_column=text_column,
            seq_len=seq_len,
            batch_size=batch_size,
            max_tokens=calibration_tokens,
        )
        grams = output_statistics(loaded, batches, progress=progress)
    measure = _Measure(loaded, mode, grams, eval_kwargs, corpus)
    spec = PruneSpec(per_layer=per_layer, unit=unit, allow_empty_layer=allow_empty_layer)
    total_heads = sum(layer.num_heads for layer in loaded.layers)
    runs = [(order, seed) for order in orders for seed in (seeds if order == "random" else [None])]
    rows = []
    start = time.perf_counter()
    bar = tqdm(total=len(runs) * len(fractions), desc="sweep", disable=not progress, unit="model")
    for order, seed in runs:
        given = None if scores is None or order not in scores else scores[order]
        for fraction, pruned in _order_steps(loaded, order, seed or 0, fractions, spec, method, request, given):
            n = sum(len(p) for p in pruned)
            for compensation in [None] + ([compensate] if compensate else []):
                row = {"order": order, "seed": seed, "fraction": fraction, "pruned_heads": n}
                row.update(fraction_pruned=n / total_heads, compensation=compensation or "none")
                rows.append({**row, **measure(pruned, compensation)})
            bar.update()
    bar.close()
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
        "calibration": {"data": data or "pydoc-topics", "split": "calibration", "max_tokens": calibration_tokens},
        "eval": {"data": data or "pydoc-topics", "split": "eval", **eval_kwargs},
        "total_heads": total_heads,
        "seconds": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
    }
    return SweepResult(pd.DataFrame(rows), meta)


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


def _order_source(order: str, method: str) -> str:
    """The score source (headlab.scores registry) of a sweep order."""
    return method if order in ("importance", "iterative") else order


def _order_request(order: str, seed: int, request):
    if order == "ablation":
        return replace(request, max_tokens=None)  # ablation's own budget (one forward pass set per head)
    if order == "random":
        return replace(request, seed=seed)
    return request


class _Measure:
    """Perplexity, costs and speed of the model with a set of heads pruned (and compensated), made in memory and
    restored afterwards; cached by (heads, compensation) since random seeds and orders often agree."""

    def __init__(self, loaded, mode, grams, eval_kwargs, data):
        self.loaded, self.mode, self.grams, self.eval_kwargs, self.data = loaded, mode, grams, eval_kwargs, data
        self.cache: dict[tuple, dict] = {}

    def __call__(self, pruned, compensation=None) -> dict:
        key = (tuple(tuple(sorted(p)) for p in pruned), compensation)
        if key not in self.cache:
            self.cache[key] = self._measure(pruned, compensation)
        return self.cache[key]

    def _measure(self, pruned, compensation) -> dict:
        loaded, seq_len = self.loaded, self.eval_kwargs["seq_len"]
        refit = compensated(loaded, pruned, self.grams, compensation) if compensation else contextlib.nullcontext()
        with refit, pruned_in_place(loaded, pruned, self.mode) as layout:
            result = perplexity(loaded, self.data, part="eval", progress=False, **self.eval_kwargs)
            size = costs(loaded, context=seq_len)
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
        }


def write_sweep(result: SweepResult, out, *, overwrite: bool = False) -> Path:
    """sweep.csv + sweep.parquet + meta.json + sweep.png, atomically."""
    # seaborn/matplotlib load in about a second: imported only when the sweep draws its figure (saves start-up time elsewhere).
    from headlab.plots import figure_bytes, plot_sweep

    fig = plot_sweep(result.table, f"{result.meta.get('model', 'model')}: perplexity as heads are pruned")
    return write_run(
        Path(out),
        {"sweep": result.table},
        result.meta,
        overwrite=overwrite,
        extra_files={"sweep.png": figure_bytes(fig)},
    )
