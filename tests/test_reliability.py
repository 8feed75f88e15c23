"""Issue 19: the output guard, race-free publication, checks before computing, and validation of what is loaded.

The bad-input table (test_bad_input.py) holds the one-line refusals; here are the properties behind them: random
(input, output) path pairs never change an input, two real processes racing for one output never replace each
other's result, a full disk keeps the previous output, and the validators agree with hand-made cases.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core import fsio, validate
from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}


def _hashes(paths) -> dict[str, str]:
    """sha256 of every file under `paths` (symlinks followed as the commands would follow them)."""
    found = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# ---- the guard: a property over random (input, output) pairs ----------------------------------------------------


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """A small tree of real inputs, symlinks to them and folders around them; commands run from `work`."""
    root = tmp_path_factory.mktemp("guard")
    paths = {"root": root, "work": root / "work", "project": root / "project"}
    paths["work"].mkdir()
    paths["model"] = save_tiny("llama", root / "project" / "model")
    paths["corpus"] = root / "corpus.txt"
    paths["corpus"].write_text(SAMPLE_TEXT)
    paths["mask"] = root / "project" / "mask.csv"
    paths["mask"].write_text("layer,head,gate\n0,1,0\n")
    for name, target in (("modellink", "model"), ("corpuslink", "corpus"), ("projectlink", "project")):
        paths[name] = root / f"{name}"
        paths[name].symlink_to(paths[target])
    return paths


# Output candidates: the inputs themselves, things inside them, folders holding them, links to each, and fresh
# places (the only ones a run may write to).
OUTPUTS = [
    "{model}", "{model}/config.json", "{model}/sub", "{modellink}", "{modellink}/sub", "{project}", "{projectlink}",
    "{projectlink}/model", "{corpus}", "{corpus}/x", "{corpuslink}", "{mask}", "{root}", ".", "..", "{work}",
    "{root}/fresh", "fresh", "{projectlink}/../fresh2",
]  # fmt: skip
MODELS = ["{model}", "{modellink}", "{projectlink}/model"]
CORPORA = ["{corpus}", "{corpuslink}"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    out=st.sampled_from(OUTPUTS),
    model=st.sampled_from(MODELS),
    corpus=st.sampled_from(CORPORA),
    command=st.sampled_from(["stats", "importance"]),
    overwrite=st.booleans(),
)
def test_no_input_changes_whatever_the_paths(tree, out, model, corpus, command, overwrite, capsys, monkeypatch):
    assume(not (command == "stats" and out == "{mask}"))  # the mask is an input of importance only
    monkeypatch.chdir(tree["work"])
    names = {k: str(v) for k, v in tree.items()}
    inputs = [tree["model"], tree["corpus"], tree["mask"]]
    before = _hashes(inputs)
    args = [command, "--model", model.format(**names), "--device", "cpu", "--data", corpus.format(**names)]
    args += ["--seq-len", "32", "--max-tokens", "64", "--out", out.format(**names)]
    args += ["--no-induction"] if command == "stats" else ["--mask", str(tree["mask"])]
    args += ["--overwrite"] if overwrite else []
    code, _, err = run_cli(args, capsys)
    assert _hashes(inputs) == before, (args, err)
    assert sorted(p.name for p in tree["project"].iterdir()) == ["mask.csv", "model"]
    if code == 0:
        event("written")
        written = Path(out.format(**names))
        assert written.resolve().name in ("fresh", "fresh2"), args  # the only places that are not inputs
        shutil.rmtree(written)
    else:
        event("refused")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# ---- race-free publication ----------------------------------------------------------------------------------

# Runs a real headlab command whose publication first waits until both racers are ready to publish: the existence
# check at the start has passed for both, so only the rename decides.
RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from headlab.core import fsio
    from headlab.cli import main

    barrier, me = Path(sys.argv[1]), sys.argv[2]
    publish = fsio.publish

    def wait_then_publish(tmp, target, overwrite, replaceable=None):
        (barrier / me).touch()
        deadline = time.time() + 120
        while len(list(barrier.iterdir())) < 2 and time.time() < deadline:
            time.sleep(0.05)
        return publish(tmp, target, overwrite, replaceable)

    fsio.publish = wait_then_publish
    main(sys.argv[3:])
    """
)


def _race(tmp_path, args_of, barrier: bool):
    racers = []
    (tmp_path / "barrier").mkdir()
    for name in ("a", "b"):
        code = RACER if barrier else "import sys; from headlab.cli import main; main(sys.argv[3:])"
        racers.append(
            subprocess.Popen(
                [sys.executable, "-c", code, str(tmp_path / "barrier"), name, *args_of(name)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
                cwd=tmp_path,
            )
        )
    return [(p.wait(timeout=300), *p.communicate()) for p in racers]


@pytest.mark.parametrize(
    "barrier", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["both-past-the-check", "natural"]
)
def test_two_processes_one_output_never_replace_each_other(tmp_path, barrier):
    model = save_tiny("llama_mha", tmp_path / "mha")
    out = tmp_path / "gqa"

    def args_of(name):
        return ["convert-gqa", "--model", str(model), "--device", "cpu", "--kv-heads", "2", "--no-eval", "--seed",
                "0", "--out", str(out)]  # fmt: skip

    results = _race(tmp_path, args_of, barrier)
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser_err = next(err for code, _, err in results if code == 2)
    lines = loser_err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in loser_err, loser_err
    assert "appeared while this command ran" in lines[0] or "already exists" in lines[0], lines[0]
    # The published output is one run's complete checkpoint; it loads.
    loaded = load_model(str(out), device="cpu")
    assert [layer.num_kv_heads for layer in loaded.layers] == [2, 2]
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("mha", "gqa", "barrier"))
    if "appeared" in lines[0]:
        # The loser's finished result is kept under the name the error gives, complete and loadable.
        kept = lines[0].split("the finished result is in ")[1].split(":")[0]
        assert leftovers == [Path(kept).name]
        assert (Path(kept) / "model.safetensors").is_file() and (Path(kept) / "config.json").is_file()
    else:
        assert leftovers == []
    if barrier:
        assert "appeared" in lines[0]  # both passed the start check: only the no-replace rename stopped the loser


def test_overwrite_replaces_atomically_and_without_renameat2(tmp_path, monkeypatch):
    """--overwrite swaps old and new (RENAME_EXCHANGE); the lock-file fallback keeps the same semantics."""
    for use_renameat2 in (True, False):
        if not use_renameat2:
            monkeypatch.setattr(fsio, "_renameat2", lambda *a: False)
        target = tmp_path / f"out-{use_renameat2}"
        with fsio.atomic_directory(target) as tmp:
            (tmp / "a").write_text("first")
        with fsio.atomic_directory(target, overwrite=True) as tmp:
            (tmp / "a").write_text("second")
        assert (target / "a").read_text() == "second"
        with pytest.raises(HeadlabError, match="appeared while"):
            with fsio.atomic_directory(tmp_path / f"late-{use_renameat2}") as tmp:
                (tmp / "a").write_text("mine")
                (tmp_path / f"late-{use_renameat2}").mkdir()  # another run got there first
        assert list((tmp_path / f"late-{use_renameat2}").iterdir()) == []
    names = sorted(p.name for p in tmp_path.iterdir())
    kept = [n for n in names if ".unpublished-" in n]
    assert len(kept) == 2 and all((tmp_path / n / "a").read_text() == "mine" for n in kept)
    assert not [n for n in names if n.startswith(".")]  # no temporary or lock file left


def test_outputs_get_the_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        with fsio.atomic_directory(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "table.csv").write_text("x")
            save_file({"w": torch.zeros(2)}, tmp / "model.safetensors")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": 0o750, "sub": 0o750, "table.csv": 0o640, "model.safetensors": 0o640}


# ---- a full disk while writing ------------------------------------------------------------------------------


def test_disk_full_while_writing_keeps_the_previous_output(tmp_path, capsys, monkeypatch):
    model = save_tiny("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    out = tmp_path / "stats"
    base = ["stats", "--model", model, "--device", "cpu", "--data", tmp_path / "text.txt", "--seq-len", "32"]
    base += ["--max-tokens", "64", "--no-induction", "--out", out]
    code, _, err = run_cli(base, capsys)
    assert code == 0, err
    before = _hashes([out])

    def full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half a table")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    code, out_text, err = run_cli([*base, "--overwrite"], capsys)
    last = err.strip().splitlines()[-1]  # after the progress bar of the finished computation
    assert code == 2 and last.startswith("headlab: error: ") and "Traceback" not in err, err
    assert "no space left" in last and "previous output is untouched" in last
    assert _hashes([out]) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "stats", "text.txt"]


def test_free_space_is_checked_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(HeadlabError, match="1000 B free"):
        fsio.check_free_space(tmp_path / "out", 5000, "a test")
    fsio.check_free_space(tmp_path / "out", 999, "a test")


# ---- SIGHUP like SIGTERM --------------------------------------------------------------------------------------


def test_sighup_during_a_real_command_cleans_up(tmp_path):
    model = save_tiny("llama", tmp_path / "model")
    (tmp_path / "big.txt").write_text("words and more words " * 20000)
    args = ["stats", "--model", str(model), "--device", "cpu", "--data", str(tmp_path / "big.txt"), "--seq-len", "64"]
    args += ["--max-tokens", "1000000", "--no-induction", "--out", str(tmp_path / "out")]
    process = subprocess.Popen(
        [sys.executable, "-m", "headlab", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    seen = b""
    while b"%" not in seen:  # the progress bar: the work has started
        chunk = os.read(process.stderr.fileno(), 4096)
        assert chunk, "the command ended before its progress bar appeared"
        seen += chunk
    process.send_signal(signal.SIGHUP)
    _, rest = process.communicate(timeout=60)
    err = (seen + rest).decode(errors="replace")
    assert process.returncode == 130, err[-500:]
    assert "Traceback" not in err and "interrupted" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "model"]


# ---- validators against hand-made cases --------------------------------------------------------------------------


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16), None),
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(15), "lies outside"),
        ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, bytes(16), "16 bytes for shape"),
        ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "bad header entry"),
        ({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}, "__metadata__": {"k": "v"}}, bytes(8), None),
    ],
)
def test_safetensors_header_check_matches_the_format(tmp_path, header, data, message):
    path = _safetensors(tmp_path / "w.safetensors", header, data)
    if message is None:
        validate.read_safetensors_header(path)
        from safetensors import safe_open  # the reference reader accepts what ours accepts

        with safe_open(path, "pt") as handle:
            assert list(handle.keys()) == ["w"]
    else:
        with pytest.raises(HeadlabError, match=message):
            validate.read_safetensors_header(path)


def test_missing_shard_named_by_the_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001.safetensors"}}))
    with pytest.raises(HeadlabError, match="model-00001.safetensors"):
        validate.check_weight_files(tmp_path)


def _sharded(directory: Path, weight_map: dict[str, str], held: dict[str, list[str]]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for shard, names in held.items():
        save_file({name: torch.zeros(2) for name in names}, str(directory / shard))
    return directory


def test_a_shard_that_does_not_hold_what_the_index_puts_in_it_is_named(tmp_path):
    weight_map = {"a": "model-1.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors"}
    validate.check_weight_files(_sharded(tmp_path / "ok", weight_map, {"model-1.safetensors": ["a", "b"],
                                                                      "model-2.safetensors": ["c"]}))  # fmt: skip
    # another run's second shard: it lacks c and holds b, which the index puts in the first
    other = _sharded(tmp_path / "mixed", weight_map, {"model-1.safetensors": ["a", "b"], "model-2.safetensors": ["b"]})
    with pytest.raises(HeadlabError, match=r"model-2.safetensors lacks c, which its index puts there"):
        validate.check_weight_files(other)
    stray = _sharded(tmp_path / "stray", weight_map, {"model-1.safetensors": ["a", "b"],
                                                      "model-2.safetensors": ["c", "a"]})  # fmt: skip
    with pytest.raises(HeadlabError, match=r"holds a, which its index puts in model-1.safetensors"):
        validate.check_weight_files(stray)
    # a tensor the index does not name at all is left to the loader (some checkpoints carry extras)
    extra = _sharded(tmp_path / "extra", weight_map, {"model-1.safetensors": ["a", "b", "z"],
                                                      "model-2.safetensors": ["c"]})  # fmt: skip
    validate.check_weight_files(extra)


GOOD_ENTRY = {"layer": 0, "heads": [0, 2, 3], "kv_heads": [0], "num_heads": 3, "num_kv_heads": 1,
              "original_heads": 4, "original_kv_heads": 2, "padding_heads": [2]}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({}, None),
        ({"num_heads": 2}, "num_heads is 2 but the record lists 3"),
        ({"heads": [0, 2, 7]}, "outside 0..3"),
        ({"heads": [0, 0, 3]}, "more than once"),
        ({"kv_heads": [2]}, "outside 0..1"),
        ({"kv_heads": [0, 1]}, "split evenly"),
        ({"padding_heads": [1]}, "not among the kept heads"),
        ({"heads": [0, 2.0, 3]}, "list of integers"),
        ({"original_heads": 0}, "positive integer"),
    ],
)
def test_layout_entries(edit, message):
    entry = {**GOOD_ENTRY, **edit}
    if message is None:
        validate.check_layout_entry(entry, "test")
    else:
        with pytest.raises(HeadlabError, match=message):
            validate.check_layout_entry(entry, "test")


def test_layout_record_covers_each_layer_once():
    one = {**GOOD_ENTRY}
    validate.check_layout_record({"layers": [one, {**one, "layer": 1}]}, "t", num_layers=2)
    with pytest.raises(HeadlabError, match="more than once"):
        validate.check_layout_record({"layers": [one, one]}, "t", num_layers=2)
    with pytest.raises(HeadlabError, match="covers layers"):
        validate.check_layout_record({"layers": [one, {**one, "layer": 5}]}, "t", num_layers=2)


def test_fingerprint_follows_content_not_path(tmp_path):
    first = save_tiny("llama", tmp_path / "a")
    copy = Path(shutil.copytree(first, tmp_path / "b"))
    other = save_tiny("llama", tmp_path / "c", seed=1)  # same shapes, other weights
    assert validate.model_fingerprint(first) == validate.model_fingerprint(copy)
    (copy / "headlab.json").write_text("{}")  # an edited checkpoint records its edit
    assert validate.model_fingerprint(first) != validate.model_fingerprint(copy)
    assert validate.model_fingerprint(tmp_path / "no-such-dir") is None
    assert validate.model_fingerprint(first) != validate.model_fingerprint(other)


def test_score_table_of_a_copied_model_is_not_foreign(tmp_path):
    model = save_tiny("llama", tmp_path / "model")
    loaded = load_model(str(model), device="cpu")
    run = tmp_path / "run"
    run.mkdir()
    (run / "importance.csv").write_text("layer,head,importance\n")
    (run / "meta.json").write_text(json.dumps(loaded.describe()))
    copy = load_model(str(shutil.copytree(model, tmp_path / "copy")), device="cpu")
    validate.check_table_origin(run, copy, "--scores")  # same weights under another path: accepted
    meta = {**loaded.describe(), "fingerprint": "f" * 64}
    (run / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(HeadlabError, match="allow_foreign=True"):
        validate.check_table_origin(run / "importance.csv", copy, "--scores")
    validate.check_table_origin(run, copy, "--scores", allow_foreign=True)
    # A prune run records its layout after pruning: with the same fingerprint its mask still fits the original.
    (run / "meta.json").write_text(json.dumps({**loaded.describe(), "heads_per_layer": [3, 4]}))
    validate.check_table_origin(run, loaded, "--mask")
    # Without fingerprints (runs of older versions) the same path with another layout is refused.
    (run / "meta.json").write_text(json.dumps({**loaded.describe(), "heads_per_layer": [3, 4], "fingerprint": None}))
    with pytest.raises(HeadlabError, match="layout"):
        validate.check_table_origin(run, loaded, "--scores")


def test_check_weights_can_be_turned_off(tmp_path):
    model = save_tiny("llama", tmp_path / "model")
    from safetensors.torch import load_file

    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HeadlabError, match="model.norm.weight holds 1 non-finite"):
        load_model(str(model), device="cpu")
    assert load_model(str(model), device="cpu", check_weights=False).model is not None


def test_csv_and_jsonl_text_stays_text(tmp_path):
    from headlab.core.data import load_corpus

    (tmp_path / "a.csv").write_text("text\n1984\nhello world\n")
    assert load_corpus(str(tmp_path / "a.csv")).documents == ["1984", "hello world"]
    (tmp_path / "a.jsonl").write_text('{"text": "1984"}\n\n{"other": 1}\n{"text": "x y"}\n')
    assert load_corpus(str(tmp_path / "a.jsonl")).documents == ["1984", "x y"]
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": {"nested": 1}}\n')
    with pytest.raises(HeadlabError, match="line 2: column 'text' holds a dict"):
        load_corpus(str(tmp_path / "b.jsonl"))


def test_load_report_is_not_printed(tmp_path, capfd):
    """transformers' LOAD REPORT table never reaches the terminal; what matters is in the one error line."""
    from safetensors.torch import load_file

    model = save_tiny("llama", tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    tensors["extra.weight"] = torch.zeros(2)  # unexpected: harmless, must stay quiet
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    load_model(str(model), device="cpu")
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err + captured.out


def test_unreadable_input_and_unwritable_location_are_refused_before_work(tmp_path, monkeypatch):
    """As root every file is readable and writable, so access(2) is simulated: the guard asks it about each input
    and about the folder that will hold the output."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "locked").mkdir()
    real_access = os.access

    def access(path, mode):
        if Path(path).name in ("config.json", "locked"):
            return False
        return real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(HeadlabError, match="cannot read the model .*config.json"):
        fsio.guard_output(tmp_path / "out", False, {"model": tmp_path / "model"})
    with pytest.raises(HeadlabError, match="cannot write in .*locked"):
        fsio.guard_output(tmp_path / "locked" / "out", False, {})
    with pytest.raises(HeadlabError, match="cannot write in .*locked"):  # also when folders are still to be made
        fsio.guard_output(tmp_path / "locked" / "a" / "b", False, {})


def test_library_writes_refuse_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HeadlabError, match="working directory"):
        with fsio.atomic_directory(Path("."), overwrite=True):
            pass
    assert list(tmp_path.iterdir()) == []


def test_write_failures_the_environment_causes_are_recognised():
    """Messages as safetensors and the OS give them (safetensors' text seen on a full tmpfs)."""
    from safetensors import SafetensorError

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert fsio._write_failure(full) == "no space left on the device"
    assert fsio._write_failure(OSError(errno.EDQUOT, "Disk quota exceeded")) == "disk quota exceeded"
    assert fsio._write_failure(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    assert fsio._write_failure(ValueError("a bug")) is None


# ---- resumable multi-step outputs (report, demo, sweep, gqa-sweep) ----------------------------------------------


def test_resumable_directory_keeps_completed_steps_for_the_same_key_only(tmp_path):
    from headlab.core.fsio import resumable_directory

    target = tmp_path / "run"
    key = {"model": "m", "options": [1, 2]}
    with pytest.raises(HeadlabError, match=r"boom; the completed steps \(a\) are kept in .*run.partial"):
        with resumable_directory(target, key) as journal:
            (journal.staging / "a.txt").write_text("step a")
            journal.finish("a", {"seconds": 1.5})
            raise HeadlabError("boom")
    assert not target.exists() and (tmp_path / "run.partial" / "a.txt").read_text() == "step a"
    with resumable_directory(target, {"model": "m", "options": (1, 2)}) as journal:  # tuples compare as JSON lists
        assert journal.resumed == ["a"] and journal.done("a") and journal.records["a"] == {"seconds": 1.5}
        journal.finish("b")
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"]  # the journal is not published
    assert not (tmp_path / "run.partial").exists()
    # another key: the earlier steps are discarded, not reused
    with pytest.raises(HeadlabError):
        with resumable_directory(tmp_path / "other", key) as journal:
            journal.finish("a")
            raise HeadlabError("stop")
    with resumable_directory(tmp_path / "other", {**key, "model": "n"}) as journal:
        assert journal.resumed == [] and not journal.done("a")


def test_resumable_directory_never_removes_what_it_did_not_make(tmp_path):
    from headlab.core.fsio import resumable_directory

    mine = tmp_path / "run.partial"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(HeadlabError, match="not a headlab run's staging directory"):
        with resumable_directory(tmp_path / "run", {"k": 1}):
            pass
    assert (mine / "thesis.tex").read_text() == "years of work"
    # a refused or failing run that completed no step leaves nothing behind
    with pytest.raises(HeadlabError, match="bad option"):
        with resumable_directory(tmp_path / "fresh", {"k": 1}):
            raise HeadlabError("bad option")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.partial"]


def test_resumable_directory_refuses_a_second_writer(tmp_path):
    from headlab.core.fsio import resumable_directory

    with resumable_directory(tmp_path / "run", {"k": 1}) as journal:
        journal.finish("a")
        with pytest.raises(HeadlabError, match="another headlab run is writing"):
            with resumable_directory(tmp_path / "run", {"k": 1}):
                pass
    assert (tmp_path / "run").is_dir()
