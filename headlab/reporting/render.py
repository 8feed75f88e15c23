"""Rendering of `headlab report`: sections built from the tables a report run saved (never from a live model),
written as report.md and as one self-contained report.html (figures inlined)."""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from headlab.core.units import human_bytes
from headlab.reporting.heads import TOP_ATTRIBUTION, viewer_links


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)  # paths relative to the report directory
    command: str | None = None
    links: list[tuple[str, str]] = field(default_factory=list)  # (label, path relative to the report directory)
    links_title: str = ""


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
    figure = {name: f"figures/{name}.{fmt}" for name in meta["figures"]}
    sections = [Section("Summary", [f"- {line}" for line in meta["summary"]]), _model_section(info, meta["commands"])]
    for build in (_stats_section, _importance_section, _gallery_section):
        sections.append(build(run, meta, figure))
    sections += _heads_sections(run, meta, figure)  # empty in a report from before the step existed
    sections.append(_sweep_section(run, meta, figure))
    for build in (_gqa_sections, _recovery_sections, _long_sections, _speed_sections):  # empty where not run
        sections += build(run, meta, figure)
    return sections


def _recovery_sections(run: Path, meta: dict, figure: dict) -> list[Section]:
    table = _table(run / "recovery" / "before_after.csv")
    if table is None:
        return []
    settings = meta["settings"]
    tokens = settings["batch_size"] * min(settings["recovery_seq_len"], settings["seq_len"])
    text = (
        f"The svd merge to {meta.get('recovery_kv_heads')} KV heads, recovered towards the original: local "
        f"reconstruction on {settings['calibration_tokens']:,} calibration tokens "
        f"({settings['recovery_local_passes']} passes per layer), then {settings['recovery_steps']} "
        f"uptraining steps of {tokens:,} tokens (budgets in tokens: the same model on any machine; every choice made "
        "on calibration text, docs/recovery.md); eval-split perplexity."
    )
    figures = [figure["recovery_curve"]] if "recovery_curve" in figure else []
    return [Section("Recovery", [text], [("before and after", _round(table))], figures, meta["commands"]["recovery"])]


def _long_sections(run: Path, meta: dict, figure: dict) -> list[Section]:
    lengths = _table(run / "long_context" / "lengths.csv")
    if lengths is None:
        return []
    settings = meta["settings"]
    accuracy = (
        lengths.assign(
            cell=lengths["task"] + " @ " + lengths["length"].map("{:,}".format),
            value=[
                f"{c}/{n} [{lo:.0%}, {hi:.0%}]"
                for c, n, lo, hi in lengths[["correct", "prompts", "ci_low", "ci_high"]].to_numpy()
            ],
        )
        .pivot_table(index="model", columns="cell", values="value", aggfunc="first", sort=False)
        .reset_index()
    )
    positions = _table(run / "long_context" / "positions.csv")
    tables = [("retrieval: correct/prompts [95% interval]", accuracy)]
    if positions is not None and len(positions):
        bucket = positions["start"].map("{:,}".format) + "-" + positions["end"].map("{:,}".format)
        nll = positions.assign(bucket=bucket).pivot_table(index="model", columns="bucket", values="nll", sort=False)
        tables.append(("mean NLL by position (nats / token)", _round(nll.reset_index())))
    copying = _table(run / "long_context" / "copying.csv")
    if copying is not None and len(copying):
        length = copying["length"].map("copy @ {:,}".format)
        shares = copying.assign(length=length).pivot_table(
            index="model", columns="length", values="accuracy", sort=False
        )
        tables.append(("in-context copying: share of copied tokens predicted", _round(shares.reset_index())))
    kept = _table(run / "long_context" / "kv_kept.csv")
    if kept is not None:
        tables.append(("KV cache kept (fraction of the original's)", _round(kept)))
    text = (
        "Retrieval from far back, where KV compression pays and breaks: passkey prompts in eval-split text at depths "
        f"{', '.join(f'{d:g}' for d in settings['long_depths'])} ({settings['long_samples']} prompts each), greedy "
        "decoding, exact match (docs/long-context.md); the NLL of tokens by their position in one long sequence; and "
        "in-context copying, random tokens followed by their copy, scored on the copy (the mechanism retrieval rests "
        "on, hundreds of scored tokens per sequence). "
        "The KV policy keeps the whole cache for the KV heads the statistics rank as retrieval heads and 4 sinks + "
        "256 recent tokens for the others, within half the cache at the longest length (docs/kv-policy.md)."
    )
    figures = [figure[name] for name in ("needle_heatmap", "position_nll", "kv_trade") if name in figure]
    return [Section("Long context", [text], tables, figures, meta["commands"].get("long"))]


def _speed_sections(run: Path, meta: dict, figure: dict) -> list[Section]:
    speed = _table(run / "speed" / "speed.csv")
    if speed is None:
        return []
    columns = ["context", "batch", "cache_fill", "prefill_tokens_per_s", "decode_tokens_per_s", "kv_cache_bytes"]
    text = (
        "Measured decode tokens/s with a KV cache that ends holding `context` tokens, and the cache's bytes "
        "(transformers). A synthetic cache (random keys/values) replaces the timed prefill above "
        f"{meta['settings']['speed_prefill_limit']:,} tokens; `headlab speed` compares checkpoints (original, pruned, "
        "KV-reduced) and llama.cpp."
    )
    return [
        Section(
            "Speed",
            [text],
            [("speed", speed[[c for c in columns if c in speed]])],
            [figure["speed"]] if "speed" in figure else [],
            meta["commands"].get("speed"),
        )
    ]


def _model_section(info: dict, commands: dict) -> Section:
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
    return Section("Model", tables=tables, command=commands["info"])


def _stats_section(run: Path, meta: dict, figure: dict) -> Section:
    wide = _table(run / "stats" / "stats_wide.csv")
    stat_figures = [figure[n] for n in meta["figures"] if n.startswith("heatmap_") and n != "heatmap_importance"]
    described = wide.drop(columns=["layer", "head", "kv_head"]).select_dtypes("number").dropna(axis=1, how="all")
    summary = described.describe().T[["mean", "min", "max"]].reset_index(names="statistic")
    stats_meta = json.loads((run / "stats" / "meta.json").read_text())
    return Section(
        "Per-head attention statistics",
        [
            f"{stats_meta['tokens']:,} calibration tokens; one heatmap per statistic (rows: layers, columns: query "
            "heads; lines mark KV groups). Definitions: README, `headlab stats`."
        ],
        [("statistics over all heads", summary)],
        stat_figures,
        meta["commands"]["stats"],
    )


def _importance_section(run: Path, meta: dict, figure: dict) -> Section:
    importance = _table(run / "importance" / "importance.csv")
    top = importance.sort_values("rank")
    imp_meta = json.loads((run / "importance" / "meta.json").read_text())
    return Section(
        "Head importance",
        [
            f"{imp_meta['definition']} ({imp_meta['scored_tokens']:,} scored tokens), "
            "normalised per layer then to [0, 1]."
        ],
        [("all heads by rank", top)]
        if len(top) <= 20
        else [("most important heads", top.head(10)), ("least important heads", top.tail(10).iloc[::-1])],
        [figure[n] for n in ("heatmap_importance", "importance_vs_entropy", "importance_vs_sink_first") if n in figure],
        meta["commands"]["importance"],
    )


def _gallery_section(run: Path, meta: dict, figure: dict) -> Section:
    maps_meta = json.loads((run / "attention" / "meta.json").read_text())
    return Section(
        "Attention patterns",
        [f"Sentence: `{maps_meta['sentence']}`. Panels: the most and the least important heads (same colour scale)."],
        figures=[figure["attention_gallery"]] if "attention_gallery" in figure else [],
        command=meta["commands"]["plot"],
    )


def _heads_sections(run: Path, meta: dict, figure: dict) -> list[Section]:
    types = _table(run / "heads" / "head_types.csv")
    if types is None:
        return []
    heads_meta = json.loads((run / "heads" / "meta.json").read_text())
    text = [
        "Head types from the statistics above: a head counts as a type when its score is at least the threshold "
        "(half its attention mass, or half the tokens tested, goes the type's way; retrieval: ten times uniform "
        "attention on the needle). Definitions and sources: docs/commands/stats.md."
    ]
    tables = [("detected head types", types.drop(columns=["top_score"]))]
    named = [name.split(" ")[0] for cell in types["top_heads"] for name in str(cell).split(", ")]
    attribution = _table(run / "heads" / "head_attribution.csv")
    if attribution is not None:
        check = heads_meta["attribution"]["sum_check"]
        text.append(
            f"Direct logit attribution on the first {heads_meta['attribution']['tokens']:,} eval-split tokens: each "
            "head's contribution to the correct next token's logit through the final norm, its scale frozen per "
            f"position (linearised; heads + rest = the logit within {check['max_abs_error']:.1g}), averaged over "
            "positions; `positive` is the share of positions where the head raises the correct token."
        )
        top = attribution.head(TOP_ATTRIBUTION)
        if len(attribution) <= TOP_ATTRIBUTION + 5:  # the two lists below would share heads: one list instead
            tables.append(("all heads by mean attribution", attribution))
        else:
            tables.append(("heads that raise the correct token most", top))
            tables.append(("heads that lower it most", attribution.tail(5).iloc[::-1]))
        named += list(top["name"])
    for part, why in heads_meta.get("left_out", {}).items():
        text.append(f"No {part}: {why}.")
    text.append(
        f"The attention viewer (heads/viewer.html, {heads_meta['viewer']['tokens']:,} tokens, top "
        f"{heads_meta['viewer']['top_k']} keys per query) shows every head on the same text; the links open it at "
        "a head."
    )
    figures = [figure[name] for name in ("dla_mean",) if name in figure]
    section = Section("What the heads do", text, tables, figures, meta["commands"].get("heads"))
    section.links, section.links_title = viewer_links(named), "Open in the viewer"
    return [section]


def _sweep_section(run: Path, meta: dict, figure: dict) -> Section:
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
    task_metrics = [c for c in sweep_table.columns if "/" in c and not c.endswith("_stderr")]  # sweep --tasks
    if task_metrics:
        means = sweep_table.groupby(["order", "fraction"], sort=False)[task_metrics].mean().reset_index()
        shown = shown.merge(means, on=["order", "fraction"])
    return Section(
        "Pruning sweep",
        ["Perplexity on the eval split with the lowest-scoring fraction of heads removed (random: mean over seeds)."],
        [("sweep", shown)],
        [figure[name] for name in ("sweep", "sweep_tasks") if name in figure],
        meta["commands"]["sweep"],
    )


def _gqa_sections(run: Path, meta: dict, figure: dict) -> list[Section]:
    commands = meta["commands"]
    gqa_table = _table(run / "gqa_sweep" / "sweep.csv")
    if gqa_table is None:
        return [
            Section(
                "KV heads",
                [
                    "This architecture cannot hold fewer KV heads (supports_gqa=False; an MLA model caches one latent "
                    "for all heads instead)."
                ],
            )
        ]
    columns = ["variant", "kv_heads", "action", "perplexity", "kv_bytes_per_token", "relative_kv_bytes", "same_as"]
    section = Section(
        "KV heads: GQA conversion",
        [
            "Perplexity against measured KV-cache bytes per token; method mean, pool mean: KV heads averaged "
            "(Ainslie et al. 2023); method svd: the calibrated, training-free merge (`--method svd`); no uptraining."
        ],
        [("gqa sweep", gqa_table[[c for c in columns if c in gqa_table]])],
        [figure["gqa_sweep"]] if "gqa_sweep" in figure else [],
        commands["gqa_sweep"],
    )
    groups = _table(run / "gqa_groups" / "gqa_groups.csv")
    if groups is not None:
        moved = int((groups.groupby("layer")["method"].first() != "trivial").sum())
        section.figures += [figure["gqa_grouping"]] if "gqa_grouping" in figure else []
        section.text.append(
            f"Grouping: pooling to {groups['new_kv_head'].nunique()} KV heads by KV-head similarity "
            f"(mean key/value cosine on calibration text); {moved} of {groups['layer'].nunique()} layers needed a "
            "search (with one group per layer every grouping is the same)."
        )
        section.command += "\n" + commands["gqa_groups"]
    return [section]


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
        if section.links:
            links = " · ".join(f"[{label}]({path})" for label, path in section.links)
            lines += [f"{section.links_title}: {links}", ""]
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
        if section.links:
            links = " · ".join(
                f"<a href='{html.escape(path, quote=True)}'>{html.escape(label)}</a>" for label, path in section.links
            )
            parts.append(f"<p>{html.escape(section.links_title)}: {links}</p>")
        if section.command:
            parts.append(f"<pre>{html.escape(section.command)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
