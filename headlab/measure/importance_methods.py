"""The registry of head-importance methods: each entry carries its scorer (in headlab.measure.importance), help,
definition and default token budget. `importance`, prune's and sweep's score choices and the report derive from it.

This module imports no torch: the CLI reads choices and help from it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from headlab.core.registry import Lazy, Registry

# Definitions: N = scored tokens of all sequences; L(x) = summed next-token NLL of sequence x (padding excluded);
# l(x) = L(x) / n_x its mean; S = sequences; xi_h the gate of head h (headlab.mechanisms.gates).


@dataclass(frozen=True)
class ImportanceMethod:
    """One way to score heads on calibration text. scorer(loaded, batches, *, mask, accumulate, progress[,
    gradient_checkpointing]) -> raw per-layer scores [H_l]; higher = more important."""

    name: str
    scorer: Lazy
    help: str  # one line for --help and reports
    definition: str  # the formula, recorded in every run's metadata
    default_max_tokens: int  # calibration tokens scored when the text sets no budget
    backward: bool = True  # a gradient pass (gradient checkpointing applies; cheap enough to re-score iteratively)


IMPORTANCE_METHODS: Registry[ImportanceMethod] = Registry(
    "method",
    [
        ImportanceMethod(
            "grad",
            Lazy("headlab.measure.importance:grad_scores"),
            "gradient importance E_x |dL(x)/dxi_h| (Michel et al. 2019)",
            "I_h = (1/N) sum_x |dL(x)/dxi_h| at xi = 1; L(x) summed token NLL of sequence x, N scored tokens",
            2048,
        ),
        ImportanceMethod(
            "taylor",
            Lazy("headlab.measure.importance:taylor_scores"),
            "per-token |ctx_h . dL/dctx_h| (Michel et al.'s code)",
            "I_h = (1/N) sum_x sum_t |ctx_{t,h}^T dL(x)/dctx_{t,h}|; N scored tokens",
            2048,
        ),
        ImportanceMethod(
            "fisher",
            Lazy("headlab.measure.importance:fisher_scores"),
            "diagonal empirical Fisher of the head gates (Kwon et al. 2022)",
            "I_h = (1/S) sum_x (dl(x)/dxi_h)^2 at xi = 1; l(x) = L(x) / n_x the mean token NLL of sequence x, "
            "S sequences (diagonal empirical Fisher, Kwon et al. 2022)",
            2048,
        ),
        ImportanceMethod(
            "second-order",
            Lazy("headlab.measure.importance:second_order_scores"),
            "second-order Taylor estimate of each head's ablation: -mean gate gradient + Fisher / 2",
            "I_h = -(1/S) sum_x dl(x)/dxi_h + F_hh / 2 at xi = 1: second-order Taylor estimate of the mean "
            "loss increase when head h is removed, F the diagonal empirical Fisher (LeCun et al. 1990; Kwon et al. 2022)",
            2048,
        ),
        ImportanceMethod(
            "ablation",
            Lazy("headlab.measure.importance:ablation_scores"),
            "loss increase when each head alone is removed, lowest first",
            "I_h = (sum_x L(x) with xi_h = 0 - sum_x L(x)) / N; N scored tokens",
            256,  # one forward pass over the windows per head
            backward=False,
        ),
    ],
)

# accumulate="bertology" (grad only) reproduces transformers' old run_bertology.py example instead.
BERTOLOGY_DEFINITION = (
    "I_h = (1/N_in) sum_k |sum_{j<=k} d meanNLL_j/dxi_h| (transformers' run_bertology.py, gradient never reset); "
    "N_in input tokens"
)
