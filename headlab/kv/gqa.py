"""KV-head conversion: MHA/GQA -> fewer KV heads by pooling (Ainslie et al. 2023), GQA -> MHA by repeating, and
similarity-aware grouping that permutes heads so learned groups are contiguous and the result loads with vanilla
transformers.

Layout rule (transformers' repeat_kv): query head h reads KV head h // (H / G). Pooling KV heads that are
contiguous, [g*m, (g+1)*m), into KV head g keeps that rule for the same query heads, so query weights never change.
Any other equal-size grouping is first turned into a contiguous one by permuting KV heads together with the query
heads that read them (query rows, per-head query norms, output-projection columns); the permutation alone leaves
the model's function unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.arch import AttentionLayer
from headlab.core.checkpoint import check_checkpoint_out, probe_inputs, save_with_record
from headlab.core.data import TextSpec, split_text, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.fsio import check_out, resumable_directory
from headlab.core.loading import LoadedModel, check_resident
from headlab.core.tables import write_run, write_run_files
from headlab.kv.budget import (
    BudgetSpec,
    LayerOptions,
    allocation,
    apply_counts,
    check_budget_spec,
    layer_costs,
    refine_counts,
)
from headlab.kv.grouping import (
    ConversionPlan,
    check_direction,
    check_kv_heads,
    expand_weights,
    gqa_layers,
    kv_similarity,
    layer_groups,
    permute_weights,
    plan_conversion,
    pool_weights,
)
from headlab.kv.methods import GROUPINGS, KV_METHODS, POOLS
from headlab.measure.costs import kv_bytes_per_token
from headlab.measure.evaluate import perplexity
from headlab.measure.longctx import check_passkey_lengths, passkey_columns, passkey_record
from headlab.mechanisms.restore import restoring
from headlab.recovery.recover import save_recovered

# The folder of a --kv-budget checkpoint that holds the per-layer cost table and the chosen counts.
BUDGET_DIR = "kv_budget"


@dataclass
class Conversion:
    """What `convert` did: per-layer groups of original KV heads (new KV head g = groups[layer][g])."""

    kv_heads_before: int
    kv_heads_after: int
    action: str  # pool, expand or keep
    pool: str | None
    grouping: str | None
    seed: int
    groups: list[list[list[int]]] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)  # per layer: contiguous, trivial, exact or greedy
    permuted_layers: int = 0
    method: str = "mean"  # a KV_METHODS name (headlab.kv.methods)
    merge: dict | None = None  # what the svd merge did (keys/values: svd or mean, calibration tokens)

    @classmethod
    def from_plan(cls, plan: ConversionPlan) -> Conversion:
        """The record of `plan` before it is applied (apply fills in permuted_layers and merge)."""
        groups = [[list(group) for group in layer] for layer in plan.groups]
        return cls(
            plan.kv_heads_before,
            plan.kv_heads_after,
            plan.action,
            plan.pool,
            plan.grouping,
            plan.seed,
            groups,
            list(plan.methods),
            method=plan.method or "mean",
        )

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def groups_table(self, layers: list[AttentionLayer]) -> pd.DataFrame:
        """One row per original KV head: layer, kv_head (original), new_kv_head, method."""
        rows = [
            (layer.index, kv, g, self.methods[layer.index])
            for layer in layers
            for g, group in enumerate(self.groups[layer.index])
            for kv in group
        ]
        return pd.DataFrame(rows, columns=["layer", "kv_head", "new_kv_head", "method"])


def plan_groups(
    loaded: LoadedModel, kv_heads: int, grouping: str = "contiguous", similarity: dict | None = None
) -> tuple[list[list[list[int]]], list[str]]:
    """Per layer, the groups of current KV heads to pool (and how they were found): kv_heads.layer_groups."""
    return layer_groups(gqa_layers(loaded), kv_heads, grouping, similarity)


def apply(loaded: LoadedModel, plan: ConversionPlan, *, batches=None, progress: bool = False) -> Conversion:
    """Do `plan`'s weight surgery on `loaded` in place (pool, merge, expand, or nothing to keep) and write the new
    count into the config (num_key_value_heads), so save_pretrained gives a vanilla-loadable checkpoint. A plan
    with method "svd" merges each group with headlab.kv.merge, calibrated on `batches` (calibration windows)."""
    check_resident(loaded, "KV-head conversion")
    layers = gqa_layers(loaded)
    layout = (plan.num_heads, plan.kv_heads_before, plan.head_dim)
    if (layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim) != layout or len(plan.groups) != len(layers):
        raise ValueError(f"the plan is for {len(plan.groups)} layers of (H, G, D) = {layout}, not this model's")
    method = KV_METHODS[plan.method or "mean"]
    if method.calibrated and batches is None:
        raise ValueError(f"method={method.name!r} needs calibration batches")
    conversion = Conversion.from_plan(plan)
    if plan.action == "expand":
        for layer in layers:
            loaded.adapter.write(layer, expand_weights(loaded.adapter.read(layer), plan.kv_heads_after))
    elif plan.action == "pool":
        conversion.permuted_layers = _pool_layers(loaded, layers, plan)
        if method.merge is not None:
            conversion.merge = method.merge(loaded, plan.kv_heads_after, batches, progress=progress)
    if plan.action != "keep":
        loaded.adapter.set_config_heads(loaded.model.config, plan.num_heads, plan.kv_heads_after, plan.head_dim)
    return conversion


def _pool_layers(loaded: LoadedModel, layers: list[AttentionLayer], plan: ConversionPlan) -> int:
    """Permute each layer whose groups are not contiguous, then pool (a pooling method); a merge method's merge that
    follows works on the permuted, contiguous groups. Returns how many layers were permuted."""
    pools = KV_METHODS[plan.method].pools
    permuted = 0
    for layer in layers:
        weights = loaded.adapter.read(layer)
        if plan.permutes(layer.index):
            weights = permute_weights(weights, plan.order(layer.index))
            permuted += 1
            if not pools:
                loaded.adapter.write(layer, weights)
        if pools:
            pooled = pool_weights(weights, plan.kv_heads_after, plan.pool, seed=plan.seed + layer.index)
            loaded.adapter.write(layer, pooled)
    return permuted


def convert(
    loaded: LoadedModel,
    kv_heads: int,
    *,
    pool: str = "mean",
    grouping: str = "contiguous",
    similarity: dict | None = None,
    groups: list[list[list[int]]] | None = None,
    seed: int = 0,
    method: str = "mean",
    batches=None,
    progress: bool = False,
) -> Conversion:
    """Change every softmax-attention layer to `kv_heads` KV heads in place (pool, expand, or keep): `plan_conversion`
    then `apply`.

    Pooling with grouping="similarity" needs `similarity` (kv_similarity) or explicit per-layer `groups`.
    method="svd" merges each group with headlab.kv.merge, calibrated on `batches` (calibration windows), instead of
    pooling by `pool`.
    """
    check_resident(loaded, "KV-head conversion")
    plan = plan_conversion(
        gqa_layers(loaded),
        kv_heads,
        pool=pool,
        grouping=grouping,
        method=method,
        similarity=similarity,
        groups=groups,
        seed=seed,
    )
    return apply(loaded, plan, batches=batches, progress=progress)


# ---- KV-cache bytes ------------------------------------------------------------------------------------------------


@torch.no_grad()
def measured_kv_bytes_per_token(loaded: LoadedModel, tokens: int = 8) -> int:
    """Bytes of the key and value tensors of a real cache (forward with use_cache=True) per cached token.

    Each cache layer's bytes are divided by its own cached length and batch, so sliding-window layers (which keep
    only the window) count per token like the rest; linear-attention layers of hybrids hold no keys and are skipped.
    """
    model = loaded.model
    inputs = probe_inputs(model, batch=1, seq_len=tokens)
    out = model(**{k: v.to(loaded.device) for k, v in inputs.items()}, use_cache=True)
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")
    if cache is None:
        raise HeadlabError(f"{type(model).__name__} returned no cache with use_cache=True")
    total = 0
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not torch.is_tensor(keys) or not torch.is_tensor(values):
            continue
        B, T = keys.shape[0], keys.shape[-2]  # keys [B, G, T, D]
        total += (keys.numel() * keys.element_size() + values.numel() * values.element_size()) // (B * T)
    return int(total)


# ---- the commands' functions ---------------------------------------------------------------------------------------


def _perplexity(loaded, text: TextSpec, progress):
    return perplexity(loaded, text=text, progress=progress)


def _eval_record(text: TextSpec) -> dict:
    """The eval settings as the records have always named them."""
    return {"data": text.corpus_name, "part": text.split, "seq_len": text.seq_len, "batch_size": text.batch_size,
            "max_tokens": text.max_tokens}  # fmt: skip


def _similarity_for(loaded, calibration: TextSpec, progress):
    batches = calibration.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    return kv_similarity(loaded, batches, progress=progress), batches.meta


def _merge_batches(loaded, calibration: TextSpec):
    """Calibration windows for the calibrated (svd) merge."""
    return calibration.batches(loaded.tokenizer, max_positions=loaded.max_positions)


@dataclass(frozen=True)
class PoolSpec:
    """How KV heads are pooled into fewer (the choices of `plan_conversion`; expanding ignores them).

    pool: how a pooling method makes one head of a group (headlab.kv.methods.POOLS: mean, first, random)
    grouping: which KV heads share a group (GROUPINGS: contiguous, or similarity on calibration text)
    method: a KV_METHODS name (headlab.kv.methods): "mean" pools by `pool`, "svd" merges on calibration windows
    seed: the seed of pool "random"
    """

    pool: str = "mean"
    grouping: str = "contiguous"
    method: str = "mean"
    seed: int = 0


@takes_text(split="eval", seq_len=512, batch_size=4, max_tokens=2048)
def convert_checkpoint(
    loaded: LoadedModel,
    kv_heads: int,
    out,
    pooling: PoolSpec = PoolSpec(),
    *,
    text: TextSpec,
    calibration_tokens: int = 2048,
    evaluate: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    direction: str = "pool",
    recovery=None,
) -> dict:
    """`headlab convert-gqa` / `expand-kv`: perplexity and KV bytes before, convert in place, perplexity and KV
    bytes after, save to `out` verified by a vanilla reload. Bad input fails before any work; the source files are
    never touched (an --out equal to or containing the source is refused). pooling: how the KV heads are pooled
    (a PoolSpec: pool, grouping, method, seed). direction "pool" (convert-gqa) refuses more KV heads than the model
    has, "expand" (expand-kv) fewer. recovery: a function(loaded) -> record run on the converted model before saving
    (headlab.recovery.recover; the checkpoint then holds recovery/).

    text: the eval text (a TextSpec; the loose keywords data, text_column, split, max_tokens, seq_len, batch_size
    also work); similarity grouping and the svd merge read its calibration split, `calibration_tokens` tokens.

    Composes validate -> measure -> calibrate -> plan -> apply -> measure -> recover -> save.
    """
    pool, grouping, method, seed = pooling.pool, pooling.grouping, pooling.method, pooling.seed
    action = _check_conversion(loaded, kv_heads, out, overwrite, direction, pool, grouping, method)
    calibrate = action == "pool" and (grouping == "similarity" or KV_METHODS[method].calibrated)
    if evaluate or calibrate:
        text = text.resolved()  # one corpus for the perplexities and the calibration
    score = _scorer(loaded, text if evaluate else None, progress)
    layers = gqa_layers(loaded)
    G = layers[0].num_kv_heads
    record = {"model": loaded.spec, "source": loaded.source, "kv_heads_before": G, "kv_heads_after": kv_heads}
    record.update(_measured(loaded, "before", score))
    calibration = text.but(split="calibration", max_tokens=calibration_tokens)
    similarity, batches, calibrated = _calibration(
        loaded, calibration, action == "pool", {grouping}, {method}, progress
    )
    record.update(calibrated)
    plan = plan_conversion(
        layers, kv_heads, pool=pool, grouping=grouping, method=method, similarity=similarity, seed=seed
    )
    record["conversion"] = apply(loaded, plan, batches=batches, progress=progress).to_dict()
    record.update(_measured(loaded, "after", score))
    if evaluate:
        record["eval"] = _eval_record(text)
    record.update(_recover_and_save(loaded, out, record, recovery, score, overwrite))
    record["out"] = str(out)
    return record


@takes_text(split="eval", seq_len=512, batch_size=4, max_tokens=2048)
def convert_budget_checkpoint(
    loaded: LoadedModel,
    budget: BudgetSpec,
    out,
    *,
    text: TextSpec,
    calibration_tokens: int = 2048,
    evaluate: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    recovery=None,
) -> dict:
    """`headlab convert-gqa --kv-budget F`: per-layer KV-head counts that keep `budget.fraction` of the KV bytes
    (headlab.kv.budget: measured per-layer costs, exact allocation), converted in place and saved to `out`
    verified by a reload (headlab's loader when the layers differ). The cost table and the chosen counts go beside
    the checkpoint (kv_budget/costs.csv, kv_budget/meta.json). Bad input fails before any work; the source is never
    touched.

    text: the eval text; the costs and the svd merge read its calibration split (`budget.search_tokens` and
    `calibration_tokens` tokens)."""
    check_checkpoint_out(out, overwrite, loaded.source)
    check_budget_spec(loaded, budget)
    text = text.resolved()  # one corpus for the perplexities, the costs and the merge
    score = _scorer(loaded, text if evaluate else None, progress)
    layers = gqa_layers(loaded)
    record = {"model": loaded.spec, "source": loaded.source, "kv_heads_before": layers[0].num_kv_heads}
    record.update(_measured(loaded, "before", score))
    calibration = text.but(split="calibration", max_tokens=calibration_tokens)
    merge_batches = _merge_batches(loaded, calibration) if KV_METHODS[budget.method].calibrated else None
    search = text.but(split="calibration", max_tokens=budget.search_tokens)
    search_batches = search.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    # The retrieval prompts' haystack is the calibration split, as the costs' text is (never the eval text).
    haystack = split_text(text.corpus, "calibration").text if budget.retrieval_weight > 0 else None
    options = LayerOptions(loaded, merge_batches)  # the costs, the refinement and the conversion share each merge
    costs = layer_costs(loaded, budget, merge_batches, search_batches, progress, haystack, options)
    counts = allocation(loaded, costs, budget.fraction)
    refinement = None
    if budget.refine_rounds:  # local search on the whole layout's measured objective (the costs do not add up)
        additive = counts
        counts, rounds = refine_counts(
            loaded, budget, counts, merge_batches, search_batches, progress, haystack, options
        )
        refinement = {"additive_allocation": additive, "rounds": rounds}
    costs["chosen"] = [count == counts[layer] for layer, count in zip(costs.layer, costs.kv_heads)]
    record["conversion"] = apply_counts(loaded, counts, budget, merge_batches, progress=progress, options=options)
    record["conversion"].update(fraction=budget.fraction, search_tokens=search_batches.meta)
    if refinement is not None:
        record["conversion"]["refinement"] = refinement
    if budget.retrieval_weight > 0:
        record["conversion"]["retrieval_cost"] = {
            "weight": budget.retrieval_weight,
            "kind": budget.retrieval_kind,
            "prompt_tokens": budget.retrieval_len,
            "prompts": budget.retrieval_prompts,
            "predicted_retrieval_increase": float(costs.retrieval_increase[costs.chosen].sum()),
        }
    record["kv_heads_after"] = sorted(set(counts)) if len(set(counts)) > 1 else counts[0]
    record["predicted_loss_increase"] = float(costs.loss_increase[costs.chosen].sum())
    record.update(_measured(loaded, "after", score))
    if evaluate:
        record["eval"] = _eval_record(text)
    extras = {BUDGET_DIR: ({"costs": costs}, {"fraction": budget.fraction, **record["conversion"]})}
    record.update(_recover_and_save(loaded, out, record, recovery, score, overwrite, extras))
    record["out"] = str(out)
    return record


def _check_conversion(loaded, kv_heads, out, overwrite, direction, pool, grouping, method) -> str:
    """convert_checkpoint's checks before any work (--out, target, direction, choices); returns the action."""
    check_checkpoint_out(out, overwrite, loaded.source)
    layers = gqa_layers(loaded)
    H, G = layers[0].num_heads, layers[0].num_kv_heads
    action = check_kv_heads(H, G, kv_heads)
    check_direction(direction, action, H, G, kv_heads)
    if pool not in POOLS or grouping not in GROUPINGS or method not in KV_METHODS:
        raise HeadlabError(
            f"pool= must be one of {POOLS}, grouping= one of {GROUPINGS} and method= one of {tuple(KV_METHODS)}"
        )
    return action


def _scorer(loaded, text: TextSpec | None, progress):
    """The eval-split perplexity of `loaded` as it is when called, as a dict; None without a text (no --eval)."""
    if text is None:
        return None
    return lambda: _perplexity(loaded, text, progress).to_dict()


def _measured(loaded: LoadedModel, when: str, score) -> dict:
    """KV bytes per token by formula and from a real cache, and perplexity when scored, suffixed by `when`."""
    measured = {
        f"kv_bytes_per_token_{when}": kv_bytes_per_token(loaded),
        f"measured_kv_bytes_per_token_{when}": measured_kv_bytes_per_token(loaded),
    }
    if score is not None:
        measured[f"perplexity_{when}"] = score()
    return measured


def _calibration(loaded, calibration: TextSpec, pooling: bool, groupings, methods, progress: bool):
    """(similarity, merge batches, record) for the pooled targets: KV-head similarity when a grouping is
    "similarity", calibration windows when a method is calibrated; None (and nothing recorded) otherwise."""
    similarity, batches, record = None, None, {}
    if pooling and "similarity" in groupings:
        similarity, record["calibration"] = _similarity_for(loaded, calibration, progress)
    if pooling and any(KV_METHODS[m].calibrated for m in methods):
        batches = _merge_batches(loaded, calibration)
        record["merge_calibration"] = batches.meta
    return similarity, batches, record


def _recover_and_save(loaded: LoadedModel, out, record: dict, recovery, score, overwrite: bool, extras=None) -> dict:
    """Run `recovery` (if any) on the converted model, score it, and save with the record; returns what the record
    gains (perplexity_recovered, verification, recovery). extras: {folder: (tables, meta)} written into the
    checkpoint beside it (headlab.core.tables.write_run_files)."""

    def write_extras(staging) -> None:
        for folder, (tables, meta) in (extras or {}).items():
            (staging / folder).mkdir()
            write_run_files(staging / folder, tables, meta)

    if recovery is None:
        return {"verification": save_with_record(loaded, out, record, write_extras, overwrite=overwrite)}
    recovered = recovery(loaded)
    gained = {} if score is None else {"perplexity_recovered": score()}
    record = {**record, **gained}
    gained["verification"] = save_recovered(loaded, out, recovered, record, overwrite=overwrite,
                                            write_extras=write_extras)  # fmt: skip
    gained["recovery"] = {k: v for k, v in recovered.items() if k != "tables"}
    return gained


@takes_text(split="eval", seq_len=512, batch_size=4, max_tokens=2048)
def gqa_sweep(
    loaded: LoadedModel,
    kv_heads: list[int] | None = None,
    *,
    groupings: tuple[str, ...] = GROUPINGS,
    pools: tuple[str, ...] = POOLS,
    methods: tuple[str, ...] = ("mean",),
    text: TextSpec,
    calibration_tokens: int = 2048,
    seed: int = 0,
    long_context: tuple[int, ...] | None = None,
    progress: bool = True,
    journal=None,
) -> tuple[pd.DataFrame, dict]:
    """Perplexity and KV bytes per token for each target KV-head count x grouping x pool (expanded and unchanged
    models get one row each). Default targets: every reachable count, from H (MHA) down to 1 (MQA).

    Conversions whose per-layer groups and pool equal an earlier row's give the same weights and reuse its numbers
    (column same_as). The model is restored to its original weights after each row. methods (headlab.kv.methods): a
    pooling method ("mean") gives one row per pool of `pools`, any other ("svd") one row per grouping; columns
    method and pool say which (pool empty for a merge).
    text: the eval text (a TextSpec, or the loose keywords corpus/data, text_column, part/split, max_tokens, seq_len,
    batch_size); calibration reads its calibration split, `calibration_tokens` tokens.
    long_context: lengths in tokens at which each variant's passkey retrieval is measured too
    (headlab.measure.longctx.passkey_columns: columns passkey_<length>, the fraction of prompts correct, and
    passkey_prompts; haystack from the eval split); None or empty: not measured. Slow: 6 prompts per length per variant.
    journal (headlab.core.fsio.StepJournal): each variant's row is recorded there, and one an interrupted run of the same
    sweep recorded is read back instead of converted and measured again.
    """
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    if kv_heads is None:
        kv_heads = [g for g in range(H, 0, -1) if (G % g == 0) or (H % g == 0 and g % G == 0)]
    actions = {g: check_kv_heads(H, G, g) for g in kv_heads}  # validate every target before any work
    _check_choices(groupings, pools, methods)
    long_context = tuple(dict.fromkeys(long_context)) if long_context else None  # none asked: not measured
    if long_context:
        check_passkey_lengths(loaded, long_context)
    text = text.resolved()  # one corpus for every row and the calibration
    meta = {"model": loaded.spec, "source": loaded.source, "eval": _eval_record(text), "seed": seed}
    if long_context:
        meta["long_context"] = passkey_record(long_context)
    pooling = any(a == "pool" for a in actions.values())
    calibration = text.but(split="calibration", max_tokens=calibration_tokens)
    similarity, batches, calibrated = _calibration(loaded, calibration, pooling, groupings, methods, progress)
    meta.update(calibrated)

    rows, seen = [], {}
    jobs = _sweep_jobs(kv_heads, actions, groupings, pools, methods)
    for g, grouping, method, pool in tqdm(jobs, desc="GQA sweep", disable=not progress, unit="variant"):
        plan = _variant_plan(layers, g, grouping, method, pool, similarity, seed)
        key = (g, method, pool, repr(plan.groups))
        label = f"{g}/{grouping or actions[g]}/{pool or method or '-'}"
        if key in seen:
            same = dict(seen[key], grouping=grouping, method=method, pool=pool, variant=label)
            rows.append(dict(same, same_as=seen[key]["variant"]))
            continue
        if journal is not None and journal.done(label):
            row = journal.records[label]["row"]
        else:
            with restoring(loaded):  # back to the original model for the next variant, also after an error
                conversion = apply(loaded, plan, batches=batches)
                row = {"variant": label, "kv_heads": g, "action": conversion.action, "grouping": grouping}
                row.update(method=method, pool=pool)
                row.update(_variant_numbers(loaded, text, conversion))
                if long_context:  # the converted model's passkey retrieval, beside its perplexity
                    row.update(passkey_columns(loaded, text, long_context))
            if journal is not None:
                journal.finish(label, {"row": row})
        rows.append(row)
        seen[key] = row
    frame = pd.DataFrame(rows)
    frame["relative_kv_bytes"] = frame["kv_bytes_per_token"] / kv_bytes_per_token(loaded)
    meta.update({"query_heads": H, "kv_heads": G, "head_dim": D, "targets": kv_heads, "dtype": str(loaded.dtype)})
    return frame, meta


def _variant_plan(layers, kv_heads: int, grouping: str | None, method: str | None, pool: str | None, similarity, seed):
    """The plan of one sweep row; grouping and method None: an expanded or unchanged model, pool None: a merge."""
    return plan_conversion(
        layers,
        kv_heads,
        pool=pool or "mean",
        grouping=grouping or "contiguous",
        method=method or "mean",
        similarity=similarity,
        seed=seed,
    )


def _variant_numbers(loaded: LoadedModel, text: TextSpec, conversion: Conversion) -> dict:
    """One sweep row's measurements of the converted model in memory."""
    result = _perplexity(loaded, text, progress=False)
    return {
        "perplexity": result.perplexity,
        "nll": result.nll,
        "scored_tokens": result.scored_tokens,
        "kv_bytes_per_token": measured_kv_bytes_per_token(loaded),
        "kv_bytes_per_token_formula": kv_bytes_per_token(loaded),
        "permuted_layers": conversion.permuted_layers,
        "same_as": None,
    }


def _check_choices(groupings, pools, methods) -> None:
    checks = (("groupings=", groupings, GROUPINGS), ("pools=", pools, POOLS), ("methods=", methods, tuple(KV_METHODS)))
    for name, values, allowed in checks:
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise HeadlabError(f"{name}: unknown {unknown or 'empty list'}; use some of {', '.join(allowed)}")


def _sweep_jobs(kv_heads, actions, groupings, pools, methods) -> list[tuple[int, str | None, str | None, str | None]]:
    """(target, grouping, method, pool) per variant: for a pooled target every grouping x method, a pooling method
    once per pool; one row (no grouping, method or pool) for an expanded or unchanged model."""
    jobs = []
    for g in kv_heads:
        if actions[g] != "pool":
            jobs.append((g, None, None, None))
            continue
        for grouping in groupings:
            for method in methods:
                each = pools if KV_METHODS[method].pools else (None,)
                jobs += [(g, grouping, method, pool) for pool in each]
    return jobs


def run_sweep(loaded: LoadedModel, out, *, overwrite: bool = False, **kwargs) -> tuple[pd.DataFrame, dict]:
    """`headlab gqa-sweep`: the sweep table (CSV + Parquet), meta.json, the similarity pairs and the plot. Each
    variant is a step kept in OUT.partial, so a failed or interrupted run resumes when run again (resumable_sweep)."""
    return resumable_sweep(loaded, out, overwrite, kwargs, lambda journal: gqa_sweep(loaded, journal=journal, **kwargs))


def resumable_sweep(loaded: LoadedModel, out, overwrite: bool, options: dict, compute) -> tuple[pd.DataFrame, dict]:
    """`compute(journal) -> (frame, meta)` inside a resumable OUT (headlab.core.fsio.resumable_directory), keyed by the
    model and `options`; the sweep's files are written into it and published when it completes."""
    check_out(out, overwrite)
    key = {"command": "headlab gqa-sweep", "model": loaded.describe()}
    key["options"] = {name: repr(value) for name, value in sorted(options.items())}
    with resumable_directory(out, key, overwrite=overwrite) as journal:
        frame, meta = compute(journal)
        write_run_files(journal.staging, *sweep_files(frame, meta, loaded.spec))
    return frame, meta


def sweep_files(frame: pd.DataFrame, meta: dict, spec: str) -> tuple[dict, dict, dict]:
    """(tables, meta, figures) of a sweep's run directory: sweep.csv/.parquet, meta.json and gqa_sweep.png."""
    # seaborn/matplotlib take about a second to import: only the sweep draws, so conversion skips that start-up time.
    from headlab.viz.plots import figure_bytes, plot_gqa_sweep

    fig = plot_gqa_sweep(frame, f"{spec}: {meta['query_heads']} query heads, KV heads swept")
    return {"sweep": frame}, meta, {"gqa_sweep.png": figure_bytes(fig)}


def write_sweep(out, frame: pd.DataFrame, meta: dict, spec: str, *, overwrite: bool = False) -> None:
    """A sweep's table (CSV + Parquet), meta.json and gqa_sweep.png under `out`, published atomically."""
    tables, meta, figures = sweep_files(frame, meta, spec)
    write_run(out, tables, meta, overwrite=overwrite, extra_files=figures)
