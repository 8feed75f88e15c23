"""Figures from small hand-made tables: each renders, is sized to its grid, carries the expected labels (read back from
the matplotlib Figure), and `headlab plot` redraws a saved run directory without a model."""

from __future__ import annotations

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from tiny_text import run_cli

from headlab.core.errors import HeadlabError
from headlab.viz import plots


def wide_table(layers: int, heads: int, kv_heads: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    r = heads // kv_heads
    rows = [(la, h, h // r) for la in range(layers) for h in range(heads)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "kv_head"])
    n = len(frame)
    frame["entropy"] = rng.uniform(0, 4, n)
    frame["sink_first"] = rng.uniform(0, 1, n)
    frame["is_positional"] = False
    frame["cls_share"] = np.nan  # causal models: n/a
    return frame


def importance_table(wide: pd.DataFrame, seed: int = 1) -> pd.DataFrame:
    frame = wide[["layer", "head", "kv_head"]].copy()
    frame["importance"] = np.random.default_rng(seed).uniform(0, 1, len(frame))
    frame["rank"] = frame["importance"].rank(ascending=False, method="first").astype(int)
    return frame


def png_size(path) -> tuple[int, int]:
    image = matplotlib.image.imread(path)
    return image.shape[1], image.shape[0]


def vertical_lines(ax) -> list[float]:
    return sorted(float(line.get_xdata()[0]) for line in ax.lines if len(set(line.get_xdata())) == 1)


def test_small_heatmap_has_numbers_labels_and_kv_lines(tmp_path):
    wide = wide_table(6, 12, 4)
    fig = plots.plot_head_heatmap(wide, "entropy", title="entropy")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("query head") and "KV-group" in ax.get_xlabel()
    assert ax.get_ylabel() == "layer" and ax.get_title() == "entropy"
    assert fig.axes[1].get_ylabel() == plots.label_of("entropy")  # the colour bar
    assert len(ax.texts) == 6 * 12  # every cell annotated on a small grid
    assert vertical_lines(ax) == [3.0, 6.0, 9.0]  # groups of 3 query heads
    width, height = fig.get_size_inches()
    path = plots.save_figure(fig, tmp_path / "h.png")
    pixels = png_size(path)
    assert abs(pixels[0] - width * plots.DPI) < 0.25 * width * plots.DPI
    assert abs(pixels[1] - height * plots.DPI) < 0.25 * height * plots.DPI


def test_large_heatmap_scales_and_drops_numbers():
    small = plots.plot_head_heatmap(wide_table(6, 12, 4), "entropy")
    large = plots.plot_head_heatmap(wide_table(80, 64, 8), "entropy")
    assert len(large.axes[0].texts) == 0
    assert large.get_size_inches()[1] > small.get_size_inches()[1]
    assert max(large.get_size_inches()) <= 16
    # Tick labels thinned so they stay readable, at 8 pt or more.
    labels = [t for t in large.axes[0].get_yticklabels() if t.get_text()]
    assert 10 <= len(labels) < 80 and min(t.get_fontsize() for t in labels) >= 8
    assert vertical_lines(large.axes[0]) == [8.0 * i for i in range(1, 8)]


def test_mha_has_no_kv_lines_and_per_layer_layouts_get_segments():
    mha = wide_table(2, 4, 4)
    fig = plots.plot_head_heatmap(mha, "entropy")
    assert vertical_lines(fig.axes[0]) == [] and "KV" not in fig.axes[0].get_xlabel()
    pruned = wide_table(2, 4, 2)
    pruned.loc[pruned["layer"] == 1, "kv_head"] = [0, 1, 1, 1]  # layer 1 has another layout
    assert plots.kv_boundaries(pruned) == {0: [2], 1: [1]}
    ax = plots.plot_head_heatmap(pruned, "entropy").axes[0]
    segments = sorted((tuple(line.get_xdata()), tuple(line.get_ydata())) for line in ax.lines)
    assert segments == [((1, 1), (1, 2)), ((2, 2), (0, 1))]


def test_colour_scale_is_diverging_only_around_a_meaningful_zero():
    signed = plots.colour_scale(np.array([-2.0, 0.5, 1.0]))
    assert signed["center"] == 0 and signed["vmin"] == -2 and signed["vmax"] == 2
    positive = plots.colour_scale(np.array([0.2, 0.5, np.nan]))
    assert "center" not in positive and positive["vmin"] == 0 and positive["vmax"] == 0.5
    assert plots.colour_scale(np.array([0.2]), bounded=(0, 1))["vmax"] == 1


def test_statistic_heatmaps_skip_flags_and_empty_columns():
    figures = plots.plot_statistic_heatmaps(wide_table(2, 4, 2), "tiny")
    assert set(figures) == {"heatmap_entropy", "heatmap_sink_first"}
    assert figures["heatmap_entropy"].axes[0].get_title() == "tiny: " + plots.label_of("entropy")


def test_statistic_heatmaps_draw_detection_patterns():
    """stats --detect NAME adds a column detect_NAME: it gets a heatmap like the built-in statistics."""
    wide = wide_table(2, 4, 2).assign(detect_diagonal=np.linspace(0, 1, 8), detect_empty=np.nan)
    figures = plots.plot_statistic_heatmaps(wide)
    assert "heatmap_detect_diagonal" in figures and "heatmap_detect_empty" not in figures
    grid = figures["heatmap_detect_diagonal"].axes[0].collections[0].get_array()
    assert np.allclose(np.asarray(grid).reshape(2, 4), np.linspace(0, 1, 8).reshape(2, 4))


def test_spearman_matches_a_hand_computed_case():
    # ranks x: 1 2 3 4, y: 1 3 2 4 -> d^2 sum 2 -> rho = 1 - 6*2/(4*15) = 0.8
    assert plots.spearman(pd.Series([10, 20, 30, 40]), pd.Series([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)


def test_importance_scatter():
    wide = wide_table(3, 4, 2)
    importance = importance_table(wide)
    fig = plots.plot_importance_scatter(importance, wide, "sink_first", "tiny")
    ax = fig.axes[0]
    assert ax.get_xlabel() == plots.label_of("sink_first") and ax.get_ylabel() == plots.label_of("importance")
    assert len(ax.collections[0].get_offsets()) == 12  # one point per head
    rho = plots.spearman(wide["sink_first"], importance["importance"])
    assert f"rho = {rho:.2f}" in ax.get_title()
    assert fig.axes[1].get_ylabel() == "layer"


def sweep_table() -> pd.DataFrame:
    rows = []
    for order, seed, ppl in (
        ("importance", None, [10, 11, 14]),
        ("random", 0, [10, 13, 30]),
        ("random", 1, [10, 15, 40]),
    ):
        for f, p in zip([0.0, 0.25, 0.5], ppl):
            rows.append(
                {"order": order, "seed": seed, "fraction": f, "fraction_pruned": f, "pruned_heads": int(f * 8)}
                | {"perplexity": p, "parameters": 100 - 10 * f, "kv_bytes_per_token": 64, "tokens_per_s": 5.0}
            )
    return pd.DataFrame(rows)


def test_pruning_sweep_plot():
    fig = plots.plot_sweep(sweep_table(), "tiny")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "attention heads pruned" and ax.get_ylabel() == "perplexity (eval split)"
    assert ax.get_yscale() == "linear"  # 10..40: under the 20x threshold
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"importance", "random", "unpruned"}
    table = sweep_table()
    table.loc[table["fraction"] == 0.5, "perplexity"] *= 10
    assert plots.plot_sweep(table).axes[0].get_yscale() == "log"


def gqa_table() -> pd.DataFrame:
    rows = [
        ("4/expand/-", 4, "expand", None, None, 10.0, 1024, None),
        ("2/keep/-", 2, "keep", None, None, 10.0, 512, None),
        ("1/contiguous/mean", 1, "pool", "contiguous", "mean", 12.0, 256, None),
        ("1/similarity/mean", 1, "pool", "similarity", "mean", 12.0, 256, "1/contiguous/mean"),
    ]
    columns = ["variant", "kv_heads", "action", "grouping", "pool", "perplexity", "kv_bytes_per_token", "same_as"]
    return pd.DataFrame(rows, columns=columns)


def test_gqa_sweep_plot_leaves_out_repeated_variants():
    fig = plots.plot_gqa_sweep(gqa_table(), "tiny")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "KV-cache KiB per token (measured)" and ax.get_ylabel().startswith("perplexity")
    assert sum(len(c.get_offsets()) for c in ax.collections) == 3
    assert sorted(t.get_text() for t in ax.texts) == ["G=1", "G=2", "G=4"]


def test_gqa_sweep_plot_keeps_budget_labels_apart_and_joins_rows_on_one_point():
    budget = [
        (f"budget 0.5 retrieval x{w:g}" if w else "budget 0.5", 1.5, "kv-budget", "per-layer", None, ppl, 384, None)
        for w, ppl in ((0, 76.9), (1, 82.9), (4, 84.3), (16, 84.3))
    ]
    columns = ["variant", "kv_heads", "action", "grouping", "pool", "perplexity", "kv_bytes_per_token", "same_as"]
    fig = plots.plot_gqa_sweep(pd.concat([gqa_table(), pd.DataFrame(budget, columns=columns)]), "tiny")
    ax = fig.axes[0]
    texts = {t.get_text(): t for t in ax.texts if t.get_text().startswith("budget")}
    assert sorted(texts) == ["budget 0.5", "budget 0.5 retrieval x1", "budget 0.5 retrieval x4 = x16"]
    fig.canvas.draw()
    # each label's baseline in points, bottom to top: its point's height plus its offset (xyann, in points)
    heights = sorted(ax.transData.transform(t.xy)[1] * 72 / fig.dpi + t.xyann[1] for t in texts.values())
    assert all(upper - lower >= 11 - 1e-6 for lower, upper in zip(heights, heights[1:]))


def maps_table(tokens=("<s>", "a", "b")) -> pd.DataFrame:
    rows = []
    T = len(tokens)
    for selection, layer, head, importance in (("most important", 0, 1, 1.0), ("least important", 1, 0, 0.0)):
        for i in range(T):
            for j in range(i + 1):
                rows.append((selection, layer, head, importance, i, j, 1.0 / (i + 1), tokens[i], tokens[j]))
    columns = ["selection", "layer", "head", "importance", "query", "key", "weight", "query_token", "key_token"]
    return pd.DataFrame(rows, columns=columns)


def test_attention_gallery_has_one_panel_per_head_with_tokens():
    fig = plots.plot_attention_gallery(maps_table(), "tiny")
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 2
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["<s>", "a", "b"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["<s>", "a", "b"]
    assert panels[0].get_title().startswith("most important: layer 0, head 1")
    image = panels[0].images[0]
    assert image.get_clim() == (0, 1)
    grid = image.get_array()
    assert grid[2, 0] == pytest.approx(1 / 3) and bool(np.ma.is_masked(grid[0, 2]))  # future keys left blank
    assert fig.axes[-1].get_ylabel() == "attention weight"


def test_query_groups_follow_repeat_kv_and_the_new_groups():
    # 8 query heads, 4 KV heads pooled as {0, 2} -> 0 and {1, 3} -> 1.
    groups = pd.DataFrame({"layer": 0, "kv_head": [0, 2, 1, 3], "new_kv_head": [0, 0, 1, 1]})
    table = plots.query_groups(groups, 8)
    assert table["kv_head"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert table["new_kv_head"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(HeadlabError):
        plots.query_groups(groups, 6)
    fig = plots.plot_grouping(groups, query_heads=8, title="t")
    left, right = (ax for ax in fig.axes if ax.get_title())
    assert left.get_title() == "before: 4 KV heads" and right.get_title() == "after: 2 KV heads"
    assert [t.get_text() for t in right.texts] == ["0", "0", "1", "1", "0", "0", "1", "1"]


def write_run_dir(root):
    from headlab.core.tables import write_run

    wide = wide_table(2, 4, 2)
    write_run(root / "stats", {"stats_wide": wide}, {"model": "tiny"})
    write_run(root / "importance", {"importance": importance_table(wide)}, {"model": "tiny"})
    write_run(root / "sweep", {"sweep": sweep_table()}, {"model": "tiny"})
    write_run(root / "gqa_sweep", {"sweep": gqa_table()}, {"model": "tiny"})
    write_run(root / "attention", {"attention_maps": maps_table()}, {"model": "tiny"})
    groups = plots.query_groups(pd.DataFrame({"layer": [0, 0], "kv_head": [0, 1], "new_kv_head": [0, 0]}), 4)
    write_run(root / "gqa_groups", {"gqa_groups": groups}, {"model": "tiny"})
    return root


EXPECTED = {
    "heatmap_entropy",
    "heatmap_sink_first",
    "heatmap_importance",
    "importance_vs_entropy",
    "importance_vs_sink_first",
    "sweep",
    "gqa_sweep",
    "attention_gallery",
    "gqa_grouping",
}


def test_plot_run_redraws_every_figure(tmp_path):
    run = write_run_dir(tmp_path / "run")
    written = plots.plot_run(run)
    assert {p.stem for p in written} == EXPECTED
    assert all(p.parent == run / "figures" and p.suffix == ".png" and p.stat().st_size > 5_000 for p in written)


def test_cli_plot_formats_and_errors(tmp_path, capsys):
    run = write_run_dir(tmp_path / "run")
    code, out, err = run_cli(["plot", run, "--format", "svg", "--out", tmp_path / "svg"], capsys)
    assert code == 0, err
    assert {p.stem for p in (tmp_path / "svg").glob("*.svg")} == EXPECTED
    assert (tmp_path / "svg" / "sweep.svg").read_text().lstrip().startswith("<?xml")
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["plot", tmp_path / "empty"], capsys)
    assert code == 2 and "no table" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["plot", tmp_path / "missing"], capsys)
    assert code == 2 and "no such run directory" in err
    with pytest.raises(HeadlabError, match="format"):
        plots.save_figure(plots.plot_sweep(sweep_table()), tmp_path / "x.gif")


def test_a_full_disk_never_truncates_a_figure(tmp_path, monkeypatch):
    """save_figure writes beside the figure and renames: a full disk leaves the previous figure whole, one-line
    error, no temporary file left."""
    import errno

    import matplotlib.pyplot as plt

    from headlab.core import fsio
    from headlab.core.errors import HeadlabError
    from headlab.viz.plots import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "line.png")
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG") and oct(path.stat().st_mode & 0o777) != oct(0o600)

    class FullDisk:
        def __init__(self, fd, mode):
            self.handle = open(fd, mode)  # noqa: SIM115 - closed in __exit__

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsio.os, "fdopen", FullDisk)
    ax.plot([0, 1], [0, 1])
    with pytest.raises(HeadlabError, match="no space left on the device; the previous file is untouched"):
        save_figure(fig, path)
    plt.close(fig)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["line.png"]


def test_kv_trade_draws_one_point_per_method_and_task_and_refuses_a_bad_table():
    from headlab.viz.plots import plot_kv_trade

    trade = pd.DataFrame(
        {"model": ["original", "original", "policy", "policy", "MQA", "MQA"], "kv_kept": [1, 1, 0.5, 0.5, 1 / 3, 1 / 3],
         "task": ["passkey", "multikey"] * 3, "accuracy": [0.67, 1.0, 0.67, 0.67, 0.0, 0.0],
         "nll": [3.08, 3.08, 3.08, 3.08, 5.32, 5.32], "bucket": ["[512, 2048)"] * 6}  # fmt: skip
    )
    fig = plot_kv_trade(trade, "trade")
    accuracy_panels, nll_panel = fig.axes[:2], fig.axes[2]
    for ax, task in zip(accuracy_panels, ["passkey", "multikey"]):
        points = np.concatenate([c.get_offsets() for c in ax.collections])
        expected = trade[trade["task"] == task][["kv_kept", "accuracy"]].to_numpy()
        assert sorted(map(tuple, points.round(6))) == sorted(map(tuple, expected.round(6)))
    assert len(np.concatenate([c.get_offsets() for c in nll_panel.collections])) == 3
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["original", "policy", "MQA"]
    plt.close(fig)
    with pytest.raises(HeadlabError, match="kv_kept"):
        plot_kv_trade(trade.drop(columns="kv_kept"))


def test_needle_heatmap_puts_models_on_rows_at_one_length():
    """Rungs at one length: one row per model in the table's order (not sorted), cells annotated correct/prompts."""
    rows = []
    for model, correct in (("original", (2, 1)), ("merged", (0, 0)), ("a pruned", (1, 2))):
        for depth, c in zip((0.0, 1.0), correct):
            rows.append({"model": model, "task": "passkey", "length": 2048, "depth": depth, "correct": c,
                         "prompts": 2, "accuracy": c / 2})  # fmt: skip
    fig = plots.plot_needle_heatmap(pd.DataFrame(rows))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["original", "merged", "a pruned"]
    assert [t.get_text() for t in ax.texts] == ["2/2", "1/2", "0/2", "0/2", "1/2", "2/2"]
    assert np.allclose(np.asarray(ax.collections[0].get_array()).reshape(3, 2), [[1, 0.5], [0, 0], [0.5, 1]])
    assert ax.get_title() == "passkey @ 2,048 tokens"
