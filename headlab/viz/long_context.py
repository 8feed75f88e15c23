"""Long-context figures: the needle heatmap (accuracy per context length x needle depth) and NLL by position, one
line per model; from the tables of headlab.measure.longctx (cells.csv, position_curve.csv)."""

from __future__ import annotations

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from headlab.core.errors import HeadlabError
from headlab.viz.plots import _subplots, _theme


def plot_needle_heatmap(cells: pd.DataFrame, title: str = "") -> Figure:
    """Accuracy (share of prompts answered exactly) per length (rows) x depth (columns), one panel per task; each
    cell is annotated "correct/prompts"."""
    if cells.empty or not {"task", "length", "depth", "accuracy"} <= set(cells.columns):
        raise HeadlabError("the cells table needs task, length, depth and accuracy columns and at least one row")
    tasks = list(dict.fromkeys(cells["task"]))
    _theme()
    fig, axes = _subplots(1, len(tasks), figsize=(1.2 + 4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        part = cells[cells["task"] == task]
        grid = part.pivot_table(index="length", columns="depth", values="accuracy", aggfunc="mean")
        notes = part.assign(
            note=part["correct"].astype(int).astype(str) + "/" + part["prompts"].astype(int).astype(str)
        )
        labels = notes.pivot_table(index="length", columns="depth", values="note", aggfunc="first")
        sns.heatmap(grid, vmin=0, vmax=1, cmap="RdYlGn", annot=labels.loc[grid.index, grid.columns].to_numpy(),
                    fmt="", cbar=ax is axes[0][-1], cbar_kws={"label": "accuracy"}, ax=ax, linewidths=0.5)  # fmt: skip
        ax.set_xticklabels([f"{float(t.get_text()):.0%}" for t in ax.get_xticklabels()])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context length (tokens)")
        ax.set_title(task)
    fig.suptitle(title or "long-context retrieval (exact match)")
    fig.tight_layout()
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


__all__ = ["plot_needle_heatmap", "plot_position_nll"]
