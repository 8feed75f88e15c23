"""The foundation commands (info, eval) and their bad-input rules: one line, exit code 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sample.txt"
    path.write_text(SAMPLE_TEXT)
    return path


def test_info_json(tiny_dir, capsys):
    code, out, _ = run_cli(["info", "--model", tiny_dir, "--json", "--context", "100"], capsys)
    info = json.loads(out)
    assert code == 0
    assert (info["attention_layers"], info["query_heads"], info["kv_heads"], info["head_dim"]) == (2, 4, 2, 16)
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V x layers x G x D x float32


def test_eval_table_and_json(tiny_dir, corpus_file, capsys):
    code, out, _ = run_cli(["eval", "--model", tiny_dir, "--data", corpus_file, "--seq-len", "32", "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["split"] == "eval" and result["scored_tokens"] > 100
    code, out, _ = run_cli(["eval", "--model", tiny_dir, "--data", corpus_file, "--seq-len", "32"], capsys)
    assert code == 0 and "perplexity" in out and "bits per byte" in out


def test_python_m_headlab_is_the_cli():
    done = subprocess.run([sys.executable, "-m", "headlab", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "eval" in done.stdout and "info" in done.stdout


BAD_INPUTS = {
    "nonexistent path": (["eval", "--model", "./no/such/dir"], "no such model"),
    "unreachable hub id": (["info", "--model", "someone/not-cached-model"], "cannot reach the hub"),
    "unknown dtype": (["info", "--dtype", "float8"], "float8"),
    "unknown device": (["info", "--device", "tpu"], "device"),
    "cuda without gpu": (["info", "--device", "cuda"], "no CUDA GPU"),
    "missing corpus": (["eval", "--model", "{model}", "--data", "./missing.txt", "--seq-len", "32"], "no such corpus"),
    "empty corpus": (["eval", "--model", "{model}", "--data", "{empty}", "--seq-len", "32"], "no text"),
    "missing column": (["eval", "--model", "{model}", "--data", "{table}", "--seq-len", "32"], "no column"),
    "seq-len too long": (["eval", "--model", "{model}", "--data", "{corpus}", "--seq-len", "65"], "maximum positions"),
    "stride zero": (["eval", "--model", "{model}", "--data", "{corpus}", "--seq-len", "32", "--stride", "0"], "stride"),
    "stride above seq-len": (
        ["eval", "--model", "{model}", "--data", "{corpus}", "--seq-len", "16", "--stride", "17"],
        "stride",
    ),
    "corpus too short": (["eval", "--model", "{model}", "--data", "{short}", "--seq-len", "16"], "too short"),
    "unknown option": (["eval", "--frobnicate"], "No such option"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(case, tiny_dir, corpus_file, tmp_path, capsys, monkeypatch):
    if case == "cuda without gpu" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is unreachable here anyway; offline makes it instant
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "short.txt").write_text("ab")
    (tmp_path / "table.csv").write_text("body\nsome text\n")
    args, expected = BAD_INPUTS[case]
    names = {
        "model": tiny_dir,
        "corpus": corpus_file,
        "empty": tmp_path / "empty.txt",
        "short": tmp_path / "short.txt",
        "table": tmp_path / "table.csv",
    }
    args = [a.format(**names) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert "Traceback" not in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, BloomConfig

    AutoModelForCausalLM.from_config(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "bloom"
    )
    code, _, err = run_cli(["info", "--model", tmp_path / "bloom"], capsys)
    assert code == 2 and "unsupported architecture 'bloom'" in err and "llama" in err


def test_root_help_lists_every_command_as_click_would_without_importing_them():
    """`headlab --help` reads each command's docstring as source text; the list is the one click builds from the
    imported commands, and no command module (so neither torch nor transformers) is imported for it."""
    import subprocess
    import sys

    import click

    from headlab.cli import cli

    context = click.Context(cli, info_name="headlab")
    names = cli.list_commands(context)
    limit = click.HelpFormatter().width - 6 - max(len(name) for name in names)
    expected = {name: cli.get_command(context, name).get_short_help_str(limit) for name in names}
    listed = cli.get_help(context)
    for name, short in expected.items():
        assert f"  {name}" in listed and short in listed, (name, short)
    code = (
        "import sys\nfrom headlab.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or "
        "m.startswith('headlab.cli.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
