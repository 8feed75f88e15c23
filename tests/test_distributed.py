"""torchrun data parallelism on CPU (gloo): two processes give the numbers of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_text import SAMPLE_TEXT, save_tiny


def torchrun(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "headlab",
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)


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
