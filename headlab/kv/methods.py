"""The registry of KV compression methods, and the grouping and pooling choices they use: how each group of KV
heads becomes one head. GQA conversion, the GQA sweep, the report and the CLI iterate it instead of naming methods.

This module imports no torch: the CLI reads choices and help from it at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from headlab.core.registry import Lazy, Registry

GROUPINGS = ("contiguous", "similarity")  # which KV heads share a group (headlab.kv.grouping)
POOLS = ("mean", "first", "random")  # how a pooling method makes one head of a group (headlab.kv.grouping.pool_weights)
MLA_BUDGETS = ("gqa", "mqa")  # KV budgets of the MLA conversion, as rungs of the ladder (headlab.kv.mla)
MLA_BUDGET_HELP = (
    "KV numbers per token per layer: gqa (the source's own 2 x KV heads x head_dim), mqa (2 x head_dim), a count "
    "such as 48, or a fraction of the source's cache such as 0.125 or 12.5%"
)


def mla_budget(text: str | int | float) -> str | int | float:
    """A convert-mla budget as written: a rung name (MLA_BUDGETS) as is; 'P%' or a number <= 1 is a fraction of the
    source's cache (float); a whole number above 1 is numbers per token per layer (int). Anything else: ValueError."""
    if isinstance(text, str) and text.strip().lower() in MLA_BUDGETS:
        return text.strip().lower()
    raw = str(text).strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise ValueError(f"unknown budget {raw!r}: {MLA_BUDGET_HELP}") from None
    value = value / 100 if percent else value
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"budget {raw!r} must be positive: {MLA_BUDGET_HELP}")
    if percent or value <= 1:
        if value > 1:
            raise ValueError(f"budget {raw} is above the source's whole cache (100%)")
        return value
    if value != int(value):
        raise ValueError(f"budget {raw} must be a whole number of KV numbers per token per layer, or a fraction <= 1")
    return int(value)


def mla_budget_numbers(budget: str | int | float, num_kv_heads: int, head_dim: int) -> int:
    """KV numbers per token per layer of a parsed budget: gqa 2GD, mqa 2D, a fraction f: round(f x 2GD), a count as is."""
    full = 2 * num_kv_heads * head_dim
    if budget == "gqa":
        return full
    if budget == "mqa":
        return 2 * head_dim
    if isinstance(budget, float):
        return max(1, round(budget * full))
    return int(budget)


@dataclass(frozen=True)
class KVMethod:
    """One way to turn each group of KV heads into one. A pooling method pools every group by the `pool` rule; any
    other merges after the groups are made contiguous: merge(loaded, kv_heads, batches, *, progress) -> record, and,
    for per-layer budgets (headlab.kv.budget), layer_merge(loaded, {layer: kv_heads}, batches, *, progress) ->
    {layer: merged HeadWeights} without writing them."""

    name: str
    help: str
    calibrated: bool  # needs calibration windows (activations), so the conversion reads calibration text
    pools: bool  # pooled by the `pool` rule; False: `merge` decides every new head
    merge: Lazy | None = None
    layer_merge: Lazy | None = None


KV_METHODS: Registry[KVMethod] = Registry(
    "method",
    [
        KVMethod("mean", "pool each group by --pool (Ainslie et al. 2023)", calibrated=False, pools=True),
        KVMethod(
            "svd",
            "calibrated training-free merge (weighted SVD of values, complex rank-1 keys per rotary frequency, folded into "
            "the query and output projections; headlab.kv.merge)",
            calibrated=True,
            pools=False,
            merge=Lazy("headlab.kv.merge:merge_kv_heads"),
            layer_merge=Lazy("headlab.kv.merge:layer_merges"),
        ),
    ],
)


# ---- per-KV-head cache policies (headlab.kv.policy, `headlab kv-policy`) ----------------------------------------------

# How KV heads are ranked for the whole cache, the default first: retrieval heads (copy score) first and the rest by
# the attention mass a sinks + window cache would lose; the copy score alone; that mass alone; DuoAttention's trained
# gates (headlab.kv.duo_gates: no statistics, a training loop over the gates) (docs/kv-policy.md).
POLICY_SCORES = ("retrieval-streaming", "retrieval", "streaming", "gates")
POLICY_SCORE_HELP = {
    "retrieval-streaming": "KV heads whose queries attend to the passkey tokens they copy keep the whole cache first, "
    "then those with the most attention outside sinks + window",
    "retrieval": "by the copy score alone",
    "streaming": "by the attention outside sinks + window alone",
    "gates": "by DuoAttention's gates, trained on passkey prompts with the weights frozen (slow: --gate-steps steps "
    "of 4 forward and backward passes)",
}
# Adam steps of the gates score's optimisation (`kv-policy --gate-steps`; headlab.kv.duo_gates.GateSpec)
GATE_STEPS = 24
# A head retrieves when its copy attention is at least ten times what a uniform head gives one key of the 1,024-token
# retrieval prompts (1/1024); below it the retrieval score is noise, and the mass outside the window ranks better
# (docs/kv-policy.md, "Which heads stay whole").
RETRIEVING = 0.01
# What a per-layer budget's retrieval cost scores (headlab.kv.budget.BudgetSpec.retrieval_kind): needle answers, or
# the copy of random-token sequences (headlab.measure.copying).
RETRIEVAL_KINDS = ("needles", "copy")
DEFAULT_SINKS = 4  # StreamingLLM's four initial tokens
DEFAULT_WINDOW = 256  # DuoAttention's recent window; 64 cost 2-4% of NLL at half the cache (docs/kv-policy.md)

