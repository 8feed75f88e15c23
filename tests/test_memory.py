"""Memory-bounded paths give the same answers as the plain ones: checkpoint verification with the reloaded copy's
blocks streamed from disk (vanilla, per-layer layouts, KV conversions; a tampered file is caught), and importance
scored one sequence per backward pass with activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core import reload_stream
from headlab.core.checkpoint import CheckpointMismatch, save_checkpoint, verify_reload
from headlab.core.loading import from_model
from headlab.measure.importance import head_importance


@pytest.fixture
def always_stream(monkeypatch):
    monkeypatch.setattr(reload_stream, "STREAM_ABOVE_BYTES", 0)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "gemma3"])
def test_streamed_verification_of_a_vanilla_checkpoint(name, tmp_path, always_stream):
    model = tiny_model(name)
    check = save_checkpoint(model, None, tmp_path / "c")
    assert "streamed from disk" in check.loader and check.max_abs_diff <= 1e-6


def test_streamed_verification_of_per_layer_and_kv_converted_layouts(tmp_path, always_stream):
    from headlab.kv.gqa import convert
    from headlab.pruning.prune import apply_physical, physical_layout, prepare_config

    loaded = from_model(tiny_model("llama"))
    layout = physical_layout(loaded.layers, [{0, 1}, {3}])
    apply_physical(loaded, layout)
    prepare_config(loaded, layout)
    check = save_checkpoint(loaded.model, None, tmp_path / "pruned")
    assert check.loader.startswith("headlab load_pruned") and check.max_abs_diff <= 1e-6
    converted = from_model(tiny_model("llama"))
    convert(converted, 1)
    assert save_checkpoint(converted.model, None, tmp_path / "mqa").max_abs_diff <= 1e-6


def test_streamed_verification_catches_a_changed_tensor(tmp_path, always_stream):
    model = tiny_model("llama")
    save_checkpoint(model, None, tmp_path / "c")
    weights = load_file(tmp_path / "c" / "model.safetensors")
    weights["model.layers.1.self_attn.v_proj.weight"] += 0.1
    save_file(weights, tmp_path / "c" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="differs"):
        verify_reload(tmp_path / "c", model)


def test_streaming_is_chosen_by_size(monkeypatch):
    model = tiny_model("llama")
    assert not reload_stream.should_stream(model)  # tiny: a second copy is cheap
    monkeypatch.setattr(reload_stream, "STREAM_ABOVE_BYTES", reload_stream.model_bytes(model) - 1)
    assert reload_stream.should_stream(model)


@pytest.mark.parametrize("method", ["grad", "taylor"])
def test_importance_one_row_per_pass_with_checkpointing_equals_whole_batches(tmp_path, method):
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    common = dict(method=method, data=str(corpus), seq_len=32, batch_size=4, max_tokens=256, progress=False)
    whole = head_importance(loaded, **common)
    rows = head_importance(loaded, max_rows=1, gradient_checkpointing=True, **common)
    assert rows.meta["batches"] == 4 * whole.meta["batches"]
    assert rows.meta["scored_tokens"] == whole.meta["scored_tokens"]
    for a, b in zip(whole.raw, rows.raw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_the_low_memory_mode_is_chosen_by_the_memory_available(tmp_path, monkeypatch):
    """Whole batches without recomputation where the estimate fits the memory available, one sequence per pass with
    recomputed blocks where it does not; the scores are the same either way."""
    from headlab.core.data import TextSpec
    from headlab.measure import importance
    from headlab.pruning.scores import ScoreRequest, resolved_low_memory, score_heads

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    request = ScoreRequest(TextSpec(str(corpus), None, "calibration", 32, 4, 256), progress=False)
    estimate = importance.gradient_pass_bytes(loaded, 4, 32)
    assert estimate > 0
    assert importance.gradient_pass_bytes(loaded, 8, 32) == 2 * estimate  # linear in the rows of a pass
    passes = []
    real = importance.head_importance

    def recording(*args, **kwargs):
        passes.append((kwargs["max_rows"], kwargs["gradient_checkpointing"]))
        return real(*args, **kwargs)

    monkeypatch.setattr("headlab.pruning.scores.head_importance", recording)
    scores = {}
    for available, low in ((100 * estimate, False), (estimate, True)):
        monkeypatch.setattr(importance, "available_memory", lambda device, b=available: b)
        assert importance.choose_low_memory(loaded, 4, 32) is low
        assert resolved_low_memory(loaded, request) is low
        scores[low] = score_heads("grad", loaded, request)
    assert passes == [(None, False), (1, True)]
    for a, b in zip(scores[False], scores[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    # Asked for, either mode holds whatever the memory; unreadable memory means the low-memory mode.
    assert resolved_low_memory(loaded, ScoreRequest(request.text, low_memory=False)) is False
    monkeypatch.setattr(importance, "available_memory", lambda device: None)
    assert importance.choose_low_memory(loaded, 4, 32) is True
    assert importance.choose_low_memory(loaded, 4, 32, available=100 * estimate) is False


def test_available_memory_reads_the_host():
    from headlab.measure.importance import available_memory

    assert available_memory("cpu") > 0


def test_a_model_larger_than_the_memory_available_is_refused_before_loading(tmp_path, monkeypatch):
    """load_model compares the weights' bytes in the dtype asked (safetensors bytes scaled from the stored dtype) with
    the memory available and refuses in one line naming the ways around it; a device map is not checked (it places
    what fits and offloads the rest)."""
    from tiny_text import save_tiny

    from headlab.core import loading
    from headlab.core.errors import HeadlabError

    directory = save_tiny("llama", tmp_path / "model")
    stored = sum(p.stat().st_size for p in directory.glob("*.safetensors"))  # float32 on disk
    monkeypatch.setattr(loading, "available_memory", lambda device: stored // 2 + 1000)
    with pytest.raises(HeadlabError, match=r"B in float32.*--dtype bfloat16.*--max-memory.*--streaming"):
        loading.load_model(str(directory), device="cpu")
    assert loading.load_model(str(directory), device="cpu", dtype="bfloat16").dtype == torch.bfloat16  # half fits
    assert loading.load_model(str(directory), device="cpu", device_map="auto").model is not None


def test_convert_mla_refuses_when_the_second_model_would_not_fit(tmp_path, monkeypatch, capsys):
    """convert-mla builds the MLA model beside the loaded one: with less memory available than the loaded model's
    bytes it stops in one line, before converting, and writes nothing."""
    from tiny_text import run_cli, save_tiny

    from headlab.core import loading

    directory = save_tiny("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
    real = loading.available_memory
    calls = []

    def shrinking(device):  # enough to load the model, too little for a second copy
        calls.append(device)
        return real(device) if len(calls) == 1 else 1000

    monkeypatch.setattr(loading, "available_memory", shrinking)
    code, _, err = run_cli(["convert-mla", "--model", directory, "--data", tmp_path / "text.txt", "--budget", "gqa",
                            "--out", tmp_path / "out"], capsys)  # fmt: skip
    assert code == 2 and "builds the MLA model beside the loaded one" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


def test_a_model_offloaded_to_disk_scores_in_the_low_memory_mode(tmp_path):
    """Every block on disk (one device in the map): a whole-batch gradient pass would keep each block's weights, read
    in for the forward, until the backward (16 GB for the 8B shape), so the low-memory mode is chosen."""
    from tiny_text import save_tiny

    from headlab.core.loading import load_model, offloaded_modules
    from headlab.measure import importance

    directory = save_tiny("llama", tmp_path / "model")
    offloaded = load_model(str(directory), device="cpu", device_map="auto", max_memory=1000)
    assert set(offloaded.model.hf_device_map.values()) == {"disk"} and offloaded_modules(offloaded.model)
    assert importance.choose_low_memory(offloaded, 1, 8, available=10**12) is True
    plain = load_model(str(directory), device="cpu")
    assert importance.choose_low_memory(plain, 1, 8, available=10**12) is False
