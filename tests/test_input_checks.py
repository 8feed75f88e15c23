"""Issue 29, trust at the edges: a fingerprint that follows every weight byte, configs checked against the tensors,
text that is not text, and the refusals that used to be tracebacks or misleading lines. The command-line cases
(one line, exit 2, nothing written) are rows of tests/test_bad_input.py; these check the library side."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import hostile
import pandas as pd
import pytest
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core import validate
from headlab.core.data import MAX_NOT_TEXT_SHARE, load_corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import checked_cache_dir, load_model
from headlab.viz.plots import plot_head_heatmap


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("checks") / "llama")


def _flip_byte_of(path: Path, tensor: str) -> None:
    """Change one byte inside `tensor`'s data, in place: same size, same header, same sampled blocks elsewhere."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])[tensor]["data_offsets"]
    raw[8 + length + (begin + end) // 2 + 1] ^= 0x40
    with open(path, "r+b") as handle:  # in place: the inode stays
        handle.write(raw)


def test_fingerprint_changes_when_one_attention_weight_is_edited_in_place(llama, tmp_path):
    copy = Path(shutil.copytree(llama, tmp_path / "copy"))
    edited = Path(shutil.copytree(llama, tmp_path / "edited"))
    cache = tmp_path / "fingerprints.json"
    original = validate.model_fingerprint(llama, cache)
    assert validate.model_fingerprint(copy, cache) == original
    assert validate.model_fingerprint(edited, cache) == original
    size = (edited / hostile.WEIGHTS).stat().st_size
    _flip_byte_of(edited / hostile.WEIGHTS, "model.layers.1.self_attn.q_proj.weight")
    assert (edited / hostile.WEIGHTS).stat().st_size == size
    assert validate.model_fingerprint(edited, cache) != original  # the cache entry of the old bytes is not reused
    assert validate.model_fingerprint(edited) != original  # and without a cache
    assert validate.model_fingerprint(copy, cache) == original


def test_fingerprint_cache_is_keyed_by_file_identity(llama, tmp_path):
    cache = tmp_path / "fingerprints.json"
    first = validate.model_fingerprint(llama, cache)
    entries = json.loads(cache.read_text())
    name = str((llama / hostile.WEIGHTS).resolve())
    assert entries[name]["inode"] == (llama / hostile.WEIGHTS).stat().st_ino
    # a forged digest under the file's current identity is what the next call returns: the file is not re-read
    entries[name]["sha256"] = "0" * 64
    cache.write_text(json.dumps(entries))
    assert validate.model_fingerprint(llama, cache) != first
    os.utime(llama / hostile.WEIGHTS)  # any change of mtime makes the entry stale
    assert validate.model_fingerprint(llama, cache) == first
    cache.write_text("{not json")  # a damaged cache costs a recomputation, never a refusal
    assert validate.model_fingerprint(llama, cache) == first


def test_score_table_of_the_original_is_foreign_to_a_model_edited_in_place(llama, tmp_path):
    edited = Path(shutil.copytree(llama, tmp_path / "edited"))
    original = load_model(str(edited), device="cpu")
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame([{"layer": a, "head": b, "importance": 1.0} for a in range(2) for b in range(4)]).to_csv(
        run / "importance.csv", index=False
    )
    (run / "meta.json").write_text(json.dumps(original.describe()))
    validate.check_table_origin(run, original, "scores")  # the model it was computed on
    _flip_byte_of(edited / hostile.WEIGHTS, "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(HeadlabError, match="was computed on"):
        validate.check_table_origin(run, load_model(str(edited), device="cpu"), "scores")


@pytest.mark.parametrize(
    ("variant", "fragment"),
    [
        ("fewerlayers", "the checkpoint holds model.layers.0 to model.layers.1, config field num_hidden_layers = 1"),
        ("morelayers", "num_hidden_layers = 3 builds model.layers.0 to model.layers.2, the checkpoint has no"),
        ("wrongshape", "model.layers.0.mlp.down_proj.weight has shape [64, 128] in the checkpoint"),
        ("unknownact", "config field hidden_act = 'swishy' is not known"),
        ("unknownrope", "config field rope_parameters.rope_type = 'wobbly' is not known"),
        ("bigtokenizer", "the model's input embeddings have 128 rows"),
        ("brokentokenizer", "cannot load the tokenizer of"),
    ],
)
def test_checkpoints_that_contradict_themselves_are_refused_by_name(variant, fragment, llama, tmp_path):
    made = hostile.contradicting_checkpoints(llama, tmp_path)
    with pytest.raises(HeadlabError, match=None) as error:
        load_model(str(made[variant]), device="cpu")
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_shape_refusal_names_the_config_field(llama, tmp_path):
    made = hostile.contradicting_checkpoints(llama, tmp_path)
    with pytest.raises(HeadlabError, match=r"config makes it \[64, 96\] \(config field intermediate_size = 96\)"):
        load_model(str(made["wrongshape"]), device="cpu")


def test_bytes_saved_as_text_are_not_a_corpus(tmp_path):
    random_bytes = tmp_path / "random.txt"
    random_bytes.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(HeadlabError, match="is not UTF-8 text: byte 0x80 at offset 128"):
        load_corpus(str(random_bytes))
    controls = tmp_path / "controls.txt"  # valid UTF-8, but mostly control characters
    controls.write_text(SAMPLE_TEXT[:200] + "\x00\x01\x02" * 100)
    with pytest.raises(HeadlabError, match="control or replacement characters"):
        load_corpus(str(controls))
    # below the threshold: text with a few stray control characters (and a UTF-8 byte-order mark) is text
    text = SAMPLE_TEXT
    stray = int(len(text) * MAX_NOT_TEXT_SHARE / 2)
    near = tmp_path / "near.txt"
    near.write_bytes(b"\xef\xbb\xbf" + (text + "\x07" * stray).encode())
    assert load_corpus(str(near)).text == text + "\x07" * stray
    load_corpus(None)  # the embedded corpus is text


def test_cache_folder_that_is_a_file_is_refused_before_work(tmp_path, monkeypatch):
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HEADLAB_CACHE", str(blocker))
    with pytest.raises(HeadlabError, match="HEADLAB_CACHE .* is a file, not a folder"):
        checked_cache_dir()
    monkeypatch.setenv("HEADLAB_CACHE", str(blocker / "below"))
    with pytest.raises(HeadlabError, match="cannot be a folder"):
        checked_cache_dir()
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "fresh" / "cache"))
    assert checked_cache_dir() == tmp_path / "fresh" / "cache"  # creatable: accepted, nothing made yet
    assert not (tmp_path / "fresh").exists()


def test_cli_refuses_a_cache_file_before_loading_anything(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HEADLAB_CACHE", str(blocker))
    monkeypatch.chdir(tmp_path)
    for args in (["info", "--device", "cpu"], ["stats", "--device", "cpu", "--out", "s"]):
        code, out, err = run_cli(args, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and "HEADLAB_CACHE" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-file"]


def test_heatmap_refuses_duplicate_heads_and_empty_tables():
    rows = [{"layer": 0, "head": 0, "importance": 1.0}, {"layer": 0, "head": 1, "importance": 2.0}]
    plot_head_heatmap(pd.DataFrame(rows), "importance")
    with pytest.raises(HeadlabError, match="layer 0 head 1 more than once"):
        plot_head_heatmap(pd.DataFrame([*rows, {"layer": 0, "head": 1, "importance": 9.0}]), "importance")
    with pytest.raises(HeadlabError, match="no rows"):
        plot_head_heatmap(pd.DataFrame(columns=["layer", "head", "importance"]), "importance")


def test_plot_and_prune_refuse_the_same_duplicate_table(tmp_path, capsys):
    """The check is shared: plot says what prune's score reader says about the same table."""
    from headlab.pruning.scores import read_scores

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(hostile.duplicate_scores(tmp_path), run / "importance.csv")
    code, _, err = run_cli(["plot", run], capsys)
    assert code == 2 and "lists layer 0 head 1 more than once" in err
    layers = load_model(str(save_tiny("llama", tmp_path / "llama")), device="cpu").layers
    with pytest.raises(HeadlabError, match="lists layer 0 head 1 more than once"):
        read_scores(run / "importance.csv", layers)


def test_uppercase_gguf_suffix_is_a_gguf_file(tmp_path):
    fake = tmp_path / "model.GGUF"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(HeadlabError) as error:
        load_model(str(fake), device="cpu")
    assert "no such model" not in str(error.value) and "hub" not in str(error.value)
    assert "GGUF" in str(error.value)
