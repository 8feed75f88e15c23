"""Per-layer KV-head counts under one KV-cache budget (`convert-gqa --kv-budget`): every softmax-attention layer
keeps its own number of KV heads, a divisor of its G, placed where fewer heads cost least.

Costs: c_l(g) = mean calibration NLL with layer l alone converted to g KV heads (pooled, or merged as the method
merges), minus the original model's; c_l(G) = 0. With a retrieval weight w > 0, c_l(g) += w r_l(g), r_l(g) the same
increase of the mean NLL of the answer tokens of synthetic retrieval prompts (RULER's single needle and multi-key,
haystack from the calibration text; headlab.recovery.retrieval_windows): text NLL alone places the cache where
perplexity needs it and leaves none of the layers that long-context retrieval runs through
(docs/commands/convert-gqa.md). Allocation: the g_l minimising sum_l c_l(g_l) subject to sum_l g_l D_l <= budget
(KV bytes per token are proportional to sum_l g_l D_l), solved exactly by dynamic programming over the layers (a
multiple-choice knapsack). The costs are taken as additive over layers, as prune's budget search takes them;
Puzzle (Bercovich et al. 2024, Nemotron-51B) scores per-layer variants alone and combines them the same way. They
do not add up exactly: refine_counts (opt-in) re-measures every layer's options with the others at the allocated
layout and re-allocates, keeping a round only when the whole layout measures better.

A layout whose layers differ is saved with headlab's per-layer head record (headlab.core.layout, loaded by
headlab.core.loading.load_model) and exports to llama.cpp's `deci` architecture, which reads n_head_kv per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.errors import HeadlabError
from headlab.core.layout import HEAD_LAYOUT_KEY, LayerLayout, layout_record
from headlab.core.loading import LoadedModel, check_resident
from headlab.kv.grouping import gqa_layers, pool_weights
from headlab.kv.methods import KV_METHODS, POOLS, RETRIEVAL_KINDS
from headlab.measure.copying import MIN_COPY_LENGTH, copy_sequence, copy_start
from headlab.measure.costs import budget_units, kv_choices
from headlab.measure.importance import ScoringBatch, scoring_batches, sequence_nll
from headlab.measure.stats import random_token_ids
from headlab.recovery.retrieval_windows import retrieval_batches


def allocate_kv(costs: list[dict[int, float]], widths: list[int], budget: int) -> list[int]:
    """The per-layer counts g_l (keys of costs[l]) minimising sum_l costs[l][g_l] with sum_l g_l widths[l] <= budget:
    exact dynamic programming over the total width used (ties: the first layer option in each dict's order)."""
    best = {0: (0.0, [])}  # width used -> (least total cost, counts so far)
    for layer_costs, width in zip(costs, widths):
        new: dict[int, tuple[float, list[int]]] = {}
        for used, (total, counts) in best.items():
            for g, cost in layer_costs.items():
                after = used + g * width
                if after > budget:
                    continue
                value = total + cost
                if after not in new or value < new[after][0]:
                    new[after] = (value, counts + [g])
        if not new:
            raise HeadlabError(f"no per-layer layout fits a budget of {budget} KV-head dimensions")
        best = new
    return min(best.values(), key=lambda entry: entry[0])[1]


COPY_COST_SEED = 1_000  # added to the spec's seed: the cost's copy sequences are not longeval's (seed 0)


class _LayerShape(NamedTuple):
    """What the allocation reads of an attention layer, fixed when taken (index, head size, KV heads)."""

    index: int
    head_dim: int
    num_kv_heads: int


@dataclass(frozen=True)
class BudgetSpec:
    """How convert-gqa --kv-budget converts: the fraction of the original KV bytes kept, the method (KV_METHODS) and
    pool of each layer's conversion, and the calibration tokens each cost measurement runs on."""

    fraction: float
    method: str = "mean"
    pool: str = "mean"
    seed: int = 0
    search_tokens: int = 1024
    # Also let a layer (not layer 0) lose its attention entirely: 0 KV heads. Only llama.cpp's deci holds no cache
    # for such a layer (headlab.runtimes.gguf_export); transformers keeps one zero-output padding head there.
    allow_empty_layer: bool = False
    # Weight w of the retrieval cost r_l(g) added to each layer's text cost (0: text NLL alone), and the prompts it is
    # measured on: so many retrieval prompts of so many tokens over the calibration text.
    retrieval_weight: float = 0.0
    retrieval_len: int = 1024
    retrieval_prompts: int = 6
    # What the retrieval cost scores (RETRIEVAL_KINDS): "needles", the answers of needle prompts; "copy", the copy
    # of random-token sequences (headlab.measure.copying), hundreds of scored retrievals per sequence.
    retrieval_kind: str = "needles"
    # Rounds of local search after the allocation (refine_counts): each re-measures every layer's options with the
    # other layers at the current layout, since the layers' costs do not add up (0: the additive allocation alone).
    refine_rounds: int = 0


def layer_choices(layer, spec: BudgetSpec) -> list[int]:
    """The KV-head counts `layer` may take under `spec`: the divisors of its G, and 0 (no attention) when allowed
    for every layer but the first, which llama.cpp needs with heads (it reads the head size from layer 0)."""
    return kv_choices(layer.num_kv_heads) + ([0] if spec.allow_empty_layer and layer.index > 0 else [])


def _without_attention(weights):
    """One padding head (query 0, KV head 0) whose output projection and bias are zero: the layer adds nothing."""
    kept = weights.take([0], [0])
    kept.o.zero_()
    if kept.o_bias is not None:
        kept.o_bias.zero_()
    return kept


def _layer_options(loaded: LoadedModel, method: str, pool: str, seed: int, kv_heads: int, batches, progress):
    """{layer index: that layer's weights converted alone to `kv_heads` KV heads}, nothing written; layers whose G
    `kv_heads` does not divide below G are left out. kv_heads 0: the layer without attention (every layer but 0)."""
    if kv_heads == 0:
        return {layer.index: _without_attention(loaded.adapter.read(layer)) for layer in gqa_layers(loaded)[1:]}
    layers = [layer for layer in gqa_layers(loaded) if layer.num_kv_heads % kv_heads == 0 < kv_heads]
    layers = [layer for layer in layers if kv_heads < layer.num_kv_heads]
    chosen = KV_METHODS[method]
    if chosen.pools:
        return {
            layer.index: pool_weights(loaded.adapter.read(layer), kv_heads, pool, seed=seed + layer.index)
            for layer in layers
        }
    return chosen.layer_merge(loaded, {layer.index: kv_heads for layer in layers}, batches, progress=progress)


class LayerOptions:
    """Each layer's weights converted alone to g KV heads (_layer_options), computed once per (method, pool, seed, g)
    from the model as it is at the first request. layer_costs, refine_counts and apply_counts all convert from the
    unedited model with the same merge batches, so one calibrated merge (a forward pass over the calibration text)
    serves all three, and every budget row of a sweep. Writing a cached option copies it (Adapter.write), so the
    cache is never changed by what is done to the model afterwards."""

    def __init__(self, loaded: LoadedModel, batches):
        self.loaded, self.batches = loaded, batches
        self._by_key: dict[tuple, dict] = {}

    def __call__(self, spec: BudgetSpec, kv_heads: int, progress: bool = False) -> dict:
        key = (spec.method, spec.pool, spec.seed, kv_heads)
        if key not in self._by_key:
            self._by_key[key] = _layer_options(
                self.loaded, spec.method, spec.pool, spec.seed, kv_heads, self.batches, progress
            )
        return self._by_key[key]


def retrieval_scoring(loaded: LoadedModel, spec: BudgetSpec, text: str) -> list[ScoringBatch]:
    """spec.retrieval_prompts retrieval prompts of spec.retrieval_len tokens over `text` (the calibration split), each
    scored on its answer tokens only (labels -100 elsewhere), as the per-layer retrieval cost reads them; with
    retrieval_kind "copy", as many copy sequences of that length scored on the copy's tokens after its first."""
    if spec.retrieval_kind == "copy":
        return _copy_scoring(loaded, spec)
    out = []
    stream = retrieval_batches(loaded.tokenizer, text, spec.retrieval_len, seed=spec.seed)
    for _, (ids, mask, _epoch, answer) in zip(range(spec.retrieval_prompts), stream):
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = torch.where(answer[:, :-1], ids[:, 1:], -100)  # position t predicts token t+1
        out.append(ScoringBatch(ids, mask, labels))
    return out


def _copy_scoring(loaded: LoadedModel, spec: BudgetSpec) -> list[ScoringBatch]:
    """The copy sequences of the retrieval cost (seeded apart from those longeval reports, so the cost is not fitted
    to the sequences it is judged on), labels on the tokens copy_outcome scores."""
    vocabulary = random_token_ids(loaded)
    start = copy_start(spec.retrieval_len)  # the copy's first token is not scored
    out = []
    for index in range(spec.retrieval_prompts):
        ids = torch.tensor([copy_sequence(vocabulary, spec.retrieval_len, COPY_COST_SEED + spec.seed, index)])
        labels = torch.full_like(ids, -100)
        labels[0, start:-1] = ids[0, start + 1 :]  # position t predicts token t + 1
        out.append(ScoringBatch(ids, torch.ones_like(ids), labels))
    return out


def _check_retrieval_kind(spec: BudgetSpec) -> None:
    if spec.retrieval_kind not in RETRIEVAL_KINDS:
        raise HeadlabError(f"unknown retrieval kind {spec.retrieval_kind!r}; use one of {', '.join(RETRIEVAL_KINDS)}")


def _losses(loaded: LoadedModel, spec: BudgetSpec, search_batches, retrieval_text):
    """A callable measuring the model as it stands: {"loss_increase": mean calibration NLL} and, with a retrieval
    weight, {"retrieval_increase": mean answer NLL of the retrieval prompts}; absolute values, which the callers take
    differences of."""
    scored = scoring_batches(loaded, search_batches)
    if not sum(b.scored for b in scored):
        raise HeadlabError("no calibration tokens to measure the per-layer costs on")
    _check_retrieval_kind(spec)
    retrieving = spec.retrieval_weight > 0
    if retrieving and not retrieval_text and spec.retrieval_kind == "needles":
        raise HeadlabError("a retrieval weight needs calibration text for the retrieval prompts")
    retrieval = retrieval_scoring(loaded, spec, retrieval_text) if retrieving else []

    def losses() -> dict:
        measured = {"loss_increase": _mean_nll(loaded, scored)}
        return measured | ({"retrieval_increase": _mean_nll(loaded, retrieval)} if retrieving else {})

    return losses


def _objective(measured: dict, weight: float) -> float:
    """J = text NLL + w x retrieval NLL: what the allocation minimises, for a whole layout."""
    return measured["loss_increase"] + weight * measured.get("retrieval_increase", 0.0)


@torch.no_grad()  # refine_counts measures outside layer_costs' no_grad: no graph to build for a number
def _mean_nll(loaded: LoadedModel, batches: list[ScoringBatch]) -> float:
    """Mean NLL per scored token of `batches` (the scored tokens are counted from their labels)."""
    tokens = float(sum(b.scored for b in batches))
    return sum(float(sequence_nll(loaded.model, b, loaded.device).double().sum()) for b in batches) / tokens


@torch.no_grad()
def layer_costs(
    loaded: LoadedModel,
    spec: BudgetSpec,
    merge_batches,
    search_batches,
    progress: bool = True,
    retrieval_text=None,
    options: LayerOptions | None = None,
):
    """The table of c_l(g): one row per (layer, KV heads) with the calibration NLL increase of converting that layer
    alone (0 for its own G), and its KV numbers per token (2 g D; 0 for a layer left without attention). With
    spec.retrieval_weight > 0 also `retrieval_increase` (the answer-token NLL increase on retrieval prompts over
    `retrieval_text`, the calibration split) and `cost` = loss_increase + weight x retrieval_increase, which the
    allocation then minimises. `options`: converted weights shared with later calls (LayerOptions)."""
    check_resident(loaded, "the per-layer KV budget")
    options = options or LayerOptions(loaded, merge_batches)
    layers = gqa_layers(loaded)
    retrieving = spec.retrieval_weight > 0
    losses = _losses(loaded, spec, search_batches, retrieval_text)
    reference = losses()
    zero = {name: 0.0 for name in reference}
    rows = [dict(layer=layer.index, kv_heads=layer.num_kv_heads, **zero) for layer in layers]
    counts = sorted({g for layer in layers for g in layer_choices(layer, spec) if g < layer.num_kv_heads})
    total = sum(len(layer_choices(layer, spec)) - 1 for layer in layers)
    bar = tqdm(total=total, desc="per-layer KV costs", disable=not progress, unit="model")
    adapter = loaded.adapter
    for g in counts:
        converted = options(spec, g)
        for layer in layers:
            if layer.index not in converted:
                continue
            original = adapter.read(layer)
            adapter.write(layer, converted[layer.index])
            try:
                measured = losses()
                rows.append(dict(layer=layer.index, kv_heads=g, **{k: measured[k] - reference[k] for k in measured}))
            finally:
                adapter.write(layer, original)
            bar.update()
    bar.close()
    width = {layer.index: layer.head_dim for layer in layers}
    frame = pd.DataFrame(rows).sort_values(["layer", "kv_heads"], ascending=[True, False], ignore_index=True)
    frame["kv_numbers_per_token"] = 2 * frame["kv_heads"] * frame["layer"].map(width)
    return weighted_costs(frame, spec.retrieval_weight) if retrieving else frame


def weighted_costs(costs: pd.DataFrame, retrieval_weight: float) -> pd.DataFrame:
    """`costs` (layer_costs, measured with a retrieval weight) with `cost` = loss_increase + w x retrieval_increase
    for w = `retrieval_weight`; w 0 drops the column, so the allocation reads the text cost alone. One measurement
    serves every weight: the two increases do not depend on it."""
    frame = costs.drop(columns="cost", errors="ignore")
    if retrieval_weight > 0:
        frame["cost"] = frame["loss_increase"] + retrieval_weight * frame["retrieval_increase"]
    return frame


def allocation(loaded: LoadedModel, costs: pd.DataFrame, fraction: float) -> list[int]:
    """The per-layer KV-head counts of `costs` (layer_costs) that fit `fraction` of the original KV bytes at least
    total cost (its `cost` column where it has one, else `loss_increase`); a 0 row in `costs` (allow_empty_layer)
    lets that layer lose its attention."""
    return _allocate(gqa_layers(loaded), costs, fraction)


def _allocate(layers, costs: pd.DataFrame, fraction: float) -> list[int]:
    """allocation() over `layers` (the unconverted model's attention layers, read before any layer changed)."""
    column = "cost" if "cost" in costs else "loss_increase"
    per_layer = [
        {int(kv): float(cost) for kv, cost in zip(rows.kv_heads, rows[column])}
        for rows in (costs[costs.layer == layer.index] for layer in layers)
    ]
    empty = any(0 in options for options in per_layer)
    return allocate_kv(per_layer, [layer.head_dim for layer in layers], budget_units(layers, fraction, empty))


@torch.no_grad()
def refine_counts(
    loaded: LoadedModel,
    spec: BudgetSpec,
    counts: list[int],
    merge_batches,
    search_batches,
    progress: bool = True,
    retrieval_text=None,
    options: LayerOptions | None = None,
) -> tuple[list[int], list[dict]]:
    """Local search from `counts` on the measured objective of the whole layout, J(A) = calibration NLL + w x
    retrieval NLL (w = spec.retrieval_weight), for spec.refine_rounds rounds: with every layer at A's count,
    c'_l(g) = J(A with layer l at g) - J(A) for each of l's choices; the exact allocation of c' under the budget is
    A'; A' is kept when its measured J is lower, else the search stops (so J never rises). The single-layer costs
    (layer_costs) are measured on the original model and do not add up across layers; c' is their first-order
    correction at A. Each layer's converted weights are those apply_counts writes (from the original model). The
    model is left as it came. `options`: converted weights shared with other calls (LayerOptions). Returns the
    counts and one record per round."""
    check_resident(loaded, "the per-layer KV budget")
    layers, adapter = gqa_layers(loaded), loaded.adapter
    # The layers' shapes as they are now: a layer object reads its module, which changes as layouts are written.
    shapes = [_LayerShape(layer.index, layer.head_dim, layer.num_kv_heads) for layer in layers]
    losses = _losses(loaded, spec, search_batches, retrieval_text)
    originals = {layer.index: adapter.read(layer) for layer in layers}
    needed = sorted({g for shape in shapes for g in layer_choices(shape, spec) if g < shape.num_kv_heads})
    options = options or LayerOptions(loaded, merge_batches)
    converted = {g: options(spec, g) for g in needed}

    def write(layer, shape, g):
        adapter.write(layer, originals[shape.index] if g == shape.num_kv_heads else converted[g][shape.index])

    def measure(layout) -> float:
        for layer, shape, g in zip(layers, shapes, layout):
            write(layer, shape, g)
        return _objective(losses(), spec.retrieval_weight)

    rounds, counts = [], list(counts)
    per_round = sum(len(layer_choices(shape, spec)) - 1 for shape in shapes)
    bar = tqdm(total=spec.refine_rounds * per_round, desc="refining the KV layout", disable=not progress, unit="model")
    try:
        current = measure(counts)
        for round_index in range(1, spec.refine_rounds + 1):
            rows = []
            for layer, shape, chosen in zip(layers, shapes, counts):
                for g in layer_choices(shape, spec):
                    cost = 0.0
                    if g != chosen:  # layer l alone moved to g, every other layer at the current layout
                        write(layer, shape, g)
                        cost = _objective(losses(), spec.retrieval_weight) - current
                        write(layer, shape, chosen)
                        bar.update()
                    rows.append(dict(layer=shape.index, kv_heads=g, cost=cost))
            proposal = _allocate(shapes, pd.DataFrame(rows), spec.fraction)
            value = measure(proposal) if proposal != counts else current
            kept = value < current
            rounds.append({"round": round_index, "objective_before": current, "proposed": proposal,
                           "objective_proposed": value, "kept": kept})  # fmt: skip
            if not kept:
                break
            counts, current = proposal, value
    finally:
        for layer in layers:
            adapter.write(layer, originals[layer.index])
        bar.close()
    return counts, rounds


def describe_rounds(rounds: list[dict]) -> str:
    """refine_counts' rounds in one line: "round 1: 3.9929 -> 3.8621 kept; round 2: 3.8621 -> 3.8621 not kept"."""
    return "; ".join(
        f"round {step['round']}: {step['objective_before']:.4f} -> {step['objective_proposed']:.4f} "
        + ("kept" if step["kept"] else "not kept")
        for step in rounds
    )


def apply_counts(
    loaded: LoadedModel,
    counts: list[int],
    spec: BudgetSpec,
    batches,
    progress: bool = True,
    record_layout: bool = True,
    options: LayerOptions | None = None,
) -> dict:
    """Convert every layer to its count (contiguous groups, pooled or merged by spec.method) in place, and (with
    record_layout, for saving) record the layout in the config: the head counts when every layer agrees (vanilla
    transformers loads it), else headlab's per-layer head record. `options`: converted weights shared with earlier
    calls on the same unedited model (LayerOptions). Returns the conversion record."""
    layers = gqa_layers(loaded)
    if len(counts) != len(layers):
        raise HeadlabError(f"{len(counts)} per-layer KV-head counts for {len(layers)} attention layers")
    for layer, g in zip(layers, counts):
        if g not in layer_choices(layer, spec):
            raise HeadlabError(
                f"layer {layer.index}: {g} KV heads is none of its choices {layer_choices(layer, spec)} (a divisor "
                "of its KV heads; 0 with allow_empty_layer, never in layer 0)"
            )
    options = options or LayerOptions(loaded, batches)
    converted = {}
    for g in sorted(set(counts)):
        targets = {layer.index for layer, count in zip(layers, counts) if count == g < layer.num_kv_heads}
        if targets:
            per_layer = options(spec, g, progress)
            converted.update({index: per_layer[index] for index in targets})
    layout = [_layer_layout(layer, g) for layer, g in zip(layers, counts)]
    for layer in layers:
        if layer.index in converted:
            loaded.adapter.write(layer, converted[layer.index])
    config = loaded.model.config.get_text_config()
    H, D = layers[0].num_heads, layers[0].head_dim
    # Without record_layout (measured in memory and restored, as the sweeps do) the config keeps its counts.
    if record_layout and len(set(counts)) == 1:
        loaded.adapter.set_config_heads(config, H, counts[0], D)
    elif record_layout:
        setattr(config, HEAD_LAYOUT_KEY, layout_record(config, layout, approximate=False))
    return {
        "kv_heads_per_layer": list(counts),
        "method": spec.method,
        "pool": spec.pool if KV_METHODS[spec.method].pools else None,
        "seed": spec.seed,
        "loader": "vanilla" if len(set(counts)) == 1 else "headlab",
        # layers left without attention: one zero-output padding head in transformers, none in llama.cpp's deci
        "attention_free_layers": [layer.index for layer, g in zip(layers, counts) if g == 0],
        "kv_numbers_per_token_without_padding": sum(2 * g * layer.head_dim for layer, g in zip(layers, counts)),
    }


def _layer_layout(layer, g: int) -> LayerLayout:
    """The layout record of a layer pooled to g KV heads (contiguous groups), or (g = 0) left with one zero-output
    padding head, as physical pruning records an emptied layer."""
    if g == 0:
        return LayerLayout(layer.index, [0], [0], layer.num_heads, layer.num_kv_heads, padding=[0], kv_groups=[[0]])
    size = layer.num_kv_heads // g
    groups = [list(range(i * size, (i + 1) * size)) for i in range(g)]
    return LayerLayout(layer.index, list(range(layer.num_heads)), [group[0] for group in groups], layer.num_heads,
                       layer.num_kv_heads, kv_groups=groups)  # fmt: skip


def check_budget_spec(loaded: LoadedModel, spec: BudgetSpec) -> None:
    """Every --kv-budget choice that needs no forward pass: the method, pool, budget and search tokens."""
    KV_METHODS[spec.method]  # an unknown name lists the registry
    if spec.pool not in POOLS:
        raise HeadlabError(f"unknown pool={spec.pool!r}; use one of {', '.join(POOLS)}")
    if spec.search_tokens < 1:
        raise HeadlabError(f"search_tokens={spec.search_tokens} must be at least 1")
    if not (isinstance(spec.refine_rounds, int) and spec.refine_rounds >= 0):
        raise HeadlabError(f"refine_rounds={spec.refine_rounds} must be a whole number >= 0")
    if not (math.isfinite(spec.retrieval_weight) and spec.retrieval_weight >= 0):
        raise HeadlabError(f"retrieval_weight={spec.retrieval_weight} must be a finite number >= 0")
    _check_retrieval_kind(spec)
    if spec.retrieval_weight > 0:
        if spec.retrieval_kind == "copy" and spec.retrieval_len < MIN_COPY_LENGTH:
            raise HeadlabError(f"retrieval_len={spec.retrieval_len}: a copy sequence needs {MIN_COPY_LENGTH} tokens")
        if spec.retrieval_prompts < 1:
            raise HeadlabError(f"retrieval_prompts={spec.retrieval_prompts} must be at least 1")
        limit = loaded.max_positions
        if spec.retrieval_len < 1 or (limit is not None and spec.retrieval_len > limit):
            raise HeadlabError(f"retrieval_len={spec.retrieval_len} must be in [1, the model's {limit} positions]")
    budget_units(gqa_layers(loaded), spec.fraction, spec.allow_empty_layer)
