"""Pruning sweeps on tiny models: each row is the perplexity of the model with exactly those heads gated off."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, parity_generate, run_cli, save_tiny, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure import longctx
from headlab.measure.evaluate import perplexity
from headlab.measure.long_tasks import TRADE_DEPTHS, TRADE_SAMPLES
from headlab.mechanisms.gates import head_gates
from headlab.pruning.scores import random_scores
from headlab.pruning.sweep import SweepPlan, sweep, write_sweep

EVAL = dict(seq_len=32, batch_size=2)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(SAMPLE_TEXT)
    return str(path)


def _loaded(name="llama", **overrides):
    return from_model(tiny_model(name, **overrides), tiny_tokenizer(), spec=name)


def test_sweep_rows_match_gated_perplexity(corpus, tmp_path):
    loaded = _loaded()
    result = sweep(
        loaded,
        SweepPlan(fractions=[0.5, 0.0, 0.25], orders=["importance", "random", "iterative", "entropy"], seeds=[0, 1]),
        data=corpus,
        calibration_tokens=128,
        eval_tokens=128,
        progress=False,
        **EVAL,
    )
    table = result.table
    assert len(table) == 3 * (3 + 2)  # fractions x (importance, iterative, entropy, 2 random seeds)
    assert sorted(table["fraction"].unique()) == [0.0, 0.25, 0.5]
    assert table.loc[table["fraction"] == 0.0, "perplexity"].nunique() == 1  # every curve starts unpruned
    assert list(table.groupby("fraction")["pruned_heads"].unique().map(list)) == [[0], [2], [4]]  # of 8 heads

    # Slow, obvious check of one random row: the lowest 4 of the seeded scores, gated off, then plain perplexity.
    with head_gates(loaded, _lowest_random_gates(loaded, seed=1, count=4)):
        expected = perplexity(loaded, corpus, split="eval", max_tokens=128, progress=False, **EVAL).perplexity
    row = table[(table["order"] == "random") & (table["seed"] == 1) & (table["fraction"] == 0.5)].iloc[0]
    assert row["perplexity"] == pytest.approx(expected, rel=1e-5)
    # Size columns follow the physical layout: 4 of 8 heads gone; KV bytes fall only with whole KV groups gone.
    unpruned = table[table["fraction"] == 0.0].iloc[0]
    # (4 heads live; GQA groups left unequal keep zero-output padding heads instead of duplicating KV heads)
    assert row["query_heads"] - row["padding_heads"] == 4 and row["parameters"] < unpruned["parameters"]
    assert row["kv_bytes_per_token"] == 2 * row["kv_heads"] * 16 * 4
    # The unpruned model was restored after every point.
    assert loaded.layers[0].num_heads == 4

    out = write_sweep(result, tmp_path / "run")
    assert {p.name for p in out.iterdir()} >= {"sweep.csv", "sweep.parquet", "meta.json", "sweep.png"}
    assert len(pd.read_csv(out / "sweep.csv")) == len(table)
    with pytest.raises(HeadlabError, match="overwrite=True"):
        write_sweep(result, tmp_path / "run")


def _lowest_random_gates(loaded, seed: int, count: int) -> list[torch.Tensor]:
    """Gates [4] per layer of the 2-layer, 4-head tiny model with the `count` lowest seeded random scores off (ties:
    lower flat index first), by hand."""
    scores = torch.cat(random_scores(loaded.layers, seed))
    gates = [torch.ones(4), torch.ones(4)]
    for flat in sorted(range(8), key=lambda i: (float(scores[i]), i))[:count]:
        gates[flat // 4][flat % 4] = 0.0
    return gates


def test_sweep_long_context_columns_measure_each_pruned_model(corpus, monkeypatch):
    """--long-context's columns: fraction 0 is passkey retrieval of the model before pruning, a pruned row that of
    the model with exactly its heads gated off (decoding stood in for by a model-dependent answer)."""
    monkeypatch.setattr(longctx, "transformers_generate", parity_generate)
    loaded = _loaded(max_position_embeddings=512)
    plan = SweepPlan(fractions=[0.0, 0.5], orders=["random"], seeds=[1])
    result = sweep(loaded, plan, data=corpus, calibration_tokens=128, eval_tokens=64, long_context=(300, 300, 400),
                   progress=False, **EVAL)  # fmt: skip
    table = result.table
    assert table["passkey_prompts"].tolist() == [6, 6]  # 3 depths x 2 prompts
    assert table[["passkey_300", "passkey_400"]].stack().between(0, 1).all()
    assert result.meta["long_context"]["lengths"] == [300, 400] and result.meta["long_context"]["samples"] == 2

    def direct(length):
        return longctx.long_context(loaded, data=corpus, split="eval", tasks=("passkey",), lengths=[length],
                                    depths=TRADE_DEPTHS, samples=TRADE_SAMPLES, position_sequences_count=0,
                                    progress=False).accuracy("passkey", length)  # fmt: skip

    before, after = table.iloc[0], table.iloc[1]
    assert before["fraction"] == 0.0 and [before["passkey_300"], before["passkey_400"]] == [direct(300), direct(400)]
    with head_gates(loaded, _lowest_random_gates(loaded, seed=1, count=4)):
        assert [after["passkey_300"], after["passkey_400"]] == [direct(300), direct(400)]
    assert before["passkey_300"] != after["passkey_300"]  # the stand-in tells the two models apart


def test_sweep_bad_input():
    loaded = _loaded()
    with pytest.raises(HeadlabError, match=r"\[0, 1\)"):
        sweep(loaded, SweepPlan(fractions=[0.0, 1.0], orders=["random"]), progress=False)
    with pytest.raises(HeadlabError, match="unknown order"):
        sweep(loaded, SweepPlan(fractions=[0.0], orders=["magnitude"]), progress=False)
    with pytest.raises(HeadlabError, match="exceeds the model's maximum positions"):
        sweep(loaded, SweepPlan(fractions=[0.0], orders=["random"]), long_context=(96,), progress=False)


def test_cli_sweep(tmp_path, corpus, capsys):
    src = save_tiny("gpt2", tmp_path / "src")
    args = ["sweep", "--model", src, "--device", "cpu", "--data", corpus, "--max-tokens", "64", "--seq-len", "32",
            "--calibration-tokens", "64", "--fractions", "0,0.5", "--orders", "random", "--seeds", "0",
            "--out", tmp_path / "o"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "random" in out and (tmp_path / "o" / "sweep.png").is_file()
    code, _, err = run_cli([*args[:-2], "--fractions", "0,1.5", "--out", tmp_path / "p"], capsys)
    assert code == 2 and "[0, 1)" in err and not (tmp_path / "p").exists()


def test_cli_sweep_long_context_keys_the_resumable_run(tmp_path, corpus, capsys, monkeypatch):
    """sweep --long-context decodes for real on each pruned model; its lengths are part of the resumable run's key, so
    a rerun with other lengths starts afresh instead of mixing columns."""
    from headlab.pruning import sweep as sweep_module

    src = save_tiny("llama", tmp_path / "src", max_position_embeddings=512)
    args = ["sweep", "--model", src, "--device", "cpu", "--data", corpus, "--max-tokens", "64", "--seq-len", "32",
            "--calibration-tokens", "64", "--fractions", "0,0.5", "--orders", "importance,random", "--seeds", "0"]  # fmt: skip
    code, stdout, err = run_cli([*args, "--long-context", "300", "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    table = pd.read_csv(tmp_path / "o" / "sweep.csv")
    assert table["passkey_300"].between(0, 1).all() and set(table["passkey_prompts"]) == {6}
    assert table["copy_300"].between(0, 1).all()  # in-context copying beside it (headlab.measure.copying)
    assert "passkey_300" in stdout
    meta = __import__("json").loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["long_context"]["lengths"] == [300] and meta["long_context"]["depths"] == [0.0, 0.5, 1.0]

    calls, real = [], sweep_module.passkey_columns

    def failing(loaded, text, lengths):
        calls.append(lengths)
        if len(calls) == 3:  # importance's two models done; random's pruned model fails
            raise HeadlabError("the machine went away")
        return real(loaded, text, lengths)

    monkeypatch.setattr(sweep_module, "passkey_columns", failing)
    out = tmp_path / "resumed"
    code, _, err = run_cli([*args, "--long-context", "300", "--out", out], capsys)
    assert code == 2 and f"the completed steps (importance) are kept in {out}.partial" in err
    code, _, err = run_cli([*args, "--long-context", "400", "--out", out], capsys)
    assert code == 0, err
    assert "already done" not in err  # other lengths: nothing of the first run is reused
    columns = pd.read_csv(out / "sweep.csv").columns
    assert "passkey_400" in columns and "passkey_300" not in columns


def test_cli_sweep_resumes_after_a_failed_order(tmp_path, corpus, capsys, monkeypatch):
    """An order that fails keeps the orders before it in OUT.partial; the same command again measures only what is
    missing and writes the same table as an uninterrupted sweep (timings aside)."""
    from headlab.pruning import sweep as sweep_module

    src = save_tiny("llama", tmp_path / "src")
    args = ["sweep", "--model", src, "--device", "cpu", "--data", corpus, "--max-tokens", "64", "--seq-len", "32",
            "--calibration-tokens", "64", "--fractions", "0,0.25,0.5", "--orders", "importance,random,entropy",
            "--seeds", "0,1"]  # fmt: skip
    code, _, err = run_cli([*args, "--out", tmp_path / "whole"], capsys)
    assert code == 0, err
    measured = []
    real = sweep_module._Measure._measure

    def measure(self, pruned, compensation):
        measured.append(pruned)
        if fail and len(measured) == 5:  # importance's 3 fractions done; random seed 0 fails at its second model
            raise HeadlabError("the machine went away")
        return real(self, pruned, compensation)

    monkeypatch.setattr(sweep_module._Measure, "_measure", measure)
    fail = True
    out = tmp_path / "resumed"
    code, _, err = run_cli([*args, "--out", out], capsys)
    assert code == 2 and "the machine went away" in err.splitlines()[-1]
    assert f"the completed steps (importance) are kept in {out}.partial" in err and not out.exists()
    fail, measured[:] = False, []
    code, _, err = run_cli([*args, "--out", out], capsys)
    assert code == 0, err
    assert "importance already done" in err and not (tmp_path / "resumed.partial").exists()
    assert len(measured) < 12  # importance's models were not measured again
    whole, resumed = pd.read_csv(tmp_path / "whole" / "sweep.csv"), pd.read_csv(out / "sweep.csv")
    pd.testing.assert_frame_equal(whole.drop(columns="tokens_per_s"), resumed.drop(columns="tokens_per_s"))
