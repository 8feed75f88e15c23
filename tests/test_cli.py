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


# ---- library messages in the command's terms: parameters become options (headlab.cli.cli_message) -------------

OPTIONS = {
    "seq_len": "--seq-len",
    "max_length": "--max-length",
    "method": "--method",
    "kv_heads": "--kv-heads",
    "overwrite": "--overwrite",
    "check_weights": "--check-weights/--no-check-weights",
    "fraction": "--fraction",
    "count": "--count",
    "uniform": "--uniform",
    "unit": "--unit",
    "data": "--data",
}
TRANSLATIONS = [
    ("seq_len=4 is too short", "--seq-len 4 is too short"),
    ("unknown method='x'; use one of grad, taylor", "unknown --method 'x'; use one of grad, taylor"),
    ("give kv_heads", "give --kv-heads"),
    ("kv_heads=3 does not divide 4 (use kv_heads)", "--kv-heads 3 does not divide 4 (use --kv-heads)"),
    ("give exactly one of fraction= and count=", "give exactly one of --fraction and --count"),
    ("method= re-scores: use method='grad'", "--method re-scores: use --method 'grad'"),
    ("pass overwrite=True to replace it", "pass --overwrite to replace it"),
    ("uniform=True cannot prune 3", "--uniform cannot prune 3"),
    ("damaged (check_weights=False loads it anyway)", "damaged (--no-check-weights loads it anyway)"),
    ("stride=0 must be between 1 and max_length (8)", "stride=0 must be between 1 and --max-length (8)"),
    ("out=/runs/x lies inside the corpus (data=/runs)", "out=/runs/x lies inside the corpus (--data /runs)"),
    # plain words may be prose: only their name= form is the option
    ("the method of the unit, the data and the count", "the method of the unit, the data and the count"),
    # not parameters: attributes, paths, quoted text, longer names, options already written
    ("text.seq_len of /runs/seq_len", "text.seq_len of /runs/seq_len"),
    ("'seq_len' max_seq_len=2 seq_lens", "'seq_len' max_seq_len=2 seq_lens"),
    ("--seq-len 4 exceeds --kv-heads", "--seq-len 4 exceeds --kv-heads"),
    ("overwrite=False", "overwrite=False"),  # a flag without an off switch
]  # fmt: skip


@pytest.mark.parametrize("message, expected", TRANSLATIONS)
def test_cli_message_writes_parameters_as_options(message, expected):
    from headlab.cli import cli_message

    assert cli_message(message, OPTIONS) == expected
    assert cli_message(message, {}) == message  # outside a command: the library's words


def test_command_options_spell_each_parameter_as_the_command_does():
    import click

    from headlab.cli import cli, command_options

    ctx = click.Context(cli)
    evaluation = command_options(cli.get_command(ctx, "eval"))
    # one option with two spellings (--max-length/--seq-len): the one named like the library's parameter
    assert evaluation["seq_len"] == "--seq-len" and evaluation["max_length"] == "--max-length"
    assert evaluation["model_spec"] == "--model" and evaluation["part"] == "--split" and evaluation["data"] == "--data"
    assert evaluation["check_weights"] == "--check-weights/--no-check-weights"
    uptrain = command_options(cli.get_command(ctx, "uptrain"))
    assert (uptrain["trained"], uptrain["minutes"], uptrain["stages"]) == ("--train", "--minutes", "--recover")
    # prune takes the recovery settings and the foreign-table switch under other names (LIBRARY_NAMES)
    prune = command_options(cli.get_command(ctx, "prune"))
    assert (prune["minutes"], prune["lr"], prune["stages"]) == ("--recover-minutes", "--recover-lr", "--recover")
    assert prune["allow_foreign"] == "--allow-foreign-scores" and prune["allow_empty_layer"] == "--allow-empty-layer"
    assert "run_dir" not in command_options(cli.get_command(ctx, "plot"))  # an argument has no option


def test_a_library_error_names_the_commands_options(tiny_dir, corpus_file, capsys):
    """rolling_windows says stride=17 and max_length; eval's user reads its own options."""
    args = ["eval", "--model", tiny_dir, "--device", "cpu", "--data", corpus_file, "--seq-len", "16", "--stride", "17"]
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert err == "headlab: error: --stride 17 must be between 1 and --max-length (16)\n"


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


# ---- `headlab COMMAND --help` stays fast: no torch, transformers, pandas, matplotlib or seaborn ----------------

HEAVY = ("torch", "transformers", "pandas", "matplotlib", "seaborn")
HELP_IMPORTS = """
import io, json, sys, contextlib
from headlab.cli import cli
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        cli([sys.argv[1], '--help'], standalone_mode=False)
    except SystemExit:
        pass
heavy = sorted({k.split('.')[0] for k in sys.modules if k.split('.')[0] in sys.argv[2].split(',')})
print(json.dumps({'heavy': heavy, 'help': help_text.getvalue()}))
"""


def _commands():
    from headlab.cli import cli

    return cli.list_commands(None)


@pytest.mark.parametrize("name", _commands())
def test_command_help_imports_no_heavy_package(name):
    """`headlab NAME --help` builds its options from torch-free modules (the registries, the wings' choices.py,
    core.model_names) and lists every option of the command: the heavy imports wait for the command to run."""
    import click

    from headlab.cli import cli

    done = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS, name, ",".join(HEAVY)], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    command = cli.get_command(click.Context(cli), name)
    options = [opt for param in command.params if isinstance(param, click.Option) for opt in param.opts]
    assert options and all(opt in result["help"] for opt in options), result["help"]
    assert result["heavy"] == [], f"`headlab {name} --help` imports {result['heavy']}"
