"""The end-to-end pipeline behind `headlab report` and `headlab demo`: info, statistics, importance, an attention
gallery, a pruning sweep, a GQA sweep and grouping, every figure, and report.md / a self-contained report.html.

Each step writes its own run directory (the same tables its CLI command writes) inside the report directory, so
`headlab plot REPORT_DIR` redraws every figure without a model; every number in the report comes from those tables.
"""

from __future__ import annotations

import base64
import html
import json
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from headlab.errors import HeadlabError
from headlab.loading import DEFAULT_MODEL, LoadedModel, atomic_directory
from headlab.report_text import human_bytes

SAMPLE_SENTENCE = "The cat sat on the mat because it was tired, and then it slept."
DEMO_OUT = Path("runs/demo")
DEMO_MARKER = "headlab demo"  # meta.json "command" of a demo run: `headlab demo` may replace such a directory


@dataclass(frozen=True)
class Settings:
    """How much text each step reads (tokens) and what the sweeps cover; `full` and `quick` presets below."""

    seq_len: int = 256
    batch_size: int = 4
    stats_tokens: int = 2048
    induction_len: int = 64
    induction_count: int = 8
    importance_tokens: int = 1024
    eval_tokens: int = 1024
    calibration_tokens: int = 1024
    fractions: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    orders: tuple[str, ...] = ("importance", "random", "entropy")
    seeds: tuple[int, ...] = (0, 1)
    groupings: tuple[str, ...] = ("contiguous", "similarity")
    pools: tuple[str, ...] = ("mean",)
    # mean pooling (Ainslie et al.) beside the calibrated merge (headlab.merge), so the report shows both
    methods: tuple[str, ...] = ("mean", "svd")
    gallery_heads: int = 3
    # headlab speed: decode with a KV cache; points above speed_prefill_limit tokens get a synthetic cache
    speed_contexts: tuple[int, ...] = (512, 2048, 8192)
    speed_batches: tuple[int, ...] = (1, 8)
    speed_decode_tokens: int = 4
    speed_prefill_limit: int = 2048


PRESETS = {
    "full": Settings(),
    "quick": Settings(
        stats_tokens=512,
        induction_len=32,
        induction_count=4,
        importance_tokens=512,
        eval_tokens=512,
        calibration_tokens=512,
        fractions=(0.0, 0.3, 0.5),
        orders=("importance", "random"),
        seeds=(0,),
        groupings=("contiguous",),
        speed_contexts=(128, 512),
        speed_batches=(1, 4),
        speed_decode_tokens=2,
    ),
}


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
    from headlab.capture import capture_attention
    from headlab.stats import _frame_tokens

    if loaded.tokenizer is None:
        raise HeadlabError("the attention gallery needs the model's tokenizer")
    prefix, suffix = _frame_tokens(loaded)
    ids = prefix + loaded.tokenizer(sentence, add_special_tokens=False)["input_ids"] + suffix
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
    from headlab import gqa

    groups, methods = gqa.plan_groups(loaded, target, grouping, similarity)
    rows = []
    for layer in gqa.gqa_layers(loaded):
        new_of = {kv: g for g, members in enumerate(gqa.canonical(groups[layer.index])) for kv in members}
        for head in range(layer.num_heads):
            kv = layer.kv_head_of(head)
            rows.append((layer.index, head, kv, new_of[kv], grouping, methods[layer.index]))
    return pd.DataFrame(rows, columns=["layer", "head", "kv_head", "new_kv_head", "grouping", "method"])


# ---- summary of the trades -------------------------------------------------------------------------------------


def _pct(new: float, old: float) -> str:
    """Relative change: '+12.3%' below a doubling, '10.8x' from there on (a +97,000% reads worse than 971x)."""
    ratio = new / old
    return f"{(ratio - 1) * 100:+.1f}%" if ratio < 2 else f"{ratio:,.1f}x"


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
    the unchanged model (bytes from a real cache), and what the MHA expansion would cost."""
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
            f"{int(base['kv_heads'])} -> {int(g)} KV heads ({best['grouping']} grouping, {best['pool']} pooling, no "
            f"uptraining) saves {saved:.1%} of the KV cache ({human_bytes(base['kv_bytes_per_token'])} -> "
            f"{human_bytes(best['kv_bytes_per_token'])} per token) for {_pct(best['perplexity'], base['perplexity'])} "
            f"perplexity ({base['perplexity']:.2f} -> {best['perplexity']:.2f})."
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


def step_commands(model: str | None, data: str | None, text_column: str | None, s: Settings, out: Path, target):
    """The CLI command behind each step, with the options the report used (each writing its own runs/STEP)."""
    common = dict(model=model, data=data, text_column=text_column)
    size = dict(seq_len=s.seq_len, batch_size=s.batch_size)
    return {
        "info": f"headlab info {_flags(model=model)}".strip(),
        "stats": "headlab stats "
        + _flags(
            **common,
            max_tokens=s.stats_tokens,
            **size,
            induction_len=s.induction_len,
            induction_count=s.induction_count,
            out="runs/stats",
        ),
        "importance": "headlab importance "
        + _flags(**common, max_tokens=s.importance_tokens, **size, out="runs/importance"),
        "sweep": "headlab sweep "
        + _flags(
            **common,
            fractions=s.fractions,
            orders=s.orders,
            seeds=s.seeds,
            max_tokens=s.eval_tokens,
            calibration_tokens=s.importance_tokens,
            **size,
            out="runs/sweep",
        ),
        "gqa_sweep": "headlab gqa-sweep "
        + _flags(
            **common,
            grouping=s.groupings,
            pool=s.pools,
            method=s.methods,
            max_tokens=s.eval_tokens,
            calib_tokens=s.calibration_tokens,
            **size,
            out="runs/gqa_sweep",
        ),
        "gqa_groups": "headlab convert-gqa "
        + _flags(
            **common,
            kv_heads=target,
            grouping="similarity",
            calib_tokens=s.calibration_tokens,
            max_tokens=s.eval_tokens,
            **size,
            out="converted",
        ),
        "speed": "headlab speed "
        + (shlex.quote(model) + " " if model else "")
        + _flags(
            contexts=",".join(map(str, s.speed_contexts)),
            batches=",".join(map(str, s.speed_batches)),
            decode_tokens=s.speed_decode_tokens,
            prefill_limit=s.speed_prefill_limit,
            runtime="transformers",
            out="runs/speed",
        ),
        "plot": f"headlab plot {shlex.quote(str(out))}",
    }


# ---- the pipeline ----------------------------------------------------------------------------------------------


def fit_settings(s: Settings, max_positions: int | None) -> Settings:
    """Shrink the windows and induction sequences to the model's positions (2 x length + a prefix token fit)."""
    if max_positions is None:
        return s
    contexts = tuple(c for c in s.speed_contexts if c <= max_positions) or (max_positions // 2,)
    return replace(
        s,
        seq_len=min(s.seq_len, max_positions),
        induction_len=min(s.induction_len, max(2, (max_positions - 2) // 2)),
        speed_contexts=contexts,
    )


def check_report_out(out: Path, overwrite: bool, demo: bool = False) -> None:
    """An existing `out` needs overwrite=True, except a previous `headlab demo` output, which a demo replaces."""
    out = Path(out)
    if not out.exists() or overwrite:
        return
    if demo and is_demo_run(out):
        return
    raise HeadlabError(f"{out} already exists; pass --overwrite to replace it")


# What a report directory holds at its top level; a demo replaces a directory only if it holds nothing else.
REPORT_ENTRIES = {
    "meta.json",
    "info.json",
    "report.md",
    "report.html",
    "figures",
    "stats",
    "importance",
    "attention",
    "sweep",
    "gqa_sweep",
    "gqa_groups",
}


def is_demo_run(path: Path) -> bool:
    """A directory written by `headlab demo` (its meta.json says so) holding nothing a user added at its top level."""
    path = Path(path)
    try:
        marked = json.loads((path / "meta.json").read_text()).get("command") == DEMO_MARKER
        return marked and {p.name for p in path.iterdir()} <= REPORT_ENTRIES
    except (OSError, ValueError, AttributeError):
        return False


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


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
) -> Report:
    """Run every analysis on `loaded`, write each step's tables under `out`, draw every figure and write
    report.md and report.html (figures embedded as base64). Written atomically: `out` appears complete or not at all.
    """
    from headlab import gqa, plots
    from headlab.data import calibration_batches, load_corpus
    from headlab.evaluate import model_info
    from headlab.importance import head_importance
    from headlab.stats import head_statistics, write_statistics
    from headlab.sweep import sweep, write_sweep
    from headlab.tables import versions, write_run

    out = Path(out)
    s = fit_settings(settings or PRESETS["quick" if quick else "full"], loaded.max_positions)
    if fmt not in plots.FORMATS:
        raise HeadlabError(f"unknown figure format {fmt!r}; use one of {', '.join(plots.FORMATS)}")
    check_report_out(out, overwrite, demo=command == DEMO_MARKER)
    load_corpus(data, text_column)  # a bad --data fails here, before any model work
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
    model_flag = None if loaded.spec == DEFAULT_MODEL else loaded.spec
    commands = step_commands(model_flag, data, text_column, s, out, target)
    report = Report(out)
    steps = ["info", "stats", "importance", "gallery", "sweep"] + (["gqa"] if can_gqa else []) + ["speed"]
    started = time.perf_counter()

    def step(name: str):
        report.seconds[name] = time.perf_counter()
        _say(progress, f"[{len(report.seconds)}/{len(steps) + 1}] {name}")

    def done(name: str):
        report.seconds[name] = round(time.perf_counter() - report.seconds[name], 2)

    common = dict(data=data, text_column=text_column, seq_len=s.seq_len, batch_size=s.batch_size, progress=progress)
    with atomic_directory(out, overwrite=True) as tmp:
        step("info")
        info = model_info(loaded, context=s.seq_len)
        (tmp / "info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
        done("info")

        step("stats")
        tidy = head_statistics(
            loaded,
            max_tokens=s.stats_tokens,
            induction_len=s.induction_len,
            induction_count=s.induction_count,
            **common,
        )
        write_statistics(tmp / "stats", tidy)
        done("stats")

        step("importance")
        importance = head_importance(loaded, max_tokens=s.importance_tokens, **common)
        write_run(
            tmp / "importance", {"importance": importance.table, "kv_groups": importance.kv_groups}, importance.meta
        )
        done("importance")

        step("gallery")
        maps = attention_maps(loaded, importance.table, sentence, s.gallery_heads)
        write_run(tmp / "attention", {"attention_maps": maps}, {**loaded.describe(), "sentence": sentence})
        done("gallery")

        step("sweep")
        from headlab.prune import read_scores

        result = sweep(
            loaded,
            # The importance order starts from the scores just computed with the same settings (same numbers as
            # `headlab sweep` recomputing them, without the second gradient pass).
            scores={"importance": read_scores(importance.table, layers)},
            fractions=s.fractions,
            orders=s.orders,
            seeds=s.seeds,
            calibration_tokens=s.importance_tokens,
            eval_tokens=s.eval_tokens,
            **common,
        )
        write_sweep(result, tmp / "sweep")
        done("sweep")

        gqa_frame = None
        if can_gqa:
            step("gqa")
            gqa_frame, gqa_meta = gqa.gqa_sweep(
                loaded,
                groupings=s.groupings,
                pools=s.pools,
                methods=s.methods,
                corpus=data,
                text_column=text_column,
                max_tokens=s.eval_tokens,
                seq_len=s.seq_len,
                batch_size=s.batch_size,
                calib_tokens=s.calibration_tokens,
                progress=progress,
            )
            write_run(tmp / "gqa_sweep", {"sweep": gqa_frame}, gqa_meta)
            if target is not None:
                batches = calibration_batches(
                    loaded.tokenizer,
                    data,
                    seq_len=s.seq_len,
                    batch_size=s.batch_size,
                    max_tokens=s.calibration_tokens,
                    text_column=text_column,
                    max_positions=loaded.max_positions,
                )
                similarity = gqa.kv_similarity(loaded, batches, progress=progress)
                groups = grouping_table(loaded, target, similarity, "similarity")
                write_run(
                    tmp / "gqa_groups",
                    {"gqa_groups": groups, "kv_similarity": gqa.similarity_table(similarity)},
                    {**loaded.describe(), "kv_heads_after": target, "calibration": batches.meta},
                )
            done("gqa")

        step("speed")
        from headlab.speed import SpeedSpec, measure_model, relative_to_first

        speed_spec = SpeedSpec(
            s.speed_contexts, s.speed_batches, s.speed_decode_tokens, s.speed_prefill_limit, ("transformers",)
        )
        speed_table = relative_to_first(measure_model(loaded, model_flag or DEFAULT_MODEL, speed_spec, progress))
        write_run(tmp / "speed", {"speed": speed_table}, {**loaded.describe(), "spec": speed_spec.to_dict()})
        done("speed")

        step("figures")
        figures = plots.run_figures(tmp)
        for name, fig in figures.items():
            plots.save_figure(fig, tmp / "figures" / f"{name}.{fmt}", fmt)
        report.figures = sorted(figures)
        done("figures")

        report.summary = pruning_trades(result.table) + (gqa_trades(gqa_frame) if gqa_frame is not None else [])
        total = round(time.perf_counter() - started, 2)
        meta = {
            **loaded.describe(),
            "command": command,
            "data": data or "pydoc-topics",
            "quick": quick,
            "settings": {k: getattr(s, k) for k in s.__dataclass_fields__},
            "seconds": report.seconds,
            "total_seconds": total,
            "threads": torch.get_num_threads(),
            "figures": report.figures,
            "commands": commands,
            "command_line": f"{command} "
            + _flags(model=model_flag, data=data, text_column=text_column, quick=quick, out=out),
            "summary": report.summary,
            "versions": versions(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        sections = build_sections(tmp, meta, info, fmt)
        (tmp / "report.md").write_text(render_markdown(sections, meta))
        (tmp / "report.html").write_text(render_html(sections, meta, tmp))
    _say(progress, f"report written to {out} in {total:.0f} s")
    return report


# ---- report.md and report.html ---------------------------------------------------------------------------------


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)  # paths relative to the report directory
    command: str | None = None


def _table(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.is_file() else None


def _round(frame: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    frame = frame.copy()
    for column in frame.columns:
        if pd.api.types.is_float_dtype(frame[column]):
            frame[column] = frame[column].map(lambda v: "" if pd.isna(v) else f"{v:.{digits}g}")
    return frame


def build_sections(run: Path, meta: dict, info: dict, fmt: str) -> list[Section]:
    """The report's sections, from the tables saved under `run` (never from the live model)."""
    commands = meta["commands"]
    figure = {name: f"figures/{name}.{fmt}" for name in meta["figures"]}
    sections = [Section("Summary", [f"- {line}" for line in meta["summary"]])]

    ladder = pd.DataFrame(info["ladder"]) if info.get("ladder") else None
    layout = pd.DataFrame(
        [
            ("model type", info["model_type"]),
            ("attention layers", info["attention_layers"]),
            ("query heads / KV heads / head_dim", f"{info['query_heads']} / {info['kv_heads']} / {info['head_dim']}"),
            ("parameters (attention)", f"{info['parameters']:,} ({info['attention_parameters']:,})"),
            ("KV cache per token", human_bytes(info["kv_bytes_per_token"]) + f" ({info['cache_dtype']})"),
        ],
        columns=["", "value"],
    )
    tables = [("layout", layout)]
    if ladder is not None:
        ladder = ladder.assign(kv_per_token=ladder["kv_bytes_per_token"].map(human_bytes))
        tables.append(("KV-cache ladder", ladder[["variant", "kv_heads", "kv_per_token", "current"]]))
    sections.append(Section("Model", tables=tables, command=commands["info"]))

    wide = _table(run / "stats" / "stats_wide.csv")
    stat_figures = [figure[n] for n in meta["figures"] if n.startswith("heatmap_") and n != "heatmap_importance"]
    described = wide.drop(columns=["layer", "head", "kv_head"]).select_dtypes("number").dropna(axis=1, how="all")
    summary = described.describe().T[["mean", "min", "max"]].reset_index(names="statistic")
    stats_meta = json.loads((run / "stats" / "meta.json").read_text())
    sections.append(
        Section(
            "Per-head attention statistics",
            [
                f"{stats_meta['tokens']:,} calibration tokens; one heatmap per statistic (rows: layers, columns: query "
                "heads; lines mark KV groups). Definitions: README, `headlab stats`."
            ],
            [("statistics over all heads", summary)],
            stat_figures,
            commands["stats"],
        )
    )

    importance = _table(run / "importance" / "importance.csv")
    top = importance.sort_values("rank")
    imp_meta = json.loads((run / "importance" / "meta.json").read_text())
    sections.append(
        Section(
            "Head importance",
            [
                f"{imp_meta['definition']} ({imp_meta['scored_tokens']:,} scored tokens), normalised per layer then to [0, 1]."
            ],
            [("all heads by rank", top)]
            if len(top) <= 20
            else [("most important heads", top.head(10)), ("least important heads", top.tail(10).iloc[::-1])],
            [
                figure[n]
                for n in ("heatmap_importance", "importance_vs_entropy", "importance_vs_sink_first")
                if n in figure
            ],
            commands["importance"],
        )
    )
    maps_meta = json.loads((run / "attention" / "meta.json").read_text())
    sections.append(
        Section(
            "Attention patterns",
            [
                f"Sentence: `{maps_meta['sentence']}`. Panels: the most and the least important heads (same colour scale)."
            ],
            figures=[figure["attention_gallery"]] if "attention_gallery" in figure else [],
            command=commands["plot"],
        )
    )

    sweep_table = _table(run / "sweep" / "sweep.csv")
    shown = (
        sweep_table.groupby(["order", "fraction"], sort=False)
        .agg(
            pruned_heads=("pruned_heads", "mean"),
            perplexity=("perplexity", "mean"),
            parameters=("parameters", "mean"),
            kv_bytes_per_token=("kv_bytes_per_token", "mean"),
            tokens_per_s=("tokens_per_s", "mean"),
        )
        .reset_index()
    )
    sections.append(
        Section(
            "Pruning sweep",
            [
                "Perplexity on the eval split with the lowest-scoring fraction of heads removed (random: mean over seeds)."
            ],
            [("sweep", shown)],
            [figure["sweep"]] if "sweep" in figure else [],
            commands["sweep"],
        )
    )

    gqa_table = _table(run / "gqa_sweep" / "sweep.csv")
    if gqa_table is not None:
        columns = ["variant", "kv_heads", "action", "perplexity", "kv_bytes_per_token", "relative_kv_bytes", "same_as"]
        sections.append(
            Section(
                "KV heads: GQA conversion",
                [
                    "Perplexity against measured KV-cache bytes per token; pool mean: KV heads averaged (Ainslie et "
                    "al. 2023); pool svd: the calibrated, training-free merge (`--method svd`); no uptraining."
                ],
                [("gqa sweep", gqa_table[[c for c in columns if c in gqa_table]])],
                [figure["gqa_sweep"]] if "gqa_sweep" in figure else [],
                commands["gqa_sweep"],
            )
        )
        groups = _table(run / "gqa_groups" / "gqa_groups.csv")
        if groups is not None:
            moved = int((groups.groupby("layer")["method"].first() != "trivial").sum())
            sections[-1].figures += [figure["gqa_grouping"]] if "gqa_grouping" in figure else []
            sections[-1].text.append(
                f"Grouping: pooling to {groups['new_kv_head'].nunique()} KV heads by KV-head similarity "
                f"(mean key/value cosine on calibration text); {moved} of {groups['layer'].nunique()} layers needed a "
                "search (with one group per layer every grouping is the same)."
            )
            sections[-1].command += "\n" + commands["gqa_groups"]
    else:
        sections.append(Section("KV heads", ["This architecture cannot hold fewer KV heads (supports_gqa=False)."]))
    speed = _table(run / "speed" / "speed.csv")
    if speed is not None:
        columns = ["context", "batch", "cache_fill", "prefill_tokens_per_s", "decode_tokens_per_s", "kv_cache_bytes"]
        sections.append(
            Section(
                "Speed",
                [
                    "Measured decode tokens/s with a KV cache holding `context` tokens, and the cache's bytes "
                    "(transformers). A synthetic cache (random keys/values) replaces the timed prefill above "
                    f"{meta['settings']['speed_prefill_limit']:,} tokens; `headlab speed` compares checkpoints "
                    "(original, pruned, KV-reduced) and llama.cpp."
                ],
                [("speed", speed[[c for c in columns if c in speed]])],
                [figure["speed"]] if "speed" in figure else [],
                commands.get("speed"),
            )
        )
    return sections


def markdown_table(frame: pd.DataFrame) -> str:
    frame = _round(frame)
    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = [
        "| " + " | ".join("" if pd.isna(v) else str(v) for v in row) + " |" for row in frame.itertuples(index=False)
    ]
    return "\n".join([header, rule, *body])


def _title(meta: dict) -> str:
    return f"headlab report: {meta['model']} on {meta['data']}"


def render_markdown(sections: list[Section], meta: dict) -> str:
    lines = [
        f"# {_title(meta)}",
        "",
        f"Reproduce everything: `{meta['command_line']}`" if "command_line" in meta else "",
    ]
    lines += [f"Total {meta['total_seconds']:.0f} s on {meta['threads']} threads ({meta['versions']['torch']}).", ""]
    for section in sections:
        lines += [f"## {section.title}", "", *section.text, ""]
        for name, frame in section.tables:
            lines += [f"**{name}**", "", markdown_table(frame), ""]
        lines += [f"![{Path(f).stem}]({f})" for f in section.figures] + ([""] if section.figures else [])
        if section.command:
            lines += ["```bash", section.command, "```", ""]
    return "\n".join(lines)


def render_html(sections: list[Section], meta: dict, run: Path) -> str:
    """One self-contained page: figures inlined as base64 data URIs, no external CSS or scripts."""
    mime = {"png": "image/png", "svg": "image/svg+xml", "pdf": "application/pdf"}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(_title(meta))}</title><style>",
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}",
        "table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}img,embed{max-width:100%;margin:.5em 0;display:block}"
        "pre{background:#f4f4f4;padding:.6em;overflow-x:auto;white-space:pre-wrap}",
        "</style></head><body>",
        f"<h1>{html.escape(_title(meta))}</h1>",
        f"<p>Reproduce everything: <code>{html.escape(meta['command_line'])}</code></p>",
        f"<p>Total {meta['total_seconds']:.0f} s on {meta['threads']} threads.</p>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        items = [t[2:] for t in section.text if t.startswith("- ")]
        if items:
            parts.append("<ul>" + "".join(f"<li>{html.escape(t)}</li>" for t in items) + "</ul>")
        parts += [f"<p>{html.escape(t)}</p>" for t in section.text if not t.startswith("- ")]
        for name, frame in section.tables:
            parts.append(f"<h4>{html.escape(name)}</h4>" + _round(frame).to_html(index=False, na_rep="", border=0))
        for path in section.figures:
            kind = Path(path).suffix.lstrip(".")
            data = base64.b64encode((run / path).read_bytes()).decode("ascii")
            tag = "embed" if kind == "pdf" else "img"
            parts.append(f"<{tag} src='data:{mime[kind]};base64,{data}' alt='{html.escape(Path(path).stem)}'>")
        if section.command:
            parts.append(f"<pre>{html.escape(section.command)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
