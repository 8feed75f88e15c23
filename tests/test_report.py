"""`headlab report` / `headlab demo` end to end on a saved tiny checkpoint and a small text file, and the pieces the
report is built from: the attention gallery (against eager attention), the KV grouping and the trade summaries."""

from __future__ import annotations

import json
import re
import shlex

import pandas as pd
import pytest
import torch
from models import tiny_model
from slow_clock import slow_machine
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.reporting import report

SECTIONS = [
    "Summary",
    "Model",
    "Per-head attention statistics",
    "Head importance",
    "Attention patterns",
    "What the heads do",
    "Pruning sweep",
    "KV heads: GQA conversion",
    "Recovery",
    "Speed",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One quick report of a tiny Llama (4 query heads, 2 KV heads) on a small text file."""
    from headlab.cli import main

    root = tmp_path_factory.mktemp("report")
    checkpoint = save_tiny("llama", root / "ckpt")
    corpus = root / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    out = root / "report"
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--model", str(checkpoint), "--data", str(corpus), "--quick", "--out", str(out)])
    assert exit_info.value.code == 0
    return {"root": root, "checkpoint": checkpoint, "corpus": corpus, "out": out}


def test_report_holds_every_section_figure_and_command(tiny_run):
    out = tiny_run["out"]
    meta = json.loads((out / "meta.json").read_text())
    markdown = (out / "report.md").read_text()
    assert [line[3:] for line in markdown.splitlines() if line.startswith("## ")] == SECTIONS
    figures = sorted(p.stem for p in (out / "figures").glob("*.png"))
    assert figures == meta["figures"]
    assert {"heatmap_entropy", "heatmap_importance", "importance_vs_entropy", "importance_vs_sink_first"} <= set(
        figures
    )
    assert {"sweep", "gqa_sweep", "attention_gallery", "gqa_grouping", "recovery_curve", "speed", "dla_mean"} <= set(
        figures
    )
    for name in figures:  # every figure is in the markdown ...
        assert f"(figures/{name}.png)" in markdown
    # ... and embedded in the HTML, which refers to no other file.
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(figures)
    assert "figures/" not in page and "<link" not in page and "<script" not in page
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in page
    commands = re.findall(r"```bash\n(.*?)\n```", markdown, re.S)
    assert len(commands) == 9 and all(c.startswith("headlab ") for block in commands for c in block.splitlines())
    assert meta["command_line"].startswith("headlab report --model") and "--quick" in meta["command_line"]
    for step in ("stats", "importance", "sweep", "gqa_sweep", "gqa_groups", "attention", "heads", "recovery", "speed"):
        assert (out / step / "meta.json").is_file()


def test_summary_numbers_come_from_the_tables(tiny_run):
    out = tiny_run["out"]
    meta = json.loads((out / "meta.json").read_text())
    sweep = pd.read_csv(out / "sweep" / "sweep.csv")
    gqa = pd.read_csv(out / "gqa_sweep" / "sweep.csv")
    assert meta["summary"] == report.pruning_trades(sweep) + report.gqa_trades(gqa)
    base = sweep.loc[sweep["pruned_heads"] == 0, "perplexity"].mean()
    assert f"against {base:.2f} unpruned" in meta["summary"][0]
    markdown = (out / "report.md").read_text()
    assert all(line in markdown for line in meta["summary"])


@pytest.mark.parametrize("step, table", [("stats", "stats_wide"), ("sweep", "sweep")])
def test_reproduce_command_gives_the_same_table(tiny_run, tmp_path, capsys, step, table):
    """The command printed in the report, run on its own, writes the report's table (the sweep: also though the
    report hands it the importance scores it computed instead of recomputing them)."""
    out = tiny_run["out"]
    args = shlex.split(json.loads((out / "meta.json").read_text())["commands"][step])[1:]
    args[args.index("--out") + 1] = str(tmp_path / step)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    again = pd.read_csv(tmp_path / step / f"{table}.csv")
    expected = pd.read_csv(out / step / f"{table}.csv")
    measured = [c for c in ("tokens_per_s",) if c in expected]  # timings differ from run to run
    pd.testing.assert_frame_equal(again.drop(columns=measured), expected.drop(columns=measured))


def test_plot_redraws_the_report(tiny_run, tmp_path, capsys):
    out = tiny_run["out"]
    code, _, err = run_cli(["plot", out, "--out", tmp_path / "figures"], capsys)
    assert code == 0, err
    assert (
        sorted(p.stem for p in (tmp_path / "figures").glob("*.png"))
        == json.loads((out / "meta.json").read_text())["figures"]
    )


def test_heads_section_comes_from_its_tables_and_links_into_the_viewer(tiny_run, tmp_path, capsys):
    """What the heads do: the types are the stats table's own scores, the attribution ranking is what `headlab
    attribute --positions all` (the step's printed command) gives on the saved text, and every link opens the viewer
    at a head the model has."""
    from headlab.reporting.heads import attribution_ranking, head_types

    out = tiny_run["out"]
    wide = pd.read_csv(out / "stats" / "stats_wide.csv")
    types = pd.read_csv(out / "heads" / "head_types.csv")
    pd.testing.assert_frame_equal(types, head_types(wide), check_dtype=False)
    induction = types.set_index("statistic").loc["induction"]
    assert induction["heads"] == int((wide["induction"] >= 0.5).sum())
    best = wide.sort_values(["induction", "layer", "head"], ascending=[False, True, True]).iloc[0]
    assert induction["top_heads"].startswith(f"L{int(best['layer'])}H{int(best['head'])} ({best['induction']:.2f})")

    meta = json.loads((out / "meta.json").read_text())
    attribute = shlex.split(meta["commands"]["heads"].splitlines()[0])[1:]
    attribute[attribute.index("--out") + 1] = str(tmp_path / "attribute")
    code, _, err = run_cli(attribute, capsys)
    assert code == 0, err
    again = attribution_ranking(pd.read_csv(tmp_path / "attribute" / "dla.csv"))
    saved = pd.read_csv(out / "heads" / "head_attribution.csv")
    pd.testing.assert_frame_equal(saved, again, check_dtype=False, atol=1e-9)

    markdown = (out / "report.md").read_text()
    links = re.findall(r"\]\((heads/viewer\.html#(L\d+H\d+))\)", markdown)
    assert links and {name for _, name in links} >= set(saved["name"].head(3))
    viewer = (out / "heads" / "viewer.html").read_text()
    for _, name in links:
        assert f'"{name}"' in viewer  # the picker knows the head the link names
    assert "<a href='heads/viewer.html#" in (out / "report.html").read_text()


def test_report_bad_input_fails_before_work(tiny_run, tmp_path, capsys):
    args = ["report", "--model", tiny_run["checkpoint"], "--quick"]
    code, _, err = run_cli([*args, "--data", tmp_path / "missing.txt", "--out", tmp_path / "r"], capsys)
    assert code == 2 and "no such corpus" in err and not (tmp_path / "r").exists()
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--out" in err
    code, _, err = run_cli([*args, "--data", tiny_run["corpus"], "--out", tiny_run["out"]], capsys)
    assert code == 2 and "--overwrite" in err


def test_demo_replaces_only_its_own_output(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    user = tmp_path / "runs" / "demo"
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    args = ["demo", "--model", tiny_run["checkpoint"], "--data", tiny_run["corpus"]]  # the quick preset by default
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--overwrite" in err and (user / "notes.txt").read_text() == "mine"
    # A previous demo's directory (its meta.json says so) is replaced without --overwrite.
    (user / "meta.json").write_text(json.dumps({"command": report.DEMO_MARKER, "files": ["meta.json"]}))
    code, _, err = run_cli(args, capsys)  # a demo's directory, but a user added a file: kept
    assert code == 2 and "--overwrite" in err and (user / "notes.txt").read_text() == "mine"
    (user / "notes.txt").unlink()
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    meta = json.loads((user / "meta.json").read_text())
    assert meta["command"] == "headlab demo" and meta["quick"] and (user / "report.html").is_file()
    assert "recovery" not in meta["seconds"] and not (user / "recovery").exists()  # the demo preset leaves it out
    assert "wrote runs/demo/report.md" in out
    report.check_report_out(user, overwrite=False, demo=True)  # a demo may run again
    with pytest.raises(HeadlabError, match="overwrite=True"):
        report.check_report_out(user, overwrite=False, demo=False)
    # A file a user added anywhere inside the previous demo (here in a step's folder) makes it theirs: kept.
    (user / "stats" / "my-notes.txt").write_text("mine too")
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--overwrite" in err and (user / "stats" / "my-notes.txt").read_text() == "mine too"
    assert not report.is_demo_run(user)
    (user / "stats" / "my-notes.txt").unlink()
    assert report.is_demo_run(user)


def test_attention_maps_equal_eager_attentions():
    """The gallery's weights are the model's own eager attention probabilities for the selected heads."""
    from tiny_text import tiny_tokenizer

    model = tiny_model("llama", attn_implementation="eager")
    loaded = from_model(model, tiny_tokenizer())
    importance = pd.DataFrame(
        {"layer": [0, 0, 0, 0, 1, 1, 1, 1], "head": [0, 1, 2, 3] * 2, "kv_head": [0, 0, 1, 1] * 2}
    ).assign(importance=[0.9, 0.1, 0.5, 0.4, 0.3, 1.0, 0.2, 0.0])
    importance["rank"] = importance["importance"].rank(ascending=False).astype(int)
    maps = report.attention_maps(loaded, importance, "ab cd", heads=2)
    chosen = maps.drop_duplicates(["layer", "head"])
    assert list(zip(chosen["selection"], chosen["layer"], chosen["head"])) == [
        ("most important", 1, 1),
        ("most important", 0, 0),
        ("least important", 1, 3),
        ("least important", 0, 1),
    ]
    ids = [1] + [10 + ord(c) - 32 for c in "ab cd"]  # BOS then characters (tiny tokenizer)
    assert maps.drop_duplicates("key").sort_values("key")["key_token"].tolist() == ["<s>", "a", "b", "_", "c", "d"]
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions  # L x [1, H, T, T]
    for (layer, head), part in maps.groupby(["layer", "head"]):
        expected = attentions[layer][0, head]
        assert len(part) == 6 * 7 // 2  # causal: query i sees keys 0..i
        assert (part["key"] <= part["query"]).all()
        got = torch.tensor(part["weight"].to_numpy().copy(), dtype=torch.float32)
        queries, keys = torch.tensor(part["query"].tolist()), torch.tensor(part["key"].tolist())
        assert torch.allclose(got, expected[queries, keys], atol=1e-5)


def test_grouping_table_follows_the_similarity():
    """4 KV heads where 0~2 and 1~3 are alike: pooling to 2 groups them so, whatever their positions."""
    loaded = from_model(tiny_model("llama", num_key_value_heads=4, num_attention_heads=8))
    similarity = torch.eye(4).repeat(2, 1, 1) * 0 + 0.1  # [L, G, G]
    similarity[:, 0, 2] = similarity[:, 2, 0] = similarity[:, 1, 3] = similarity[:, 3, 1] = 0.9
    table = report.grouping_table(loaded, 2, {"similarity": similarity}, "similarity")
    layer0 = table[table["layer"] == 0]
    assert layer0["kv_head"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layer0["new_kv_head"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert set(table["method"]) == {"exact"}
    assert report.gqa_target(3) == 1 and report.gqa_target(8) == 4 and report.gqa_target(1) is None


def test_trades_are_computed_from_hand_made_tables():
    sweep = pd.DataFrame(
        {
            "order": ["importance"] * 3 + ["random"] * 3,
            "fraction": [0.0, 0.3, 0.5] * 2,
            "fraction_pruned": [0.0, 0.3, 0.5] * 2,
            "pruned_heads": [0, 3, 5] * 2,
            "perplexity": [10.0, 11.0, 12.5, 10.0, 13.0, 20.0],
            "parameters": [100, 90, 80] * 2,
        }
    )
    lines = report.pruning_trades(sweep)
    assert lines[0] == (
        "Pruning 30% of the attention heads costs importance order +10.0% (11.00); random order +30.0% (13.00) "
        "perplexity against 10.00 unpruned."
    )
    assert "importance order +25.0%" in lines[1] and lines[2] == "At 50% the best order is importance."
    gqa = pd.DataFrame(
        {
            "kv_heads": [9, 3, 1, 1],
            "action": ["expand", "keep", "pool", "pool"],
            "grouping": [None, None, "contiguous", "similarity"],
            "pool": [None, None, "mean", "mean"],
            "perplexity": [10.0, 10.0, 15.0, 14.0],
            "kv_bytes_per_token": [3 * 3072, 3072, 1024, 1024],
        }
    )
    lines = report.gqa_trades(gqa)
    assert lines[0] == (
        "3 -> 1 KV heads (similarity grouping, mean pooling, no uptraining) saves 66.7% of the KV cache "
        "(3.00 KiB -> 1.00 KiB per token) for +40.0% perplexity (10.00 -> 14.00)."
    )
    assert "multiplies the KV cache by 3.0" in lines[1]
    # sweep --compensate rows are their own line, never averaged with the plain ones.
    both = pd.concat([sweep.assign(compensation="none"), sweep.assign(compensation="ridge", perplexity=10.0)])
    assert "importance + ridge order +0.0%" in report.pruning_trades(both)[0]
    assert "importance order +10.0%" in report.pruning_trades(both)[0]


def test_fit_settings_respects_the_models_positions():
    fitted = report.fit_settings(report.PRESETS["full"], 64)
    assert fitted.seq_len == 64 and 2 * fitted.induction_len + 1 <= 64 and fitted.heads_tokens == 62
    assert fitted.speed_contexts == (32,)  # none of 512, 2048, 8192 fits 64 positions: half of them
    assert report.fit_settings(report.PRESETS["full"], 4096).speed_contexts == (512, 2048)
    assert report.fit_settings(report.PRESETS["full"], None) == report.PRESETS["full"]


# ---- the same report on any machine: budgets in tokens, resume after a failure -------------------------------------

# Columns that hold timings: they differ from run to run; every other value must not.
TIMINGS = {"tokens_per_s", "seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_seconds"}


def _same_tables(a, b, steps=("stats", "importance", "sweep", "gqa_sweep", "gqa_groups", "recovery")):
    """Every table of each step's run directory in `a` equals `b`'s, timings aside."""
    for step in steps:
        names = sorted(p.name for p in (a / step).glob("*.csv"))
        assert names and names == sorted(p.name for p in (b / step).glob("*.csv")), step
        for name in names:
            left, right = pd.read_csv(a / step / name), pd.read_csv(b / step / name)
            timing = [c for c in left.columns if c in TIMINGS or c.endswith("_seconds")]
            pd.testing.assert_frame_equal(left.drop(columns=timing), right.drop(columns=timing), obj=f"{step}/{name}")


def test_report_on_a_much_slower_machine_finishes_with_the_same_numbers(tiny_run, tmp_path, monkeypatch, capsys):
    """A machine 1,000 times slower (as the clocks see it) runs every step and writes the whole report, with the
    same tables as the fixture's run on this machine: no budget is in minutes."""
    slow_machine(monkeypatch, 1000.0)
    out = tmp_path / "slow"
    args = ["report", "--model", tiny_run["checkpoint"], "--data", tiny_run["corpus"], "--quick", "--out", out]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    assert (
        json.loads((out / "meta.json").read_text())["figures"]
        == json.loads((tiny_run["out"] / "meta.json").read_text())["figures"]
    )
    _same_tables(out, tiny_run["out"])
    recovery = json.loads((out / "recovery" / "meta.json").read_text())
    assert not recovery["stopped_on_time"] and recovery["uptrain"]["stopped_by"] == "the step budget"


def test_a_failed_step_keeps_the_steps_before_it_and_a_rerun_resumes(tiny_run, tmp_path, monkeypatch, capsys):
    """Step k fails: the error names it, steps 1..k-1 stay in OUT.partial and nothing is published; the same command
    again runs only steps k.. and writes the report, with the same tables as an uninterrupted run."""
    calls = []
    original = list(report.REPORT_STEPS)

    def counted(name, function, fail=False):
        def step(run):
            calls.append(name)
            if fail:
                raise HeadlabError("the disk is on fire")
            function(run)

        return step

    failing = [(n, counted(n, f, fail=n == "recovery")) for n, f in original]
    monkeypatch.setattr(report, "REPORT_STEPS", failing)
    out = tmp_path / "resumed"
    args = ["report", "--model", tiny_run["checkpoint"], "--data", tiny_run["corpus"], "--quick", "--out", out]
    code, _, err = run_cli(args, capsys)
    names = [n for n, _ in original if n != "long"]  # the long-context step runs only with --long-context
    k = names.index("recovery") + 1
    error = err.strip().splitlines()[-1]  # the one-line error, after the progress lines
    assert code == 2 and error.startswith("headlab: error: ")
    assert f"step {k}/{len(names) + 1} (recovery) failed: the disk is on fire" in error
    assert f"steps 1-{k - 1} are kept in {out}.partial" in error and "rerun the same command" in error
    assert not out.exists() and calls == names[:k]
    partial = tmp_path / "resumed.partial"
    assert (partial / "sweep" / "sweep.csv").is_file() and not (partial / "recovery").exists()

    calls.clear()
    monkeypatch.setattr(report, "REPORT_STEPS", [(n, counted(n, f)) for n, f in original])
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert calls == names[k - 1 :]  # only the failed step and those after it ran again
    assert "kept from the previous run" in err and not partial.exists()
    assert not (out / "journal.json").exists()
    _same_tables(out, tiny_run["out"])
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["seconds"]) == set(names) | {"figures"}
    assert meta["summary"] == json.loads((tiny_run["out"] / "meta.json").read_text())["summary"]


def test_a_rerun_with_other_options_starts_afresh(tiny_run, tmp_path, monkeypatch, capsys):
    """The kept steps are reused only for the same inputs and options: another corpus discards them."""
    calls = []
    original = list(report.REPORT_STEPS)

    def failing(run):
        raise HeadlabError("stop here")

    def counting(name, function):
        return lambda run: (calls.append(name), function(run))

    monkeypatch.setattr(report, "REPORT_STEPS", [(n, failing if n == "sweep" else f) for n, f in original])
    out = tmp_path / "r"
    args = ["report", "--model", tiny_run["checkpoint"], "--quick", "--out", out]
    code, _, err = run_cli([*args, "--data", tiny_run["corpus"]], capsys)
    assert code == 2 and "(sweep) failed" in err
    other = tmp_path / "other.txt"
    other.write_text(SAMPLE_TEXT[::-1] * 4)
    monkeypatch.setattr(report, "REPORT_STEPS", [(n, counting(n, f)) for n, f in original])
    code, _, err = run_cli([*args, "--data", other], capsys)
    assert code == 0, err
    assert calls == [n for n, _ in original if n != "long"]  # every step ran again (long: only with --long-context)
    assert json.loads((out / "meta.json").read_text())["data"] == str(other)


def test_long_context_section_compares_the_original_the_merge_and_a_policy(tmp_path, capsys):
    """`report --long-context`: retrieval and NLL by position of the original, the svd merge and a per-KV-head cache
    policy at half the cache, with the cache each keeps, as a section with its tables, both figures and the longeval
    command, which on its own gives the original's rows again."""
    checkpoint = save_tiny("llama", tmp_path / "ckpt", max_position_embeddings=1024)
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 6)
    out = tmp_path / "report"
    args = ["report", "--model", checkpoint, "--data", corpus, "--quick", "--long-context", "600", "--out", out]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    markdown = (out / "report.md").read_text()
    sections = [line[3:] for line in markdown.splitlines() if line.startswith("## ")]
    assert sections == SECTIONS[:-1] + ["Long context", "Speed"]
    lengths = pd.read_csv(out / "long_context" / "lengths.csv")
    policy = lengths["model"].iloc[2]
    assert lengths["model"].tolist()[:2] == ["original", "1 KV heads, svd merge"] and set(lengths["length"]) == {600}
    assert policy.startswith("KV policy") and len(lengths) == 3
    kept = pd.read_csv(out / "long_context" / "kv_kept.csv").set_index("model")["kv_kept"]
    assert kept["original"] == 1.0 and kept["1 KV heads, svd merge"] == 0.5  # 2 -> 1 KV heads
    assert 0.2 < kept[policy] <= 0.5 + 0.01  # measured on the cache after the last decode step (a few more slots)
    assert "KV cache kept" in (out / "report.md").read_text() and "(figures/kv_trade.png)" in markdown
    copying = pd.read_csv(out / "long_context" / "copying.csv")
    assert copying["model"].tolist() == lengths["model"].tolist() and "in-context copying" in markdown
    assert "(figures/needle_heatmap.png)" in markdown and "(figures/position_nll.png)" in markdown
    command = json.loads((out / "meta.json").read_text())["commands"]["long"]
    assert command.startswith("headlab longeval") and "--lengths 600" in command
    args = shlex.split(command)[1:]
    args[args.index("--out") + 1] = str(tmp_path / "alone")
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    alone = pd.read_csv(tmp_path / "alone" / "lengths.csv")
    original = lengths[lengths["model"] == "original"].drop(columns="model").reset_index(drop=True)
    pd.testing.assert_frame_equal(alone, original)
    alone_copying = pd.read_csv(tmp_path / "alone" / "copying.csv")  # the same sequences, the same model
    ours = copying[copying["model"] == "original"].drop(columns="model").reset_index(drop=True)
    pd.testing.assert_frame_equal(alone_copying, ours)


def test_report_on_an_encoder(tmp_path, capsys):
    """A masked LM (tiny BERT, 64 positions): the gallery sentence is cut to the positions, there is no speed step
    (no KV cache to decode with) and no attribution (no norm + unembedding head), and the heads section says why."""
    checkpoint = save_tiny("bert", tmp_path / "bert")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "report"
    code, _, err = run_cli(["report", "--model", checkpoint, "--data", corpus, "--quick", "--out", out], capsys)
    assert code == 0, err
    markdown = (out / "report.md").read_text()
    sections = [line[3:] for line in markdown.splitlines() if line.startswith("## ")]
    assert "What the heads do" in sections and "Speed" not in sections
    assert "No attribution: BertForMaskedLM is an encoder" in markdown
    assert (out / "heads" / "viewer.html").is_file() and not (out / "heads" / "head_attribution.csv").exists()
    maps = pd.read_csv(out / "attention" / "attention_maps.csv")
    assert maps["query"].max() < 64  # the sentence was cut to the model's positions
