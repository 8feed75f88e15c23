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

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
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
