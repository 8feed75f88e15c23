"""`convert-mla --streaming` (headlab.kv.mla_streaming): the tensors of the in-memory conversion with the same plan
and calibration windows, written one attention layer at a time from a model whose blocks may wait on disk."""

from __future__ import annotations

import json

import pytest
import torch
from test_streaming import stored_tensors
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core.data import TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model
from headlab.kv import mla
from headlab.kv.mla_streaming import convert_mla_streaming

PLANS = [dict(kv_lora_rank=24, rope_dim=8), dict(kv_lora_rank=12, rope_dim=4, q_lora_rank=40)]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "sample.txt"
    path.write_text(SAMPLE_TEXT * 4)
    return TextSpec(data=str(path), split="calibration", seq_len=32, batch_size=4, max_tokens=512)


def both_ways(name: str, tmp_path, text, plan: dict, **load):
    """(streamed directory, in-memory directory): the same plan and windows, in memory (convert_to_mla + save_mla,
    as convert-mla runs them) and streamed from the saved checkpoint."""
    source = save_tiny(name, tmp_path / "source")
    reference = load_model(str(source), device="cpu")
    batches = text.batches(reference.tokenizer, max_positions=64)
    plan_in_memory = mla.plan_mla(reference, **plan)
    converted, record = mla.convert_to_mla(reference, plan_in_memory, batches, progress=False)
    mla.save_mla(converted, tmp_path / "memory", record)
    loaded = load_model(str(source), device="cpu", **load)
    streamed_plan = mla.plan_mla(loaded, **plan, resident=False)
    convert_mla_streaming(loaded, source, tmp_path / "streamed", streamed_plan, batches, max_shard_bytes=40_000,
                          progress=False)  # fmt: skip
    return tmp_path / "streamed", tmp_path / "memory"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("plan", PLANS, ids=["latent", "low-rank-query"])
def test_streamed_mla_equals_the_in_memory_conversion(name, plan, tmp_path, text):
    """Bit for bit: the Grams spilled to files, the layers converted one at a time and their norms folded one at a
    time give the in-memory conversion's tensors (q/k-norm sources, query biases and a low-rank query included)."""
    streamed, memory = both_ways(name, tmp_path, text, plan)
    got, expected = stored_tensors(streamed), stored_tensors(memory)
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    config, reference = (json.loads((d / "config.json").read_text()) for d in (streamed, memory))
    assert {k: v for k, v in config.items() if k != "transformers_version"} == {
        k: v for k, v in reference.items() if k != "transformers_version"
    }
    record = json.loads((streamed / "headlab.json").read_text())
    assert record["streaming"] is True and record["latent_norm_fold"]["norms_folded"] >= 2
    assert not list(tmp_path.glob(".headlab-grams-*")), "the Gram files were left behind"


def test_calibrating_with_the_blocks_on_disk_gives_the_same_model(tmp_path, text):
    """The source offloaded to disk (--max-memory) runs the calibration passes through accelerate's hooks: the
    converted tensors match the in-memory conversion's to float32 rounding."""
    streamed, memory = both_ways("llama", tmp_path, text, PLANS[0], device_map="auto", max_memory=20_000)
    got, expected = stored_tensors(streamed), stored_tensors(memory)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def test_the_streamed_checkpoint_runs_in_vanilla_transformers(tmp_path, text):
    from transformers import AutoModelForCausalLM

    streamed, memory = both_ways("llama", tmp_path, text, PLANS[0])
    ids = torch.arange(3, 19).reshape(1, 16)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(streamed).eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(memory).eval()(input_ids=ids).logits
    assert torch.equal(a, b)


def test_the_rope_dim_search_is_refused_with_the_candidates(tmp_path, text):
    source = save_tiny("llama", tmp_path / "source")
    loaded = load_model(str(source), device="cpu")
    plan = mla.plan_mla(loaded, "mqa", resident=False)
    batches = text.batches(loaded.tokenizer, max_positions=64)
    with pytest.raises(HeadlabError, match="give the split, e.g. --rope-dim"):
        convert_mla_streaming(loaded, source, tmp_path / "out", plan, batches, progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_convert_mla_streaming(tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "source")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
    args = ["convert-mla", "--streaming", "--model", source, "--data", tmp_path / "text.txt", "--seq-len", "32",
            "--calibration-tokens", "256", "--out", tmp_path / "out"]  # fmt: skip
    code, out, err = run_cli([*args, "--kv-lora-rank", "24", "--rope-dim", "8"], capsys)
    assert code == 0, err
    assert "streaming" in out and "structural check" in out and (tmp_path / "out" / "headlab.json").is_file()
    code, _, err = run_cli([*args[:-1], tmp_path / "other", "--budget", "mqa"], capsys)
    assert code == 2 and "--rope-dim" in err.strip().splitlines()[-1] and not (tmp_path / "other").exists()
    code, _, err = run_cli([*args[:-1], tmp_path / "other", "--kv-lora-rank", "24", "--rope-dim", "8", "--recover",
                            "local"], capsys)  # fmt: skip
    assert code == 2 and "--streaming" in err.strip().splitlines()[-1]
