"""headlab.checkpoint: a saved checkpoint reloads to the same logits (checked before anything is published), a
mismatch is caught and nothing is written, an existing or self-overlapping --out is refused before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
from models import tiny_inputs, tiny_model

from headlab.checkpoint import (
    META_FILE,
    CheckpointMismatch,
    check_checkpoint_out,
    describe_check,
    logits_of,
    save_checkpoint,
    verify_reload,
)
from headlab.errors import HeadlabError


def test_verify_reload_catches_a_mismatch(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2)
    with pytest.raises(CheckpointMismatch):
        verify_reload(tmp_path / "ckpt", model)


def test_saved_checkpoint_reloads_to_the_same_logits_and_records_its_check(tmp_path):
    model = tiny_model("llama")
    check = save_checkpoint(model, None, tmp_path / "out", meta={"edit": "none"})
    assert check.max_abs_diff <= check.tolerance
    record = json.loads((tmp_path / "out" / META_FILE).read_text())
    assert record["edit"] == "none" and record["verification"]["max_abs_diff"] == check.max_abs_diff
    assert "max |logit diff|" in describe_check(record["verification"])
    reloaded = type(model).from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    inputs = tiny_inputs("llama")
    torch.testing.assert_close(logits_of(reloaded, inputs), logits_of(model, inputs), rtol=0, atol=1e-5)


def test_a_failed_verification_publishes_nothing(tmp_path, monkeypatch):
    import headlab.checkpoint as checkpoint

    def mismatch(*args, **kwargs):
        raise CheckpointMismatch("differs")

    monkeypatch.setattr(checkpoint, "verify_reload", mismatch)
    with pytest.raises(CheckpointMismatch):
        save_checkpoint(tiny_model("llama"), None, tmp_path / "out")
    assert os.listdir(tmp_path) == []  # neither the target nor a temporary directory is left


def test_out_must_be_new_and_apart_from_the_source(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(HeadlabError, match="already exists"):
        check_checkpoint_out(tmp_path / "exists", overwrite=False)
    check_checkpoint_out(tmp_path / "exists", overwrite=True)
    (tmp_path / "source").mkdir()
    for out in (tmp_path / "source", tmp_path / "source" / "inside", tmp_path):
        with pytest.raises(HeadlabError, match="source model"):
            check_checkpoint_out(out, overwrite=True, source=tmp_path / "source")
