"""Smoke tests of the experiment scripts: --help, and a run over two tiny saved models and a small text file whose
tables agree with the API they wrap."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from tiny_text import SAMPLE_TEXT, save_tiny

from headlab.core.cpu_matmul import BLOCK_ELEMENTS
from headlab.runtimes.gguf_export import ENCODE_BLOCK_BYTES

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripts")
    corpus = root / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    return {
        "llama": save_tiny("llama", root / "llama"),
        "qwen2": save_tiny("qwen2", root / "qwen2"),
        "gpt2": save_tiny("gpt2", root / "gpt2"),
        "corpus": corpus,
    }


@pytest.mark.parametrize("name", ["pruning_study", "gqa_study"])
def test_help(name):
    result = subprocess.run([sys.executable, SCRIPTS / f"{name}.py", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage:" in result.stdout and "--out" in result.stdout


SMALL = ["--eval-tokens", "64", "--seq-len", "32", "--batch-size", "2", "--quiet"]


def test_pruning_study(models, tmp_path):
    study = load_script("pruning_study")
    args = [models["llama"], models["qwen2"], "--data", models["corpus"], "--fractions", "0,0.5"]
    out = study.main(
        [str(a) for a in args] + SMALL + ["--calibration-tokens", "64", "--seeds", "0", "--out", str(tmp_path / "s")]
    )
    table = pd.read_csv(out / "study.csv")
    assert set(table["model"]) == {str(models["llama"]), str(models["qwen2"])}
    assert set(table["order"]) == {"importance", "random"}
    unpruned = table[table["pruned_heads"] == 0]
    assert (unpruned["relative_perplexity"] == 1.0).all()
    # 4 heads x 2 layers, half pruned: 4 heads per model and order.
    assert set(table.loc[table["fraction"] == 0.5, "pruned_heads"]) == {4}
    for model in table["model"].unique():
        per_model = pd.read_csv(out / study.slug(model) / "sweep.csv")
        assert per_model["perplexity"].tolist() == pytest.approx(
            table.loc[table["model"] == model, "perplexity"].tolist()
        )
    assert (out / "study.png").stat().st_size > 10_000
    with pytest.raises(Exception, match="overwrite=True"):
        study.main([str(models["llama"]), "--out", str(out)])


def test_gqa_study_skips_models_without_kv_heads(models, tmp_path, capsys):
    study = load_script("gqa_study")
    args = [models["llama"], models["gpt2"], "--data", models["corpus"], "--groupings", "contiguous"]
    out = study.main([str(a) for a in args] + SMALL + ["--calibration-tokens", "64", "--out", str(tmp_path / "g")])
    assert "skipped" in capsys.readouterr().out
    table = pd.read_csv(out / "study.csv")
    assert set(table["model"]) == {str(models["llama"])}
    assert sorted(table["kv_heads"]) == [1, 2, 4]
    by_g = table.set_index("kv_heads")
    assert by_g.loc[2, "relative_kv_bytes"] == 1.0 and by_g.loc[1, "relative_kv_bytes"] == 0.5
    assert by_g.loc[4, "relative_perplexity"] == pytest.approx(1.0, rel=1e-5)  # expanding is lossless
    assert (out / study.slug(str(models["llama"])) / "sweep.csv").is_file()
    with pytest.raises(Exception, match="--pools"):
        study.main([str(models["llama"]), "--pools", "median", "--out", str(tmp_path / "x")])


def test_cost_model_formulas_against_hand_counts():
    """The cost model's sizes are the shape's own tensors counted by hand, and its times add the terms it names."""
    cost = load_script("cost_model")
    tiny = cost.Shape("tiny", layers=2, hidden=8, mlp=16, heads=2, kv_heads=1, head_dim=4, vocab=32)
    # per layer: q and o 8x8 each, k and v 8x4 each, gate/up/down 8x16 each, two norms of 8
    assert tiny.layer_parameters == 2 * 64 + 2 * 32 + 3 * 128 + 16
    assert tiny.parameters == 2 * 32 * 8 + 2 * tiny.layer_parameters + 8
    assert tiny.attention_parameters == 2 * (2 * 64 + 2 * 32)
    assert cost.memory_streaming(tiny) == cost.R0 + 32 * 8 * 2
    # the export writes each matrix a block of rows at a time: one 64 MiB float32 block and its f16 encoding
    assert cost.memory_offloaded(tiny, 100, export=True) == cost.R0 + 100 + 32 * 8 * 2 + 1.5 * 64 * 2**20
    assert cost.memory_offloaded(tiny, 100, unembedding=True) == cost.R0 + 100 + 2 * (32 * 8 * 2)
    assert cost.EXPORT_BLOCK == 1.5 * ENCODE_BLOCK_BYTES  # the formula follows the exporter's block
    # eval and importance read every offloaded weight through mapped pages: one upcast block, the logits of 10 tokens
    # (2 float32 copies of 10 x 32, 3 with the gradient) and, for the gradient, what each of the 2 blocks keeps
    assert cost.memory_offloaded_reader(tiny, 100, tokens=10) == cost.R0 + 100 + cost.UPCAST_BLOCK + 2 * 10 * 32 * 4
    kept = 2 * cost.KEPT_PER_BLOCK * 10 * 8 * 4
    assert cost.memory_offloaded_reader(tiny, 100, gradient=True, tokens=10) == pytest.approx(
        cost.R0 + 100 + cost.UPCAST_BLOCK + 3 * 10 * 32 * 4 + kept
    )
    assert cost.UPCAST_BLOCK == 4 * BLOCK_ELEMENTS  # the formula follows cpu_matmul's float32 row block
    assert cost.reader_flops(tiny, 10, "importance") == 3 * cost.reader_flops(tiny, 10, "eval")
    assert cost.reader_flops(tiny, 10, "eval") == 2 * (tiny.parameters - 32 * 8) * 10
    W = tiny.parameters * 2
    assert cost.time_through(tiny, rate=W, fixed=5.0, per_layer_byte=0.0) == 6.0
    assert cost.time_through(tiny, rate=W, fixed=0.0, per_layer_byte=1.0) == 1.0 + 2 * tiny.layer_parameters * 2
    assert cost.time_through(tiny, rate=W, fixed=5.0, per_layer_byte=0.0, factor=2.5) == 7.5  # a writer: 2.5 copies
    fsdp = cost.memory_uptrain(tiny, processes=2)
    # each rank reads its half of both from the files; the trained student alone comes back whole to rank 0's host
    assert fsdp["load"] == W and fsdp["host"] == W and fsdp["peak"] == max(fsdp["training"], fsdp["load"])
    alone = cost.memory_uptrain(tiny)
    assert alone["load"] == 2 * W and alone["host"] == 0 and alone["training"] == 2 * W + 6 * tiny.attention_parameters
    # a reader's capped runs bracket what it needs: killed under 0.75x and finished under 1.25x is within 25%
    row = {"predicted": 4.0 * cost.GIB}
    killed = {**row, "cap": int(3.0 * cost.GIB), "outcome": "killed for memory"}
    finished = {**row, "cap": int(5.0 * cost.GIB), "outcome": "finished"}
    assert cost._bracket([finished, killed])[2] == "within ±25%"
    assert "more than 3.00 GiB (killed for memory under 0.75x)" in cost._bracket([finished, killed])[0]
    assert cost._bracket([{**finished, "cap": int(3.0 * cost.GIB)}])[2] == "predicted more than 25% high"
    assert cost._bracket([{**killed, "cap": int(6.0 * cost.GIB)}])[2] == "predicted more than 25% low"
    assert cost._bracket([killed])[2] == "not bracketed within 25%"  # no finished run: no upper bound
    assert cost._bracket([]) is None
    llama8b = cost.shape("llama-3.1-8b")
    assert abs(llama8b.parameters - 8.03e9) < 0.01e9  # the published 8.03B
