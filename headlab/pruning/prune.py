"""Head pruning: choose heads (by score, explicitly, iteratively), remove them by masking or by slicing the
projections, and save checkpoints that load back (vanilla transformers when uniform, headlab's loader otherwise).

Selection works on per-layer sets of original query-head indices. Mask mode keeps every shape; physical mode
rewrites each layer through its adapter (read -> HeadWeights.take -> write), so it holds for every family.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

from headlab.core import checkpoint
from headlab.core.arch import AttentionLayer
from headlab.core.checkpoint import check_checkpoint_out
from headlab.core.data import TextSpec, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.layout import (
    HEAD_LAYOUT_KEY,
    LayerLayout,
    group_heads,
    is_uniform,
    layout_record,
    physical_layout,
)
from headlab.core.loading import LoadedModel, check_resident
from headlab.core.tables import write_run
from headlab.measure.costs import costs
from headlab.measure.evaluate import perplexity
from headlab.mechanisms.gates import gates_from_pruned, write_mask
from headlab.mechanisms.restore import restoring
from headlab.pruning.choices import DEFAULT_CALIBRATION_TOKENS, MODES
from headlab.pruning.score_sources import SCORE_SOURCES
from headlab.pruning.scores import ScoreRequest, score_heads
from headlab.pruning.selection import (
    BudgetSearch,
    _select_uniform,
    calibration_grams,
    calibration_scoring_batches,
    check_amount,
    check_budget,
    check_select,
    check_unit,
    select_heads,
    select_joint,
)
from headlab.recovery.compensate import apply_compensation, check_compensation, compensation_batches, output_statistics
from headlab.recovery.recover import RECOVERY_DIR, write_recovery

RECORD_DIR = "pruning"  # inside a pruned checkpoint: heads.csv/.parquet, mask.csv (gates format), meta.json


# ---- selection ----------------------------------------------------------------------------------------------------


def parse_heads(spec: str, layers: list[AttentionLayer]) -> list[set[int]]:
    """`"L:h,h;L:h"` -> per-layer sets of query heads; unknown layers or heads are errors."""
    pruned = [set() for _ in layers]
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        match = re.fullmatch(r"(\d+)\s*:\s*(\d+(?:\s*,\s*\d+)*)", part)
        if match is None:
            raise HeadlabError(f"cannot read {part!r} in heads=; use 'LAYER:HEAD,HEAD;LAYER:HEAD'")
        layer = int(match.group(1))
        if layer >= len(layers):
            raise HeadlabError(
                f"heads= names layer {layer}, which does not exist (the model has {len(layers)} attention layers)"
            )
        for head in (int(h) for h in match.group(2).split(",")):
            if head >= layers[layer].num_heads:
                raise HeadlabError(f"layer {layer} has no head {head} ({layers[layer].num_heads} heads) in heads=")
            pruned[layer].add(head)
    if not any(pruned):
        raise HeadlabError("heads= names no head")
    return pruned


def pruned_table(layers: list[AttentionLayer], pruned: list[set[int]], scores=None) -> pd.DataFrame:
    """Tidy record: one row per head, `layer, head, kv_head, pruned` (+ `score` when known)."""
    rows = []
    for layer, heads in zip(layers, pruned):
        for h in range(layer.num_heads):
            row = {"layer": layer.index, "head": h, "kv_head": layer.kv_head_of(h), "pruned": h in heads}
            if scores is not None:
                row["score"] = float(scores[layer.index][h])
            rows.append(row)
    return pd.DataFrame(rows)


def check_not_empty(layers: list[AttentionLayer], pruned: list[set[int]], allow_empty_layer: bool) -> None:
    if allow_empty_layer:
        return
    for layer, heads in zip(layers, pruned):
        if len(heads) >= layer.num_heads:
            raise HeadlabError(
                f"this prunes every head of layer {layer.index}; pass allow_empty_layer=True to allow it"
            )


# ---- applying a selection -----------------------------------------------------------------------------------------


def apply_mask(loaded: LoadedModel, pruned: list[set[int]]) -> None:
    """Mask mode, in place: zero the pruned heads' output-projection columns (and their query rows, and the key and
    value rows of KV heads left without queries), keeping every shape (`mask_layer`, layer by layer)."""
    check_resident(loaded, "mask pruning")
    with torch.no_grad():
        for layer, heads in zip(loaded.layers, pruned):
            mask_layer(loaded.adapter, layer, heads)


def mask_layer(adapter, layer: AttentionLayer, heads: set[int]) -> None:
    """Mask one layer's `heads` through its adapter (no_grad is the caller's).

    Output-projection columns alone make the model equal to gating those heads with 0; the query/KV rows are zeroed
    only to make the removal visible in the weights, and not where the q/k norm spans heads (OLMo2), where a zero
    head would change the other heads' normalisation.
    """
    if not heads:
        return
    w = adapter.read(layer)
    index = torch.tensor(sorted(heads))
    w.o[:, index] = 0
    if not adapter.norm_spans_heads:
        w.q[index] = 0
        if w.q_bias is not None:
            w.q_bias[index] = 0
        dead = [g for g in range(layer.num_kv_heads) if all(h in heads for h in group_heads(layer, g))]
        for t in (w.k, w.v, w.k_bias, w.v_bias):
            if t is not None and dead:
                t[torch.tensor(dead)] = 0
    adapter.write(layer, w)


def apply_physical(loaded: LoadedModel, layout: list[LayerLayout]) -> None:
    """Physical mode, in place: slice q/k/v/o weights, biases and per-head norms to the layout (`slice_layer`)."""
    check_resident(loaded, "physical pruning")
    with torch.no_grad():
        for layer, lay in zip(loaded.layers, layout):
            slice_layer(loaded.adapter, layer, lay)


def slice_layer(adapter, layer: AttentionLayer, lay: LayerLayout) -> None:
    """Slice one layer to its layout through the adapter: kept heads and KV heads only, padding heads' output
    columns zeroed (no_grad is the caller's)."""
    unchanged = lay.num_heads == layer.num_heads and lay.kv_heads == list(range(layer.num_kv_heads))
    if unchanged and not lay.padding:
        return
    w = adapter.read(layer).take(lay.heads, lay.kv_heads)
    for position, head in enumerate(lay.heads):
        if head in lay.padding:
            w.o[:, position] = 0  # [C, D] block of the padding head: it contributes nothing
    adapter.write(layer, w)


@contextlib.contextmanager
def pruned_in_place(loaded: LoadedModel, pruned: list[set[int]], mode: str = "physical"):
    """Apply a selection for the duration of a block, then write the original weights back (also on error)."""
    with restoring(loaded):
        yield apply(loaded, pruned, mode)


# ---- saving and loading -------------------------------------------------------------------------------------------


def prepare_config(loaded: LoadedModel, layout: list[LayerLayout] | None) -> str:
    """Write the pruned layout into the model's config before saving; returns "vanilla" or "headlab" (the loader).

    Uniform layouts update the head counts (vanilla from_pretrained builds them); others keep the original counts
    and record per-layer heads under HEAD_LAYOUT_KEY, so vanilla loading fails on shapes instead of running wrong.
    """
    config = loaded.model.config
    if layout is None:  # mask mode: shapes unchanged
        return "headlab" if getattr(config, HEAD_LAYOUT_KEY, None) else "vanilla"
    if is_uniform(layout, loaded.adapter, config, loaded.layers[0].head_dim):
        lay = layout[0]
        loaded.adapter.set_config_heads(config, lay.num_heads, lay.num_kv_heads, loaded.layers[0].head_dim)
        if hasattr(config, HEAD_LAYOUT_KEY):
            delattr(config, HEAD_LAYOUT_KEY)
        return "vanilla"
    setattr(config, HEAD_LAYOUT_KEY, layout_record(config, layout, loaded.adapter.norm_spans_heads))
    return "headlab"


@dataclass
class PruneResult:
    """What `prune` did: the selection, the layout, the costs and perplexities before and after, where it went."""

    pruned: list[set[int]]
    table: pd.DataFrame
    mode: str
    loader: str  # "vanilla" (AutoModel.from_pretrained) or "headlab" (headlab.core.loading.load_model)
    layout: list[LayerLayout] | None
    before: dict
    after: dict
    ppl_before: float | None
    ppl_after: float | None
    out: Path | None
    verification: dict | None
    meta: dict = field(default_factory=dict)

    @property
    def num_pruned(self) -> int:
        return sum(len(p) for p in self.pruned)


def save_pruned(
    loaded: LoadedModel, out, result_meta: dict, table: pd.DataFrame, gates, *, overwrite=False, recovery=None
) -> dict:
    """Save the pruned model atomically with its record (pruning/heads.csv+.parquet, mask.csv, meta.json), after
    checkpoint.save_checkpoint has reloaded it and compared logits. Returns the verification."""

    def write_record(staging: Path) -> None:
        write_run(staging / RECORD_DIR, {"heads": table}, result_meta, overwrite=False)
        # The model may no longer have the original shapes: the mask is indexed by the original heads.
        write_mask(staging / RECORD_DIR / "mask.csv", gates, original_layers(table))
        if recovery is not None:
            write_recovery(staging / RECOVERY_DIR, recovery, f"recovery of {loaded.spec}")

    return checkpoint.save_with_record(loaded, Path(out), result_meta, write_record, overwrite=overwrite)


def original_layers(table: pd.DataFrame):
    """Minimal layer views (index, num_heads) of the original model, from the pruning record."""
    return [
        SimpleNamespace(index=int(layer), num_heads=int(len(group)))
        for layer, group in table.groupby("layer", sort=True)
    ]


@dataclass(frozen=True)
class PruneSpec:
    """How many heads to prune and how to count them: the input of the pure `plan` step besides the scores.

    fraction: the fraction of heads (or KV groups) to prune; count: their number instead (neither: 0.2 of them);
    per_layer: take the amount within every layer, not globally; unit: "head" or "kv-group", what one step removes;
    uniform: the same number from every layer (or KV group), a vanilla-loadable layout; allow_empty_layer: allow
    removing every head of a layer. (`prune` reads per_layer/uniform as the budgets of Selection.budget.)"""

    fraction: float | None = None
    count: int | None = None
    per_layer: bool = False
    unit: str = "head"
    uniform: bool = False
    allow_empty_layer: bool = False


@dataclass(frozen=True)
class Selection:
    """How `prune` chooses the heads (PruneSpec says how many): given, read from a table, or scored on the
    calibration split, then ranked or selected jointly under a budget.

    heads: exactly these heads, 'L:h,h;L:h' (nothing is scored; no amount, scores or iterative with it)
    scores: a scores table instead of scoring: a DataFrame, or a CSV/Parquet path or importance run directory
    method: the score source when neither is given (headlab.pruning.score_sources: grad, taylor, fisher, ablation,
        obs, random with `seed`, entropy, ...)
    iterative: re-score after each of this many steps, the heads chosen so far masked (None: score once)
    select: rank | fisher-block | obs (headlab.pruning.selection)
    budget: global | per-layer | uniform | search; None: the one PruneSpec.per_layer/uniform name, else global
    seed: the seed of method "random"
    calibration_tokens: calibration tokens for the scores, the OBS statistics and the compensate refit
    search_tokens: calibration tokens each budget-search measurement runs on
    low_memory: importance runs one sequence per backward pass with activation checkpointing (same scores, a
        fraction of the memory, about 3x the time on a CPU); None: only when whole batches would not fit in the
        memory available (headlab.measure.importance.choose_low_memory)
    """

    heads: str | None = None
    scores: object = None  # DataFrame, CSV/Parquet path or importance run directory
    method: str = "grad"
    iterative: int | None = None
    select: str = "rank"
    budget: str | None = None
    seed: int = 0
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    search_tokens: int = 512
    low_memory: bool | None = None


def plan(
    layers: list[AttentionLayer],
    scores: list[torch.Tensor],
    spec: PruneSpec,
    *,
    already: list[set[int]] | None = None,
    step: int = 1,
    steps: int = 1,
) -> list[set[int]]:
    """Pure: scores + spec -> per-layer sets of heads to prune. Iterative pruning asks for step/steps of the amount
    at each step, `already` holding the heads earlier steps chose."""
    return select_heads(
        layers,
        scores,
        fraction=None if spec.fraction is None else spec.fraction * step / steps,
        count=None if spec.count is None else round(spec.count * step / steps),
        per_layer=spec.per_layer,
        unit=spec.unit,
        uniform=spec.uniform,
        allow_empty_layer=spec.allow_empty_layer,
        already=already,
    )


def apply(loaded: LoadedModel, pruned: list[set[int]], mode: str) -> list[LayerLayout] | None:
    """Prune in place: "mask" zeroes the heads' output-projection columns (shapes kept; returns None), "physical"
    slices them out through the adapter (returns the layout)."""
    if mode == "mask":
        apply_mask(loaded, pruned)
        return None
    layout = physical_layout(loaded.layers, pruned)
    apply_physical(loaded, layout)
    return layout


@takes_text(split="calibration", seq_len=256, batch_size=4)
def prune(
    loaded: LoadedModel,
    spec: PruneSpec = PruneSpec(),
    selection: Selection = Selection(),
    *,
    mode: str = "mask",
    text: TextSpec,
    eval_tokens: int | None = 1024,
    evaluate: bool = True,
    compensate: str | None = None,
    recovery=None,
    out=None,
    overwrite: bool = False,
    progress: bool = True,
) -> PruneResult:
    """Select heads, prune them in place (mask or physical), report costs and perplexity before and after, and save
    a verified checkpoint with its pruning record to `out` (when given). Bad input fails before any work.

    The workflow is score -> plan -> compensate -> apply -> evaluate -> save. spec: how many heads and how they are
    counted (PruneSpec; 0.2 of the heads without fraction or count); selection: how they are chosen (Selection:
    explicit heads, a scores table, or a score method, ranked or selected jointly under a budget). text: the corpus,
    its column, the window length and batch size (a TextSpec; the loose keywords data, text_column, seq_len,
    batch_size also work); scores and compensation read its calibration split (`selection.calibration_tokens`),
    perplexity its eval split (`eval_tokens`; evaluate=False skips it). mode: "mask" zeroes the heads, "physical"
    slices them out. compensate: "ridge" refits the kept heads' output-projection columns, "bias" folds the removed
    heads' mean output into the o_proj bias (headlab.recovery.compensate), before pruning. recovery: a
    function(loaded) -> record run on the pruned model before saving (headlab.recovery.recover). out, overwrite:
    the checkpoint directory and whether it may be replaced."""
    # Inside, the arguments become a PruneSpec (plan), a ScoreRequest (scores) and two TextSpecs (calibration, eval).
    heads, scores, method, iterative = selection.heads, selection.scores, selection.method, selection.iterative
    spec, budget, joint = check_request(loaded, spec, selection, mode=mode, compensate=compensate, out=out,
                                        overwrite=overwrite)  # fmt: skip
    # The corpus is resolved once, and only when some step reads text (scores, compensation, perplexity).
    reads_text = (heads is None and (scores is None or iterative)) or evaluate or compensate is not None
    text = text.resolved() if reads_text else text
    request = ScoreRequest(text.but(split="calibration", max_tokens=selection.calibration_tokens), progress,
                           selection.seed, table=scores, low_memory=selection.low_memory)  # fmt: skip
    choice = choose_heads(loaded, spec, request, selection, budget=budget, joint=joint, compensate=compensate)
    gates = gates_from_pruned(loaded.layers, choice.pruned)  # on the original heads, before physical surgery
    eval_text = text.but(split="eval", max_tokens=eval_tokens)
    evaluation = eval_text if evaluate else None
    request = replace(request, grams=choice.grams)  # the refit reads the Grams the selection computed, if any
    measured = _prune_and_measure(loaded, choice.pruned, mode, compensate, request, evaluation, recovery)
    record = dict(heads=heads, scores=scores, method=method, iterative=iterative, select=selection.select,
                  budget=budget, calibration_tokens=selection.calibration_tokens, joint=choice.joint_meta,
                  seed=selection.seed)  # fmt: skip
    meta = _prune_record(loaded, mode, measured, selection_record(record, spec), choice.pruned, eval_text)
    verification = None
    if out is not None:
        verification = save_pruned(
            loaded, out, meta, choice.table, gates, overwrite=overwrite, recovery=measured["recovered"]
        )
    out = Path(out) if out is not None else None
    return PruneResult(
        choice.pruned, choice.table, mode, measured["loader"], measured["layout"], measured["before"],
        measured["after"], measured["ppl_before"], measured["ppl_after"], out, verification, meta,
    )  # fmt: skip


@dataclass
class _Choice:
    """Which heads go, with their scores table (and the joint selection's record when one chose them)."""

    pruned: list[set[int]]
    table: pd.DataFrame
    joint_meta: dict | None = None
    grams: list | None = None  # the calibration Grams the selection computed (--compensate refits from the same)


def choose_heads(loaded, spec: PruneSpec, request: ScoreRequest, selection: Selection, *, budget, joint,
                  compensate) -> _Choice:  # fmt: skip
    """The selection step: explicit heads, score -> plan (iterated), or (`joint`) a joint selection / budget
    search. `budget`: the budget _budget resolved from `selection` and `spec`."""
    heads, method, select, iterative = selection.heads, selection.method, selection.select, selection.iterative
    table_source = request.table
    choosing = heads is None and table_source is None
    if heads is None and (select == "obs" or (choosing and method == "obs") or (budget == "search" and compensate)):
        request = replace(request, grams=calibration_grams(loaded, request.text, progress=request.progress))
    # Everything cheap is checked; explicit heads and score tables are validated before any forward pass.
    table_scores = score_heads("table", loaded, request) if table_source is not None else None
    if heads is not None:
        pruned, current = parse_heads(heads, loaded.layers), None
        check_not_empty(loaded.layers, pruned, spec.allow_empty_layer)
    elif joint:
        chosen = _choose_joint(loaded, spec, selection, budget, request, table_scores, compensate)
        table = _with_steps(pruned_table(loaded.layers, chosen.pruned, chosen.scores), chosen.table)
        return _Choice(chosen.pruned, table, chosen.meta, request.grams)
    else:
        pruned, current = _choose(loaded, spec, method, request, table_scores, iterative)
    return _Choice(pruned, pruned_table(loaded.layers, pruned, current), grams=request.grams)


def _prune_and_measure(loaded, pruned, mode, compensate, request, evaluation, recovery) -> dict:
    """compensate -> apply -> recover, with costs and perplexity (on `evaluation`, a TextSpec or None) around it."""
    measured = {"before": costs(loaded), "ppl_before": _ppl(loaded, evaluation, request.progress)}
    measured["total_heads"] = sum(layer.num_heads for layer in loaded.layers)  # before physical surgery
    measured["compensation"] = None if compensate is None else _compensate(loaded, pruned, compensate, request)
    measured["equivalent"] = _physical_equivalent(loaded, pruned) if mode == "mask" else (None, None)
    layout = apply(loaded, pruned, mode)
    measured.update(layout=layout, after=costs(loaded), ppl_after=_ppl(loaded, evaluation, request.progress))
    recovered = recovery(loaded) if recovery is not None else None
    measured["recovered"] = recovered
    measured["ppl_recovered"] = _ppl(loaded, evaluation, request.progress) if recovered is not None else None
    measured["loader"] = prepare_config(loaded, layout)
    return measured


def _prune_record(loaded, mode, measured: dict, selection: dict, pruned, eval_text: TextSpec) -> dict:
    """The checkpoint's meta.json (key order as earlier records)."""
    layout, equivalent, recovered = measured["layout"], measured["equivalent"], measured["recovered"]
    eval_settings = {"seq_len": eval_text.seq_len, "batch_size": eval_text.batch_size,
                     "max_tokens": eval_text.max_tokens, "text_column": eval_text.text_column}  # fmt: skip
    meta = {
        **loaded.describe(),
        "mode": mode,
        "loader": measured["loader"],
        "selection": selection,
        "pruned_heads": sum(len(p) for p in pruned),
        "total_heads": measured["total_heads"],
        "approximate": mode == "physical" and loaded.adapter.norm_spans_heads,
        "padding_heads": sum(len(lay.padding) for lay in layout or []),
        "costs_before": measured["before"],
        "costs_after": measured["after"],
        "physical_equivalent": equivalent[0],
        "physical_equivalent_layout": equivalent[1],
        "perplexity_before": measured["ppl_before"],
        "perplexity_after": measured["ppl_after"],
        "compensation": measured["compensation"],
        "eval": {"data": eval_text.corpus_name, "split": "eval", **eval_settings},
    }
    if recovered is not None:
        meta["recovery"] = {k: v for k, v in recovered.items() if k != "tables"}
        meta["perplexity_recovered"] = measured["ppl_recovered"]
    return meta


def selection_record(options: dict, spec: PruneSpec) -> dict:
    """The meta.json `selection` entry, in the key order earlier records used; `options`: the Selection's fields
    as prune resolved them (heads, scores, method, iterative, select, budget, calibration_tokens, joint, seed)."""
    heads, scores, method, select = options["heads"], options["scores"], options["method"], options["select"]
    selection = {
        "heads": heads,
        "scores": str(scores) if scores is not None and not isinstance(scores, pd.DataFrame) else scores is not None,
        "method": None if heads is not None or scores is not None or select != "rank" else method,
        "iterative": options["iterative"],
        "calibration_tokens": options["calibration_tokens"],
        "select": select if heads is None else None,
        "budget": options["budget"] if heads is None else None,
        "joint": options["joint"],
        "seed": options["seed"] if heads is None and scores is None and method == "random" else None,
    }
    keys = ("heads", "scores", "method", "fraction", "count", "per_layer", "unit", "uniform", "iterative")
    merged = {**selection, **vars(spec)}
    extra = ("allow_empty_layer", "calibration_tokens", "select", "budget", "joint", "seed")
    return {**{key: merged[key] for key in keys}, **{k: merged[k] for k in extra}}


def check_request(loaded, spec: PruneSpec, selection: Selection, *, mode, compensate, out, overwrite):
    """Every check of a prune request that needs no forward pass (prune runs it first; a command that measures
    something before pruning runs it before that). Returns (spec with its budget and default amount filled in,
    the budget name, whether a joint selection chooses)."""
    check_compensation(loaded, compensate)
    budget = _budget(selection.budget, spec.per_layer, spec.uniform)
    spec = replace(spec, per_layer=budget == "per-layer", uniform=budget == "uniform")  # never the caller's object
    spec = _check_prune(loaded, spec, heads=selection.heads, scores=selection.scores, iterative=selection.iterative,
                        mode=mode, out=out, overwrite=overwrite)  # fmt: skip
    joint = selection.heads is None and (selection.select != "rank" or budget == "search")
    _check_selection(loaded, spec, selection, budget, compensate)
    return spec, budget, joint


def _check_prune(loaded, spec: PruneSpec, *, heads, scores, iterative, mode, out, overwrite) -> PruneSpec:
    """Every option check that needs no forward pass; returns `spec` with the default amount (20% of the heads)
    filled in."""
    if mode not in MODES:
        raise HeadlabError(f"unknown mode={mode!r}; use mask or physical")
    if heads is not None:
        if scores is not None or iterative or spec.fraction is not None or spec.count is not None or spec.uniform:
            raise HeadlabError(
                "heads= names the heads itself; drop scores=, fraction=, count=, iterative= and uniform="
            )
    else:
        if spec.fraction is None and spec.count is None:
            spec = replace(spec, fraction=0.2)
        check_amount(spec.fraction, spec.count)
        check_unit(loaded.layers, spec.unit)
    if iterative is not None and (iterative < 1 or spec.uniform):
        raise HeadlabError("iterative= needs at least 1 step and cannot be combined with uniform=True")
    if out is not None:
        check_checkpoint_out(out, overwrite, loaded.source)
    return spec


def _choose(loaded, spec: PruneSpec, method: str, request: ScoreRequest, table_scores, iterative):
    """score -> plan, `iterative` times (re-scoring by `method` with the heads chosen so far masked)."""
    layers = loaded.layers
    if spec.uniform:  # an impossible uniform amount must fail before scoring
        zeros = [torch.zeros(layer.num_heads) for layer in layers]
        _select_uniform(layers, zeros, spec.fraction, spec.count, spec.unit, [set() for _ in layers])
    current = table_scores if table_scores is not None else score_heads(method, loaded, request)
    steps = iterative or 1
    pruned = [set() for _ in layers]
    for step in range(1, steps + 1):
        if step > 1:
            current = score_heads(method, loaded, replace(request, pruned=pruned))
        pruned = plan(layers, current, spec, already=pruned, step=step, steps=steps)
    return pruned, current


def _compensate(loaded, pruned, method: str, request: ScoreRequest) -> dict:
    """Refit the output projections for the heads about to go (in place); the meta.json `compensation` entry.
    The Grams come from `request.grams` when the selection computed them on the same calibration windows."""
    batches = compensation_batches(loaded, text=request.text)
    grams = (
        request.grams if request.grams is not None else output_statistics(loaded, batches, progress=request.progress)
    )
    compensation = apply_compensation(loaded, pruned, grams, method)
    return {
        "method": method,
        "calibration": batches.meta,
        "error_before": float(compensation["error_before"].mean()),
        "error_after": float(compensation["error_after"].mean()),
        "layers": compensation.to_dict("records"),
    }


def _budget(budget: str | None, per_layer: bool, uniform: bool) -> str:
    """--budget, or the budget the --per-layer / --uniform flags name (global without either)."""
    implied = "uniform" if uniform else "per-layer" if per_layer else None
    if per_layer and uniform:
        raise HeadlabError("per_layer=True and uniform=True are different budgets; give one")
    if budget is not None and implied is not None and budget != implied:
        raise HeadlabError(f"budget={budget!r} contradicts {implied.replace('-', '_')}=True; give one")
    return budget or implied or "global"


def _check_selection(loaded, spec: PruneSpec, selection: Selection, budget, compensate):
    """The selection options' checks that need no forward pass (headlab.pruning.selection), after _check_prune."""
    select, method, iterative = selection.select, selection.method, selection.iterative
    heads, scores = selection.heads, selection.scores
    check_select(select, budget, compensate=compensate, iterative=iterative, heads=heads, scores=scores)
    if heads is None and scores is None:
        choosable = SCORE_SOURCES.names(choosable=True)
        if method not in choosable:
            raise HeadlabError(f"unknown method={method!r}; use one of {', '.join(choosable)} (or a scores= table)")
        if iterative and not SCORE_SOURCES[method].recomputable:
            names = ", ".join(SCORE_SOURCES.names(recomputable=True))
            raise HeadlabError(f"iterative= re-scores with heads removed: method= {names}")
    if select == "obs":
        check_resident(loaded, "select='obs' (it reads the output projections to refit them)")
    if heads is None:  # an amount the budget cannot meet fails here, before any scoring
        check_budget(
            loaded.layers, unit=spec.unit, budget=budget, fraction=spec.fraction, count=spec.count,
            allow_empty_layer=spec.allow_empty_layer,
        )  # fmt: skip


@dataclass
class _Joint:
    pruned: list[set[int]]
    scores: list[torch.Tensor] | None
    table: pd.DataFrame
    meta: dict


def _choose_joint(loaded, spec: PruneSpec, selection: Selection, budget, request, table_scores, compensate):
    """A joint selection or a budget search (headlab.pruning.selection) instead of score -> plan."""
    current = table_scores
    if current is None and selection.select == "rank":
        current = score_heads(selection.method, loaded, request)
    search_text = request.text.but(max_tokens=selection.search_tokens)
    chosen = select_joint(
        loaded, select=selection.select, budget=budget, unit=spec.unit, fraction=spec.fraction, count=spec.count,
        allow_empty_layer=spec.allow_empty_layer,
        scoring_batches=calibration_scoring_batches(loaded, request.text),
        grams=request.grams, scores=current,
        search=BudgetSearch(calibration_scoring_batches(loaded, search_text), compensate)
        if budget == "search" else None,
        progress=request.progress,
    )  # fmt: skip
    return _Joint(chosen.pruned, current, chosen.table, chosen.meta)


def _with_steps(table: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Add selection_step and selection_cost (the path step and cumulative cost at which a head was removed)."""
    at = {(r.layer, int(h)): (r.step, r.cost) for r in steps[steps["taken"]].itertuples() for h in r.heads.split(",")}
    pairs = [at.get((layer, head), (None, None)) for layer, head in zip(table["layer"], table["head"])]
    return table.assign(selection_step=[p[0] for p in pairs], selection_cost=[p[1] for p in pairs])


def _physical_equivalent(loaded, pruned) -> tuple[dict, list[dict]]:
    """What a physical prune would cost (mask mode keeps the shapes): costs and layout, the model restored after."""
    with pruned_in_place(loaded, pruned, "physical") as physical:
        return costs(loaded), [lay.to_dict() for lay in physical]


def _ppl(loaded, evaluation: TextSpec | None, progress: bool) -> float | None:
    """Perplexity on the eval text, or None when nothing is evaluated."""
    return None if evaluation is None else perplexity(loaded, text=evaluation, progress=progress).perplexity
