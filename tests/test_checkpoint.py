"""headlab.core.checkpoint: a saved checkpoint reloads to the same logits (checked before anything is published), a
mismatch is caught and nothing is written, an existing or self-overlapping --out is refused before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
from models import tiny_inputs, tiny_model

from headlab.core.checkpoint import (
    META_FILE,
    CheckpointMismatch,
    check_checkpoint_out,
    describe_check,
    logits_of,
    save_checkpoint,
    save_with_record,
    verify_reload,
)
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model


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
    import headlab.core.checkpoint as checkpoint

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


def test_save_with_record_publishes_weights_record_and_extras_together(tmp_path):
    model = tiny_model("llama")

    def extras(staging):
        assert (staging / META_FILE).is_file() and not (tmp_path / "out").exists()  # staged, not yet published
        (staging / "record").mkdir()
        (staging / "record" / "table.csv").write_text("layer,head\n0,1\n")

    check = save_with_record(from_model(model), tmp_path / "out", {"edit": "none"}, extras)
    assert check["max_abs_diff"] <= check["tolerance"]
    assert (tmp_path / "out" / "record" / "table.csv").read_text() == "layer,head\n0,1\n"
    record = json.loads((tmp_path / "out" / META_FILE).read_text())
    assert record["edit"] == "none" and record["verification"]["max_abs_diff"] == check["max_abs_diff"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging directory left beside it


@pytest.mark.parametrize("stage", ["verification", "extras"])
def test_save_with_record_leaves_nothing_when_a_stage_fails(stage, tmp_path, monkeypatch):
    import headlab.core.checkpoint as checkpoint

    def mismatch(*args, **kwargs):
        raise CheckpointMismatch("differs")

    def extras(staging):
        (staging / "record").mkdir()
        if stage == "extras":
            raise OSError("the record could not be written")

    if stage == "verification":
        monkeypatch.setattr(checkpoint, "verify_reload", mismatch)
    with pytest.raises((CheckpointMismatch, OSError)):
        save_with_record(from_model(tiny_model("llama")), tmp_path / "out", {}, extras)
    assert os.listdir(tmp_path) == []  # neither the target nor a temporary directory is left


def test_save_with_record_keeps_an_existing_output_without_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(HeadlabError, match="already exists"):
        save_with_record(from_model(tiny_model("llama")), tmp_path / "out", {})
    assert os.listdir(tmp_path / "out") == ["old.txt"]
    save_with_record(from_model(tiny_model("llama")), tmp_path / "out", {"edit": "new"}, overwrite=True)
    assert not (tmp_path / "out" / "old.txt").exists()
    assert json.loads((tmp_path / "out" / META_FILE).read_text())["edit"] == "new"
