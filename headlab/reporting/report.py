"""The end-to-end pipeline behind `headlab report` and `headlab demo`: info, statistics, importance, an attention
gallery, a pruning sweep, a GQA sweep and grouping, every figure, and report.md / a self-contained report.html.

Each step writes its own run directory (the same tables its CLI command writes) inside the report directory, so
`headlab plot REPORT_DIR` redraws every figure without a model; every number in the report comes from those tables.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
from headlab.core.data import DEFAULT_CORPUS, TextSpec, calibration_batches, load_corpus, split_text, tokenize
from headlab.core.errors import HeadlabError
from headlab.core.fsio import StepJournal, resumable_directory, write_json
from headlab.core.loading import LoadedModel
from headlab.core.model_names import DEFAULT_MODEL
from headlab.core.tables import versions, write_run
from headlab.core.units import human_bytes
from headlab.kv import gqa, ladder
from headlab.kv import grouping as kv_grouping
from headlab.kv.policy import (
    DEFAULT_WINDOW,
    POLICY_SCORES,
    applied_policy,
    choose_policy,
    kv_head_scores,
    measured_generate,
)
from headlab.measure.attention_view import attention_topk
from headlab.measure.attribution import direct_logit_attribution
from headlab.measure.costs import kv_bytes_per_token, model_info
from headlab.measure.evaluate import domain_perplexities
from headlab.measure.importance import head_importance
from headlab.measure.longctx import long_context
from headlab.measure.stats import STREAMING_WINDOWS, _frame_tokens, head_statistics, write_statistics
from headlab.mechanisms.capture import capture_attention
from headlab.mechanisms.head_cache import HeadPolicyCache
from headlab.pruning.scores import read_scores
from headlab.pruning.sweep import SweepPlan, TaskSpec, sweep, write_sweep
from headlab.recovery.reconstruct import LocalSpec
from headlab.recovery.recover import RecoverySpec, recover, teacher_copy, write_recovery
from headlab.recovery.uptrain import UptrainConfig
from headlab.reporting import heads
from headlab.reporting.render import build_sections, render_html, render_markdown
from headlab.runtimes.speed import SpeedSpec, measure_model, relative_to_first
from headlab.viz import plots
from headlab.viz.viewer import view_page

SAMPLE_SENTENCE = "The cat sat on the mat because it was tired, and then it slept."
DEMO_MARKER = "headlab demo"  # meta.json "command" of a demo run: `headlab demo` may replace such a directory


@dataclass(frozen=True)
class Settings:
    """How much text each step reads (tokens) and what the sweeps cover; `full` and `quick` presets below."""

    seq_len: int = 256
    batch_size: int = 4
    stats_tokens: int = 2048
    induction_len: int = 64
    induction_count: int = 8
    retrieval_count: int = 4  # passkey prompts of the retrieval score (stats), 1,024 tokens each
    importance_tokens: int = 1024
    eval_tokens: int = 1024
    calibration_tokens: int = 1024
    fractions: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    orders: tuple[str, ...] = ("importance", "random", "entropy")
    seeds: tuple[int, ...] = (0, 1)
    groupings: tuple[str, ...] = ("contiguous", "similarity")
    pools: tuple[str, ...] = ("mean",)
    # mean pooling (Ainslie et al.) beside the calibrated merge (headlab.kv.merge), so the report shows both
    methods: tuple[str, ...] = ("mean", "svd")
    # MLA rungs of the KV ladder (headlab.kv.ladder): the training-free conversion at these budgets, where it applies
    mla_budgets: tuple[str, ...] = ("gqa", "mqa")
    gallery_heads: int = 3
    # "what the heads do": direct logit attribution and the attention viewer on this many eval-split tokens
    heads_tokens: int = 256
    # recovery of the svd-merged model: local reconstruction on calibration_tokens (recovery_local_passes per layer),
    # then uptraining steps of batch_size x recovery_seq_len tokens (budgets, so every machine gets the same model);
    # 0 steps: no recovery step
    recovery_steps: int = 12
    recovery_seq_len: int = 128
    recovery_local_passes: int = 6
    # headlab speed: decode with a KV cache; points above speed_prefill_limit tokens get a synthetic cache
    speed_contexts: tuple[int, ...] = (512, 2048, 8192)
    speed_batches: tuple[int, ...] = (1, 8)
    speed_decode_tokens: int = 4
    speed_prefill_limit: int = 2048
    # long-context retrieval (headlab longeval) of the original and the svd merge to the grouping target, at these
    # lengths (prompt and answer; capped by the model's positions); () leaves the step out: a 2k prompt costs a
    # 135M model about 15 s of 2 CPU cores, so it is asked for (`report --long-context 1k,2k`)
    long_lengths: tuple[int, ...] = ()
    long_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    long_samples: int = 2


PRESETS = {
    "full": Settings(),
    "quick": Settings(
        stats_tokens=512,
        induction_len=32,
        induction_count=4,
        retrieval_count=2,
        importance_tokens=512,
        eval_tokens=512,
        calibration_tokens=512,
        fractions=(0.0, 0.3, 0.5),
        orders=("importance", "random"),
        seeds=(0,),
        groupings=("contiguous",),
        heads_tokens=128,
        mla_budgets=("gqa",),  # one build at full rank (the mqa budget builds and compares three rope splits)
        recovery_steps=6,
        speed_contexts=(128, 512),
        speed_batches=(1, 4),
        speed_decode_tokens=2,
    ),
}
# `headlab demo` without --full: the quick preset less its recovery step. Six uptraining steps and a local pass on 512
# calibration tokens cost half the quick run (55 of 120 s on 2 cores) and kept nothing: held-out perplexity rose on
# some domain, so both stages were refused and the table showed the merge unchanged. `--full` recovers for 12 steps.
PRESETS["demo"] = replace(PRESETS["quick"], recovery_steps=0)


@dataclass
class Report:
    """What `run_report` wrote: the directory, the per-step seconds and the summary lines."""

    out: Path
    seconds: dict[str, float] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


# ---- the attention gallery -------------------------------------------------------------------------------------


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Readable per-token labels: each token decoded alone, spaces shown as '_' and newlines as '\\n'."""
    labels = []
    for token in ids:
        text = tokenizer.decode([token]) if tokenizer is not None else str(token)
        labels.append(text.replace("\n", "\\n").replace(" ", "_") or f"<{token}>")
    return labels


@torch.no_grad()
def attention_maps(
    loaded: LoadedModel, importance: pd.DataFrame, sentence: str = SAMPLE_SENTENCE, heads: int = 3
) -> pd.DataFrame:
    """Attention weights of the `heads` most and least important heads on one sentence, as a tidy table
    `selection, layer, head, kv_head, importance, rank, query, key, weight, query_token, key_token` (visible keys
    only). The weights are softmax(QK^T / sqrt(d) + mask), computed by headlab's capture function (the eager math)."""

    if loaded.tokenizer is None:
        raise HeadlabError("the attention gallery needs the model's tokenizer")
    prefix, suffix = _frame_tokens(loaded)
    words = loaded.tokenizer(sentence, add_special_tokens=False)["input_ids"]
    if loaded.max_positions is not None:  # a sentence longer than the model's positions is cut to fit
        words = words[: max(1, loaded.max_positions - len(prefix) - len(suffix))]
    ids = prefix + words + suffix
    ranked = importance.sort_values("rank")
    k = min(heads, len(ranked) // 2) or 1
    chosen = pd.concat(
        [ranked.head(k).assign(selection="most important"), ranked.tail(k)[::-1].assign(selection="least important")]
    )
    wanted = {(int(r.layer), int(r.head)) for r in chosen.itertuples()}
    labels = token_labels(loaded.tokenizer, ids)
    captured: dict[tuple[int, int], torch.Tensor] = {}

    def on_chunk(chunk):
        for head in range(chunk.probs.shape[1]):
            if (chunk.layer.index, head) in wanted:
                weights = chunk.probs[0, head].masked_fill(~chunk.visible[0, 0], float("nan"))  # [c, Tk]
                part = torch.full((weights.shape[0], len(ids)), float("nan"))
                part[:, : weights.shape[1]] = weights.cpu()
                key = (chunk.layer.index, head)
                captured[key] = part if key not in captured else torch.cat([captured[key], part])

    input_ids = torch.tensor([ids], device=loaded.device)  # [1, T]
    with capture_attention(loaded.model, loaded.layers, on_chunk):
        loaded.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    rows = []
    for r in chosen.itertuples():
        grid = captured[(int(r.layer), int(r.head))]  # [T, T]
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not torch.isnan(grid[i, j]):
                    rows.append(
                        (r.selection, r.layer, r.head, r.kv_head, r.importance, r.rank, i, j, float(grid[i, j]))
                    )
    columns = ["selection", "layer", "head", "kv_head", "importance", "rank", "query", "key", "weight"]
    table = pd.DataFrame(rows, columns=columns)
    table["query_token"] = [labels[i] for i in table["query"]]
    table["key_token"] = [labels[j] for j in table["key"]]
    return table


# ---- GQA grouping ----------------------------------------------------------------------------------------------


def gqa_target(num_kv_heads: int) -> int | None:
    """The KV-head count the grouping step pools to: the largest proper divisor of the current count (e.g. 8 -> 4,
    3 -> 1), the smallest change that still halves or better the KV cache; None for an MQA model."""
    divisors = [g for g in range(num_kv_heads - 1, 0, -1) if num_kv_heads % g == 0]
    return divisors[0] if divisors else None


def grouping_table(loaded: LoadedModel, target: int, similarity: dict | None, grouping: str) -> pd.DataFrame:
    """One row per query head: layer, head, kv_head (read now), new_kv_head (read after pooling to `target` KV
    heads with `grouping`), grouping, method (exact / greedy / trivial / contiguous search)."""

    groups, methods = gqa.plan_groups(loaded, target, grouping, similarity)
    rows = []
    for layer in kv_grouping.gqa_layers(loaded):
        new_of = {kv: g for g, members in enumerate(kv_grouping.canonical(groups[layer.index])) for kv in members}
        for head in range(layer.num_heads):
            kv = layer.kv_head_of(head)
            rows.append((layer.index, head, kv, new_of[kv], grouping, methods[layer.index]))
    return pd.DataFrame(rows, columns=["layer", "head", "kv_head", "new_kv_head", "grouping", "method"])


# ---- summary of the trades -------------------------------------------------------------------------------------


def _pct(new: float, old: float) -> str:
    """Relative change: '+12.3%' below a doubling, '10.8x' from there on (a +97,000% reads worse than 971x)."""
    ratio = new / old
    return f"{(ratio - 1) * 100:+.1f}%" if ratio < 2 else f"{ratio:,.1f}x"


def _how(row) -> str:
    """How a GQA sweep row made one head of each group: its pool ('mean pooling') or its merge ('svd merge')."""
    return f"{row['pool']} pooling" if isinstance(row["pool"], str) else f"{row['method']} merge"


def pruning_trades(sweep: pd.DataFrame, at: float = 0.3) -> list[str]:
    """Sentences on the perplexity cost of pruning, from a sweep table: at the swept fraction nearest `at` and at
    the largest one, for each order (random: mean over seeds)."""
    base = sweep.loc[sweep["pruned_heads"] == 0, "perplexity"]
    if base.empty:
        return ["The sweep has no unpruned row, so no relative costs can be given."]
    base = float(base.mean())
    if "compensation" in sweep and (sweep["compensation"] != "none").any():  # sweep --compensate: its own lines
        sweep = sweep.assign(
            order=[o if c == "none" else f"{o} + {c}" for o, c in zip(sweep["order"], sweep["compensation"])]
        )
    mean = sweep.groupby(["order", "fraction"], sort=False).agg(
        perplexity=("perplexity", "mean"), pruned=("fraction_pruned", "mean"), params=("parameters", "mean")
    )
    fractions = sorted(f for f in sweep["fraction"].unique() if f > 0)
    if not fractions:
        return [f"Unpruned perplexity {base:.3f}; the sweep pruned nothing."]
    lines = []
    for fraction in dict.fromkeys([min(fractions, key=lambda f: abs(f - at)), max(fractions)]):
        costs = []
        for order in mean.index.get_level_values(0).unique():
            if (order, fraction) in mean.index:
                row = mean.loc[(order, fraction)]
                costs.append(f"{order} order {_pct(row['perplexity'], base)} ({row['perplexity']:.2f})")
        lines.append(
            f"Pruning {fraction:.0%} of the attention heads costs {'; '.join(costs)} perplexity "
            f"against {base:.2f} unpruned."
        )
    best = mean.reset_index()
    best = best[best["fraction"] == max(fractions)].sort_values("perplexity").iloc[0]
    lines.append(f"At {max(fractions):.0%} the best order is {best['order']}.")
    return lines


def gqa_trades(frame: pd.DataFrame) -> list[str]:
    """Sentences on the KV-cache trade, from a gqa-sweep table: each pooled KV-head count's best variant against
    the unchanged model (bytes from a real cache), each MLA rung against the pooling at its bytes, and what the MHA
    expansion would cost."""
    keep = frame[frame["action"] == "keep"]
    if keep.empty:
        return []
    base = keep.iloc[0]
    lines = []
    pooled = frame[(frame["action"] == "pool")]
    for g, part in sorted(pooled.groupby("kv_heads"), key=lambda item: -item[0]):
        best = part.sort_values("perplexity").iloc[0]
        saved = 1 - best["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        lines.append(
            f"{int(base['kv_heads'])} -> {int(g)} KV heads ({best['grouping']} grouping, {_how(best)}, no "
            f"uptraining) saves {saved:.1%} of the KV cache ({human_bytes(base['kv_bytes_per_token'])} -> "
            f"{human_bytes(best['kv_bytes_per_token'])} per token) for {_pct(best['perplexity'], base['perplexity'])} "
            f"perplexity ({base['perplexity']:.2f} -> {best['perplexity']:.2f})."
        )
    for row in frame[frame["action"] == "mla"].itertuples():
        same = pooled[pooled["kv_bytes_per_token"] == row.kv_bytes_per_token].sort_values("perplexity")
        versus = (
            f", against {same.iloc[0]['perplexity']:.2f} for the best KV-head pooling at those bytes"
            if len(same)
            else ""
        )
        lines.append(
            f"{row.variant} (multi-head latent attention at the {row.budget} budget, no uptraining) holds "
            f"{human_bytes(row.kv_bytes_per_token)} per token for {_pct(row.perplexity, base['perplexity'])} "
            f"perplexity ({base['perplexity']:.2f} -> {row.perplexity:.2f}{versus})."
        )
    expand = frame[frame["action"] == "expand"]
    for row in expand.itertuples():
        lines.append(
            f"Expanding to {int(row.kv_heads)} KV heads (MHA) is lossless ({_pct(row.perplexity, base['perplexity'])} "
            f"perplexity) but multiplies the KV cache by {row.kv_bytes_per_token / base['kv_bytes_per_token']:.1f}."
        )
    return lines


# ---- commands that reproduce each step -------------------------------------------------------------------------


def _flags(**options) -> str:
    """Options as CLI flags in the order given: --name value (lists comma-joined, quoted for a shell), a bare --name
    for True, nothing for None or False."""
    parts = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            if isinstance(value, (list, tuple)):
                value = ",".join(str(v) for v in value)
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def _command(words: str, **options) -> str:
    """`headlab WORDS --option value ...` (options as _flags writes them)."""
    return f"headlab {words} {_flags(**options)}".strip()


def step_commands(model: str | None, data: str | None, text_column: str | None, s: Settings, out: Path, target):
    """The CLI command behind each step, with the options the report used (each writing its own runs/STEP)."""
    common = dict(model=model, data=data, text_column=text_column)
    size = dict(seq_len=s.seq_len, batch_size=s.batch_size)
    convert = dict(**common, kv_heads=target)  # the grouping and recovery steps are both `headlab convert-gqa`
    budget = dict(calibration_tokens=s.calibration_tokens, max_tokens=s.eval_tokens, **size)
    induction = dict(induction_len=s.induction_len, induction_count=s.induction_count, retrieval_count=s.retrieval_count)
    return {
        "info": _command("info", model=model),
        "stats": _command("stats", **common, max_tokens=s.stats_tokens, **size, **induction, out="runs/stats"),
        "importance": _command("importance", **common, max_tokens=s.importance_tokens, **size, out="runs/importance"),
        "sweep": _command(
            "sweep",
            **common,
            **dict(fractions=s.fractions, orders=s.orders, seeds=s.seeds),
            **dict(max_tokens=s.eval_tokens, calibration_tokens=s.importance_tokens, **size),
            out="runs/sweep",
        ),
        "gqa_sweep": _command(
            "gqa-sweep",
            **common,
            **dict(grouping=s.groupings, pool=s.pools, method=s.methods),
            **(dict(mla=s.mla_budgets) if s.mla_budgets else {}),
            **dict(max_tokens=s.eval_tokens, calibration_tokens=s.calibration_tokens, **size),
            out="runs/gqa_sweep",
        ),
        "gqa_groups": _command("convert-gqa", **convert, grouping="similarity", **budget, out="converted"),
        "recovery": _command(
            "convert-gqa",
            **convert,
            method="svd",
            **budget,
            **dict(recover="local,uptrain", recover_steps=s.recovery_steps),
            out="recovered",
        ),
        "speed": _command(
            "speed" + (" " + shlex.quote(model) if model else ""),
            **dict(contexts=s.speed_contexts, batches=s.speed_batches, decode_tokens=s.speed_decode_tokens),
            **dict(prefill_limit=s.speed_prefill_limit, runtime="transformers", out="runs/speed"),
        ),
        "long": _command(
            "longeval",
            **common,
            **dict(lengths=s.long_lengths, depths=s.long_depths, samples=s.long_samples, out="runs/longeval"),
        ),
        "heads": _command("attribute", model=model, text_file=out / "heads" / "text.txt", positions="all",
                          out="runs/attribute")
        + "\n"
        + _command("show", model=model, text_file=out / "heads" / "text.txt", max_tokens=s.heads_tokens,
                   out="runs/show"),  # fmt: skip
        "plot": f"headlab plot {shlex.quote(str(out))}",
    }


# ---- the pipeline ----------------------------------------------------------------------------------------------


def fit_settings(s: Settings, max_positions: int | None) -> Settings:
    """Shrink the windows and induction sequences to the model's positions (2 x length + a prefix token fit; the
    heads step's text leaves room for the special tokens attribution adds)."""
    if max_positions is None:
        return s
    contexts = tuple(c for c in s.speed_contexts if c <= max_positions) or (max_positions // 2,)
    return replace(
        s,
        seq_len=min(s.seq_len, max_positions),
        induction_len=min(s.induction_len, max(2, (max_positions - 2) // 2)),
        heads_tokens=min(s.heads_tokens, max(2, max_positions - 2)),
        speed_contexts=contexts,
        long_lengths=tuple(n for n in s.long_lengths if n <= max_positions),
    )


def check_report_out(out: Path, overwrite: bool, demo: bool = False) -> None:
    """An existing `out` needs overwrite=True, except a previous `headlab demo` output, which a demo replaces."""
    out = Path(out)
    if not out.exists() or overwrite:
        return
    if demo and is_demo_run(out):
        return
    raise HeadlabError(f"{out} already exists; pass overwrite=True to replace it")


def is_demo_run(path: Path) -> bool:
    """A directory written by `headlab demo` (its meta.json says so) holding nothing a user added: every file in it,
    at any depth, is one the demo listed in meta.json's "files" (and nothing is a link)."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("command") != DEMO_MARKER or path.is_symlink():
            return False
        if {p.name for p in path.iterdir()} - report_entries():
            return False
        return set(_files(path)) <= set(meta.get("files", ()))
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _files(root: Path) -> list[str]:
    """Every entry under `root` as a relative POSIX path (folders end in '/'; a link counts as a file, never
    followed), for the demo's list of what it wrote."""
    entries = []
    for folder, dirs, files in os.walk(root):  # os.walk lists a linked folder in `dirs` and does not enter it
        base = Path(folder).relative_to(root)
        entries += [(base / d).as_posix() + ("" if (Path(folder) / d).is_symlink() else "/") for d in dirs]
        entries += [(base / f).as_posix() for f in files]
    return sorted(entries)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


@dataclass
class ReportRun:
    """What the report steps share: the model, the settings, the text options, the staging directory, and what
    earlier steps produced for later ones (importance for the gallery and sweep, tables for the summary)."""

    loaded: LoadedModel
    s: Settings
    tmp: Path
    common: dict  # data, text_column, seq_len, batch_size, progress
    sentence: str
    target: int | None  # KV heads the grouping step pools to (None: no grouping step)
    tasks: TaskSpec | None = None  # lm-eval tasks the sweep also runs on every pruned model
    info: dict = field(default_factory=dict)
    importance_table: pd.DataFrame | None = None
    sweep_table: pd.DataFrame | None = None
    gqa_frame: pd.DataFrame | None = None
    figures: list[str] = field(default_factory=list)


def _info_step(run: ReportRun) -> None:
    run.info = model_info(run.loaded, context=run.s.seq_len)
    write_json(run.tmp / "info.json", run.info)


def _stats_step(run: ReportRun) -> None:
    s = run.s
    tidy = head_statistics(
        run.loaded,
        max_tokens=s.stats_tokens,
        induction_len=s.induction_len,
        induction_count=s.induction_count,
        retrieval_count=s.retrieval_count,
        **run.common,
    )
    write_statistics(run.tmp / "stats", tidy)


def _importance_step(run: ReportRun) -> None:
    importance = head_importance(run.loaded, max_tokens=run.s.importance_tokens, **run.common)
    tables = {"importance": importance.table, "kv_groups": importance.kv_groups}
    write_run(run.tmp / "importance", tables, importance.meta)


def _gallery_step(run: ReportRun) -> None:
    maps = attention_maps(run.loaded, run.importance_table, run.sentence, run.s.gallery_heads)
    write_run(run.tmp / "attention", {"attention_maps": maps}, {**run.loaded.describe(), "sentence": run.sentence})


def _heads_step(run: ReportRun) -> None:
    """What the heads do: the head types the stats step's table shows (headlab.reporting.heads), each head's mean
    direct logit attribution to the correct next token over Settings.heads_tokens eval-split tokens, and the
    attention viewer of the same text (heads/viewer.html). A part the model cannot give (attribution needs a final
    norm and an unembedding: no encoder) is left out, and meta.json says why."""
    loaded = run.loaded
    wide = pd.read_csv(run.tmp / "stats" / "stats_wide.csv")
    part = split_text(load_corpus(run.common["data"], run.common["text_column"]), "eval")
    text = tokenize(loaded.tokenizer, part.text, max_tokens=run.s.heads_tokens)[1]
    tables = {"head_types": heads.head_types(wide)}
    meta = {**loaded.describe(), "text": part.describe(), "tokens": run.s.heads_tokens, "left_out": {}}
    try:
        dla = direct_logit_attribution(loaded, text, positions="all")
        tables["head_attribution"] = heads.attribution_ranking(dla)
        meta["attribution"] = {k: dla.attrs["meta"][k] for k in ("tokens", "sum_check", "norm")}
    except HeadlabError as error:
        meta["left_out"]["attribution"] = str(error)
    view = attention_topk(loaded, text, max_tokens=run.s.heads_tokens)
    page = view_page(view, loaded.spec or DEFAULT_MODEL)
    meta["viewer"] = {"file": "viewer.html", **{k: view.meta[k] for k in ("tokens", "top_k", "definition")}}
    # text.txt: the text itself, so `headlab attribute/show --text-file` (the step's commands) read the same tokens
    write_run(run.tmp / "heads", tables, meta, extra_files={"viewer.html": page, "text.txt": text})


def _sweep_step(run: ReportRun) -> None:
    s = run.s
    result = sweep(
        run.loaded,
        SweepPlan(fractions=s.fractions, orders=s.orders, seeds=s.seeds),
        # The importance order starts from the scores just computed with the same settings (same numbers as
        # `headlab sweep` recomputing them, without the second gradient pass).
        scores={"importance": read_scores(run.importance_table, run.loaded.layers)},
        calibration_tokens=s.importance_tokens,
        eval_tokens=s.eval_tokens,
        tasks=run.tasks,
        **run.common,
    )
    write_sweep(result, run.tmp / "sweep")
    run.sweep_table = result.table


def _gqa_step(run: ReportRun) -> None:
    s, loaded, data, text_column = run.s, run.loaded, run.common["data"], run.common["text_column"]
    run.gqa_frame, gqa_meta = ladder.ladder(
        loaded,
        mla=s.mla_budgets,
        groupings=s.groupings,
        pools=s.pools,
        methods=s.methods,
        data=data,
        text_column=text_column,
        max_tokens=s.eval_tokens,
        seq_len=s.seq_len,
        batch_size=s.batch_size,
        calibration_tokens=s.calibration_tokens,
        progress=run.common["progress"],
    )
    write_run(run.tmp / "gqa_sweep", {"sweep": run.gqa_frame}, gqa_meta)
    if run.target is None:
        return
    batches = calibration_batches(
        loaded.tokenizer,
        data,
        seq_len=s.seq_len,
        batch_size=s.batch_size,
        max_tokens=s.calibration_tokens,
        text_column=text_column,
        max_positions=loaded.max_positions,
    )
    similarity = kv_grouping.kv_similarity(loaded, batches, progress=run.common["progress"])
    groups = grouping_table(loaded, run.target, similarity, "similarity")
    write_run(
        run.tmp / "gqa_groups",
        {"gqa_groups": groups, "kv_similarity": kv_grouping.similarity_table(similarity)},
        {**loaded.describe(), "kv_heads_after": run.target, "calibration": batches.meta},
    )


def _svd_merge(run: ReportRun, corpus) -> LoadedModel:
    """A copy of the report's model with its KV heads merged (svd, calibration split) to the grouping target; the
    recovery and long-context steps both compare this rung with the original."""
    s, merged = run.s, teacher_copy(run.loaded)
    batches = calibration_batches(
        merged.tokenizer, corpus, seq_len=s.seq_len, batch_size=s.batch_size, max_tokens=s.calibration_tokens
    )
    gqa.convert(merged, run.target, method="svd", batches=batches)
    return merged


def _recovery_step(run: ReportRun) -> None:
    """The svd merge to the grouping target, recovered (local reconstruction, then Settings.recovery_steps of
    uptraining: token budgets, so any machine gets the same model); eval perplexity of the original, the merge and
    the recovered merge, on the corpus and on each DEFAULT_EVAL_DOMAINS domain (columns perplexity_<domain>). The
    report's model is never changed: the merge is made on a copy."""
    s, loaded = run.s, run.loaded
    if run.target is None or s.recovery_steps <= 0:
        return
    corpus = load_corpus(run.common["data"], run.common["text_column"])
    student = _svd_merge(run, corpus)  # the copy is the student; `loaded` is the original (teacher)
    text = TextSpec(corpus, split="eval", seq_len=s.seq_len, batch_size=s.batch_size, max_tokens=s.eval_tokens)

    def measured(model) -> dict:
        """Eval perplexity of the corpus, then of each DEFAULT_EVAL_DOMAINS domain (perplexity_<domain>) alike."""
        frame = domain_perplexities(model, DEFAULT_EVAL_DOMAINS, text=text, progress=False)
        values = frame.set_index("domain")["perplexity"]  # a domain that is the corpus itself: the corpus's row
        return {"perplexity": values.iloc[0], **{f"perplexity_{name}": values[name] for name in DEFAULT_EVAL_DOMAINS}}

    rows = [{"model": "original", **measured(loaded), "seconds": 0.0}]
    merged = f"{run.target} KV heads, svd merge"
    rows.append({"model": merged, **measured(student), "seconds": 0.0})
    config = UptrainConfig(steps=s.recovery_steps, seq_len=min(s.recovery_seq_len, s.seq_len), heldout_tokens=512)
    # eval_tokens 0: the eval split is measured below, once; no activation checkpointing: 4 windows of 128 tokens
    # of a report-sized model fit in memory, and recomputing them would cost a quarter of the step
    # held-out checks every 4 steps (the default, about 8 a run, would check after every one of so few steps)
    config = replace(config, eval_tokens=0, gradient_checkpointing=False, heldout_every=4)
    local = LocalSpec(steps=s.recovery_local_passes)
    spec = RecoverySpec(uptrain=config, local=local, local_tokens=s.calibration_tokens)
    spec.local_seq_len = s.seq_len
    record = recover(student, loaded, spec, data=corpus, progress=run.common["progress"])
    rows.append({"model": f"{merged} + local + uptrain", **measured(student), "seconds": record["seconds"]})
    record["tables"]["before_after"] = pd.DataFrame(rows)
    record["kv_heads"] = run.target
    write_recovery(run.tmp / "recovery", record, f"recovery of the {run.target}-KV-head svd merge")


def _long_step(run: ReportRun) -> None:
    """Long-context retrieval and NLL by position (headlab.measure.longctx) of the original, of the svd merge to the
    grouping target (made on a copy) where KV heads can pool, and of the original under a per-KV-head cache policy at
    half the cache (headlab.kv.policy, scored by the stats step's tables): the trade the perplexity tables cannot
    show, with the KV cache each keeps (measured on the real cache for the policy)."""
    s, loaded = run.s, run.loaded
    text = TextSpec(run.common["data"], run.common["text_column"], "eval", max_tokens=None)
    rungs = [("original", loaded, None)]
    kept = [{"model": "original", "kv_kept": 1.0, "how": "the model's cache"}]
    if run.target is not None:
        merged = _svd_merge(run, text.corpus)
        label = f"{run.target} KV heads, svd merge"
        rungs.append((label, merged, None))
        kept.append({"model": label, "kv_kept": kv_bytes_per_token(merged) / kv_bytes_per_token(loaded),
                     "how": "layout (KV heads kept)"})  # fmt: skip
    policy = _report_policy(run, max(s.long_lengths))
    if policy is not None:
        rungs.append((f"KV policy ({policy.score}), half the cache", loaded, policy))
    tables: dict[str, list[pd.DataFrame]] = {}
    meta = {}
    for label, model, under in rungs:
        caches: list[dict] = []
        with applied_policy(model, under) as layers:
            generate = measured_generate(model, layers, caches) if under is not None else None
            result = long_context(model, text=text, lengths=s.long_lengths, depths=s.long_depths,
                                  samples=s.long_samples, generate=generate, progress=run.common["progress"])  # fmt: skip
        if under is not None:
            full = kv_bytes_per_token(loaded) * max(s.long_lengths)
            largest = max(caches, key=lambda row: row["length"])
            kept.append({"model": label, "kv_kept": largest["cache_bytes"] / largest["prompts"] / full,
                         "how": f"measured on the policy's cache at {largest['length']:,} tokens"})  # fmt: skip
            meta["kv_policy"] = policy.meta
        for name, frame in result.tables().items():
            tables.setdefault(name, []).append(frame.assign(model=label))
        meta.update({key: value for key, value in result.meta.items() if not key.endswith("seconds")})
    frames = {name: pd.concat(parts) for name, parts in tables.items()}
    write_run(run.tmp / "long_context", {**frames, "kv_kept": pd.DataFrame(kept)}, meta)


def _report_policy(run: ReportRun, context: int):
    """The per-KV-head policy at half the cache at `context` tokens from the stats step's table (retrieval score,
    else streaming), or None where the statistics cannot score it (no tokenizer, windows too short) or the model's
    layers cannot take one (sliding-window layers)."""
    wide = pd.read_csv(run.tmp / "stats" / "stats_wide.csv")
    for score in POLICY_SCORES:
        try:
            scores = kv_head_scores(wide, run.loaded, score, DEFAULT_WINDOW, STREAMING_WINDOWS)
            policy = choose_policy(scores, budget=0.5, context=context, score=score)
            layers = policy.layers(run.loaded)  # a sliding-window layer refuses a real policy cache here
            HeadPolicyCache(run.loaded.model.config, {layer.block: layers[layer.index] for layer in run.loaded.layers})
            return policy
        except HeadlabError:
            continue
    return None


def _figures_step(run: ReportRun, fmt: str) -> None:
    figures = plots.run_figures(run.tmp)
    for name, fig in figures.items():
        plots.save_figure(fig, run.tmp / "figures" / f"{name}.{fmt}", fmt)  # run.figures: read back (_read_back)


def _speed_step(run: ReportRun) -> None:
    s = run.s
    spec = SpeedSpec(s.speed_contexts, s.speed_batches, s.speed_decode_tokens, s.speed_prefill_limit, ("transformers",))
    label = run.loaded.spec or DEFAULT_MODEL
    table = relative_to_first(measure_model(run.loaded, label, spec, run.common["progress"]))
    write_run(run.tmp / "speed", {"speed": table}, {**run.loaded.describe(), "spec": spec.to_dict()})


# The report is this list of steps, run in order inside one atomic directory; "gqa" only where KV heads can pool.
REPORT_STEPS = [
    ("info", _info_step),
    ("stats", _stats_step),
    ("importance", _importance_step),
    ("gallery", _gallery_step),
    ("heads", _heads_step),
    ("sweep", _sweep_step),
    ("gqa", _gqa_step),
    ("recovery", _recovery_step),
    ("long", _long_step),
    ("speed", _speed_step),
]


@dataclass(frozen=True)
class ReportPlan:
    """What a report runs, decided from the model's layout before any model work: the fitted settings, the KV-head
    count the grouping and recovery steps pool to, the steps in order and the command behind each."""

    settings: Settings
    can_gqa: bool  # every layer has the same (H, G) and the adapter can hold fewer KV heads
    target: int | None
    recovering: bool
    steps: list[tuple[str, object]]
    commands: dict[str, str]
    model_flag: str | None  # --model as a user would type it (None for the embedded default)


def plan_report(loaded: LoadedModel, s: Settings, data, text_column, out: Path, tasks: TaskSpec | None) -> ReportPlan:
    """Which steps run on this model and with which settings (`s` already fitted to its positions); `tasks`: the
    lm-eval tasks the sweep also runs (their flags join the sweep's command)."""
    layers = loaded.layers
    G = layers[0].num_kv_heads
    can_gqa = loaded.adapter.supports_gqa and len({(la.num_heads, la.num_kv_heads) for la in layers}) == 1
    target = gqa_target(G) if can_gqa else None
    # Similarity grouping differs from contiguous only when pooling to 1 < G' < G groups; otherwise its rows would
    # repeat the contiguous ones, so the sweep skips them (and their similarity pass).
    groupings = (
        s.groupings if any(G % g == 0 for g in range(2, G)) else tuple(g for g in s.groupings if g != "similarity")
    )
    s = replace(s, groupings=groupings or ("contiguous",))
    if not can_gqa or ladder.mla_refusal(loaded) is not None:
        s = replace(s, mla_budgets=())  # no MLA rung for an attention deepseek_v3 cannot express
    model_flag = None if loaded.spec == DEFAULT_MODEL else loaded.spec
    commands = step_commands(model_flag, data, text_column, s, out, target)
    if tasks and tasks.tasks:  # the sweep ran lm-eval tasks too
        commands["sweep"] += " " + _flags(tasks=tasks.tasks, include_path=tasks.include_path, task_limit=tasks.limit)
    recovering = target is not None and s.recovery_steps > 0
    encoder = loaded.adapter.is_encoder  # no KV cache: nothing to decode, no long-context generation
    skipped = {"gqa": not can_gqa, "recovery": not recovering, "long": not s.long_lengths or encoder, "speed": encoder}
    steps = [(name, function) for name, function in REPORT_STEPS if not skipped.get(name)]
    return ReportPlan(s, can_gqa, target, recovering, steps, commands, model_flag)


# What each step writes under the report directory: removed before the step runs again after a failure.
STEP_OUTPUTS = {
    "info": ("info.json",),
    "stats": ("stats",),
    "importance": ("importance",),
    "gallery": ("attention",),
    "heads": ("heads",),
    "sweep": ("sweep",),
    "gqa": ("gqa_sweep", "gqa_groups"),
    "recovery": ("recovery",),
    "long": ("long_context",),
    "speed": ("speed",),
    "figures": ("figures",),
}


def report_entries() -> set[str]:
    """What a report directory holds at its top level (the documents and every step's outputs); a demo replaces a
    directory only if it holds nothing else."""
    return {"meta.json", "report.md", "report.html", *(entry for entries in STEP_OUTPUTS.values() for entry in entries)}


def _read_back(run: ReportRun, step: str) -> None:
    """What later steps need from `step`, read from its files: the same after the step ran now as after it ran in an
    earlier, interrupted run of the same command."""
    tmp = run.tmp
    if step == "info":
        run.info = json.loads((tmp / "info.json").read_text())
    elif step == "importance":
        run.importance_table = pd.read_parquet(tmp / "importance" / "importance.parquet")
    elif step == "sweep":
        run.sweep_table = pd.read_parquet(tmp / "sweep" / "sweep.parquet")
    elif step == "gqa":
        run.gqa_frame = pd.read_parquet(tmp / "gqa_sweep" / "sweep.parquet")
    elif step == "figures":
        run.figures = sorted(path.stem for path in (tmp / "figures").iterdir())


def _run_steps(run: ReportRun, steps: list, progress: bool, journal: StepJournal) -> dict[str, float]:
    """Run each step in order, announcing it, and record it in `journal` once done; a step an earlier run of the
    same command completed (journal.resumed) is read back instead of run. A failing step names itself and what was
    kept. Returns the seconds each step took, by step name (a kept step: the seconds it took then)."""
    seconds = {}
    for number, (name, function) in enumerate(steps, 1):
        label = f"[{number}/{len(steps)}] {name}"
        if journal.done(name):
            _say(progress, f"{label}: kept from the previous run of this command")
            seconds[name] = journal.records[name].get("seconds", 0.0)
            _read_back(run, name)
            continue
        _say(progress, label)
        for entry in STEP_OUTPUTS.get(name, ()):  # a half-written output of this step from an interrupted run
            path = run.tmp / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif os.path.lexists(path):
                path.unlink()
        begin = time.perf_counter()
        try:
            function(run)
            _read_back(run, name)
        except BaseException as error:
            kept = (
                f"steps 1-{number - 1} are kept in {journal.staging}: rerun the same command to resume at step {number}"
                if number > 1
                else "rerun the same command to try again"
            )
            if isinstance(error, HeadlabError):
                raise HeadlabError(f"step {number}/{len(steps)} ({name}) failed: {error}; {kept}") from error
            _say(True, f"headlab: step {number}/{len(steps)} ({name}) stopped; {kept}")
            raise
        seconds[name] = round(time.perf_counter() - begin, 2)
        journal.finish(name, {"seconds": seconds[name]})
    return seconds


def _report_meta(loaded: LoadedModel, plan: ReportPlan, report: Report, options: dict, total: float) -> dict:
    """meta.json of a report: the model, the settings, each step's seconds and command, the summary, versions.
    `options`: the run's command, data, text_column, quick and out, as run_report received them."""
    s, data = plan.settings, options["data"]
    flags = _flags(
        model=plan.model_flag, data=data, text_column=options["text_column"], quick=options["quick"], out=options["out"]
    )
    return {
        **loaded.describe(),
        "command": options["command"],
        "data": data or DEFAULT_CORPUS,
        "quick": options["quick"],
        "settings": {k: getattr(s, k) for k in s.__dataclass_fields__},
        "seconds": report.seconds,
        "total_seconds": total,
        "threads": torch.get_num_threads(),
        "figures": report.figures,
        "commands": plan.commands,
        "command_line": f"{options['command']} " + flags,
        "summary": report.summary,
        "recovery_kv_heads": plan.target if plan.recovering else None,
        "versions": versions(),
    }


def _write_documents(tmp: Path, meta: dict, info: dict, fmt: str) -> None:
    """meta.json, report.md and the self-contained report.html, all read from the tables under `tmp`. meta.json lists
    every file the report holds, so a later demo replaces the directory only while nothing else was added."""
    meta = {**meta, "files": sorted({*_files(tmp), "meta.json", "report.md", "report.html"})}
    write_json(tmp / "meta.json", meta)
    sections = build_sections(tmp, meta, info, fmt)
    (tmp / "report.md").write_text(render_markdown(sections, meta))
    (tmp / "report.html").write_text(render_html(sections, meta, tmp))


# One parameter per `headlab report` option, so the Python API mirrors the command (and `headlab demo` reuses it with
# its own `command`); the steps themselves take the ReportPlan and ReportRun bundles.
def run_report(
    loaded: LoadedModel,
    out,
    *,
    data: str | None = None,
    text_column: str | None = None,
    quick: bool = False,
    settings: Settings | None = None,
    overwrite: bool = False,
    progress: bool = True,
    command: str = "headlab report",
    sentence: str = SAMPLE_SENTENCE,
    fmt: str = "png",
    tasks: TaskSpec | None = None,
) -> Report:
    """Run every analysis on `loaded`, write each step's tables under `out`, draw every figure and write
    report.md and report.html (figures embedded as base64). Written atomically: `out` appears complete or not at all.
    tasks: lm-eval tasks the pruning sweep also runs on every pruned model (accuracy against heads pruned; a
    TaskSpec: names, local task YAMLs, documents per task).
    """

    out = Path(out)
    s = fit_settings(settings or PRESETS["quick" if quick else "full"], loaded.max_positions)
    if fmt not in plots.FORMATS:
        raise HeadlabError(f"unknown figure format {fmt!r}; use one of {', '.join(plots.FORMATS)}")
    check_report_out(out, overwrite, demo=command == DEMO_MARKER)
    load_corpus(data, text_column)  # a bad --data fails here, before any model work
    tasks = tasks if tasks is not None and tasks.tasks else None  # no task names: no lm-eval
    plan = plan_report(loaded, s, data, text_column, out, tasks)
    s = plan.settings
    report = Report(out)
    started = time.perf_counter()
    common = dict(data=data, text_column=text_column, seq_len=s.seq_len, batch_size=s.batch_size, progress=progress)
    # A previous demo may be replaced without --overwrite; anything else that appears meanwhile is not replaced.
    replaceable = is_demo_run if command == DEMO_MARKER else None
    task_options = {"tasks": tasks.tasks, "include_path": tasks.include_path} if tasks else {}
    if tasks and tasks.limit is not None:
        task_options["limit"] = tasks.limit
    # The steps' results depend on these alone: a rerun with the same key resumes after the last completed step.
    key = dict(command=command, model=loaded.describe(), data=data, text_column=text_column, settings=asdict(s))
    key.update(sentence=sentence, fmt=fmt, tasks=task_options)
    with resumable_directory(out, key, overwrite=overwrite, replaceable=replaceable) as journal:
        tmp = journal.staging
        if journal.resumed:
            _say(progress, f"resuming from {tmp}: {', '.join(journal.resumed)} already done")
        run = ReportRun(loaded, s, tmp, common, sentence, plan.target, tasks)
        steps = plan.steps + [("figures", lambda run: _figures_step(run, fmt))]
        report.seconds = _run_steps(run, steps, progress, journal)
        report.figures = run.figures
        report.summary = pruning_trades(run.sweep_table) + (gqa_trades(run.gqa_frame) if plan.can_gqa else [])
        total = round(time.perf_counter() - started, 2)
        options = dict(command=command, data=data, text_column=text_column, quick=quick, out=out)
        _write_documents(tmp, _report_meta(loaded, plan, report, options, total), run.info, fmt)
    _say(progress, f"report written to {out} in {total:.0f} s")
    return report
