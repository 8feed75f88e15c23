"""Issue 29, output safety: every writing command goes through the guard, --overwrite replaces only what headlab
wrote (or an empty folder), single-file writes are race-free and get the umask's permissions, and the leftovers of
killed runs are removed by the next run (never those of a live one)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core import fsio
from headlab.core.errors import HeadlabError

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg"}
M = ["--device", "cpu"]
DATA = ["--data", "{text}", "--seq-len", "32", "--max-tokens", "64"]
TEXT = ["--data", "{text}"]  # report and demo take no --seq-len

# Every command that takes --out, with the least it needs to reach its guard; `{out}` is where the output goes. A new
# writing command without a row here fails test_every_writing_command_is_listed.
WRITERS = {
    "stats": ["--model", "{llama}", *M, *DATA, "--no-induction"],
    "importance": ["--model", "{llama}", *M, *DATA],
    "sweep": ["--model", "{llama}", *M, *DATA],
    "gqa-sweep": ["--model", "{mha}", *M, *DATA],
    "prune": ["--model", "{llama}", *M, *DATA, "--heads", "0:0"],
    "convert-gqa": ["--model", "{mha}", *M, *DATA, "--kv-heads", "2"],
    "convert-mla": ["--model", "{llama}", *M, *DATA, "--budget", "gqa"],
    "expand-kv": ["--model", "{llama}", *M, *DATA, "--kv-heads", "4"],
    "uptrain": [
        "--model",
        "{llama}",
        "--teacher",
        "{mha}",
        *M,
        "--data",
        "{text}",
        "--seq-len",
        "32",
        "--eval-seq-len",
        "32",
    ],
    "export-gguf": ["--model", "{bpe}", *M, "--no-verify"],
    "speed": ["{llama}", "--device", "cpu", "--contexts", "16", "--batches", "1"],
    "report": ["--model", "{llama}", *M, *TEXT, "--quick"],
    "demo": ["--model", "{llama}", *M, *TEXT, "--quick"],
    "eval": ["--model", "{llama}", *M, "--tasks", "tiny_mc", "--include-path", "{tasks}"],
    "plot": ["{run}"],
    "longeval": ["--model", "{llama}", *M, *TEXT],
    "kv-policy": ["--model", "{llama}", *M, *DATA],
    "attribute": ["--model", "{llama}", *M, "--text", "abc"],
    "show": ["--model", "{llama}", *M, "--text", "abc"],
}


def _sha(root: Path) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def bpe_tokenizer():
    """A byte-level BPE tokenizer (what export-gguf writes) trained on the sample text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([SAMPLE_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("output_guard")
    found = {"root": root, "llama": save_tiny("llama", root / "llama"), "mha": save_tiny("llama_mha", root / "mha")}
    found["bpe"] = root / "bpe"  # llama with a byte-level BPE vocabulary: export-gguf takes it
    tiny_model("llama", vocab_size=300).save_pretrained(found["bpe"])
    bpe_tokenizer().save_pretrained(found["bpe"])
    found["text"] = root / "sample.txt"
    found["text"].write_text(SAMPLE_TEXT)
    found["run"] = root / "run"  # a run directory for plot: one table
    found["run"].mkdir()
    (found["run"] / "importance.csv").write_text("layer,head,kv_head,importance\n0,0,0,0.5\n0,1,0,0.25\n")
    found["tasks"] = root / "tasks"
    found["tasks"].mkdir()
    (found["tasks"] / "tiny_mc.jsonl").write_text('{"q": "Sky?", "choices": ["blue", "red"], "label": 0}\n')
    (found["tasks"] / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {found['tasks'] / 'tiny_mc.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n"
    )
    return found


def _args(command: str, paths: dict, out) -> list[str]:
    names = {k: str(v) for k, v in paths.items()}
    return [command, *(a.format(**names) for a in WRITERS[command]), "--out", str(out)]


def _one_line_refusal(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("headlab: error: ") and "Traceback" not in err, err
    return lines[-1]


# ---- every writing command is guarded ----------------------------------------------------------------------------


def test_every_writing_command_is_listed():
    import click

    from headlab.cli import cli

    with click.Context(cli) as ctx:
        writing = {
            name
            for name in cli.list_commands(ctx)
            if any("--out" in p.opts for p in cli.get_command(ctx, name).params if isinstance(p, click.Option))
        }
    assert writing == set(WRITERS)


@pytest.mark.parametrize(
    "command",
    WRITERS,
)  # fmt: skip
def test_every_writing_command_refuses_an_out_inside_its_source(paths, command, capsys, monkeypatch, tmp_path):
    if command == "eval":
        pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)  # a default output elsewhere would show up here
    model = next(a.strip("{}") for a in WRITERS[command] if a in ("{llama}", "{mha}", "{bpe}", "{run}"))
    source = paths["run"] / "importance.csv" if command == "plot" else paths[model]  # plot reads tables, no model
    before = _sha(source)
    code, _, err = run_cli(_args(command, paths, source / "sub"), capsys)
    assert "lies inside" in _one_line_refusal(code, err)
    assert _sha(source) == before and not (source / "sub").exists() and list(tmp_path.iterdir()) == []


# ---- --overwrite replaces only what headlab wrote --------------------------------------------------------------


@pytest.mark.parametrize("command", [c for c in WRITERS if c != "plot"])  # plot has no --overwrite
def test_overwrite_keeps_a_folder_of_other_files(paths, command, capsys, monkeypatch, tmp_path):
    if command == "eval":
        pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / ("mine.gguf" if command == "export-gguf" else "mine")
    if command == "export-gguf":
        mine.write_text("a user's file")
    else:
        mine.mkdir()
        (mine / "thesis.tex").write_text("years of work")
    before = _sha(mine)
    code, _, err = run_cli([*_args(command, paths, mine), "--overwrite"], capsys)
    line = _one_line_refusal(code, err)
    assert "did not write" in line and "--overwrite replaces only" in line, line
    assert _sha(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]


def test_overwrite_replaces_a_previous_output_or_an_empty_folder(paths, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for out in ("empty", "empty", "fresh.gguf", "fresh.gguf"):  # the second time: headlab's own previous output
        command = "export-gguf" if out.endswith(".gguf") else "stats"
        code, _, err = run_cli([*_args(command, paths, out), "--overwrite"], capsys)
        assert code == 0, err
    assert (tmp_path / "empty" / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "fresh.gguf"]  # no temporary or lock file


@pytest.mark.parametrize("kind", ["file", "fifo", "mount"])
@pytest.mark.parametrize("command", ["stats", "export-gguf"])
def test_overwrite_never_replaces_a_file_fifo_or_mount_point(paths, kind, command, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("mine")
    elif kind == "fifo":
        os.mkfifo(target)
    else:  # mounting needs privileges: the check asks os.path.ismount, which says yes here (a bind-mounted file)
        target.mkdir() if command == "stats" else target.write_text("mine")
        real_ismount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == target.resolve() or real_ismount(p))
    code, _, err = run_cli([*_args(command, paths, target), "--overwrite"], capsys)
    line = _one_line_refusal(code, err)
    assert {"file": "did not write", "fifo": "is a FIFO", "mount": "mount point"}[kind] in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert target.read_text() == "mine" if target.is_file() else True


def test_library_publication_never_renames_a_mount_point_or_fifo(tmp_path, monkeypatch):
    """atomic_directory (used by every writer, also from Python) refuses what a rename cannot swap, overwrite or not;
    and what turns up at the target while a run works is checked again at publication."""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(HeadlabError, match="is not a folder"):
        with fsio.atomic_directory(tmp_path / "fifo", overwrite=True):
            pass
    with pytest.raises(HeadlabError, match="not replaced; the finished result is in"):
        with fsio.atomic_directory(tmp_path / "late", overwrite=True) as tmp:
            (tmp / "a").write_text("mine")
            os.mkfifo(tmp_path / "late")
    assert (tmp_path / "fifo").exists() and Path(tmp_path / "late").is_fifo()
    kept = [p for p in tmp_path.iterdir() if ".unpublished-" in p.name]
    assert len(kept) == 1 and (kept[0] / "a").read_text() == "mine"


# ---- names the shell did not expand, names that are not UTF-8 -------------------------------------------------------


@pytest.mark.parametrize("out", ["~/x.gguf", "~", os.fsdecode(b"bad\xffname.gguf")])
def test_literal_tilde_and_non_utf8_out_are_refused(paths, out, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(_args("export-gguf", paths, out), capsys)
    line = _one_line_refusal(code, err)
    assert ("did not expand" in line) if out.startswith("~") else ("not valid UTF-8" in line and "\\xff" in line)
    assert list(tmp_path.iterdir()) == []


# ---- export-gguf: permissions, full or read-only disk, two runs at once ------------------------------------------


@pytest.fixture(scope="module")
def bpe_loaded(paths):
    from headlab.core.loading import load_model

    return load_model(str(paths["bpe"]), device="cpu")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_gguf_gets_the_umask_permissions(bpe_loaded, tmp_path, umask):
    from headlab.runtimes.gguf_export import export_gguf

    old = os.umask(umask)
    try:
        export_gguf(bpe_loaded, tmp_path / "m.gguf", progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o666 & ~umask
    assert fsio.replace_refusal(tmp_path / "m.gguf") is None  # headlab's mark: --overwrite may replace it


def test_gguf_full_or_read_only_disk_is_one_line(paths, capsys, monkeypatch, tmp_path):
    import gguf

    out = tmp_path / "m.gguf"
    code, _, err = run_cli(_args("export-gguf", paths, out), capsys)
    assert code == 0, err
    before = _sha(out)
    real_write = gguf.GGUFWriter.write_tensor_data
    calls = []

    def full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # a few tensors in: part of the file is on disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    code, _, err = run_cli([*_args("export-gguf", paths, out), "--overwrite"], capsys)
    line = _one_line_refusal(code, err)
    assert "no space left" in line and "previous file is untouched" in line, line
    assert _sha(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]

    def read_only(*args, **kwargs):  # the file system turned read-only after the guard looked
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    code, _, err = run_cli([*_args("export-gguf", paths, tmp_path / "new.gguf")], capsys)
    assert "read-only file system" in _one_line_refusal(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# Runs a command with publication held back: it prints "publishing" when its output is complete, then waits until the
# file argv[1] exists (at most a minute) before publishing.
SLOW_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from headlab.core import fsio
    from headlab.cli import main

    publish = fsio.publish

    def slow_publish(*args, **kwargs):
        print("publishing", flush=True)
        deadline = time.time() + 60
        while not Path(sys.argv[1]).exists() and time.time() < deadline:
            time.sleep(0.05)
        return publish(*args, **kwargs)

    fsio.publish = slow_publish
    main(sys.argv[2:])
    """
)


def test_two_exports_to_one_file_never_both_succeed(paths, tmp_path):
    out, go = tmp_path / "m.gguf", tmp_path.parent / f"{tmp_path.name}-go"
    args = [*_args("export-gguf", paths, out), "--overwrite", "--json"]
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_PUBLISHER, str(go), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    assert first.stdout.readline().strip() == b"publishing"  # its file is complete, not yet in place
    second = subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True, text=True, env=ENV)
    go.touch()
    first_out, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    line = _one_line_refusal(second.returncode, second.stderr)
    assert "another headlab run is writing" in line, line
    record = json.loads(first_out)
    assert record["bytes"] == out.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# ---- leftovers of killed runs ----------------------------------------------------------------------------------


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_remove_stale_removes_only_what_dead_runs_left(tmp_path):
    host = fsio._host()
    dead, alive = _dead_pid(), os.getpid()
    (tmp_path / f".out.{dead}.{host}.abc{fsio.TMP_SUFFIX}").mkdir()
    (tmp_path / f".m.gguf.{dead}.{host}.x_1{fsio.TMP_SUFFIX}").write_text("half")
    (tmp_path / f".out.{alive}.{host}.def{fsio.TMP_SUFFIX}").mkdir()  # a live run's: kept
    (tmp_path / f".out.{dead}.otherhost.ghi{fsio.TMP_SUFFIX}").mkdir()  # another machine's: cannot tell, kept
    (tmp_path / ".out.headlab-lock").write_text("")  # nobody holds it
    (tmp_path / ".notes").write_text("a user's hidden file")
    (tmp_path / "out.partial").mkdir()  # a resumable run's completed steps
    held = fsio._lock(tmp_path / ".other.headlab-lock", wait=False)
    try:
        removed = {p.name for p in fsio.remove_stale(tmp_path)}
    finally:
        held.close()
    assert removed == {f".out.{dead}.{host}.abc{fsio.TMP_SUFFIX}", f".m.gguf.{dead}.{host}.x_1{fsio.TMP_SUFFIX}",
                       ".out.headlab-lock"}  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".out.{alive}.{host}.def{fsio.TMP_SUFFIX}", f".out.{dead}.otherhost.ghi{fsio.TMP_SUFFIX}", ".notes",
         ".other.headlab-lock", "out.partial"]
    )  # fmt: skip


def test_cache_leftovers_go_with_the_next_conversion(tmp_path, monkeypatch):
    """The embedded model's conversion writes into HEADLAB_CACHE through atomic_directory, which clears a killed
    conversion's leftovers there first."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path))
    from headlab.core.loading import cache_dir

    stale = cache_dir() / f".smollm2-135m.{_dead_pid()}.{fsio._host()}.q{fsio.TMP_SUFFIX}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    with fsio.atomic_directory(cache_dir() / "smollm2-135m", overwrite=True) as tmp:
        (tmp / "headlab_source.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]


@pytest.mark.parametrize("command", ["stats", "export-gguf"])
def test_a_killed_run_leaves_what_the_next_run_removes(paths, command, tmp_path):
    out = tmp_path / ("m.gguf" if command == "export-gguf" else "out")
    args = _args(command, paths, out)
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_PUBLISHER, str(tmp_path.parent / "never"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert process.stdout.readline().strip() == b"publishing"  # mid-write: the temporary is complete
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left and all(name.startswith(f".{out.name}.") for name in left), left  # no handler ran
    assert any(name.endswith(fsio.TMP_SUFFIX) and f".{process.pid}." in name for name in left), left
    rerun = subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True, text=True, env=ENV)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


# ---- export-gguf's verification windows ------------------------------------------------------------------------


def test_verification_windows_stay_within_the_models_positions(bpe_loaded, paths):
    from headlab.runtimes.llamacpp import eval_windows, window_length

    limit = bpe_loaded.max_positions
    assert limit == 64  # the tiny config's max_position_embeddings
    windows = eval_windows(bpe_loaded, data=str(paths["text"]), seq_len=256, max_tokens=400)
    assert max(len(w) for w in windows) == limit and window_length(bpe_loaded, 256) == limit
    assert window_length(bpe_loaded, 32) == 32
    short = eval_windows(bpe_loaded, data=str(paths["text"]), seq_len=32, max_tokens=400)
    assert max(len(w) for w in short) == 32
