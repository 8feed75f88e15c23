"""Which heads to remove: joint per-layer selection (block-diagonal Fisher, OBS reconstruction) and per-layer
budgets (global, per-layer, uniform, and a search over measured per-layer loss curves).

Every selection here is a per-layer greedy removal path (units in order, cumulative cost after each) plus a budget
that says how many steps of each path to take:
- global:    take steps in order of the smallest marginal cost across layers (for per-head scores: the global
             ranking of headlab.pruning.prune.select_heads);
- per-layer: the same count (or fraction) in every layer;
- uniform:   the same number from every KV group (GQA query heads) or layer: vanilla-loadable layouts;
- search:    measure the calibration loss increase c_l(k) of each layer's first k steps alone (the others intact,
             with the compensation the prune will apply), then choose k_l minimising sum_l c_l(k_l) subject to
             sum_l k_l = budget exactly by dynamic programming (Kwon et al. 2022's mask search, with measured costs
             in place of their Fisher estimate, and the in-layer choice re-made jointly: their rearrangement).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.arch import AttentionLayer
from headlab.core.data import TextSpec
from headlab.core.errors import HeadlabError
from headlab.measure.importance import fisher_statistics, sequence_nll
from headlab.measure.importance import scoring_batches as prepare_batches
from headlab.mechanisms.gates import gates_from_pruned, head_gates
from headlab.pruning.choices import BUDGETS, SELECTS, UNITS
from headlab.pruning.obs import choose_alpha_path
from headlab.recovery.compensate import compensated, compensation_batches, output_statistics

SELECT_HELP = {
    "rank": "rank the per-head scores of --method (lowest first)",
    "fisher-block": "per layer, greedily the heads whose joint block-diagonal Fisher cost 1/2 1_R^T F 1_R is least",
    "obs": "per layer, greedily the heads whose removal leaves the least loss-weighted o_proj reconstruction error "
    "after the ridge refit of --compensate (structured OBS)",
}


@dataclass
class Path:
    """Greedy removal order of one layer: `units` (lists of query heads) and cumulative `cost` after each step."""

    layer: int
    units: list[list[int]]
    cost: list[float]
    extra: dict = field(default_factory=dict)


# ---- per-head ranking (the plan step of headlab.pruning.prune) -----------------------------------------------------


def _units(layer: AttentionLayer, unit: str) -> list[list[int]]:
    """The prunable units of a layer as lists of query heads: single heads, or a KV head's whole group."""
    if unit == "head":
        return [[h] for h in range(layer.num_heads)]
    gs = layer.group_size
    return [list(range(g * gs, (g + 1) * gs)) for g in range(layer.num_kv_heads)]


def _amount(fraction: float | None, count: int | None, total: int, what: str) -> int:
    if count is not None:
        if count > total:
            raise HeadlabError(f"count={count} exceeds the {total} {what}")
        return count
    return _nearest(fraction * total)


def _nearest(x: float) -> int:
    """The nearest integer, halves rounded down: a fraction between two layouts prunes the smaller one."""
    return max(0, math.ceil(x - 0.5 - 1e-9))


def check_amount(fraction: float | None, count: int | None) -> None:
    if (fraction is None) == (count is None):
        raise HeadlabError("give exactly one of fraction= and count=")
    if fraction is not None and not 0 <= fraction < 1:
        raise HeadlabError(f"fraction={fraction} must be in [0, 1)")
    if count is not None and count < 0:
        raise HeadlabError(f"count={count} must be >= 0")


def select_heads(
    layers: list[AttentionLayer],
    scores: list[torch.Tensor],
    *,
    fraction: float | None = None,
    count: int | None = None,
    per_layer: bool = False,
    unit: str = "head",
    uniform: bool = False,
    allow_empty_layer: bool = False,
    already: list[set[int]] | None = None,
) -> list[set[int]]:
    """The lowest-scoring units (heads, or KV groups scored by the sum of their query heads), globally or per layer.

    `fraction`/`count` is the total to have pruned, including `already` (iterative pruning). A unit that would
    empty a layer is skipped unless allow_empty_layer. Ties go to the lower (layer, head). Returns per-layer sets.
    """
    check_amount(fraction, count)
    check_unit(layers, unit)
    if len(scores) != len(layers) or any(s.shape != (layer.num_heads,) for s, layer in zip(scores, layers)):
        raise HeadlabError("the scores do not match the model's layers and heads")
    pruned = [set(s) for s in already] if already is not None else [set() for _ in layers]
    if uniform:
        return _select_uniform(layers, scores, fraction, count, unit, pruned)
    units = [_units(layer, unit) for layer in layers]

    def score(layer: int, heads: list[int]) -> float:
        return float(scores[layer][heads].sum())

    def open_units(layer: int) -> list[list[int]]:
        return [u for u in units[layer] if not set(u) <= pruned[layer]]

    def fits(layer: int, heads: list[int]) -> bool:
        return allow_empty_layer or len(pruned[layer] | set(heads)) < layers[layer].num_heads

    what = "heads" if unit == "head" else "KV groups"
    if per_layer:
        for i in range(len(layers)):
            target = _amount(fraction, count, len(units[i]), f"{what} of layer {i}")
            done = len(units[i]) - len(open_units(i))
            ordered = sorted(open_units(i), key=lambda u: (score(i, u), u))
            done = _take_in_order(((i, heads) for heads in ordered), done, target, fits, pruned)
            if done < target:
                raise HeadlabError(
                    f"cannot prune {target} {what} of layer {i} and keep one head; pass allow_empty_layer=True"
                )
        return pruned
    total = sum(len(u) for u in units)
    target = _amount(fraction, count, total, what)
    done = total - sum(len(open_units(i)) for i in range(len(layers)))
    candidates = sorted(
        ((score(i, u), i, u) for i in range(len(layers)) for u in open_units(i)), key=lambda c: (c[0], c[1], c[2])
    )
    done = _take_in_order(((i, heads) for _, i, heads in candidates), done, target, fits, pruned)
    if done < target:
        raise HeadlabError(
            f"cannot prune {target} {what} while keeping one head in every layer; pass allow_empty_layer=True"
        )
    return pruned


def _take_in_order(candidates, done: int, target: int, fits, pruned: list[set[int]]) -> int:
    """Prune the (layer, heads) candidates in the order given, skipping those `fits` refuses, until `target` units are
    pruned; returns how many are pruned then (the per-layer and the global selection share this loop)."""
    for i, heads in candidates:
        if done >= target:
            break
        if fits(i, heads):
            pruned[i] |= set(heads)
            done += 1
    return done


def check_unit(layers: list[AttentionLayer], unit: str) -> None:
    if unit not in UNITS:
        raise HeadlabError(f"unknown unit={unit!r}; use one of {', '.join(UNITS)}")
    if unit == "kv-group" and all(layer.group_size == 1 for layer in layers):
        raise HeadlabError("unit='kv-group' means nothing different on a model without GQA (one query per KV head)")


def _select_uniform(layers, scores, fraction, count, unit, pruned) -> list[set[int]]:
    """Remove the same number k from every container: per KV group (GQA heads), per layer (MHA heads, KV groups)."""
    if any(pruned):
        raise HeadlabError("uniform=True cannot be combined with iterative or preset pruning")
    if len({(layer.num_heads, layer.num_kv_heads) for layer in layers}) != 1:
        raise HeadlabError("uniform=True needs every attention layer to have the same head layout")
    H, G = layers[0].num_heads, layers[0].num_kv_heads
    gs = H // G
    if unit == "head" and gs > 1:
        containers = [[[g * gs + i for i in range(gs)] for g in range(G)] for _ in layers]  # query heads of a group
        size, what = gs, "query heads per KV group"
    elif unit == "head":
        containers = [[list(range(H))] for _ in layers]
        size, what = H, "heads per layer"
    else:
        containers = [[list(range(G))] for _ in layers]  # one container of KV-group ids per layer
        size, what = G, "KV groups per layer"
    n_containers = sum(len(c) for c in containers)
    if count is not None:
        if count % n_containers:
            raise HeadlabError(
                f"uniform=True cannot prune {count} {'KV groups' if unit == 'kv-group' else 'heads'}: the count "
                f"must be a multiple of {n_containers} (the same number in each of {n_containers} "
                f"{'layers' if size != gs or unit != 'head' else 'KV groups'}), e.g. {n_containers}"
            )
        k = count // n_containers
    else:
        k = _nearest(fraction * size)
    if (fraction or count) and k == 0:
        raise HeadlabError(
            f"uniform=True cannot prune {fraction if count is None else count}: the nearest uniform layout removes 0 "
            f"of {size} {what} (smallest step: 1/{size} = {1 / size:.3f})"
        )
    if k >= size:
        hint = "; prune whole groups with unit='kv-group'" if unit == "head" and gs > 1 else ""
        raise HeadlabError(f"uniform=True cannot remove all {size} {what}{hint}")
    for i, layer_containers in enumerate(containers):
        for members in layer_containers:
            if unit == "kv-group":
                ranked = sorted(members, key=lambda g: (float(scores[i][g * gs : (g + 1) * gs].sum()), g))
                for g in ranked[:k]:
                    pruned[i] |= set(range(g * gs, (g + 1) * gs))
            else:
                ranked = sorted(members, key=lambda h: (float(scores[i][h]), h))
                pruned[i] |= set(ranked[:k])
    return pruned


# ---- constraints ----------------------------------------------------------------------------------------------


def layer_units(layer, unit: str) -> list[list[int]]:
    if unit == "head":
        return [[h] for h in range(layer.num_heads)]
    gs = layer.group_size
    return [list(range(g * gs, (g + 1) * gs)) for g in range(layer.num_kv_heads)]


def uniform_cap(layers, unit: str, fraction, count) -> int:
    """k removed from every container (a GQA layer's KV groups for heads, else the layer), or a one-line error."""
    pruned = _select_uniform(
        layers, [torch.zeros(layer.num_heads) for layer in layers], fraction, count, unit, [set() for _ in layers]
    )
    layer = layers[0]
    k = len(pruned[0])
    if unit == "kv-group":
        return k // layer.group_size
    return k // layer.num_kv_heads if layer.group_size > 1 else k


def _allowed(layer, unit: str, budget: str, cap: int | None, allow_empty_layer: bool):
    """The constraint a path must keep: never empty the layer (unless allowed); uniform caps per KV group."""

    def allowed(removed: set[int], u: list[int]) -> bool:
        if not allow_empty_layer and len(removed | set(u)) >= layer.num_heads:
            return False
        if budget == "uniform" and unit == "head" and layer.group_size > 1:
            g = layer.kv_head_of(u[0])
            return sum(1 for h in removed if layer.kv_head_of(h) == g) < cap
        return True

    return allowed


def _steps(layer, unit: str, budget: str, cap: int | None) -> int | None:
    if budget != "uniform":
        return None
    return cap * layer.num_kv_heads if unit == "head" and layer.group_size > 1 else cap


# ---- per-layer paths ------------------------------------------------------------------------------------------


def greedy_path(layer, units, cost_of, allowed, steps=None) -> Path:
    """Greedy: repeatedly add the unit whose joint set cost cost_of(removed + unit) is least (ties: lower heads)."""
    removed: set[int] = set()
    path = Path(layer.index, [], [])
    limit = len(units) if steps is None else steps
    while len(path.units) < limit:
        candidates = [u for u in units if not set(u) & removed and allowed(removed, u)]
        if not candidates:
            break
        cost, unit = min(((cost_of(sorted(removed | set(u))), u) for u in candidates), key=lambda c: (c[0], c[1]))
        removed |= set(unit)
        path.units.append(unit)
        path.cost.append(cost)
    return path


def score_path(layer, units, scores: torch.Tensor, allowed, steps=None) -> Path:
    """Per-head scores: cost of a set = sum of its heads' scores (the ranking headlab.pruning.prune uses)."""
    return greedy_path(layer, units, lambda heads: float(scores[heads].sum()), allowed, steps)


def fisher_block_path(layer, units, block: torch.Tensor, allowed, steps=None) -> Path:
    """cost(R) = 1/2 1_R^T F_l 1_R, the block-diagonal Fisher estimate of the loss increase (Kwon et al. 2022)."""
    return greedy_path(layer, units, lambda heads: 0.5 * float(block[heads][:, heads].sum()), allowed, steps)


def obs_paths(loaded, grams, output_fisher, units, allowed, steps, progress=True) -> list[Path]:
    """One OBS path per layer (headlab.pruning.obs) on the compensation Grams, loss-weighted by the block-output Fisher."""
    paths = []
    for i, layer in enumerate(tqdm(loaded.layers, desc="obs selection", disable=not progress, unit="layer")):
        w = loaded.adapter.read(layer)
        W = w.o.reshape(w.o.shape[0], -1).double().cpu()
        b = None if w.o_bias is None else w.o_bias.double().cpu()
        fisher = None if output_fisher is None else output_fisher[i]
        p = choose_alpha_path(
            grams[i], W, b, layer.head_dim, units[i], output_fisher=fisher, allowed=allowed[i], steps=steps[i],
            layer=layer.index,
        )  # fmt: skip
        paths.append(
            Path(layer.index, p.units, p.cost, {"error": p.error, "alpha": p.alpha, "lam": p.lam, "single": p.single})
        )
    return paths


# ---- budgets --------------------------------------------------------------------------------------------------


def take_global(paths: list[Path], target: int) -> list[int]:
    """Steps per layer: repeatedly the next step whose marginal cost is least (ties: lower layer)."""
    taken = [0] * len(paths)
    for _ in range(target):
        best = None
        for i, p in enumerate(paths):
            k = taken[i]
            if k < len(p.units):
                marginal = p.cost[k] - (p.cost[k - 1] if k else 0.0)
                if best is None or marginal < best[0]:
                    best = (marginal, i)
        if best is None:
            break
        taken[best[1]] += 1
    return taken


def take_search(curves: list[list[float]], target: int) -> list[int]:
    """k_l minimising sum_l curves[l][k_l - 1] (0 for k_l = 0) with sum_l k_l = target: exact dynamic programming."""
    INF = math.inf
    best = [0.0] + [INF] * target  # best[t]: least total cost of t steps over the layers seen so far
    choice = []
    for curve in curves:
        new, pick = [INF] * (target + 1), [0] * (target + 1)
        for t in range(target + 1):
            for k in range(0, min(len(curve), t) + 1):
                if best[t - k] == INF:
                    continue
                value = best[t - k] + (curve[k - 1] if k else 0.0)
                if value < new[t]:
                    new[t], pick[t] = value, k
        best = new
        choice.append(pick)
    if best[target] == INF:
        raise HeadlabError(f"the budget search cannot place {target} removals within the layers' limits")
    taken, t = [0] * len(curves), target
    for i in range(len(curves) - 1, -1, -1):
        taken[i] = choice[i][t]
        t -= taken[i]
    return taken


@torch.no_grad()
def measured_curves(loaded, paths: list[Path], batches, *, compensate=None, grams=None, progress=True) -> list:
    """c_l(k): mean calibration NLL with layer l's first k path steps removed (gated to 0; refit by `compensate`
    on `grams` when given), minus the unpruned one. One forward-pass set per (layer, k)."""
    layers = loaded.layers
    tokens = float(sum(b.scored for b in batches))

    def loss(pruned) -> float:
        total = 0.0
        refit = compensated(loaded, pruned, grams, compensate) if compensate else contextlib.nullcontext()
        with refit, head_gates(loaded, gates_from_pruned(layers, pruned)):
            for batch in batches:
                total += float(sequence_nll(loaded.model, batch, loaded.device).double().sum())
        return total / tokens

    reference = loss([set() for _ in layers])
    curves = []
    bar = tqdm(total=sum(len(p.units) for p in paths), desc="budget search", disable=not progress, unit="model")
    for i, p in enumerate(paths):
        curve, removed = [], set()
        for unit in p.units:
            removed |= set(unit)
            pruned = [set() for _ in layers]
            pruned[i] = set(removed)
            curve.append(loss(pruned) - reference)
            bar.update()
        curves.append(curve)
    bar.close()
    return curves


# ---- the whole selection --------------------------------------------------------------------------------------


@dataclass
class SelectionResult:
    pruned: list[set[int]]
    table: pd.DataFrame  # one row per path step: layer, step, heads, cost, taken (+ error for obs)
    meta: dict = field(default_factory=dict)


def check_select(select: str, budget: str, *, compensate=None, iterative=None, heads=None, scores=None) -> None:
    if select not in SELECTS:
        raise HeadlabError(f"unknown select={select!r}; use one of {', '.join(SELECTS)}")
    if budget not in BUDGETS:
        raise HeadlabError(f"unknown budget={budget!r}; use one of {', '.join(BUDGETS)}")
    if select == "rank" and budget != "search":
        return
    if heads is not None:
        raise HeadlabError("heads= names the heads itself; drop select= and budget='search'")
    if iterative:
        raise HeadlabError(
            f"iterative= re-scores between steps; select={select!r} and budget='search' are greedy already"
        )
    if select == "obs" and compensate == "bias":
        raise HeadlabError(
            "select='obs' predicts the ridge refit of compensate='ridge'; with compensate='bias' the refit it "
            "assumes does not apply (use select='rank' or 'fisher-block')"
        )
    if select != "rank" and scores is not None:
        raise HeadlabError(f"scores= gives per-head scores for select='rank'; select={select!r} computes its own")


def check_budget(layers, *, unit, budget, fraction, count, allow_empty_layer) -> None:
    """An amount the budget cannot meet fails before any scoring: uniform layouts (headlab.pruning.prune's rules), and
    global / search / per-layer amounts that would empty a layer."""
    if fraction is None and count is None:
        return
    if budget == "uniform":
        uniform_cap(layers, unit, fraction, count)
        return
    units = [len(layer_units(layer, unit)) for layer in layers]
    what = "heads" if unit == "head" else "KV groups"
    if budget != "per-layer":
        _amount(fraction, count, sum(units), what)  # more than the model has: refused even with allow_empty_layer
    if allow_empty_layer:
        return
    if budget == "per-layer":
        for layer, n in zip(layers, units):
            if _amount(fraction, count, n, f"{what} of layer {layer.index}") >= n:
                raise HeadlabError(
                    f"cannot prune every {what[:-1]} of layer {layer.index} and keep one head; "
                    "pass allow_empty_layer=True"
                )
        return
    target, room = _amount(fraction, count, sum(units), what), sum(n - 1 for n in units)
    if target > room:
        raise HeadlabError(
            f"cannot prune {target} {what} while keeping one head in every layer (at most {room}); "
            "pass allow_empty_layer=True"
        )


@dataclass(frozen=True)
class BudgetSearch:
    """What --budget search measures its per-layer loss curves on (measured_curves).

    batches: the prepared ScoringBatches each measurement runs on (the search tokens of the calibration split)
    compensate: the compensation the prune will apply ("ridge", "bias"), refitted in every measurement; None: none
    """

    batches: object
    compensate: str | None = None


def select_joint(
    loaded,
    *,
    select: str,
    budget: str,
    unit: str,
    fraction,
    count,
    allow_empty_layer: bool,
    scoring_batches,
    grams=None,
    scores=None,
    search: BudgetSearch | None = None,
    progress=True,
) -> SelectionResult:
    """Paths by `select` (per-head `scores` for rank), then `budget` (see the module docstring).

    scoring_batches: prepared ScoringBatches for the gradient statistics; grams: headlab.recovery.compensate's output
    statistics (obs, and search with compensation); search: what budget "search" measures on (BudgetSearch)."""
    check_amount(fraction, count)
    check_unit(loaded.layers, unit)
    cap = uniform_cap(loaded.layers, unit, fraction, count) if budget == "uniform" else None
    paths, meta = joint_paths(
        loaded, select=select, budget=budget, unit=unit, cap=cap, allow_empty_layer=allow_empty_layer,
        scoring_batches=scoring_batches, grams=grams, scores=scores, progress=progress,
    )  # fmt: skip
    if budget == "search":
        curves = measured_curves(
            loaded, paths, search.batches, compensate=search.compensate, grams=grams, progress=progress
        )
        for p, curve in zip(paths, curves):
            p.extra["measured"] = curve
    taken = allocate(loaded, paths, budget=budget, unit=unit, fraction=fraction, count=count, cap=cap)
    pruned = [set(h for u in p.units[:k] for h in u) for p, k in zip(paths, taken)]
    meta["removed_per_layer"] = {p.layer: k for p, k in zip(paths, taken)}
    return SelectionResult(pruned, selection_table(paths, taken), meta)


def joint_paths(
    loaded, *, select, budget, unit, cap, allow_empty_layer, scoring_batches, grams=None, scores=None, progress=True
) -> tuple[list[Path], dict]:
    """Every layer's greedy removal path under the budget's constraints (uniform caps, a head kept per layer)."""
    layers = loaded.layers
    units = [layer_units(layer, unit) for layer in layers]
    allowed = [_allowed(layer, unit, budget, cap, allow_empty_layer) for layer in layers]
    steps = [_steps(layer, unit, budget, cap) for layer in layers]
    meta: dict = {"select": select, "budget": budget, "unit": unit}
    if select == "rank":
        if scores is None:
            raise HeadlabError("select='rank' needs per-head scores")
        paths = [score_path(layer, units[i], scores[i], allowed[i], steps[i]) for i, layer in enumerate(layers)]
    elif select == "fisher-block":
        stats = fisher_statistics(loaded, scoring_batches, progress=progress)
        paths = [
            fisher_block_path(layer, units[i], stats.block[i], allowed[i], steps[i]) for i, layer in enumerate(layers)
        ]
        meta["fisher_sequences"] = stats.sequences
    else:
        if grams is None:
            raise HeadlabError("select='obs' needs the calibration Gram of the output projections")
        stats = fisher_statistics(loaded, scoring_batches, output_fisher=True, progress=progress)
        paths = obs_paths(loaded, grams, stats.output, units, allowed, steps, progress)
        meta["fisher_tokens"] = stats.tokens
        meta["alphas"] = {p.layer: p.extra["alpha"] for p in paths}
    if budget == "uniform":
        short = [p.layer for p, s in zip(paths, steps) if len(p.units) < s]
        if short:
            raise HeadlabError(f"budget='uniform' cannot remove {cap} per container in layers {short}")
    return paths, meta


def allocate(loaded, paths: list[Path], *, budget, unit, fraction, count, cap=None) -> list[int]:
    """Steps taken from each layer's path: uniform (the whole capped path), per-layer, global, or search (by the
    measured curves in path.extra["measured"]); a budget the paths cannot meet is a one-line error."""
    layers = loaded.layers
    what = "heads" if unit == "head" else "KV groups"
    units = [layer_units(layer, unit) for layer in layers]
    if budget == "uniform":
        return [len(p.units) for p in paths]
    if budget == "per-layer":
        taken = []
        for layer, p, u in zip(layers, paths, units):
            target = _amount(fraction, count, len(u), f"{what} of layer {layer.index}")
            if target > len(p.units):
                raise HeadlabError(
                    f"cannot prune {target} {what} of layer {layer.index} and keep one head; "
                    "pass allow_empty_layer=True"
                )
            taken.append(target)
        return taken
    target = _amount(fraction, count, sum(len(u) for u in units), what)
    room = sum(len(p.units) for p in paths)
    if target > room:
        raise HeadlabError(
            f"cannot prune {target} {what} while keeping one head in every layer (at most {room}); "
            "pass allow_empty_layer=True"
        )
    if budget == "global":
        return take_global(paths, target)
    return take_search([p.extra["measured"] for p in paths], target)


def selection_table(paths: list[Path], taken: list[int]) -> pd.DataFrame:
    """One row per path step: layer, step, heads, cost (+ reconstruction_error, measured_loss_increase), taken."""
    rows = []
    for p, k in zip(paths, taken):
        for step, (u, cost) in enumerate(zip(p.units, p.cost)):
            row = {"layer": p.layer, "step": step + 1, "heads": ",".join(map(str, u)), "cost": cost}
            if "error" in p.extra:
                row["reconstruction_error"] = p.extra["error"][step]
            if "measured" in p.extra:
                row["measured_loss_increase"] = p.extra["measured"][step]
            row["taken"] = step < k
            rows.append(row)
    return pd.DataFrame(rows)


def single_obs_scores(loaded, grams, output_fisher, progress=True) -> list[torch.Tensor]:
    """Per-head score source "obs": the OBS cost of removing each head alone (with the ridge refit), per layer."""
    layers = loaded.layers
    units = [[[h] for h in range(layer.num_heads)] for layer in layers]
    allowed = [(lambda removed, u: True) for _ in layers]
    paths = obs_paths(loaded, grams, output_fisher, units, allowed, [1] * len(layers), progress)
    return [
        torch.tensor([p.extra["single"][(h,)] for h in range(layer.num_heads)], dtype=torch.float64)
        for p, layer in zip(paths, layers)
    ]


def calibration_scoring_batches(loaded, text: TextSpec):
    """ScoringBatches of the text's calibration split (never the eval split)."""
    if loaded.tokenizer is None:
        raise HeadlabError("scoring calibration text needs the model's tokenizer")
    return prepare_batches(loaded, compensation_batches(loaded, text=text))


def calibration_grams(loaded, text: TextSpec, progress: bool = True):
    """headlab.recovery.compensate's output statistics on the calibration split (the Grams --compensate refits from)."""
    return output_statistics(loaded, compensation_batches(loaded, text=text), progress=progress)
