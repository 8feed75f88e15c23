"""Pruning sweeps: perplexity, size, KV bytes and speed of a model pruned to several fractions in several orders
(Michel et al. 2019, Fig. 3-style curves), as a tidy table and a plot.

Each pruned model is made in memory (prune.pruned_in_place) and restored afterwards; no checkpoint is written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.errors import HeadlabError
from headlab.loading import LoadedModel
from headlab.prune import (
    check_unit,
    costs,
    entropy_scores,
    importance_scores,
    pruned_in_place,
    random_scores,
    select_heads,
)

ORDERS = (
    "importance", "iterative", "random", "entropy", "ablation", "grad", "taylor", "fisher", "obs", "fisher-block",
)  # fmt: skip
JOINT_ORDERS = ("obs", "fisher-block")  # joint per-layer greedy paths (headlab.selection), not a per-head ranking
DEFAULT_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
DEFAULT_ORDERS = ("importance", "random", "entropy")
ORDER_HELP = {
    "importance": "gradient importance (Michel et al.), lowest first, scored once",
    "iterative": "gradient importance re-scored with the heads pruned so far masked, before each fraction",
    "random": "uniformly random scores, averaged over --seeds",
    "entropy": "mean attention entropy, most diffuse (highest entropy) first",
    "ablation": "loss increase when each head alone is removed, lowest first",
    "grad": "gradient importance E_x |dL(x)/dxi_h| (Michel et al.), whatever --method says",
    "taylor": "per-token |ctx_h . dL/dctx_h| (Michel et al.'s code)",
    "fisher": "diagonal empirical Fisher of the head gates (Kwon et al. 2022)",
    "obs": "structured OBS: per layer the heads whose removal leaves the least loss-weighted o_proj error after the "
    "ridge refit, greedily, layers by estimated loss (headlab.obs)",
    "fisher-block": "per layer the heads with the least joint block-diagonal Fisher cost, layers by that cost",
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
    from headlab.compensate import check_compensation

    check_compensation(loaded, compensate)
    from headlab.evaluate import perplexity

    fractions = sorted(set(float(f) for f in fractions))
    orders, seeds = list(dict.fromkeys(orders)), list(dict.fromkeys(seeds))
    check_sweep(fractions, orders, seeds)
    check_unit(loaded.layers, unit)
    if loaded.max_positions is not None and seq_len > loaded.max_positions:  # fail before the first score pass
        raise HeadlabError(f"--seq-len {seq_len} exceeds the model's maximum positions ({loaded.max_positions})")
    if mode not in ("mask", "physical"):
        raise HeadlabError(f"unknown --mode {mode!r}; use mask or physical")
    if mode == "physical" and loaded.adapter.norm_spans_heads:
        mode = "mask"  # physical is approximate here; the sweep reports exact masked perplexity instead
    layers = loaded.layers
    total_heads = sum(layer.num_heads for layer in layers)
    score_kwargs = dict(data=data, seq_len=seq_len, batch_size=batch_size, progress=progress)
    importance_kwargs = dict(score_kwargs, text_column=text_column, method=method, max_tokens=calibration_tokens)

    def scores_for(order: str, seed: int):
        if scores is not None and order in scores:
            return [torch.as_tensor(s, dtype=torch.float64) for s in scores[order]]
        if order in ("importance", "iterative"):
            return importance_scores(loaded, **importance_kwargs)
        if order == "ablation":
            return importance_scores(loaded, **dict(importance_kwargs, method="ablation", max_tokens=None))
        if order in ("grad", "taylor", "fisher"):
            return importance_scores(loaded, **dict(importance_kwargs, method=order))
        if order in JOINT_ORDERS:
            return _joint_paths(loaded, order, unit, per_layer, allow_empty_layer, grams, importance_kwargs)
        if order == "entropy":
            return entropy_scores(loaded, **score_kwargs, text_column=text_column, max_tokens=calibration_tokens)
        return random_scores(layers, seed)

    eval_kwargs = dict(seq_len=seq_len, batch_size=batch_size, max_tokens=eval_tokens, text_column=text_column)
    cache: dict[tuple, dict] = {}
    grams = None
    if compensate is not None or "obs" in orders:
        from headlab.compensate import compensation_batches, output_statistics

        batches = compensation_batches(
            loaded, data, text_column=text_column, seq_len=seq_len, batch_size=batch_size, max_tokens=calibration_tokens
        )
        grams = output_statistics(loaded, batches, progress=progress)

    def measure(pruned, compensation=None) -> dict:
        key = (tuple(tuple(sorted(p)) for p in pruned), compensation)
        if key not in cache:
            from headlab.compensate import compensated

            refit = compensated(loaded, pruned, grams, compensation) if compensation else contextlib.nullcontext()
            with refit, pruned_in_place(loaded, pruned, mode) as layout:
                result = perplexity(loaded, data, part="eval", progress=False, **eval_kwargs)
                size = costs(loaded, context=seq_len)
            if mode == "mask":  # the model kept its shapes: report what the physical prune would cost
                with pruned_in_place(loaded, pruned, "physical") as layout:
                    size = costs(loaded, context=seq_len)
            cache[key] = {
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
        return cache[key]

    runs = [(order, seed) for order in orders for seed in (seeds if order == "random" else [None])]
    rows = []
    start = time.perf_counter()
    bar = tqdm(total=len(runs) * len(fractions), desc="sweep", disable=not progress, unit="model")
    for order, seed in runs:
        scores = scores_for(order, seed or 0)
        pruned = [set() for _ in layers]
        for fraction in fractions:
            if order == "iterative" and any(pruned):
                scores = importance_scores(loaded, pruned, **importance_kwargs)
            if order in JOINT_ORDERS:  # `scores` holds the layers' greedy paths: take steps for this fraction
                from headlab.selection import allocate

                budget = "per-layer" if per_layer else "global"
                taken = allocate(loaded, scores, budget=budget, unit=unit, fraction=fraction, count=None)
                pruned = [set(h for u in p.units[:k] for h in u) for p, k in zip(scores, taken)]
            else:
                pruned = select_heads(
                    layers,
                    scores,
                    fraction=fraction,
                    per_layer=per_layer,
                    unit=unit,
                    allow_empty_layer=allow_empty_layer,
                    already=pruned if order == "iterative" else None,
                )
            n = sum(len(p) for p in pruned)
            for compensation in [None] + ([compensate] if compensate else []):
                rows.append(
                    {
                        "order": order,
                        "seed": seed,
                        "fraction": fraction,
                        "pruned_heads": n,
                        "fraction_pruned": n / total_heads,
                        "compensation": compensation or "none",
                        **measure(pruned, compensation),
                    }
                )
            bar.update()
    bar.close()
    table = pd.DataFrame(rows)
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
    return SweepResult(table, meta)


def _joint_paths(loaded, order, unit, per_layer, allow_empty_layer, grams, importance_kwargs):
    """The joint selection's per-layer greedy paths (headlab.selection), computed once for every fraction."""
    from headlab.selection import calibration_scoring_batches, joint_paths

    kw = importance_kwargs
    batches = calibration_scoring_batches(
        loaded, data=kw["data"], text_column=kw["text_column"], seq_len=kw["seq_len"], batch_size=kw["batch_size"],
        max_tokens=kw["max_tokens"],
    )  # fmt: skip
    paths, _ = joint_paths(
        loaded, select=order, budget="per-layer" if per_layer else "global", unit=unit, cap=None,
        allow_empty_layer=allow_empty_layer, scoring_batches=batches, grams=grams, progress=kw["progress"],
    )  # fmt: skip
    return paths


def write_sweep(result: SweepResult, out, *, overwrite: bool = False) -> Path:
    """sweep.csv + sweep.parquet + meta.json + sweep.png, atomically."""
    from headlab.plots import figure_bytes, plot_sweep
    from headlab.tables import write_run

    fig = plot_sweep(result.table, f"{result.meta.get('model', 'model')}: perplexity as heads are pruned")
    return write_run(
        Path(out),
        {"sweep": result.table},
        result.meta,
        overwrite=overwrite,
        extra_files={"sweep.png": figure_bytes(fig)},
    )
