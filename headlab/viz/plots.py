"""Every headlab figure, drawn with seaborn from saved tidy tables (never from a live model), sized to the grid.

Each `plot_*` function takes tables and returns a matplotlib Figure; `plot_run` redraws all figures of a run
directory (what `headlab plot` does); `save_figure` writes PNG, SVG or PDF.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import matplotlib.ticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_write_bytes
from headlab.core.validate import check_unique_heads
from headlab.measure.stats import SINK_TOKENS, STATISTICS, STREAMING_WINDOWS
from headlab.viz.choices import FORMATS

DPI = 120
# Statistic -> axis/colour-bar label (with units). Columns not listed are labelled by their name.
LABELS = {
    "entropy": "attention entropy (nats)",
    "normalized_entropy": "normalised entropy (0 = one key, 1 = uniform)",
    "confidence": "confidence (mean max weight)",
    "positional_prev": "fraction of queries whose argmax is i-1",
    "positional_next": "fraction of queries whose argmax is i+1",
    "sink_first": "sink mass: attention to the first token",
    "sink_first4": "sink mass: attention to the first 4 tokens",
    "prev_share": "attention to the previous token",
    "self_share": "attention to the token itself",
    "mean_distance": "mean attention distance (tokens)",
    **{f"stream_{w}": f"streaming mass: {SINK_TOKENS} sinks + {w} recent keys" for w in STREAMING_WINDOWS},
    "induction": "induction score",
    "retrieval": "retrieval score (attention on the copied needle token)",
    "output_norm": "head output L2 norm",
    "cls_share": "attention to [CLS]",
    "sep_share": "attention to [SEP]",
    "importance": "importance (normalised to [0, 1])",
    "importance_raw": "importance (raw)",
    "contribution": "direct logit attribution (logit units)",
    "recovered": "recovered fraction of the logit difference",
}
SHORT_NAMES = {"sink_first": "sink mass (first token)", "sink_first4": "sink mass (first 4 tokens)"}
# Above this many cells a heatmap carries no numbers: they would be unreadable.
ANNOTATE_MAX_CELLS = 400


def _theme(font_scale: float = 1.0) -> None:
    sns.set_theme(style="white", context="notebook", font_scale=font_scale)


def _subplots(*args, figsize, **kwargs):
    """A Figure outside pyplot (no backend, no global figure list to leak into; notebooks still display it)."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def label_of(column: str) -> str:
    return LABELS.get(column, column.replace("_", " "))


def save_figure(fig, path, fmt: str | None = None) -> Path:
    """Write `fig` to `path` (format from `fmt` or the suffix: png, svg or pdf), atomically."""
    path = Path(path)
    fmt = (fmt or path.suffix.lstrip(".") or "png").lower()
    if fmt not in FORMATS:
        raise HeadlabError(f"unknown figure format {fmt!r}; use one of {', '.join(FORMATS)}")
    path = path.with_suffix(f".{fmt}")
    # encoded first, then renamed into place: a full disk never leaves a truncated figure where a good one was
    return atomic_write_bytes(path, figure_bytes(fig, fmt))


def figure_bytes(fig, fmt: str = "png") -> bytes:
    """The figure encoded as `fmt` (for run directories written atomically and for HTML embedding)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


# ---- layer x head heatmaps ------------------------------------------------------------------------------------


def grid_layout(layers: int, heads: int) -> dict:
    """Figure size, fonts and annotation choice for a layers x heads grid (legible from 2 x 2 to 80 x 64).

    Cells get up to 0.9 in of width and 0.5 in of height and shrink so the figure stays within about 13 x 12 in;
    numbers are written in the cells only when there are at most ANNOTATE_MAX_CELLS and each is tall enough.
    """
    cell_w = min(max(11.0 / heads, 0.12), 0.9)
    cell_h = min(max(10.0 / layers, 0.12), 0.5)
    annotate = layers * heads <= ANNOTATE_MAX_CELLS and cell_h >= 0.22 and cell_w >= 0.35
    return {
        "figsize": (heads * cell_w + 2.6, layers * cell_h + 1.6),
        "annotate": annotate,
        "annot_size": max(5.5, min(10.0, cell_h * 72 * 0.42)),
        "tick_size": max(8.0, min(10.0, min(cell_h, cell_w) * 72 * 0.6)),
        # Label every k-th row/column so that labels stay about 0.3 in apart at 8 pt.
        "x_step": max(1, math.ceil(0.3 / cell_w)),
        "y_step": max(1, math.ceil(0.22 / cell_h)),
    }


def _number_format(values: np.ndarray) -> str:
    finite = values[np.isfinite(values)]
    top = float(np.abs(finite).max()) if finite.size else 0.0
    return ".2f" if top < 10 else ".1f" if top < 100 else ".0f"


def colour_scale(values: np.ndarray, bounded: tuple[float, float] | None = None) -> dict:
    """Colour arguments for a heatmap: diverging around 0 only when the values take both signs (a meaningful zero),
    else sequential from 0 (non-negative values) or from the minimum; `bounded` fixes the range (e.g. probabilities)."""
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if bounded is not None:
        return {"cmap": "viridis", "vmin": bounded[0], "vmax": bounded[1]}
    if low < 0 < high:
        edge = max(-low, high)
        return {"cmap": "vlag", "center": 0.0, "vmin": -edge, "vmax": edge}
    if low >= 0:
        return {"cmap": "viridis", "vmin": 0.0, "vmax": high if high > 0 else 1.0}
    return {"cmap": "viridis_r", "vmin": low, "vmax": high}


def kv_boundaries(table: pd.DataFrame) -> dict[int, list[int]]:
    """Per layer, the head indices h where kv_head(h) != kv_head(h-1): the left edges of KV groups after the first.
    Layers where every query head has its own KV head (MHA) have no groups to mark."""
    if "kv_head" not in table:
        return {}
    edges = {}
    for layer, part in table.sort_values(["layer", "head"]).groupby("layer"):
        kv = part["kv_head"].to_numpy()
        heads = part["head"].to_numpy()
        shared = len(set(kv.tolist())) < len(kv)
        edges[int(layer)] = [int(heads[i]) for i in range(1, len(kv)) if kv[i] != kv[i - 1]] if shared else []
    return edges


def plot_head_heatmap(table: pd.DataFrame, value: str, *, title: str | None = None, bounded=None):
    """A layer x head heatmap of `value` (rows: layers, top = first), with KV-group boundaries as white vertical
    lines on GQA models (where the table's kv_head changes between neighbouring heads)."""
    for column in ("layer", "head", value):
        if column not in table:
            raise HeadlabError(f"the table has no {column!r} column")
    if table.empty:  # a 0 x 0 grid has no size to lay out
        raise HeadlabError("the table has no rows: nothing to draw")
    check_unique_heads(zip(table["layer"], table["head"]), "the table")  # pivot_table would keep the first silently
    grid = table.pivot_table(index="layer", columns="head", values=value, aggfunc="first", dropna=False)
    grid = grid.sort_index().sort_index(axis=1)
    layers, heads = grid.shape
    layout = grid_layout(layers, heads)
    _theme()
    values = grid.to_numpy(dtype=float)
    if not np.isfinite(values).any():  # an empty heatmap would look like a drawn result
        raise HeadlabError(f"column {value!r} holds no finite value (only nan/inf): nothing to draw")
    fig, ax = _subplots(figsize=layout["figsize"])
    annotate = layout["annotate"]
    sns.heatmap(
        grid,
        ax=ax,
        annot=annotate,
        fmt=_number_format(values),
        annot_kws={"size": layout["annot_size"]},
        linewidths=0.4 if annotate else 0,
        linecolor="white",
        cbar_kws={"label": label_of(value), "shrink": 0.8 if layers > 8 else 1.0},
        xticklabels=layout["x_step"],
        yticklabels=layout["y_step"],
        **colour_scale(values, bounded),
    )
    edges = kv_boundaries(table)
    shared = {tuple(e) for e in edges.values()}
    width = 2.5 if heads <= 16 else 1.2
    # White lines vanish at the white centre of a diverging map: draw them black there.
    line = "black" if colour_scale(values, bounded).get("center") is not None else "white"
    if len(shared) == 1:
        for h in next(iter(shared)):
            ax.axvline(h, color=line, linewidth=width)
    else:  # per-layer layouts (pruned models): one segment per row
        for row, layer in enumerate(grid.index):
            for h in edges.get(int(layer), []):
                ax.plot([h, h], [row, row + 1], color=line, linewidth=width)
    ax.set_xlabel("query head" + (f" ({line} lines: KV-group boundaries)" if any(edges.values()) else ""))
    ax.set_ylabel("layer")
    ax.tick_params(labelsize=layout["tick_size"])
    ax.tick_params(axis="y", rotation=0)
    ax.set_title(title or label_of(value), fontsize=12)
    fig.tight_layout()
    return fig


# Statistics that are probabilities (weights summing to at most 1 per row): one fixed [0, 1] scale would hide
# small differences, so these use the data range from 0 like the others; listed here for documentation only.
# is_positional: a 0/1 flag, already shown by positional_prev / positional_next. stream_64 stands for every window
# (the others are in the tables; `plot_head_heatmap(wide, "stream_256")` draws one).
HEATMAP_SKIP = ("is_positional", *(f"stream_{w}" for w in STREAMING_WINDOWS if w != 64))


def plot_statistic_heatmaps(wide: pd.DataFrame, model: str = "") -> dict[str, Figure]:
    """One heatmap per statistic column of a wide statistics table (stats_wide); all-NaN columns are skipped."""

    figures = {}
    patterns = [column for column in wide.columns if column.startswith("detect_")]  # stats --detect NAME
    for name in (*STATISTICS, *patterns):
        if (
            name in HEATMAP_SKIP
            or name not in wide
            or not np.isfinite(pd.to_numeric(wide[name], errors="coerce")).any()
        ):
            continue
        title = f"{model}: {label_of(name)}" if model else label_of(name)
        figures[f"heatmap_{name}"] = plot_head_heatmap(wide, name, title=title)
    return figures


def plot_importance_heatmap(importance: pd.DataFrame, model: str = "", value: str = "importance"):
    """Layer x head heatmap of head importance (importance table: layer, head, kv_head, importance, ...)."""
    title = f"{model}: head importance" if model else "head importance"
    return plot_head_heatmap(importance, value, title=title)


# ---- scatter: importance against statistics ------------------------------------------------------------------


def plot_attribution_heatmap(dla: pd.DataFrame, model: str = ""):
    """Each head's direct logit attribution (headlab.measure.attribution) at the table's last position, diverging
    around 0."""
    if dla.empty or "position" not in dla:
        raise HeadlabError("the attribution table has no rows or no 'position' column: nothing to draw")
    last = dla[dla["position"] == dla["position"].max()]
    row = last.iloc[0]
    what = f"DLA of {str(row['target'])!r} at position {int(row['position'])} ({str(row['token'])!r})"
    return plot_head_heatmap(last, "contribution", title=f"{model}: {what}" if model else what)


def plot_mean_attribution_heatmap(ranking: pd.DataFrame, model: str = ""):
    """Each head's mean direct logit attribution to the correct next token over a text's positions (the report's
    head_attribution table), diverging around 0."""
    what = "mean DLA to the correct next token"
    return plot_head_heatmap(ranking, "mean_contribution", title=f"{model}: {what}" if model else what)


def plot_patching_heatmap(patching: pd.DataFrame, model: str = ""):
    """Each head's recovered fraction under activation patching (headlab.measure.attribution): 1 = the clean run's
    logit difference, 0 = the corrupted run's."""
    what = "activation patching: recovered fraction of the logit difference"
    return plot_head_heatmap(patching, "recovered", title=f"{model}: {what}" if model else what)


def spearman(x: pd.Series, y: pd.Series) -> float:
    """Spearman's rank correlation: Pearson's r of the average ranks (ties share their mean rank); no scipy."""
    return float(np.corrcoef(x.rank().to_numpy(), y.rank().to_numpy())[0, 1])


def plot_importance_scatter(importance: pd.DataFrame, wide: pd.DataFrame, statistic: str, model: str = ""):
    """One point per head: importance against a statistic, coloured by layer, with Spearman's rank correlation."""
    data = importance[["layer", "head", "importance"]].merge(wide[["layer", "head", statistic]], on=["layer", "head"])
    data = data.dropna(subset=[statistic, "importance"])
    if data.empty:
        raise HeadlabError(f"no heads with both importance and {statistic}")
    _theme()
    fig, ax = _subplots(figsize=(7, 5))
    size = max(8.0, min(60.0, 4000.0 / len(data)))
    points = ax.scatter(
        data[statistic], data["importance"], c=data["layer"], cmap="viridis", s=size, alpha=0.8, edgecolors="none"
    )
    fig.colorbar(points, ax=ax, label="layer")
    rho = spearman(data[statistic], data["importance"])
    ax.set_xlabel(label_of(statistic))
    ax.set_ylabel(label_of("importance"))
    name = f"{model}: " if model else ""
    ax.set_title(
        f"{name}importance against {SHORT_NAMES.get(statistic, statistic.replace('_', ' '))} "
        f"(Spearman rho = {rho:.2f}, {len(data)} heads)"
    )
    ax.title.set_fontsize(10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


# ---- sweeps ----------------------------------------------------------------------------------------------------


def plot_sweep(table: pd.DataFrame, title: str | None = None):
    """Perplexity against the fraction of heads pruned, one line per order (random: mean over seeds with a band);
    Michel et al. 2019, Fig. 3. Log y when perplexities span more than 20x; the band is +-1 sd on a linear axis and
    the min-max range over seeds on a log axis (mean - sd can fall below 0, which a log axis cannot show)."""
    _theme()
    fig, ax = _subplots(figsize=(9, 4.5))
    log = table["perplexity"].max() / max(table["perplexity"].min(), 1e-9) > 20
    # sweep --compensate: plain and compensated rows of one order are different lines (solid / dashed)
    compensated = "compensation" in table and table["compensation"].nunique() > 1
    sns.lineplot(
        data=table,
        x="fraction_pruned",
        y="perplexity",
        hue="order",
        style="compensation" if compensated else "order",
        markers=True,
        dashes=compensated,
        errorbar=("pi", 100) if log else "sd",
        ax=ax,
    )
    baseline = table.loc[table["pruned_heads"] == 0, "perplexity"]
    if len(baseline):
        ax.axhline(float(baseline.iloc[0]), color="grey", linewidth=0.8, linestyle=":", label="unpruned")
    if log:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("attention heads pruned")
    ax.set_ylabel("perplexity (eval split" + (", log scale)" if log else ")"))
    ax.set_title(title or "Perplexity as heads are pruned")
    ax.grid(True, alpha=0.3)
    seeded = "seed" in table and table.groupby(["order", "fraction"])["seed"].nunique().max() > 1
    band = (" (band: min-max over seeds)" if log else " (band: +-1 sd over seeds)") if seeded else ""
    # Outside the axes: curves rise steeply towards the top left, where a legend inside would hide them.
    ax.legend(title="pruning order" + band, title_fontsize=9, frameon=True, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_sweep_tasks(table: pd.DataFrame, title: str | None = None):
    """lm-eval task metrics (sweep --tasks: "task/metric" columns) against the fraction of heads pruned, one panel
    per metric, one line per order (random: mean over seeds, band +-1 sd)."""
    metrics = [c for c in table.columns if "/" in str(c) and not str(c).endswith("_stderr")]
    if not metrics:
        raise HeadlabError("this sweep has no task metrics (run the sweep with lm-eval tasks)")
    _theme()
    fig, axes = _subplots(1, len(metrics), figsize=(4.5 * len(metrics) + 2, 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        sns.lineplot(
            data=table, x="fraction_pruned", y=metric, hue="order", style="order", markers=True, errorbar="sd", ax=ax
        )
        baseline = table.loc[table["pruned_heads"] == 0, metric]
        if len(baseline):
            ax.axhline(float(baseline.iloc[0]), color="grey", linewidth=0.8, linestyle=":", label="unpruned")
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_xlabel("attention heads pruned")
        ax.set_ylabel(metric.split("/")[1])  # the metric; the panel title names the task
        ax.set_title(metric, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend().remove()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, title="pruning order", loc="upper left", bbox_to_anchor=(1.0, 0.9), frameon=True)
    fig.suptitle(title or "lm-eval tasks as heads are pruned")
    fig.tight_layout()
    return fig


def plot_gqa_sweep(frame: pd.DataFrame, title: str = ""):
    """Perplexity against measured KV-cache KiB per token, one marker per KV-head count x grouping x pool (rows that
    repeat an earlier variant are left out: they would sit on it), MLA rows (headlab.kv.ladder) labelled by their
    latent + rope split, per-layer KV-budget rows by their fraction. Log y when perplexities span more than 10x."""
    data = frame[frame["same_as"].isna()].copy() if "same_as" in frame else frame.copy()
    data["KiB per token"] = data["kv_bytes_per_token"] / 1024
    data["grouping"] = data["grouping"].fillna(data["action"])
    # a pooling method's pool, else the method (svd, mla): one marker style per way a group becomes one head
    data["pool"] = data["pool"].fillna(data["method"] if "method" in data else "-").fillna("-")
    _theme()
    fig, ax = _subplots(figsize=(7, 4.5))
    sns.scatterplot(data=data, x="KiB per token", y="perplexity", hue="grouping", style="pool", s=90, ax=ax)
    if data["perplexity"].max() / max(data["perplexity"].min(), 1e-9) > 10:
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (eval split, log scale)")
    else:
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")  # no "+1.27e2" offset over the title
        ax.set_ylabel("perplexity (eval split)")
    ax.set_xlim(0, data["KiB per token"].max() * 1.15)
    labels = []
    for (kib, ppl), group in data.groupby(["KiB per token", "perplexity"]):
        first = group.iloc[0]
        # MLA: latent + rope; a per-layer KV budget: its fraction (and retrieval weight); rows that land on one point
        # (two weights that place the same layout) share one label
        named = first.get("action") in ("mla", "kv-budget")
        label = _shared_label(list(dict.fromkeys(group["variant"]))) if named else f"G={int(first['kv_heads'])}"
        below = first.get("action") == "mla"  # an MLA rung shares its bytes with a KV-head rung: label it below
        labels.append((kib, ppl, label, -12 if below else 4))
    ax.set_xlabel("KV-cache KiB per token (measured)")
    ax.set_title(title or "KV heads: perplexity against KV-cache size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _annotate_apart(ax, labels)  # after the layout: the spacing is in points on the final axes
    return fig


def _shared_label(variants: list[str]) -> str:
    """One label for rows on one point: the first variant, then each other one without the words it shares with the
    first from the start ("budget 0.5 retrieval x4", "budget 0.5 retrieval x16" -> "budget 0.5 retrieval x4 = x16")."""
    first = variants[0].split()
    rest = []
    for variant in variants[1:]:
        words = variant.split()
        shared = next((i for i, (a, b) in enumerate(zip(first, words)) if a != b), min(len(first), len(words)))
        rest.append(" ".join(words[shared:]) or variant)
    return " = ".join([variants[0], *rest])


def _annotate_apart(ax, labels, spacing: float = 11.0) -> None:
    """Annotate each (x, y, text, offset in points) at its point; labels that share an x and would overlap are set
    in a column `spacing` points apart, each with a thin line back to its point: budget rows at one KV size differ by
    a few perplexity points and would print over each other."""
    to_points = 72.0 / ax.figure.dpi
    for x, column in pd.DataFrame(labels, columns=["x", "y", "text", "offset"]).groupby("x"):
        y_points = [ax.transData.transform((x, y))[1] * to_points for y in column["y"]]
        rows = sorted(zip(column.itertuples(), y_points), key=lambda item: item[1])
        heights, placed = [], float("-inf")
        for row, y_point in rows:
            placed = max(y_point + row.offset, placed + spacing)
            heights.append(placed)
        # one label moved: the whole column gets leader lines, so no label reads as another point's
        crowded = any(h - y - row.offset > 1 for (row, y), h in zip(rows, heights))
        leader = {"arrowstyle": "-", "lw": 0.5, "color": "0.4"} if crowded else None
        for (row, y_point), height in zip(rows, heights):
            ax.annotate(row.text, (x, row.y), textcoords="offset points", xytext=(16 if crowded else 6, height - y_point),
                        fontsize=9, ha="left", va="center" if crowded else "baseline", arrowprops=leader)  # fmt: skip


# ---- attention-pattern gallery --------------------------------------------------------------------------------


def plot_attention_gallery(maps: pd.DataFrame, title: str = ""):
    """Attention maps of the selected heads for one sentence, tokens on the axes (query rows, key columns).

    `maps`: tidy rows `layer, head, query, key, weight, query_token, key_token, selection, importance` (as
    `headlab.reporting.report.attention_maps` writes them); one row of panels per selection (most / least important).
    The colour scale is the same fixed [0, 1] for every panel, so diffuse and sharp heads compare directly.
    """
    heads = maps[["selection", "layer", "head", "importance"]].drop_duplicates(["selection", "layer", "head"])
    selections = list(dict.fromkeys(heads["selection"]))
    columns = int(heads.groupby("selection").size().max())
    tokens = maps.drop_duplicates("key").sort_values("key")["key_token"].astype(str).tolist()
    T = len(tokens)
    panel = min(4.2, max(2.6, 0.2 * T + 0.8))
    tick = max(5.0, min(9.0, 110.0 / max(T, 1)))
    _theme()
    fig = Figure(figsize=(panel * columns + 1.4, panel * len(selections) + 1.0), layout="constrained")
    axes = fig.subplots(len(selections), columns, squeeze=False)
    image = None
    for r, selection in enumerate(selections):
        chosen = heads[heads["selection"] == selection]
        for c in range(columns):
            ax = axes[r][c]
            if c >= len(chosen):
                ax.axis("off")
                continue
            head = chosen.iloc[c]
            part = maps[(maps["layer"] == head["layer"]) & (maps["head"] == head["head"])]
            grid = np.full((T, T), np.nan)
            grid[part["query"].to_numpy(), part["key"].to_numpy()] = part["weight"].to_numpy()
            image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0, vmax=1, aspect="equal")
            ax.set_xticks(range(T), tokens, rotation=90, fontsize=tick)
            # Every panel has the same tokens: label the rows once, on the left, so labels never overlap a panel.
            ax.set_yticks(range(T), tokens if c == 0 else [], fontsize=tick)
            ax.set_title(
                f"{selection}: layer {int(head['layer'])}, head {int(head['head'])}\n"
                f"importance {float(head['importance']):.2f}",
                fontsize=9,
            )
            if c == 0:
                ax.set_ylabel("query token")
            if r == len(selections) - 1:
                ax.set_xlabel("key token")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or "Attention patterns of the most and least important heads", fontsize=12)
    return fig


MAP_CELLS = 256  # a head's map keeps at most this many rows and columns; longer texts are binned
MAP_LABELS = 48  # token labels on the axes up to this many tokens, positions beyond


def binned_map(grid: np.ndarray, cells: int = MAP_CELLS) -> tuple[np.ndarray, int]:
    """(the [T, T] map in blocks of b x b tokens, b) with b = ceil(T / cells): block (I, J) = mean over queries i in
    I of sum over keys j in J of A_ij, so each row still sums to the mass its queries give those keys."""
    T = grid.shape[0]
    b = max(1, math.ceil(T / cells))
    if b == 1:
        return grid, 1
    n = math.ceil(T / b)
    padded = np.zeros((n * b, n * b), dtype=np.float64)
    padded[:T, : grid.shape[1]] = grid
    sums = padded.reshape(n, b, n, b).sum(axis=3)  # [n, b, n]: keys summed per block
    rows = np.minimum(b, T - np.arange(n) * b)  # real queries per row block (the last may be short)
    return sums.sum(axis=1) / rows[:, None], b


def plot_attention_map(grid: np.ndarray, tokens: list[str], *, title: str = "", note: str = "") -> Figure:
    """One head's attention map (query rows, key columns; `grid` [T, T], e.g. headlab.viz.viewer.dense_map of its
    top-k keys), tokens on the axes up to MAP_LABELS tokens, binned by binned_map beyond MAP_CELLS."""
    grid = np.asarray(grid, dtype=np.float64)
    T = len(tokens)
    if T == 0 or grid.shape != (T, T):
        raise HeadlabError(f"an attention map of {grid.shape} does not match {T} tokens")
    shown, b = binned_map(grid)
    n = shown.shape[0]
    _theme()
    side = min(9.0, max(4.0, 0.16 * n + 1.8))
    fig, ax = _subplots(figsize=(side + 1.2, side))
    masked = np.triu(np.ones_like(shown, dtype=bool), 1) & (shown == 0)  # the causal future: blank, not 0
    labels = [repr(t)[1:-1] for t in tokens] if T <= MAP_LABELS else "auto"
    sns.heatmap(
        shown,
        ax=ax,
        mask=masked if b == 1 else None,
        cmap="rocket_r",
        vmin=0,
        vmax=max(float(shown.max()), 1e-6),
        square=True,
        xticklabels=labels,
        yticklabels=labels,
        cbar_kws={"label": "attention weight" if b == 1 else f"attention mass per {b} x {b} block", "shrink": 0.8},
    )
    if labels == "auto":  # tick labels are block indices: show token positions instead
        ax.set_xticklabels([str(int(float(t.get_text())) * b) for t in ax.get_xticklabels()], rotation=90)
        ax.set_yticklabels([str(int(float(t.get_text())) * b) for t in ax.get_yticklabels()], rotation=0)
    else:
        ax.tick_params(axis="both", labelsize=max(5.0, min(9.0, 300.0 / max(T, 1))))
    ax.set_xlabel("key token" if b == 1 else "key position")
    ax.set_ylabel("query token" if b == 1 else "query position")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    fig.tight_layout()
    return fig


# ---- GQA grouping ----------------------------------------------------------------------------------------------


def query_groups(groups: pd.DataFrame, query_heads: int) -> pd.DataFrame:
    """Expand a KV-head grouping table (layer, kv_head, new_kv_head; gqa.Conversion.groups_table) to one row per
    query head: layer, head, kv_head (read before), new_kv_head (read after). repeat_kv: head h reads KV head
    h // (H / G) before conversion, and after it the group its KV head was pooled into."""
    if "head" in groups:
        return groups
    rows = []
    for layer, part in groups.groupby("layer"):
        mapping = dict(zip(part["kv_head"], part["new_kv_head"]))
        G = len(mapping)
        if query_heads % G:
            raise HeadlabError(f"{query_heads} query heads do not divide into {G} KV heads")
        r = query_heads // G
        rows += [(int(layer), h, h // r, int(mapping[h // r])) for h in range(query_heads)]
    return pd.DataFrame(rows, columns=["layer", "head", "kv_head", "new_kv_head"])


def _kv_count(column: pd.Series) -> str:
    n = int(column.nunique())
    return f"{n} KV head" + ("" if n == 1 else "s")


def plot_grouping(groups: pd.DataFrame, *, query_heads: int | None = None, title: str = "", after_label: str = ""):
    """Which query heads share which KV head, before (left) and after (right) a KV-head conversion: layer x query
    head grids coloured by the KV head each query head reads (numbered in the cells on small grids)."""
    if "head" not in groups:
        if query_heads is None:
            raise HeadlabError("the grouping table has no head column; pass query_heads")
        groups = query_groups(groups, query_heads)
    before = groups.pivot(index="layer", columns="head", values="kv_head").sort_index()
    after = groups.pivot(index="layer", columns="head", values="new_kv_head").sort_index()
    layers, heads = before.shape
    layout = grid_layout(layers, heads)
    # Narrower cells than a statistics heatmap: two panels side by side, numbers of one digit or two.
    panel = min(heads * 0.5, 7.0) + 1.8
    _theme()
    fig, axes = _subplots(1, 2, figsize=(2 * panel, layout["figsize"][1] + 0.3), sharey=True)
    for ax, grid, name in (
        (axes[0], before, f"before: {_kv_count(groups['kv_head'])}"),
        (axes[1], after, after_label or f"after: {_kv_count(groups['new_kv_head'])}"),
    ):
        count = int(np.nanmax(grid.to_numpy())) + 1
        palette = ListedColormap(sns.color_palette("tab10" if count <= 10 else "husl", count))
        sns.heatmap(
            grid,
            ax=ax,
            cmap=palette,
            vmin=-0.5,
            vmax=count - 0.5,
            annot=layout["annotate"],
            fmt=".0f",
            annot_kws={"size": layout["annot_size"]},
            linewidths=0.4 if layout["annotate"] else 0,
            linecolor="white",
            cbar=count <= 16,
            cbar_kws={"label": "KV head read", "ticks": list(range(count))},
            xticklabels=layout["x_step"],
            yticklabels=layout["y_step"],
        )
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("query head (original index)")
        ax.set_ylabel("layer" if ax is axes[0] else "")
        ax.tick_params(labelsize=layout["tick_size"])
        ax.tick_params(axis="y", rotation=0)
    fig.suptitle(title or "Which query heads share which KV head", fontsize=12)
    fig.tight_layout()
    return fig


# ---- recovery ------------------------------------------------------------------------------------------------------


def plot_recovery_curve(curve: pd.DataFrame, title: str = "") -> Figure:
    """Uptraining: held-out calibration perplexity (chooses the state kept) and eval-split perplexity (report only)
    against the step (left axis), the training loss per step (right axis); from recovery/curve.csv."""
    _theme()
    fig, ax = _subplots(figsize=(7, 4.5))
    values = []
    for column, label, color in (
        ("heldout_perplexity", "held-out calibration perplexity (chooses the state kept)", "tab:blue"),
        ("perplexity", "eval-split perplexity (report only)", "tab:green"),
    ):
        points = curve.dropna(subset=[column]) if column in curve else curve.iloc[:0]
        if len(points):
            sns.lineplot(x=points["step"], y=points[column], marker="o", label=label, color=color, ax=ax)
            values += points[column].tolist()
    ax.set_xlabel("step")
    ax.set_ylabel("perplexity")
    if values and max(values) / max(min(values), 1e-9) > 20:
        ax.set_yscale("log")
    trained = curve.dropna(subset=["loss"]) if "loss" in curve else curve.iloc[:0]
    if len(trained):
        right = ax.twinx()
        right.plot(trained["step"], trained["loss"], color="tab:orange", alpha=0.35, lw=1, label="training loss (step)")
        right.set_ylabel("training loss (nats / token)")
        right.grid(False)
        ax.set_zorder(right.get_zorder() + 1)  # the perplexity points in front of the noisy per-step loss
        ax.patch.set_visible(False)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    ax.set_title(title or "uptraining towards the original")
    return fig


# ---- long context (headlab.measure.longctx tables) ------------------------------------------------------------


def plot_needle_heatmap(cells: pd.DataFrame, title: str = "") -> Figure:
    """Accuracy (share of prompts answered exactly) per length (rows) x depth (columns), one panel per task; each
    cell is annotated "correct/prompts". Several models at one length: one row per model (in table order) instead,
    so rungs compare at a glance; several models and lengths: a panel per model and task."""
    if cells.empty or not {"task", "length", "depth", "accuracy"} <= set(cells.columns):
        raise HeadlabError("the cells table needs task, length, depth and accuracy columns and at least one row")
    models = list(dict.fromkeys(cells["model"])) if "model" in cells else []
    by_model = len(models) > 1 and cells["length"].nunique() == 1
    keys = ["model", "task"] if len(models) > 1 and not by_model else ["task"]
    rows, order = ("model", models) if by_model else ("length", sorted(cells["length"].unique()))
    panels = list(dict.fromkeys(map(tuple, cells[keys].to_numpy())))
    _theme()
    height = 1.6 + 0.45 * len(order) if by_model else 3.6
    fig, axes = _subplots(1, len(panels), figsize=(1.2 + 4.2 * len(panels) + 2.5 * by_model, height), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        part = cells[np.logical_and.reduce([cells[key] == value for key, value in zip(keys, panel)])]
        grid = part.pivot_table(index=rows, columns="depth", values="accuracy", aggfunc="mean")
        notes = part.assign(
            note=part["correct"].astype(int).astype(str) + "/" + part["prompts"].astype(int).astype(str)
        )
        labels = notes.pivot_table(index=rows, columns="depth", values="note", aggfunc="first", sort=False)
        grid = grid.reindex([r for r in order if r in grid.index])
        sns.heatmap(grid, vmin=0, vmax=1, cmap="RdYlGn", annot=labels.loc[grid.index, grid.columns].to_numpy(),
                    fmt="", cbar=ax is axes[0][-1], cbar_kws={"label": "accuracy"}, ax=ax, linewidths=0.5,
                    yticklabels=ax is axes[0][0] or not by_model)  # fmt: skip
        ax.set_xticklabels([f"{float(t.get_text()):.0%}" for t in ax.get_xticklabels()])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("" if by_model else "context length (tokens)")
        length = f" @ {int(cells['length'].iloc[0]):,} tokens" if by_model else ""
        ax.set_title(": ".join(str(k) for k in panel) + length)
    fig.suptitle(title or "long-context retrieval (exact match)")
    fig.tight_layout()
    return fig


def plot_kv_trade(trade: pd.DataFrame, title: str = "") -> Figure:
    """Quality against the KV cache kept, one point per method (`model`): a panel per retrieval task (accuracy) and,
    where the table has it, one for the NLL of a position bucket. `trade`: columns model, kv_kept, task, accuracy
    (one row per model and task) and optionally nll (and bucket, its label)."""
    if trade.empty or not {"model", "kv_kept", "task", "accuracy"} <= set(trade.columns):
        raise HeadlabError("the trade table needs model, kv_kept, task and accuracy columns and at least one row")
    tasks = list(dict.fromkeys(trade["task"]))
    with_nll = "nll" in trade and trade["nll"].notna().any()
    panels = len(tasks) + int(with_nll)
    models = list(dict.fromkeys(trade["model"]))
    _theme()
    fig, axes = _subplots(1, panels, figsize=(1.0 + 3.6 * panels, 3.6 + 0.25 * len(models)), squeeze=False)
    palette = dict(zip(models, sns.color_palette("tab10", len(models))))
    markers = dict(zip(models, "osD^vP*Xhp"))
    for ax, task in zip(axes[0], tasks):
        part = trade[trade["task"] == task]
        sns.scatterplot(data=part, x="kv_kept", y="accuracy", hue="model", style="model", palette=palette,
                        markers=markers, s=90, ax=ax, legend=False)  # fmt: skip
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task)
        ax.set_ylabel("accuracy (exact match)")
    if with_nll:
        ax = axes[0][-1]
        first = trade.drop_duplicates("model")
        sns.scatterplot(data=first, x="kv_kept", y="nll", hue="model", style="model", palette=palette,
                        markers=markers, s=90, ax=ax, legend=False)  # fmt: skip
        ax.set_title("NLL" + (f" at positions {first['bucket'].iloc[0]}" if "bucket" in first else ""))
        ax.set_ylabel("mean NLL (nats / token)")
    for ax in axes[0]:
        ax.set_xlabel("KV cache kept (of the original's)")
        ax.set_xlim(0, 1.05)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    handles = [Line2D([], [], marker=markers[m], color=palette[m], linestyle="", markersize=8) for m in models]
    fig.legend(handles, models, loc="lower center", ncol=min(3, len(models)), frameon=False)
    fig.suptitle(title or "quality against the KV cache kept")
    fig.tight_layout(rect=(0, 0.06 + 0.05 * ((len(models) - 1) // 3 + 1), 1, 1))
    return fig


def plot_position_nll(curve: pd.DataFrame, title: str = "") -> Figure:
    """Mean NLL of the tokens at each position bin (x: the bin's first position), one line per `model` when the
    table has that column: how well each model uses context further back."""
    if curve.empty or not {"start", "nll"} <= set(curve.columns):
        raise HeadlabError("the position curve needs start and nll columns and at least one row")
    _theme()
    fig, ax = _subplots(figsize=(7, 4.2))
    hue = "model" if "model" in curve and curve["model"].nunique() > 1 else None
    sns.lineplot(data=curve, x="start", y="nll", hue=hue, marker="." if len(curve) < 200 else None, ax=ax)
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel("mean NLL (nats / token)")
    ax.set_title(title or "NLL by position")
    return fig


# ---- a whole run directory -------------------------------------------------------------------------------------


def plot_speed(table: pd.DataFrame, title: str = ""):
    """Decode tokens/s against context (log-log), one panel per batch size, colour = model, style = runtime."""
    _theme()
    grid = sns.relplot(
        data=table,
        x="context",
        y="decode_tokens_per_s",
        hue="model",
        style="runtime",
        col="batch",
        kind="line",
        markers=True,
        dashes=True,
        height=3.6,
        aspect=1.15,
        facet_kws={"sharey": False},
    )
    for ax in grid.axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # plain numbers (15, 16, 20), not 1.5 x 10^1: a panel often spans less than a decade
        ax.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
        ax.set_xticks(sorted(table["context"].unique()))
        ax.set_xticklabels([f"{c:,}" for c in sorted(table["context"].unique())])
    grid.set_axis_labels("context (tokens in the KV cache)", "decode tokens/s (all sequences)")
    if title:
        grid.figure.suptitle(title, y=1.03)
    return grid.figure


# Columns each saved table must hold as numbers where present (a text cell would fail deep inside seaborn).
HEAD_COLUMNS = ("layer", "head", "kv_head")
IMPORTANCE_COLUMNS = (*HEAD_COLUMNS, "importance", "importance_raw")
SWEEP_COLUMNS = ("fraction", "fraction_pruned", "perplexity", "pruned_heads", "seed", "kv_heads", "kv_bytes_per_token")


def _find(run_dir: Path, name: str) -> Path | None:
    """`name` in run_dir or one level below (a report keeps each step in its own subdirectory)."""
    for candidate in [run_dir / name, *sorted(run_dir.glob(f"*/{name}"))]:
        if candidate.is_file():
            return candidate
    return None


def _read(
    path: Path | None, numeric: tuple[str, ...] = (), *, rows: bool = False, per_head: bool = False
) -> pd.DataFrame | None:
    """A saved table (its .parquet twin when there is one), checked before anything is drawn from it: `numeric`
    columns (where present) hold numbers, `rows` asks for at least one row (a header-only table would draw an empty
    or broken figure), `per_head` asks for each (layer, head) once (the check prune's score reader makes)."""
    if path is None:
        return None
    parquet = path.with_suffix(".parquet")
    read = parquet if parquet.is_file() else path
    try:
        table = pd.read_parquet(read) if read is parquet else pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read table {read}: {str(error).splitlines()[0]}") from None
    if rows and table.empty:
        raise HeadlabError(f"table {read} has no rows (a header only): nothing to draw")
    for column in (c for c in numeric if c in table.columns):
        values = table[column]
        if pd.api.types.is_numeric_dtype(values):
            continue
        bad = values[pd.to_numeric(values, errors="coerce").isna() & values.notna()]
        if len(bad):
            # a CSV line counts the header as line 1; a parquet file has rows from 0
            where = f"line {bad.index[0] + 2}" if read is path else f"row {bad.index[0]}"
            raise HeadlabError(f"table {read}: column {column!r} holds {bad.iloc[0]!r} ({where}), not a number")
    if per_head and {"layer", "head"} <= set(table.columns):
        check_unique_heads(zip(table["layer"], table["head"]), f"table {read}")
    return table


def _model_name(run_dir: Path) -> str:
    for meta in [run_dir / "meta.json", *sorted(run_dir.glob("*/meta.json"))]:
        if meta.is_file():
            model = json.loads(meta.read_text()).get("model")
            if model:
                return str(model)
    return ""


def run_figures(run_dir) -> dict[str, Figure]:
    """Every figure the saved tables of `run_dir` (or its subdirectories) allow, by file name stem."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise HeadlabError(f"no such run directory: {run_dir}")
    model = _model_name(run_dir)
    wide = _read(_find(run_dir, "stats_wide.csv"), (*HEAD_COLUMNS, *STATISTICS), rows=True, per_head=True)
    importance = _read(_find(run_dir, "importance.csv"), IMPORTANCE_COLUMNS, rows=True, per_head=True)
    dla = _read(_find(run_dir, "dla.csv"), (*HEAD_COLUMNS, "position", "contribution"), rows=True)
    patching = _read(_find(run_dir, "patching.csv"), (*HEAD_COLUMNS, "patched", "recovered"), rows=True, per_head=True)
    ranking = _read(_find(run_dir, "head_attribution.csv"), (*HEAD_COLUMNS, "mean_contribution"), rows=True,
                    per_head=True)  # fmt: skip
    figures: dict[str, Figure] = {}
    if dla is not None:
        figures["dla"] = plot_attribution_heatmap(dla, model)
    if ranking is not None:
        figures["dla_mean"] = plot_mean_attribution_heatmap(ranking, model)
    if patching is not None:
        figures["patching"] = plot_patching_heatmap(patching, model)
    if wide is not None:
        figures.update(plot_statistic_heatmaps(wide, model))
    if importance is not None:
        figures["heatmap_importance"] = plot_importance_heatmap(importance, model)
    if wide is not None and importance is not None:
        for statistic in ("entropy", "sink_first"):
            if statistic in wide and not wide[statistic].isna().all():
                figures[f"importance_vs_{statistic}"] = plot_importance_scatter(importance, wide, statistic, model)
    sweeps = [run_dir / "sweep.csv", *sorted(run_dir.glob("*/sweep.csv"))]
    for path in sweeps:
        table = _read(path, SWEEP_COLUMNS, rows=True) if path.is_file() else None
        if table is None:
            continue
        if "order" in table:
            figures["sweep"] = plot_sweep(table, f"{model}: perplexity as heads are pruned" if model else None)
            if any("/" in str(c) and not str(c).endswith("_stderr") for c in table.columns):  # sweep --tasks
                title = f"{model}: lm-eval tasks as heads are pruned" if model else None
                figures["sweep_tasks"] = plot_sweep_tasks(table, title)
        elif "kv_heads" in table:
            figures["gqa_sweep"] = plot_gqa_sweep(table, f"{model}: perplexity against KV-cache size" if model else "")
    maps = _read(_find(run_dir, "attention_maps.csv"), (*HEAD_COLUMNS, "query", "key", "weight", "importance"))
    if maps is not None and len(maps):
        figures["attention_gallery"] = plot_attention_gallery(maps, f"{model}: attention patterns" if model else "")
    speed = _read(_find(run_dir, "speed.csv"), ("context", "decode_tokens_per_s", "batch"))
    if speed is not None and len(speed):
        figures["speed"] = plot_speed(speed, f"{model}: decode speed with a KV cache" if model else "")
    groups = _read(_find(run_dir, "gqa_groups.csv"), (*HEAD_COLUMNS, "new_kv_head"))
    if groups is not None and len(groups):
        label = ""
        if "grouping" in groups:
            label = f"after: {_kv_count(groups['new_kv_head'])} ({groups['grouping'].iloc[0]} grouping)"
        figures["gqa_grouping"] = plot_grouping(
            groups, title=f"{model}: query heads sharing KV heads", after_label=label
        )
    cells = _read(_find(run_dir, "cells.csv"), ("length", "depth", "accuracy", "correct", "prompts"))
    if cells is not None and "depth" in cells and len(cells):
        figures["needle_heatmap"] = plot_needle_heatmap(cells, f"{model}: retrieval" if model else "")
    kept = _read(_find(run_dir, "kv_kept.csv"), ("kv_kept",))
    lengths = _read(_find(run_dir, "lengths.csv"), ("length", "accuracy"))
    if kept is not None and lengths is not None and len(kept) and "model" in lengths and len(lengths):
        longest = lengths[lengths["length"] == lengths["length"].max()]
        trade = longest.merge(kept[["model", "kv_kept"]], on="model")
        if len(trade):
            title = f"{model}: retrieval at {int(longest['length'].iloc[0]):,} tokens against the KV cache kept"
            figures["kv_trade"] = plot_kv_trade(trade, title if model else "")
    positions = _read(_find(run_dir, "position_curve.csv"), ("start", "nll"))
    if positions is not None and len(positions):
        figures["position_nll"] = plot_position_nll(positions, f"{model}: NLL by position" if model else "")
    curve = _read(_find(run_dir, "curve.csv"), ("step", "heldout_perplexity", "perplexity", "loss"))
    if curve is not None and "heldout_perplexity" in curve:
        figures["recovery_curve"] = plot_recovery_curve(curve, f"{model}: recovery (uptraining)" if model else "")
    if not figures:
        raise HeadlabError(
            f"{run_dir} holds no table headlab can draw (stats_wide, importance, dla, patching, sweep, attention_maps, "
            "gqa_groups, cells, position_curve)"
        )
    return figures


def plot_run(run_dir, out=None, fmt: str = "png") -> list[Path]:
    """Redraw every figure of a run directory from its saved tables (no model); written to `out` (default
    RUN_DIR/figures) as `fmt`. Returns the files written."""
    if fmt not in FORMATS:
        raise HeadlabError(f"unknown figure format {fmt!r}; use one of {', '.join(FORMATS)}")
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "figures"
    return [save_figure(fig, out / f"{name}.{fmt}", fmt) for name, fig in run_figures(run_dir).items()]


# ---- studies over several models -------------------------------------------------------------------------------


def plot_study(table: pd.DataFrame, x: str, xlabel: str, style: str | None = None, title: str = ""):
    """Perplexity relative to each model's own baseline against `x`, one colour per model (scripts/*_study.py):
    models of different sizes compare on one scale. Log y when the ratios span more than 20x."""
    _theme()
    fig, ax = _subplots(figsize=(7.5, 4.8))
    sns.lineplot(
        data=table,
        x=x,
        y="relative_perplexity",
        hue="model",
        style=style,
        markers=True,
        dashes=False,
        errorbar="sd",
        ax=ax,
    )
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    log = table["relative_perplexity"].max() / max(table["relative_perplexity"].min(), 1e-9) > 20
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("perplexity / the model's own" + (" (log scale)" if log else ""))
    ax.set_title(title or "Perplexity relative to the unchanged model")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig
