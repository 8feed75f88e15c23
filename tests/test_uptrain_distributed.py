"""Uptraining under torchrun on CPU (gloo): N processes with batch B each train exactly as one process with batch N x B.

Each rank streams every N-th window of the same shuffled order and the gradients are averaged; when every window of
the steps run is full length, the mean of the N ranks' per-token means is the one process's per-token mean, so
losses, the kept step and the saved weights agree up to floating-point summation order."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from tiny_text import launch_headlab, saved_kv_pair, tiny_tokenizer

from headlab.core.data import Corpus, split_text
from headlab.recovery.uptrain import UptrainConfig, heldout_split, stream_batches

STEPS, SEQ_LEN, BATCH, HELDOUT = 3, 32, 4, 128


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher dir, student dir, corpus file): the tiny llama and its 2 -> 1 KV-head mean-pooled copy."""
    return saved_kv_pair(tmp_path_factory.mktemp("uptrain-dist"))


def test_the_windows_of_the_steps_run_are_full_length(pair):
    """The premise of the equality below: a short window would weigh its tokens differently in the two runs."""
    _, _, corpus = pair
    tokenizer = tiny_tokenizer()
    part = split_text(Corpus(str(corpus), corpus.read_text()), "calibration")
    train_text, _ = heldout_split(tokenizer, part.text, HELDOUT)
    config = UptrainConfig(seq_len=SEQ_LEN, batch_size=BATCH)
    stream = stream_batches(tokenizer, train_text, config, tokenizer.pad_token_id)
    for _ in range(STEPS):
        _, attention_mask, epoch = next(stream)
        assert epoch == 0 and attention_mask.shape == (BATCH, SEQ_LEN) and bool(attention_mask.all())


def test_two_processes_train_as_one_with_their_batches_together(pair, tmp_path):
    teacher, student, corpus = pair
    # float32: one process and two agree up to float32 summation order; bfloat16 autocast (the default on a CPU
    # with its kernels) rounds each rank's smaller batch differently
    common = ["uptrain", "--student", student, "--teacher", teacher, "--data", corpus, "--device", "cpu", "--no-bf16"]
    # cross-entropy at a high lr: the random tiny model learns the text's characters at once, so held-out perplexity
    # falls and a trained state (not the start) is the one kept and compared
    common += ["--objective", "ce", "--steps", STEPS, "--lr", "1e-2", "--seq-len", SEQ_LEN, "--heldout-tokens", HELDOUT]
    common += ["--eval-tokens", "0", "--eval-seq-len", SEQ_LEN, "--no-gradient-checkpointing"]
    runs, kept = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"up-{nproc}"
        done = launch_headlab([*common, "--batch-size", BATCH // nproc, "--out", out], nproc)
        assert done.returncode == 0, done.stderr[:2000]  # the error comes first, the launcher's report after
        assert done.stdout.count("written:") == 1  # rank 0 alone writes and prints
        runs[nproc] = (pd.read_csv(out / "recovery" / "curve.csv"), load_file(out / "model.safetensors"))
        meta = json.loads((out / "recovery" / "meta.json").read_text())["uptrain"]
        kept[nproc] = (meta["processes"], meta["kept_step"])
    (one, weights_one), (two, weights_two) = runs[1], runs[2]
    assert kept[1][0] == 1 and kept[2][0] == 2 and kept[1][1] == kept[2][1] > 0
    assert list(one["step"]) == list(two["step"]) == list(range(STEPS + 1))
    assert list(one["tokens"]) == list(two["tokens"]) == [step * BATCH * SEQ_LEN for step in range(STEPS + 1)]
    for column in ("loss", "kl", "ce", "heldout_perplexity"):
        assert two[column].to_numpy() == pytest.approx(one[column].to_numpy(), rel=1e-4, nan_ok=True), column
    assert weights_one.keys() == weights_two.keys()
    moved = 0.0
    original = load_file(student / "model.safetensors")
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        moved = max(moved, float((tensor - original[name]).abs().max()))
    assert moved > 1e-4  # the weights compared were trained (a kept step > 0), so closeness is not vacuous
