"""Hardening: a real SIGTERM during an atomic write leaves nothing behind; malformed inputs give clean errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_text import save_tiny

from headlab.core.data import load_corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model

WRITER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from headlab.cli import _raise_on_sigterm
    from headlab.core.fsio import atomic_directory

    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    target = Path(sys.argv[1])
    try:
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
            print("writing", flush=True)
            time.sleep(60)  # a slow save, interrupted by the parent
            (tmp / "config.json").write_text("{}")
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_during_save_leaves_no_partial_output(tmp_path, existing):
    target = tmp_path / "out"
    if existing:  # an earlier result being replaced must survive intact
        target.mkdir()
        (target / "config.json").write_text('{"old": true}')
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])
    if existing:
        assert json.loads((target / "config.json").read_text()) == {"old": True}
        assert not (target / "model.safetensors").exists()


def test_sigterm_during_a_real_command(tmp_path):
    """SIGTERM while `headlab eval` works: exit code 130, a one-line message, no traceback."""
    model = save_tiny("llama", tmp_path / "model")
    (tmp_path / "big.txt").write_text("words and more words " * 100000)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headlab",
            "eval",
            "--model",
            str(model),
            "--data",
            str(tmp_path / "big.txt"),
            "--seq-len",
            "64",
            "--max-tokens",
            "2000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    # Signal once the progress bar shows the work has started (a fixed sleep races with a fast machine).
    seen = b""
    while b"perplexity" not in seen:
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, "the command ended before its progress bar appeared"
        seen += chunk
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=60)
    err = (seen + rest).decode(errors="replace")
    assert process.returncode == 130, err[-500:]
    assert "Traceback" not in err and "interrupted" in err


# ---- fuzzing: malformed corpora and configs ----------------------------------------------------------------------

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(content=st.binary(max_size=300), suffix=st.sampled_from([".csv", ".jsonl", ".parquet", ".txt"]))
def test_fuzzed_corpus_files_fail_cleanly(tmp_path, content, suffix):
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(content)
    try:
        corpus = load_corpus(str(path))
    except HeadlabError:
        return
    assert corpus.documents and all(isinstance(d, str) and d.strip() for d in corpus.documents)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("fuzz") / "model")


@FUZZ
@given(
    edit=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from(
                [
                    "model_type",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "hidden_size",
                    "head_dim",
                    "num_hidden_layers",
                ]
            ),
            st.one_of(st.integers(-3, 300), st.text(max_size=8), st.none()),
            min_size=1,
            max_size=3,
        ),
    )
)
def test_fuzzed_configs_fail_cleanly_or_load(model_dir, tmp_path_factory, edit):
    import shutil

    target = tmp_path_factory.mktemp("cfg") / "model"
    shutil.copytree(model_dir, target)
    config_path = target / "config.json"
    if isinstance(edit, bytes):
        config_path.write_bytes(edit)
    else:
        config = json.loads(config_path.read_text())
        config.update(edit)
        config_path.write_text(json.dumps(config))
    try:
        loaded = load_model(str(target), device="cpu")
    except HeadlabError as error:
        assert "\n" not in str(error)
        return
    # It loaded: then the layout must be what the weights say, never a silent mismatch.
    assert all(layer.num_heads * layer.head_dim == 64 for layer in loaded.layers)
