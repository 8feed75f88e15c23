"""Score sources: the functions behind the registry in headlab.pruning.score_sources (grad, taylor, fisher,
ablation, obs, random, entropy, retrieval, streaming, a table). Every source returns per-layer scores [H_l]; lowest goes first.

Sources take a resolved ScoreRequest (text, budgets, seed, heads already pruned), so a command builds it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from headlab.core.arch import AttentionLayer
from headlab.core.data import TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.measure.importance import choose_low_memory, fisher_statistics, head_importance
from headlab.measure.importance_methods import IMPORTANCE_METHODS
from headlab.measure.stats import head_statistics, retrieval_statistics
from headlab.mechanisms.gates import gates_from_pruned
from headlab.pruning.score_sources import SCORE_SOURCES
from headlab.pruning.selection import calibration_grams, calibration_scoring_batches, single_obs_scores


def read_scores(source, layers: list[AttentionLayer]) -> list[torch.Tensor]:
    """Per-layer scores [H_l] from a table with columns layer, head and `importance` (an importance run) or `score`.

    `source`: a DataFrame, a .csv/.parquet file, or a run directory holding importance.csv. The table must list
    exactly the model's (layer, head) pairs: a table from another model is an error, not a silent mismatch.
    """
    frame, name = _score_frame(source)
    column = "importance" if "importance" in frame.columns else "score" if "score" in frame.columns else None
    if column is None or not {"layer", "head"} <= set(frame.columns):
        raise HeadlabError(f"score table {name} needs columns layer, head and importance or score")
    expected = {(layer.index, h) for layer in layers for h in range(layer.num_heads)}
    try:
        pairs = [(float(a), float(b)) for a, b in zip(frame["layer"], frame["head"])]
        values = [float(v) for v in frame[column]]
    except (TypeError, ValueError):
        pairs = None
    # int() would truncate 0.5 to head 0 (and fail on inf): only whole numbers name a head.
    if pairs is None or not all(math.isfinite(x) and x.is_integer() for pair in pairs for x in pair):
        raise HeadlabError(f"score table {name}: layer and head must be integers, {column} numbers")
    got = [(int(a), int(b)) for a, b in pairs]
    twice = sorted({pair for pair in got if got.count(pair) > 1})
    if twice:
        listed = ", ".join(f"layer {a} head {b}" for a, b in twice[:3])
        raise HeadlabError(f"score table {name} lists {listed}{', ...' if len(twice) > 3 else ''} more than once")
    if set(got) != expected:
        n_layers = len({a for a, _ in got})
        raise HeadlabError(
            f"score table {name} does not match the model: it lists {len(set(got))} heads in {n_layers} layers, "
            f"the model has {len(expected)} heads in {len(layers)} layers (a table from another model?)"
        )
    if not all(math.isfinite(v) for v in values):
        raise HeadlabError(f"score table {name}: every {column} must be finite")
    scores = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in layers]
    for (layer, head), value in zip(got, values):
        scores[layer][head] = value
    return scores


def _score_frame(source) -> tuple[pd.DataFrame, str]:
    if isinstance(source, pd.DataFrame):
        return source, "(table)"
    path = Path(source)
    if path.is_dir():
        for candidate in ("importance.csv", "scores.csv"):
            if (path / candidate).is_file():
                path = path / candidate
                break
        else:
            raise HeadlabError(f"{source} is a directory without importance.csv or scores.csv")
    if not path.is_file():
        raise HeadlabError(f"no such score table: {source}")
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read score table {path}: {str(error).splitlines()[0]}") from None
    return frame, str(path)


def random_scores(layers: list[AttentionLayer], seed: int) -> list[torch.Tensor]:
    """Uniform random scores (the random-order baseline of Michel et al.'s pruning curves)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(layer.num_heads, generator=generator, dtype=torch.float64) for layer in layers]


def entropy_scores(loaded: LoadedModel, **kwargs) -> list[torch.Tensor]:
    """Score = -(mean attention entropy), so the most diffuse heads (highest entropy) are pruned first."""

    table = head_statistics(loaded, induction=False, retrieval=False, ov=False, **kwargs)  # entropy: a text pass
    table = table[table["statistic"] == "entropy"]
    scores = [torch.full((layer.num_heads,), math.nan, dtype=torch.float64) for layer in loaded.layers]
    for layer, head, value in zip(table["layer"], table["head"], table["value"]):
        scores[int(layer)][int(head)] = -float(value)
    if any(bool(torch.isnan(s).any()) for s in scores):
        raise HeadlabError("head_statistics gave no entropy for some heads")
    return scores


STREAMING_SCORE_WINDOW = 64  # the recent window of the streaming score (stream_64)


def streaming_scores(loaded: LoadedModel, **kwargs) -> list[torch.Tensor]:
    """Score = 1 - stream_64 (the attention mass outside 4 sinks + the 64 most recent keys; StreamingLLM, Xiao et al.
    2023), so heads a sinks + window cache would serve (DuoAttention's streaming heads) are pruned first; a head with
    no row reaching past the window (NaN: a sliding window <= 64) fits it and scores 0."""
    name = f"stream_{STREAMING_SCORE_WINDOW}"
    table = head_statistics(loaded, induction=False, retrieval=False, ov=False, **kwargs)  # a text pass is all
    table = table[table["statistic"] == name]
    if table["value"].isna().all():
        raise HeadlabError(f"no query row reaches past {STREAMING_SCORE_WINDOW} + 4 keys: give a longer seq_len")
    scores = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    for layer, head, value in zip(table["layer"], table["head"], table["value"]):
        scores[int(layer)][int(head)] = 0.0 if math.isnan(value) else 1.0 - float(value)
    return scores


def retrieval_head_scores(loaded: LoadedModel, **kwargs) -> list[torch.Tensor]:
    """Score = the retrieval score (mean attention of an answer token's query on the needle token it copies, on
    passkey prompts; Wu et al. 2024 as attention mass), so heads that retrieve least are pruned first; a head that
    never sees the needle (sliding window) scores 0."""
    values, meta = retrieval_statistics(loaded, **kwargs)
    if "skipped" in meta:
        raise HeadlabError(f"the retrieval score does not apply: {meta['skipped']}")
    return [values[layer.index].nan_to_num(0.0) for layer in loaded.layers]


def importance_scores(loaded: LoadedModel, pruned: list[set[int]] | None = None, **kwargs) -> list[torch.Tensor]:
    """Head importance (Michel et al. 2019) from headlab.measure.importance, with already pruned heads masked (gate 0)."""

    mask = None if pruned is None else gates_from_pruned(loaded.layers, pruned)
    result = head_importance(loaded, mask=mask, **kwargs)
    scores = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    for layer, head, value in zip(result.table["layer"], result.table["head"], result.table["importance"]):
        scores[int(layer)][int(head)] = float(value)
    return scores


@dataclass
class ScoreRequest:
    """What a score source may need, resolved once per command: calibration text and budget, the random seed, the
    heads already pruned (iterative pruning; masked while scoring) and, for "table", the table itself."""

    text: TextSpec = TextSpec()  # the calibration text (corpus resolved once) and its token budget
    progress: bool = True
    seed: int = 0
    pruned: list[set[int]] | None = None
    table: object = None  # DataFrame, CSV/Parquet path or importance run directory
    grams: object = None  # headlab.recovery.compensate output statistics already computed (obs reuses them)
    # True: gradient scores one sequence per backward pass with blocks recomputed, the same per-sequence sums with
    # the peak memory about 2.5x the model's bytes (whole process) instead of over 5x (BENCHMARKS.md, memory), at
    # about 3x the time on a CPU. None: chosen by the memory available (headlab.measure.importance.choose_low_memory).
    low_memory: bool | None = None


def resolved_low_memory(loaded: LoadedModel, request: ScoreRequest) -> bool:
    """The request's low-memory mode, or the one the memory available calls for (windows of its text, batch_size
    rows per pass)."""
    if request.low_memory is not None:
        return request.low_memory
    return choose_low_memory(loaded, request.text.batch_size, request.text.seq_len)


def importance_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    """An importance method (headlab.measure.importance_methods) as a score source, with the pruned heads masked."""
    backward = IMPORTANCE_METHODS[name].backward
    low_memory = resolved_low_memory(loaded, request)
    return importance_scores(
        loaded,
        request.pruned,
        method=name,
        text=request.text,
        progress=request.progress,
        max_rows=1 if low_memory else None,
        gradient_checkpointing=low_memory and backward,
    )


def entropy_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    return entropy_scores(loaded, text=request.text, progress=request.progress)


def streaming_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    return streaming_scores(loaded, text=request.text, progress=request.progress)


def retrieval_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    return retrieval_head_scores(loaded, text=request.text, seed=request.seed, progress=request.progress)


def random_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    return random_scores(loaded.layers, request.seed)


def table_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    return read_scores(request.table, loaded.layers)


def obs_source(loaded: LoadedModel, request: ScoreRequest, name: str) -> list[torch.Tensor]:
    """The loss-weighted o_proj reconstruction error left after the ridge refit when each head alone is removed
    (headlab.pruning.obs): the Grams of --compensate and the block-output Fisher, on calibration text."""
    if request.pruned is not None and any(request.pruned):
        raise HeadlabError("the obs score is taken on the unpruned model; iterative= re-scores importance methods only")
    grams = request.grams
    if grams is None:
        grams = calibration_grams(loaded, request.text, progress=request.progress)
    batches = calibration_scoring_batches(loaded, request.text)
    stats = fisher_statistics(loaded, batches, output_fisher=True, progress=request.progress)
    return single_obs_scores(loaded, grams, stats.output, request.progress)


def score_heads(source: str, loaded: LoadedModel, request: ScoreRequest) -> list[torch.Tensor]:
    """Per-layer scores [H_l] from the named source; an unknown name is an error listing the registry."""
    return SCORE_SOURCES[source].function.resolve()(loaded, request, source)
