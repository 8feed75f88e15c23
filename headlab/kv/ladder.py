"""The KV-cache ladder on one table and one plot: MHA -> GQA-g -> MQA (headlab.kv.gqa's sweep over KV-head counts) and
MLA (headlab.kv.mla's training-free latent conversion at a rung's budget), each point a perplexity against the KV-cache
bytes per token measured from a real cache.

An MLA row at budget "gqa" caches as many numbers per token as the source's own GQA cache (2 x G x D per layer), at
"mqa" as many as MQA (2 x D); both are (kv_lora_rank + rope_dim) numbers: the latent and the shared rotary key.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from headlab.core.data import TextSpec, split_text, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.kv.budget import (
    BudgetSpec,
    LayerOptions,
    allocation,
    apply_counts,
    check_budget_spec,
    describe_rounds,
    layer_costs,
    refine_counts,
    weighted_costs,
)
from headlab.kv.gqa import gqa_sweep, measured_kv_bytes_per_token, resumable_sweep
from headlab.kv.methods import KV_METHODS, MLA_BUDGETS, mla_budget
from headlab.kv.mla import convert_to_mla, input_grams, plan_mla, rope_phases
from headlab.measure.costs import kv_bytes_per_token
from headlab.measure.evaluate import perplexity
from headlab.measure.longctx import passkey_columns
from headlab.mechanisms.restore import restoring


def check_mla_budgets(loaded: LoadedModel, budgets) -> list:
    """Each budget's MlaPlan, validated before any work (one line for an unknown budget or a source MLA cannot
    express)."""
    for budget in budgets:  # every name read before the first plan's work
        try:
            mla_budget(budget)
        except ValueError as error:
            raise HeadlabError(f"mla=: {error}") from None
    return [plan_mla(loaded, budget) for budget in budgets]


def mla_refusal(loaded: LoadedModel) -> str | None:
    """Why this model has no MLA rung (the one-line refusal of convert-mla), or None when it converts."""
    try:
        plan_mla(loaded, "gqa")
    except HeadlabError as error:
        return str(error)
    return None


def mla_rows(
    loaded: LoadedModel, plans, text: TextSpec, calibration_tokens: int, progress: bool, long_context=None
) -> pd.DataFrame:
    """One sweep row per MLA plan: converted from `loaded` (left untouched) on the calibration split, scored on
    `text` like the KV-head rows (passkey columns too at the `long_context` lengths). The input Grams and RoPE phases
    are gathered once for every plan."""
    calibration = text.but(split="calibration", max_tokens=calibration_tokens, batch_size=4)
    batches = calibration.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    grams = input_grams(loaded, batches, progress) if plans else None
    phases = rope_phases(loaded, batches, progress) if plans else None
    rows = []
    for plan in plans:
        mla, record = convert_to_mla(loaded, plan, batches, progress=progress, grams=grams, phases=phases)
        done = record["plan"]
        result = perplexity(mla, text=text, progress=False)
        label = f"MLA {done['kv_lora_rank']}+{done['rope_dim']}"
        rows.append(
            {
                "variant": label,
                "kv_heads": plan.num_heads,  # every query head reads keys and values of its own, from the latent
                "action": "mla",
                "grouping": "mla",
                "method": "mla",
                "pool": None,
                "budget": plan.budget,
                "perplexity": result.perplexity,
                "nll": result.nll,
                "scored_tokens": result.scored_tokens,
                "kv_bytes_per_token": measured_kv_bytes_per_token(mla),
                "kv_bytes_per_token_formula": kv_bytes_per_token(mla),
                "permuted_layers": 0,
                "same_as": None,
                "kv_lora_rank": done["kv_lora_rank"],
                "rope_dim": done["rope_dim"],
                "calibration_nll": record["calibration_nll_after"],
                **(passkey_columns(mla, text, long_context) if long_context else {}),
            }
        )
        del mla
    return pd.DataFrame(rows)


def budget_rows(
    loaded: LoadedModel,
    fractions,
    text: TextSpec,
    calibration_tokens: int,
    method: str,
    progress: bool,
    long_context=None,
    search_tokens: int = 1024,
    retrieval_weights: tuple[float, ...] = (0.0,),
    retrieval_len: int = 1024,
    refine_rounds: int = 0,
    retrieval_kind: str = "needles",
) -> pd.DataFrame:
    """One sweep row per per-layer KV budget and retrieval weight (headlab.kv.budget, `convert-gqa --kv-budget
    --retrieval-weight --retrieval-kind`): the per-layer costs are measured once (with the retrieval prompts of
    `retrieval_kind` when a weight is above 0), each fraction allocated from them under each weight (then refined
    for `refine_rounds` rounds on the whole layout's measured cost, refine_counts) and converted in place, scored on
    `text` like the other rows, then the model is restored."""
    spec = BudgetSpec(1.0, method=method, search_tokens=search_tokens, retrieval_weight=max(retrieval_weights),
                      retrieval_len=retrieval_len, retrieval_kind=retrieval_kind)  # fmt: skip
    calibration = text.but(split="calibration", batch_size=4)
    merge_batches = None
    if KV_METHODS[method].calibrated:
        merge_batches = calibration.but(max_tokens=calibration_tokens).batches(
            loaded.tokenizer, max_positions=loaded.max_positions
        )
    search = calibration.but(max_tokens=search_tokens).batches(loaded.tokenizer, max_positions=loaded.max_positions)
    # The retrieval prompts' haystack is the calibration split, as convert-gqa's is (never the eval text).
    haystack = split_text(text.corpus, "calibration").text if spec.retrieval_weight > 0 else None
    # every row converts from the same unedited model with the same merge batches: one merge per KV-head count
    options = LayerOptions(loaded, merge_batches)
    measured = layer_costs(loaded, spec, merge_batches, search, progress, haystack, options)
    rows = []
    for fraction in fractions:
        for weight in retrieval_weights:
            costs = weighted_costs(measured, weight)
            counts = allocation(loaded, costs, fraction)
            refinement = {}
            if refine_rounds:  # the costs do not add up across layers: search on the whole layout's measured cost
                refined = replace(spec, fraction=fraction, retrieval_weight=weight, refine_rounds=refine_rounds)
                counts, rounds = refine_counts(loaded, refined, counts, merge_batches, search, progress, haystack,
                                               options)  # fmt: skip
                refinement = {"refinement": describe_rounds(rounds), "rounds_kept": sum(r["kept"] for r in rounds)}
            with restoring(loaded):
                apply_counts(loaded, counts, spec, merge_batches, progress=False, record_layout=False, options=options)
                row = _budget_row(loaded, text, long_context, fraction, weight, method, counts, retrieval_kind)
                rows.append(row | refinement)
    return pd.DataFrame(rows)


def _budget_row(loaded: LoadedModel, text: TextSpec, long_context, fraction, weight, method, counts, kind) -> dict:
    """The sweep row of the converted `loaded` at one budget `fraction` placed under retrieval weight `weight` of
    retrieval kind `kind` (the variant names the kind when it is not the default, needles)."""
    result = perplexity(loaded, text=text, progress=False)
    scored = "retrieval" if kind == "needles" else kind
    return {
        "variant": f"budget {fraction:g}" + (f" {scored} x{weight:g}" if weight > 0 else ""),
        "kv_heads": sum(counts) / len(counts),  # the mean over layers; kv_heads_per_layer says which
        "action": "kv-budget",
        "grouping": "per-layer",
        "method": method,
        "pool": "mean" if KV_METHODS[method].pools else None,
        "budget": fraction,
        "retrieval_weight": weight,
        "retrieval_kind": kind if weight > 0 else None,
        "kv_heads_per_layer": ",".join(map(str, counts)),
        "perplexity": result.perplexity,
        "nll": result.nll,
        "scored_tokens": result.scored_tokens,
        "kv_bytes_per_token": measured_kv_bytes_per_token(loaded),
        "kv_bytes_per_token_formula": kv_bytes_per_token(loaded),
        "permuted_layers": 0,
        "same_as": None,
        **(passkey_columns(loaded, text, long_context) if long_context else {}),
    }


@takes_text(split="eval", seq_len=512, batch_size=4, max_tokens=2048)
def ladder(
    loaded: LoadedModel,
    *,
    mla: tuple = MLA_BUDGETS,  # convert-mla budgets (headlab.kv.methods.mla_budget): rungs, counts, fractions
    kv_budgets: tuple[float, ...] = (),
    retrieval_weights: tuple[float, ...] = (0.0,),
    retrieval_len: int = 1024,
    refine_rounds: int = 0,
    retrieval_kind: str = "needles",
    text: TextSpec,
    calibration_tokens: int = 2048,
    **sweep,
) -> tuple[pd.DataFrame, dict]:
    """The gqa sweep (headlab.kv.gqa.gqa_sweep, keywords `sweep`) plus one MLA row per budget in `mla` and one
    per-layer KV-budget row per fraction in `kv_budgets` and weight in `retrieval_weights` (svd merge when the
    sweep's methods include it, else mean pooling; cost = text NLL + weight x retrieval NLL, prompts of
    `retrieval_len` tokens of `retrieval_kind`, needles or copy; each layout refined for `refine_rounds` rounds), on
    one eval text; relative_kv_bytes is against the unconverted model's cache for every row."""
    plans = check_mla_budgets(loaded, mla)
    method = "svd" if "svd" in sweep.get("methods", ()) else "mean"
    if kv_budgets and not retrieval_weights:
        raise HeadlabError("retrieval_weights= is empty; give at least one weight (0: text NLL alone)")
    for fraction in kv_budgets:  # a fraction, weight or prompt length out of range fails before any work
        for weight in retrieval_weights:
            check_budget_spec(loaded, BudgetSpec(fraction, method=method, retrieval_weight=weight,
                                                 retrieval_len=retrieval_len, refine_rounds=refine_rounds,
                                                 retrieval_kind=retrieval_kind))  # fmt: skip
    text = text.resolved()
    progress = sweep.get("progress", True)
    frame, meta = gqa_sweep(loaded, text=text, calibration_tokens=calibration_tokens, **sweep)
    journal = sweep.get("journal")
    if plans:
        if journal is not None and journal.done("mla"):  # an interrupted run of the same ladder measured them
            rows = pd.DataFrame(journal.records["mla"]["rows"])
        else:
            rows = mla_rows(loaded, plans, text, calibration_tokens, progress, sweep.get("long_context"))
            if journal is not None:
                journal.finish("mla", {"rows": rows.to_dict("records")})
        rows["relative_kv_bytes"] = rows["kv_bytes_per_token"] / kv_bytes_per_token(loaded)
        frame = pd.concat([frame, rows], ignore_index=True)
        meta["mla"] = {"budgets": list(mla), "conversion": "headlab.kv.mla.convert_to_mla (training-free)"}
    if kv_budgets:
        if journal is not None and journal.done("kv-budget"):
            rows = pd.DataFrame(journal.records["kv-budget"]["rows"])
        else:
            long_context = sweep.get("long_context")
            rows = budget_rows(loaded, kv_budgets, text, calibration_tokens, method, progress, long_context,
                               retrieval_weights=retrieval_weights, retrieval_len=retrieval_len,
                               refine_rounds=refine_rounds, retrieval_kind=retrieval_kind)  # fmt: skip
            if journal is not None:
                journal.finish("kv-budget", {"rows": rows.to_dict("records")})
        rows["relative_kv_bytes"] = rows["kv_bytes_per_token"] / kv_bytes_per_token(loaded)
        frame = pd.concat([frame, rows], ignore_index=True)
        meta["kv_budgets"] = {"fractions": list(kv_budgets), "method": method, "conversion": "headlab.kv.budget",
                              "retrieval_weights": list(retrieval_weights), "refine_rounds": refine_rounds}  # fmt: skip
        if max(retrieval_weights) > 0:
            prompts = BudgetSpec(1.0).retrieval_prompts
            # copy prompts are random tokens (headlab.measure.copying); needle prompts hide facts in the text
            haystack = "calibration split" if retrieval_kind == "needles" else "random tokens"
            meta["kv_budgets"]["retrieval_prompts"] = {"kind": retrieval_kind, "tokens": retrieval_len,
                                                       "prompts": prompts, "haystack": haystack}  # fmt: skip
    return frame, meta


def run_ladder(loaded: LoadedModel, out, *, overwrite: bool = False, **kwargs) -> tuple[pd.DataFrame, dict]:
    """`headlab gqa-sweep --mla ...`: the ladder's table (CSV + Parquet), meta.json and plot; each variant and the MLA
    rows are steps kept in OUT.partial, so a failed or interrupted run resumes when run again."""
    return resumable_sweep(loaded, out, overwrite, kwargs, lambda journal: ladder(loaded, journal=journal, **kwargs))
