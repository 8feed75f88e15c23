"""Choosing a per-KV-head cache policy (headlab.kv.policy): the budget arithmetic by hand, the per-KV-head score
(the largest of its query heads'), DuoAttention's pattern files, and the kv-policy command end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from tiny_text import run_cli, save_tiny

from headlab.core.errors import HeadlabError
from headlab.kv.policy import choose_policy, duo_attention_files, kv_head_scores, read_policy, streaming_column


def _scores(values, head_dim=16):
    """Two layers x len(values[0]) KV heads with the given scores."""
    return pd.DataFrame(
        [
            {"layer": layer, "kv_head": head, "head_dim": head_dim, "score": value}
            for layer, row in enumerate(values)
            for head, value in enumerate(row)
        ]  # fmt: skip
    )


def test_budget_by_hand():
    # 4 KV heads, context 100, sinks 2 + window 9: a streaming head keeps 10 slots (0.1 of the full cache).
    # floor = 0.1; each full head adds 0.9 / 4 = 0.225: budget 0.6 fits two full heads (0.55), not three (0.775).
    scores = _scores([[0.9, 0.1], [0.5, 0.7]])
    policy = choose_policy(scores, budget=0.6, context=100, sinks=2, window=9)
    full = set(map(tuple, policy.table[policy.table["policy"] == "full"][["layer", "kv_head"]].values.tolist()))
    assert full == {(0, 0), (1, 1)}
    assert policy.kv_fraction() == pytest.approx(0.55)
    assert policy.meta["full_kv_heads"] == 2 and policy.meta["streaming_kv_heads"] == 2
    # at a context the window covers, the policy keeps everything
    assert policy.kv_fraction(10) == pytest.approx(1.0)
    # budget 1 keeps every head whole; the floor itself streams every head
    assert set(choose_policy(scores, budget=1.0, context=100, sinks=2, window=9).table["policy"]) == {"full"}
    assert set(choose_policy(scores, budget=0.1, context=100, sinks=2, window=9).table["policy"]) == {"streaming"}


def test_budget_below_the_floor_is_refused_in_one_line():
    with pytest.raises(HeadlabError, match="below what streaming every KV head keeps"):
        choose_policy(_scores([[1.0, 0.0]]), budget=0.05, context=100, sinks=2, window=9)
    with pytest.raises(HeadlabError, match="budget"):
        choose_policy(_scores([[1.0, 0.0]]), budget=1.5, context=100)


def test_kv_head_score_is_the_largest_of_its_query_heads(tmp_path):
    class Layer:
        def __init__(self, index):
            self.index, self.head_dim = index, 8

    class Loaded:
        layers = [Layer(0)]

    wide = pd.DataFrame(
        {
            "layer": [0, 0, 0, 0],
            "head": [0, 1, 2, 3],
            "kv_head": [0, 0, 1, 1],
            "retrieval": [0.1, 0.4, 0.3, 0.2],
            "stream_16": [0.9, 0.5, 0.99, 0.8],
            "stream_64": [1.0, 1.0, 1.0, 1.0],
        }  # fmt: skip
    )
    retrieval = kv_head_scores(wide, Loaded(), "retrieval", 256, (16, 64))
    assert retrieval["score"].tolist() == [0.4, 0.3]
    streaming = kv_head_scores(wide, Loaded(), "streaming", 20, (16, 64))
    assert streaming["score"].tolist() == pytest.approx([0.5, 0.2])  # 1 - the smallest stream_16 of each KV head
    assert (
        streaming_column(39, (16, 64)) == "stream_16" and streaming_column(40, (16, 64)) == "stream_64"
    )  # tie: larger
    # retrieval-streaming: retrieving KV heads (retrieval >= 0.01) first by retrieval, then the rest by outside mass
    wide_more = pd.concat([wide, wide.assign(layer=1)], ignore_index=True)
    wide_more.loc[4:, "retrieval"] = [0.005, 0.002, 0.009, 0.0]  # layer 1 retrieves nothing
    wide_more.loc[4:, "stream_16"] = [0.1, 0.2, 0.95, 0.9]  # its KV head 0 looks far, KV head 1 does not

    class Loaded2:
        layers = [Layer(0), Layer(1)]

    combined = kv_head_scores(wide_more, Loaded2(), "retrieval-streaming", 16, (16, 64))
    assert combined["score"].tolist() == pytest.approx([1.4, 1.3, 0.9, 0.1])
    with pytest.raises(HeadlabError, match="no 'retrieval' column"):
        kv_head_scores(wide.drop(columns="retrieval"), Loaded(), "retrieval", 256, (16, 64))


def test_duo_attention_files_give_the_policy_back_by_threshold_and_by_quantile():
    scores = _scores([[0.9, 0.1, 0.3], [0.5, 0.7, 0.2]])
    policy = choose_policy(scores, budget=0.55, context=100, sinks=2, window=9)
    files = duo_attention_files(policy)
    values = np.loadtxt(files["full_attention_heads.tsv"].splitlines(), delimiter="\t")
    assert values.shape == (2, 3)
    chosen = policy.table.pivot(index="layer", columns="kv_head", values="policy").values == "full"
    assert ((values >= 0.5) == chosen).all()  # DuoAttention's threshold
    config = json.loads(files["config.json"])
    assert (config["sink_size"], config["recent_size"]) == (2, 9)
    cut = np.quantile(values.flatten(), config["sparsity"], method="lower")  # the streaming share as a quantile
    assert ((values > cut) | ~chosen).all() and ((values <= cut) | chosen).all()
    # the ranking is kept: a higher score never gets a lower value
    order = policy.table.sort_values(["layer", "kv_head"])["score"].to_numpy()
    assert (np.argsort(order, kind="stable") == np.argsort(values.flatten(), kind="stable")).all()


@pytest.fixture
def tiny_checkpoint(tmp_path):
    return save_tiny("llama", tmp_path / "model", max_position_embeddings=512)


# A tiny policy run: streaming score (the tiny model has no retrieval pass at these lengths), 2 sinks + 16 recent
# tokens, the budget counted at 256 tokens.
POLICY = ["--data", "pydoc-topics", "--max-tokens", "256", "--seq-len", "64", "--context", "256", "--sinks", "2",
          "--window", "16", "--score", "streaming"]  # fmt: skip


def _policy_run(checkpoint, out, capsys, *extra, budget="0.5"):
    """`headlab kv-policy` on the tiny checkpoint into `out`; returns its stdout."""
    code, stdout, stderr = run_cli(["kv-policy", "--model", checkpoint, *POLICY, "--budget", budget, "--out", out,
                                    *extra], capsys)  # fmt: skip
    assert code == 0, stderr
    return stdout


def test_kv_policy_command_end_to_end(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "policy"
    stdout = _policy_run(tiny_checkpoint, out, capsys, budget="0.6")
    policy = read_policy(out)
    assert policy.kv_fraction() <= 0.6 + 1e-9
    assert (out / "duo_attention" / "full_attention_heads.tsv").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["policy"]["window"] == 16 and meta["statistics"]["tokens"] > 0
    assert "KV heads keep the whole cache" in stdout


def test_kv_policy_command_refuses_before_any_work(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "policy"
    for extra, message in (
        (["--context", "4096"], "maximum positions"),
        (["--budget", "0.01", "--context", "256"], "below what streaming"),
        (["--evaluate", "8k", "--context", "256"], "maximum positions"),
    ):
        code, _, stderr = run_cli(["kv-policy", "--model", tiny_checkpoint, "--out", out, *extra], capsys)
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
        assert not out.exists()


def test_retrieval_len_sets_the_retrieval_prompts(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "policy"
    retrieval = [a if a != "streaming" else "retrieval-streaming" for a in POLICY]
    code, _, stderr = run_cli(["kv-policy", "--model", tiny_checkpoint, *retrieval, "--budget", "0.6",
                               "--retrieval-len", "256", "--out", out], capsys)  # fmt: skip
    assert code == 0, stderr
    record = json.loads((out / "meta.json").read_text())["statistics"]["retrieval"]
    assert record["length"] == 256 and "skipped" not in record
    assert read_policy(out).kv_fraction() <= 0.6 + 1e-9


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--context", "abc"], "--context: cannot read 'abc'"),
        (["--context", "0"], "at least 1 token"),
        (["--retrieval-len", "2q"], "--retrieval-len: cannot read '2q'"),
        (["--retrieval-len", "256", "--score", "streaming"], "has none to set"),
        (["--retrieval-len", "4k", "--score", "retrieval"], "maximum positions"),
    ],
)
def test_token_lengths_are_refused_in_one_line(tiny_checkpoint, tmp_path, capsys, extra, message):
    out = tmp_path / "policy"
    code, _, stderr = run_cli(["kv-policy", "--model", tiny_checkpoint, "--context", "256", "--window", "16", *extra,
                               "--out", out], capsys)  # fmt: skip
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_out_on_the_stats_run_it_reads_is_refused(tiny_checkpoint, tmp_path, capsys):
    stats = tmp_path / "stats"
    stats.mkdir()
    (stats / "stats_wide.csv").write_text("layer,head\n0,0\n")
    code, _, stderr = run_cli(["kv-policy", "--model", tiny_checkpoint, "--stats", stats, "--out", stats,
                               "--overwrite"], capsys)  # fmt: skip
    assert code == 2 and "--stats" in stderr and len(stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in stats.iterdir()) == ["stats_wide.csv"]
    assert (stats / "stats_wide.csv").read_text() == "layer,head\n0,0\n"


def test_evaluation_measures_the_real_cache(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "policy"
    evaluate = ["--evaluate", "256", "--tasks", "passkey", "--samples", "1"]
    stdout = _policy_run(tiny_checkpoint, out, capsys, *evaluate, budget="0.6")
    memory = pd.read_csv(out / "memory.csv").set_index("model")
    original, policy = memory.loc["original"], memory.loc["policy"]
    assert original["kv_fraction_measured"] == 1.0
    # measured on the cache object = what the policy's arithmetic says at the slots the cache saw
    assert policy["kv_fraction_measured"] == pytest.approx(policy["kv_fraction_computed"], abs=1e-12)
    assert policy["kv_fraction_measured"] < 0.7
    accuracy = pd.read_csv(out / "long_context.csv")
    assert set(accuracy["model"]) == {"original", "policy"} and (accuracy["prompts"] == 3).all()
    positions = pd.read_csv(out / "positions.csv")
    assert set(positions["model"]) == {"original", "policy"}
    copying = pd.read_csv(out / "copying.csv")  # in-context copying, the policy applied as its mask
    assert copying["model"].tolist() == ["original", "policy"] and (copying["scored"] == 2 * 127).all()
    assert "measured cache at 256 tokens" in stdout and "copy@256:" in stdout


def test_eval_and_longeval_run_under_a_policy(tiny_checkpoint, tmp_path, capsys):
    import torch

    from headlab.core.data import TextSpec
    from headlab.core.loading import load_model
    from headlab.kv.policy import applied_policy
    from headlab.measure.evaluate import perplexity

    policy_dir = tmp_path / "policy"
    _policy_run(tiny_checkpoint, policy_dir, capsys)
    common = ["--model", tiny_checkpoint, "--data", "pydoc-topics", "--max-tokens", "512", "--max-length", "256",
              "--domains", "none", "--json"]  # fmt: skip
    code, plain_out, stderr = run_cli(["eval", *common], capsys)
    assert code == 0, stderr
    code, policy_out, stderr = run_cli(["eval", *common, "--kv-policy", policy_dir], capsys)
    assert code == 0, stderr
    plain, under = json.loads(plain_out), json.loads(policy_out)
    assert under["kv_policy"]["streaming_kv_heads"] > 0
    assert under["perplexity"] != pytest.approx(plain["perplexity"], rel=1e-6)  # 256-token windows, 16-token window
    # the same number as the library's masked policy
    loaded = load_model(str(tiny_checkpoint), device="cpu")
    text = TextSpec("pydoc-topics", split="eval", seq_len=256, max_tokens=512)
    with torch.no_grad(), applied_policy(loaded, read_policy(policy_dir)):
        expected = perplexity(loaded, text=text, progress=False).perplexity
    assert under["perplexity"] == pytest.approx(expected, rel=1e-9)

    out = tmp_path / "long"
    code, _, stderr = run_cli(
        ["longeval", "--model", tiny_checkpoint, "--data", "pydoc-topics", "--lengths", "256", "--depths", "0.5",
         "--samples", "1", "--kv-policy", policy_dir, "--out", out],  # fmt: skip
        capsys,
    )
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    measured = meta["kv_policy"]["measured_cache"]
    assert measured and all(row["cache_bytes"] > 0 for row in measured)


def test_a_policy_for_another_layout_is_refused(tiny_checkpoint, tmp_path, capsys):
    policy_dir = tmp_path / "policy"
    _policy_run(tiny_checkpoint, policy_dir, capsys)
    other = save_tiny("llama_mha", tmp_path / "mha", max_position_embeddings=512)
    code, _, stderr = run_cli(["eval", "--model", other, "--data", "pydoc-topics", "--kv-policy", policy_dir], capsys)
    assert code == 2 and "KV heads in layer 0" in stderr and len(stderr.strip().splitlines()) == 1
    code, _, stderr = run_cli(["eval", "--model", other, "--kv-policy", tmp_path], capsys)
    assert code == 2 and "not a kv-policy run" in stderr
