"""Recovery pipeline (`convert-gqa/prune --recover local,uptrain`, `headlab uptrain`): local reconstruction
(headlab.recovery.reconstruct) then uptraining (headlab.recovery.uptrain) of an edited model towards its original.

Budget: tokens and steps (local: `local_tokens` calibration tokens, LocalSpec.steps passes per layer; uptraining:
UptrainConfig.steps), so the same command gives the same model on a fast, slow or busy machine. `minutes` is only an
optional cap: with both stages local reconstruction gets at most a third of it and uptraining the rest; a stage that
reaches it stops cleanly with its best state, and the record says so. Both stages only keep changes that help on
held-out calibration text, and neither leaves any held-out calibration domain worse than it found it: local
reconstruction is undone as a whole if one got worse, uptraining keeps only states no worse on any (the record says
which were refused).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from headlab.core.checkpoint import save_with_record
from headlab.core.data import Corpus, calibration_batches, load_corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident, from_model
from headlab.core.tables import write_run
from headlab.recovery.choices import STAGES
from headlab.recovery.reconstruct import LocalSpec, check_pair, reconstruct, summary
from headlab.recovery.uptrain import (
    UptrainConfig,
    attention_parameters,
    domain_perplexities,
    heldout_batches,
    heldout_sets,
    uptrain,
)

RECOVERY_DIR = "recovery"  # inside a saved checkpoint: local.csv, curve.csv (+ .parquet), curve.png, meta.json
LOCAL_SHARE = 1 / 3  # of the minutes cap, at most, for local reconstruction when uptraining follows


def parse_stages(text: str | None) -> list[str]:
    """'local,uptrain' -> ['local', 'uptrain'] (in pipeline order); '' or None -> []."""
    if not text:
        return []
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown or len(set(names)) != len(names):
        raise HeadlabError(f"stages={text!r} has unknown or repeated stages {names}; use some of {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


@dataclass
class RecoverySpec:
    """What to run and how much of it (tokens and steps); `local` and `uptrain` hold each stage's own settings."""

    stages: list[str] = field(default_factory=lambda: list(STAGES))
    minutes: float | None = None  # optional wall-clock cap on all stages together (None: the budgets alone)
    local: LocalSpec = field(default_factory=LocalSpec)
    uptrain: UptrainConfig = field(default_factory=UptrainConfig)
    local_tokens: int = 4096  # calibration tokens of local reconstruction (the calibration part's start)
    local_seq_len: int = 256
    local_batch_size: int = 4

    def check(self) -> None:
        if not self.stages:
            raise HeadlabError(f"no recovery stage given; give stages= one or more of {', '.join(STAGES)}")
        if self.minutes is not None and not (0 < self.minutes <= 10_000):
            raise HeadlabError(f"minutes={self.minutes} must be in (0, 10000]")
        if self.local_tokens < 1:
            raise HeadlabError(f"local reconstruction needs calibration tokens, got {self.local_tokens}")
        self.local.check()
        self.uptrain.check()


def teacher_copy(loaded: LoadedModel) -> LoadedModel:
    """The original model, copied before a conversion or pruning edits `loaded` in place (the recovery target)."""
    check_resident(loaded, "recovery")
    teacher = from_model(copy.deepcopy(loaded.model), loaded.tokenizer, spec=loaded.spec)
    teacher.source = loaded.source
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    return teacher


def recover(
    student: LoadedModel,
    teacher: LoadedModel,
    spec: RecoverySpec,
    *,
    data: Corpus | str | None = None,
    text_column: str | None = None,
    progress: bool = True,
) -> dict:
    """Run spec.stages on `student` in place; returns the record: per stage its metadata and tables (DataFrames under
    "tables": local per layer, uptraining curve)."""
    spec.check()
    check_pair(student, teacher)
    check_resident(student, "recovery")
    check_resident(teacher, "recovery")
    corpus = data if isinstance(data, Corpus) else load_corpus(data, text_column)
    if student.max_positions is not None:  # windows no longer than the model takes (tiny test models: 64)
        spec = replace(spec, local_seq_len=min(spec.local_seq_len, student.max_positions))
        up, most = spec.uptrain, student.max_positions
        spec.uptrain = replace(
            up,
            seq_len=min(up.seq_len, most),
            eval_seq_len=min(up.eval_seq_len, most),
            long_seq_len=min(up.long_seq_len, most),
        )
    start = time.perf_counter()
    budget = None if spec.minutes is None else spec.minutes * 60
    record, tables = {"stages": spec.stages, "minutes_cap": spec.minutes}, {}
    if "local" in spec.stages:
        share = budget if "uptrain" not in spec.stages or budget is None else budget * LOCAL_SHARE
        local = spec.local if share is None else replace(spec.local, minutes=share / 60)
        batches = calibration_batches(
            student.tokenizer,
            corpus,
            split="calibration",
            seq_len=spec.local_seq_len,
            batch_size=spec.local_batch_size,
            max_tokens=spec.local_tokens,
            max_positions=student.max_positions,
        )
        gate = _StageGate(student, corpus, spec.uptrain)
        tables["local"] = reconstruct(student, teacher, batches, local, progress=progress)
        record["local"] = {**summary(tables["local"], local, batches.meta), **gate.verdict()}
    if "uptrain" in spec.stages:
        config = spec.uptrain
        left = None if budget is None else budget - (time.perf_counter() - start)
        if left is not None and left <= 0:  # a cap never fails the command: the stage is skipped and recorded
            record["uptrain"] = {"skipped": "local reconstruction reached the minutes cap", "steps_run": 0}
            record["uptrain"].update(tokens_seen=0, stopped_on_time=True)
        else:
            config = config if left is None else replace(config, minutes=min(left / 60, config.minutes or math.inf))
            result = uptrain(student, teacher, data=corpus, config=config, progress=progress)
            tables["curve"] = result.curve
            record["uptrain"] = result.meta
    record["stopped_on_time"] = _stopped_on_time(record)
    record["tokens_seen"] = _tokens_seen(record)
    record["seconds"] = time.perf_counter() - start
    record["tables"] = tables
    return record


class _StageGate:
    """Keeps a stage only if no held-out calibration domain got worse: measures each domain's held-out perplexity
    (uptraining's held-out sets, never trained on) before the stage, with a copy of the attention parameters it may
    change; `verdict` measures again and puts the copy back when any domain's perplexity rose."""

    def __init__(self, student: LoadedModel, corpus: Corpus, config: UptrainConfig):
        _, sets = heldout_sets(student.tokenizer, corpus, config.heldout_tokens)
        self.student = student
        self.batches = heldout_batches(student, sets, config.seq_len, config.batch_size)
        # Saved by name, not by parameter object: a stage may replace a module (a rewritten projection), and putting
        # the copy back must reach the module the model holds then.
        wanted = {id(p) for p in attention_parameters(student)}
        self.saved = {n: p.detach().clone() for n, p in student.model.named_parameters() if id(p) in wanted}
        self.before = domain_perplexities(student, self.batches)

    def verdict(self) -> dict:
        after = domain_perplexities(self.student, self.batches)
        worse = [name for name, value in after.items() if not value <= self.before[name]]
        if worse:
            current = dict(self.student.model.named_parameters())
            with torch.no_grad():
                for name, saved in self.saved.items():
                    current[name].copy_(saved)
        self.saved = {}
        return {
            "heldout_domains_before": self.before,
            "heldout_domains_after": self.before if worse else after,
            "kept": not worse,
            "not_kept_because": f"held-out perplexity rose on {', '.join(worse)}" if worse else None,
            "heldout_domains_of_the_stage": after,
        }


def _stopped_on_time(record: dict) -> bool:
    """Whether the minutes cap, rather than the token and step budgets, ended any stage."""
    local = record.get("local", {}).get("layers_stopped_on_time", 0) > 0
    return bool(local or record.get("uptrain", {}).get("stopped_on_time", False))


def _tokens_seen(record: dict) -> int:
    """Tokens the stages read: local reconstruction's calibration tokens (every pass reads them again) plus the
    uptraining tokens."""
    local = record.get("local", {}).get("calibration") or {}
    return int(local.get("tokens", 0)) + int(record.get("uptrain", {}).get("tokens_seen", 0))


def describe_stop(record: dict) -> str:
    """'local+uptrain, 73,728 tokens' for the CLI's after-recovery line, plus where the minutes cap ended a stage."""
    text = f"{'+'.join(record['stages'])}, {record.get('tokens_seen', 0):,} tokens"
    if record.get("stopped_on_time"):
        text += f"; stopped at the {record['minutes_cap']:g}-minute cap with the best state so far"
    return text


def write_recovery(directory: Path, record: dict, title: str = "") -> dict:
    """The recovery record's tables (CSV + Parquet), curve.png and meta.json under `directory`; returns the record
    without its tables (for JSON metadata)."""
    # seaborn/matplotlib take about a second to import: conversion and pruning without --recover skip that start-up.
    from headlab.viz.plots import figure_bytes, plot_recovery_curve

    tables = record.get("tables", {})
    meta = {k: v for k, v in record.items() if k != "tables"}
    extra = {}
    if "curve" in tables:
        extra["curve.png"] = figure_bytes(plot_recovery_curve(tables["curve"], title))
    write_run(Path(directory), dict(tables), meta, extra_files=extra)
    return meta


def save_recovered(
    student: LoadedModel, out, record: dict, meta: dict, *, overwrite: bool = False, write_extras=None
) -> dict | None:
    """Save the recovered checkpoint, verified by a reload (headlab.core.checkpoint), with recovery/ beside it, atomically;
    `write_extras(staging)` adds the command's own record files."""
    plain = {k: v for k, v in record.items() if k != "tables"}

    def write_record(staging: Path) -> None:
        write_recovery(staging / RECOVERY_DIR, record, f"recovery of {student.spec}")
        if write_extras is not None:
            write_extras(staging)

    return save_with_record(student, Path(out), {**meta, "recovery": plain}, write_record, overwrite=overwrite)


def before_after(record: dict) -> pd.DataFrame:
    """One row per stage: held-out calibration perplexity (uptraining) or layer error (local) before and after."""
    rows = []
    if "local" in record:
        local = record["local"]
        measure = "held-out relative layer error (mean over layers)"
        rows.append(_row("local", measure, local["error_before"], local["error_after"], local["seconds"]))
    if "uptrain" in record and "skipped" not in record["uptrain"]:
        up = record["uptrain"]
        before, after = up["heldout_perplexity_before"], up["heldout_perplexity_after"]
        rows.append(_row("uptrain", "held-out calibration perplexity", before, after, up["seconds"]))
        before, after = up["perplexity_before"], up["perplexity_after"]
        rows.append(_row("uptrain", "eval-split perplexity (report only)", before, after, up["seconds"]))
    return pd.DataFrame(rows)


def _row(stage: str, measure: str, before: float, after: float, seconds: float) -> dict:
    return {"stage": stage, "measure": measure, "before": before, "after": after, "seconds": seconds}


def spec_record(spec: RecoverySpec) -> dict:
    return asdict(spec)
