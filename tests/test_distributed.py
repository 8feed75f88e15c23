"""torchrun data parallelism on CPU (gloo): two processes give the numbers of one."""

from __future__ import annotations

import json

import pytest
from tiny_text import SAMPLE_TEXT, save_tiny
from tiny_text import launch_headlab as torchrun


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    (root / "sample.txt").write_text(SAMPLE_TEXT)
    return save_tiny("llama", root / "model"), root / "sample.txt"


def test_eval_two_processes_equal_one(setup):
    model, data = setup
    args = [
        "eval",
        "--model",
        model,
        "--data",
        data,
        "--seq-len",
        "32",
        "--stride",
        "16",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--json",
    ]
    one, two = torchrun(args, 1), torchrun(args, 2)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    single, double = json.loads(one.stdout), json.loads(two.stdout)  # only rank 0 prints
    assert double["scored_tokens"] == single["scored_tokens"]
    assert double["perplexity"] == pytest.approx(single["perplexity"], rel=1e-6)


@pytest.mark.parametrize("command", ["importance", "stats"])
def test_two_processes_give_the_table_of_one(setup, tmp_path, command):
    import pandas as pd

    model, data = setup
    tables = []
    for nproc in (1, 2):
        out = tmp_path / f"{command}-{nproc}"
        args = [
            command,
            "--model",
            model,
            "--data",
            data,
            "--seq-len",
            "24",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--out",
            out,
        ] + (["--induction-len", "16", "--induction-count", "3"] if command == "stats" else [])
        done = torchrun(args, nproc)
        assert done.returncode == 0, done.stderr[-2000:]
        name = "importance" if command == "importance" else "stats"
        tables.append(pd.read_csv(out / f"{name}.csv"))
    one, two = tables
    keys = [c for c in ("layer", "head", "kv_head", "statistic") if c in one.columns]
    assert one[keys].equals(two[keys])
    value = "importance_raw" if command == "importance" else "value"
    assert one[value].to_numpy() == pytest.approx(two[value].to_numpy(), rel=1e-5, abs=1e-9, nan_ok=True)


@pytest.mark.parametrize(
    "command",
    [
        ["prune", "--heads", "0:1;1:0,3", "--mode", "physical", "--max-tokens", "64", "--seq-len", "32"],
        ["convert-gqa", "--kv-heads", "2", "--max-tokens", "64", "--seq-len", "32", "--calibration-tokens", "64"],
    ],
    ids=["prune", "convert-gqa"],
)
def test_editing_commands_under_torchrun_write_once(setup, tmp_path, command):
    """Every rank runs the edit (its evaluations all-reduce), only rank 0 writes --out: the checkpoint equals one
    process's tensor for tensor, the summary is printed once, and the other rank's scratch copy is gone."""
    from safetensors.torch import load_file

    model, data = setup
    weights = []
    for nproc in (1, 2):
        out, scratch = tmp_path / f"out-{nproc}", tmp_path / f"tmp-{nproc}"
        scratch.mkdir()
        done = torchrun([*command, "--model", model, "--data", data, "--out", out], nproc, TMPDIR=str(scratch))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("reload check") == 1
        assert not any(scratch.glob("headlab-rank*")), "a rank's private output was left behind"
        weights.append(load_file(out / "model.safetensors"))
    one, two = weights
    assert one.keys() == two.keys()
    for name in one:
        assert one[name].equal(two[name]), name
