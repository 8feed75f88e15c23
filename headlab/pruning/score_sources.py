"""The registry of score sources: every way to rank heads for pruning, each entry with its function (in
headlab.pruning.scores), help, definition, default token budget and whether it can be re-scored with heads removed.
prune's --method, sweep's orders, the report and the CLI choices derive from it; the importance methods enter it
from headlab.measure.importance_methods, so a new importance method is a source without a second edit.

This module imports no torch: the CLI reads choices and help from it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from headlab.core.registry import Lazy, Registry
from headlab.measure.importance_methods import IMPORTANCE_METHODS


@dataclass(frozen=True)
class ScoreSource:
    """One way to rank heads. function(loaded, request, name) -> per-layer scores [H_l]; the lowest go first."""

    name: str
    function: Lazy
    help: str
    definition: str
    default_max_tokens: int | None  # calibration tokens it scores by default; None: the command's calibration budget
    recomputable: bool  # re-scored with the heads pruned so far masked (prune --iterative, sweep order "iterative")
    choosable: bool = True  # a --method choice; "table" comes with --scores instead


SCORE_SOURCES: Registry[ScoreSource] = Registry(
    "method",
    [
        *(
            ScoreSource(
                m.name,
                Lazy("headlab.pruning.scores:importance_source"),
                m.help,
                m.definition,
                m.default_max_tokens,
                recomputable=True,
            )
            for m in IMPORTANCE_METHODS.values()
        ),
        ScoreSource(
            "obs",
            Lazy("headlab.pruning.scores:obs_source"),
            "single-head structured OBS: the loss-weighted o_proj error left after the ridge refit when the head "
            "alone is removed (headlab.pruning.obs)",
            "S_h = 1/2 tr(B T_h^T (Hinv_hh)^-1 T_h) / N: the OBS cost of removing head h's rows of o_proj with the "
            "kept rows refit, B the block-output Fisher (Hassibi & Stork 1993; Kurtic et al. 2023; headlab.pruning.obs)",
            None,
            recomputable=False,
        ),
        ScoreSource(
            "random",
            Lazy("headlab.pruning.scores:random_source"),
            "uniformly random scores (seeded)",
            "S_h ~ U(0, 1), torch.Generator seeded with the seed (Michel et al. 2019's random baseline)",
            None,
            recomputable=False,
        ),
        ScoreSource(
            "entropy",
            Lazy("headlab.pruning.scores:entropy_source"),
            "mean attention entropy, most diffuse (highest entropy) first",
            "S_h = -(mean over query rows i of -sum_j A_ij ln A_ij) on calibration text (Clark et al. 2019's entropy)",
            None,
            recomputable=False,
        ),
        ScoreSource(
            "retrieval",
            Lazy("headlab.pruning.scores:retrieval_source"),
            "retrieval score on passkey prompts: the heads that attend least to the needle token being copied go first",
            "S_h = mean over answer rows i of A_{i,t(i)}, t(i) the needle token that answer token i+1 copies, on "
            "teacher-forced passkey prompts (headlab stats' retrieval; Wu et al. 2024's retrieval heads as "
            "attention mass); a head that never sees the needle (sliding window) scores 0",
            None,
            recomputable=False,
        ),
        ScoreSource(
            "streaming",
            Lazy("headlab.pruning.scores:streaming_source"),
            "streaming score: heads whose attention already fits 4 sink tokens + a 64-token recent window go first",
            "S_h = 1 - stream_64, the attention mass outside the first 4 tokens and the last 64 keys on calibration "
            "text (StreamingLLM's sinks + window, Xiao et al. 2023; DuoAttention's streaming heads, Xiao et al. "
            "2024); a head no row of which reaches past the window scores 0",
            None,
            recomputable=False,
        ),
        ScoreSource(
            "table",
            Lazy("headlab.pruning.scores:table_source"),
            "a table with columns layer, head and importance or score (an importance run)",
            "S_h = the table's value for (layer, head)",
            None,
            recomputable=False,
            choosable=False,
        ),
    ],
)

# The orders a pruning sweep (headlab.pruning.sweep) prunes by, with their meaning in a sweep: every choosable source,
# plus "importance"/"iterative" (the --method importance, scored once or re-scored before each fraction) and the joint
# per-layer selections (headlab.pruning.selection), which are greedy paths rather than one ranking.
JOINT_ORDERS = ("obs", "fisher-block")
SWEEP_METHODS = IMPORTANCE_METHODS.names(backward=True)  # ablation is too slow to re-score iteratively
ORDER_HELP = {
    "importance": "gradient importance (Michel et al.), lowest first, scored once",
    "iterative": "gradient importance re-scored with the heads pruned so far masked, before each fraction",
    **{name: SCORE_SOURCES[name].help for name in SCORE_SOURCES.names(choosable=True)},
    "random": "uniformly random scores, averaged over --seeds",
    "obs": "structured OBS: per layer the heads whose removal leaves the least loss-weighted o_proj error after the "
    "ridge refit, greedily, layers by estimated loss (headlab.pruning.obs)",
    "fisher-block": "per layer the heads with the least joint block-diagonal Fisher cost, layers by that cost",
}
ORDERS = tuple(ORDER_HELP)
DEFAULT_ORDERS = ("importance", "random", "entropy")
