"""Uptraining sharded with FSDP2 (`--parallel fsdp`) under torchrun on CPU (gloo): 2 processes train as one.

Under fsdp --batch-size is the batch of all processes together (each takes batch / N windows of the same shuffled
order), so the one-process run compared is the plain run of the same command line. When every window of the steps
run is full length (tests/test_uptrain_distributed.py checks that premise for these settings), the mean of the
ranks' per-token means, which FSDP's averaged gradients follow, is the one process's per-token mean."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from tiny_text import launch_headlab, run_cli, save_tiny, saved_kv_pair

STEPS, SEQ_LEN, BATCH, HELDOUT = 3, 32, 4, 128


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher dir, student dir, corpus file): the tiny llama and its 2 -> 1 KV-head mean-pooled copy."""
    return saved_kv_pair(tmp_path_factory.mktemp("uptrain-fsdp"))


def common(pair) -> list:
    teacher, student, corpus = pair
    # float32: one process and two agree up to float32 summation order; bfloat16 autocast (the default on a CPU
    # with its kernels) rounds each rank's smaller batch differently
    return ["uptrain", "--student", student, "--teacher", teacher, "--data", corpus, "--device", "cpu", "--no-bf16"]


def test_two_fsdp_processes_train_as_one_process_with_the_same_command(pair, tmp_path):
    args = common(pair)
    # cross-entropy at a high lr: the tiny model learns the text's characters at once, so a trained state is kept
    args += ["--objective", "ce", "--steps", STEPS, "--lr", "1e-2", "--seq-len", SEQ_LEN, "--batch-size", BATCH]
    args += [
        "--heldout-tokens",
        HELDOUT,
        "--eval-tokens",
        "0",
        "--eval-seq-len",
        SEQ_LEN,
        "--no-gradient-checkpointing",
    ]
    runs, metas = {}, {}
    for nproc in (None, 2):
        out = tmp_path / f"up-{nproc}"
        done = launch_headlab([*args, "--out", out, *(["--parallel", "fsdp"] if nproc else [])], nproc)
        assert done.returncode == 0, done.stderr[:3000]
        assert done.stdout.count("written:") == 1  # rank 0 alone writes and prints
        runs[nproc] = (pd.read_csv(out / "recovery" / "curve.csv"), load_file(out / "model.safetensors"))
        metas[nproc] = json.loads((out / "recovery" / "meta.json").read_text())["uptrain"]
    (one, weights_one), (two, weights_two) = runs[None], runs[2]
    assert (metas[None]["processes"], metas[2]["processes"], metas[2]["parallel"]) == (1, 2, "fsdp")
    assert metas[None]["kept_step"] == metas[2]["kept_step"] > 0
    assert list(one["tokens"]) == list(two["tokens"]) == [step * BATCH * SEQ_LEN for step in range(STEPS + 1)]
    for column in ("loss", "ce", "grad_norm"):
        assert two[column].to_numpy() == pytest.approx(one[column].to_numpy(), abs=1e-5, nan_ok=True), column
    assert two["heldout_perplexity"].to_numpy() == pytest.approx(one["heldout_perplexity"].to_numpy(), rel=1e-5)
    assert weights_one.keys() == weights_two.keys()
    moved, original = 0.0, load_file(pair[1] / "model.safetensors")
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((tensor - original[name]).abs().max()))
    assert moved > 1e-4  # trained weights were compared (kept step > 0), so closeness is not vacuous
    # each process holds half the shards (plus FSDP's padding) of the student, the teacher and the AdamW state
    alone, sharded = metas[None]["sharded_bytes_per_process"], metas[2]["sharded_bytes_per_process"]
    assert metas[None]["bytes_per_process"]["optimiser_state"] > 0
    assert sharded <= 0.6 * alone, (sharded, alone)
    # before sharding no process held a weight: both are safetensors checkpoints, and every rank read its own shards
    held = metas[2]["weights_held_before_sharding"]
    assert metas[None]["bytes_per_process"]["student_parameters"] > 0
    assert held["rank 0"] == held["other ranks, at most"] == 0


def test_fsdp_with_a_teacher_checkpointing_and_uneven_eval_windows(pair, tmp_path):
    """KL to the sharded teacher, activation checkpointing on, and eval windows that split 3 / 2 over the ranks
    (the rank with fewer runs a stand-in forward, or FSDP's all-gathers would wait forever): the one process's
    curve."""
    args = [*common(pair), "--steps", "2", "--lr", "1e-2", "--seq-len", SEQ_LEN, "--batch-size", "2"]
    args += ["--heldout-tokens", HELDOUT, "--eval-tokens", "200", "--eval-seq-len", "48"]
    curves = {}
    for nproc in (None, 2):
        out = tmp_path / f"kl-{nproc}"
        done = launch_headlab([*args, "--out", out, *(["--parallel", "fsdp"] if nproc else [])], nproc)
        assert done.returncode == 0, done.stderr[:3000]
        curves[nproc] = pd.read_csv(out / "recovery" / "curve.csv")
    for column in ("kl", "perplexity", "heldout_perplexity"):
        one, two = curves[None][column].to_numpy(), curves[2][column].to_numpy()
        assert two == pytest.approx(one, rel=1e-5, nan_ok=True), column


def test_a_world_that_does_not_divide_the_batch_stops_every_rank_before_any_work(pair, tmp_path):
    out = tmp_path / "never"
    done = launch_headlab([*common(pair), "--parallel", "fsdp", "--batch-size", "3", "--out", out], 2)
    # torchrun exits 1 and reports its ranks' exit status 2 (with its own traceback, after theirs: one line each)
    assert done.returncode == 1 and "exitcode: 2" in done.stderr
    ranks = done.stderr.split("torch/distributed/elastic")[0].strip().splitlines()[:-1]  # before the launcher's report
    assert len(ranks) == 2 and all(line.startswith("headlab: error:") for line in ranks), done.stderr[:2000]
    assert "--batch-size 3 is not divisible by the 2 torchrun processes" in ranks[0]
    assert not out.exists()


def _bad(args, tmp_path, monkeypatch, capsys) -> str:
    """Run in-process as torchrun's rank 0 would (its environment); exit 2, one stderr line, nothing written."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([str(a) for a in args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
    return lines[0]


def test_the_batch_check_reads_the_launchers_world(pair, tmp_path, monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)  # read before any process group: none is joined
    line = _bad([*common(pair), "--parallel", "fsdp", "--out", "up"], tmp_path, monkeypatch, capsys)
    assert "--batch-size 4 is not divisible by the 3 torchrun processes" in line and "--parallel fsdp" in line


def test_a_disk_too_small_for_the_checkpoint_stops_fsdp_before_training(pair, tmp_path, monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)  # a torchrun world of one: no process group before the sharding
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    args = [*common(pair), "--parallel", "fsdp", "--seq-len", SEQ_LEN, "--eval-seq-len", SEQ_LEN, "--out", Path("up")]
    line = _bad(args, tmp_path, monkeypatch, capsys)
    assert "1000 B free" in line and "the loaded model's weights" in line, line


def test_rank_0_still_refuses_a_non_finite_weight_when_the_ranks_read_their_own_shards(pair, tmp_path, monkeypatch,
                                                                                        capsys):  # fmt: skip
    """Both models are safetensors, so every rank loads a skeleton; rank 0 reads the files one tensor at a time and
    refuses a nan weight by name before any training, as it did when it loaded the weights."""
    from safetensors.torch import load_file, save_file

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    teacher, student, corpus = pair
    broken = tmp_path.parent / f"{tmp_path.name}-nan-student"
    shutil.copytree(student, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    args = ["uptrain", "--student", broken, "--teacher", teacher, "--data", corpus, "--device", "cpu"]
    line = _bad([*args, "--parallel", "fsdp", "--out", "up"], tmp_path, monkeypatch, capsys)
    assert "model.norm.weight" in line, line


ROUND_TRIP = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from models import tiny_model
from headlab.core.loading import from_model
from headlab.recovery import fsdp
ids = torch.tensor([[1, 2, 3, 4]])
for name, overrides in (("gpt2", {}), ("llama", {"tie_word_embeddings": True})):
    torch.manual_seed(0)
    model = tiny_model(name, **overrides)
    loaded = from_model(model)
    head = model.get_output_embeddings
    assert head().weight is model.get_input_embeddings().weight
    before = model(input_ids=ids).logits.detach()
    with fsdp.sharded(loaded, {n for n, _ in model.named_parameters()}) as work:
        optimizer = torch.optim.AdamW(list(work.model.parameters()), lr=1e-2)
        work.model(input_ids=ids).logits.square().mean().backward()
        optimizer.step()
        trained = work.model(input_ids=ids).logits.detach()
    assert loaded.model is model and not any(p.is_meta for p in model.parameters())
    assert head().weight is model.get_input_embeddings().weight, "the tie"
    torch.testing.assert_close(model(input_ids=ids).logits, trained, rtol=0, atol=1e-6)
    assert float((trained - before).abs().max()) > 1e-4  # the step changed the weights: the comparison is not vacuous
print("round trip ok")
"""


def test_the_sharded_copy_gives_its_trained_values_back_with_tied_embeddings(tmp_path):
    """A tied input/output embedding (gpt2; llama with tie_word_embeddings) stays one parameter through sharding,
    a step of AdamW on the shards and the gather into the caller's model, which then computes what the shards did."""
    done = _torchrun_script(tmp_path, ROUND_TRIP)
    assert done.returncode == 0 and done.stdout.count("round trip ok") == 2, done.stderr[-3000:]


SKELETON = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from models import tiny_model
from headlab.core import distributed
from headlab.core.loading import from_model
from headlab.recovery import fsdp
ids = torch.tensor([[1, 2, 3, 4]])
distributed.init(torch.device("cpu"), even_alone=True)
trained = {}
for skeleton in (False, True):
    torch.manual_seed(0)
    if skeleton and distributed.rank() > 0:  # the structure alone, every tensor (buffers too) on the meta device
        with torch.device("meta"):
            model = tiny_model("llama", tie_word_embeddings=True)
    else:
        model = tiny_model("llama", tie_word_embeddings=True)
    loaded = from_model(model)
    whole_after = "rank 0" if skeleton else "every rank"
    with fsdp.sharded(loaded, None, device=torch.device("cpu"), whole_after=whole_after) as work:
        optimizer = torch.optim.AdamW(list(work.model.parameters()), lr=1e-2)
        work.model(input_ids=ids).logits.square().mean().backward()
        optimizer.step()
        trained[skeleton] = work.model(input_ids=ids).logits.detach()
    if skeleton and distributed.rank() > 0:
        assert all(p.is_meta for p in model.parameters()), "rank 1 never held the weights"
    else:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "the tie"
        torch.testing.assert_close(model(input_ids=ids).logits, trained[skeleton], rtol=0, atol=1e-6)
torch.testing.assert_close(trained[True], trained[False], rtol=0, atol=0)
print("skeleton ok")
"""


PER_RANK = """
import sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from models import tiny_model
from tiny_text import tiny_tokenizer
from headlab.core import distributed
from headlab.core.loading import load_model, load_structure
from headlab.recovery import fsdp
distributed.init(torch.device("cpu"), even_alone=True)
checkpoint = Path(sys.argv[2])
if distributed.rank() == 0:  # odd sizes: 5 query heads, a vocabulary of 259 rows, so rank 1's chunks are shorter
    model = tiny_model("llama", tie_word_embeddings=True, vocab_size=259, num_attention_heads=5,
                       num_key_value_heads=1, hidden_size=40, head_dim=8)
    model.save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
torch.distributed.barrier()
ids = torch.tensor([[1, 2, 3, 4, 250]])
whole = load_model(str(checkpoint), device="cpu")
expected = whole.model(input_ids=ids).logits.detach()
skeleton = load_structure(str(checkpoint), device="cpu")
assert fsdp.is_skeleton(skeleton.model)
with fsdp.sharded(skeleton, None, device=torch.device("cpu"), whole_after="rank 0") as work:
    got = work.model(input_ids=ids).logits.detach()
torch.testing.assert_close(got, expected, rtol=0, atol=0)
if distributed.rank() == 0:  # the gathered values and the buffers the skeleton was given compute the same
    model = skeleton.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "the tie"
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
teacher = load_structure(str(checkpoint), device="cpu")  # frozen (a teacher): its files hold it, nothing comes back
with fsdp.sharded(teacher, None, device=torch.device("cpu"), whole_after="rank 0", frozen=True) as work:
    torch.testing.assert_close(work.model(input_ids=ids).logits.detach(), expected, rtol=0, atol=0)
assert fsdp.is_skeleton(teacher.model), "no rank gathered the frozen model"
print("per-rank ok")
"""


def test_every_rank_reads_its_own_shards_when_no_rank_holds_the_weights(tmp_path):
    """Both ranks pass skeletons of a safetensors checkpoint (tied embeddings; rows that 2 ranks split unevenly): each
    reads its own rows from the files, the sharded model computes the whole model's logits exactly, and rank 0
    gets the values (with the rotary buffers, which no file holds) back whole; a frozen model (the teacher) is not
    gathered at all."""
    done = _torchrun_script(tmp_path, PER_RANK, tmp_path / "tiny")
    assert done.returncode == 0 and done.stdout.count("per-rank ok") == 2, done.stderr[-3000:]


def test_checkpoint_shards_names_every_parameter_and_buffer_or_declines(tmp_path):
    """A saved checkpoint: every distinct parameter found under its stored name (the tied head once), the rotary
    frequencies computed as the loaded model has them; a source without safetensors (a hub id) gives None."""
    from headlab.core.loading import load_model, load_structure
    from headlab.recovery import fsdp

    checkpoint = save_tiny("llama", tmp_path / "tiny", tie_word_embeddings=True)
    shards = fsdp.checkpoint_shards(load_structure(str(checkpoint), device="cpu"))
    whole = load_model(str(checkpoint), device="cpu").model
    assert shards.names == {name: name for name, _ in whole.named_parameters()}
    assert "lm_head.weight" not in shards.names  # tied: read once, as the embedding
    for name, buffer in whole.named_buffers():
        torch.testing.assert_close(shards.buffers[name], buffer, rtol=0, atol=0, msg=name)
    hub = fsdp.checkpoint_shards(replace(load_structure(str(checkpoint), device="cpu"), source="org/model"))
    assert hub is None
    # a stored name the model does not use (keys renamed by hand): rank 0 must send the values instead
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(checkpoint, renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.norm.renamed"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    structure = load_structure(str(checkpoint), device="cpu")
    assert fsdp.checkpoint_shards(replace(structure, source=str(renamed))) is None
    no_safetensors = tmp_path / "empty"
    no_safetensors.mkdir()
    assert fsdp.checkpoint_shards(replace(structure, source=str(no_safetensors))) is None


def _torchrun_script(tmp_path, text: str, *arguments) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(text)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests = Path(__file__).parent
    command = [*map(str, command), str(tests), *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)


def test_a_rank_with_only_the_structure_receives_its_shards_from_rank_0(tmp_path):
    """Rank 1 passes a skeleton on the meta device (rotary buffers included), rank 0 the model: the shards, the
    buffers and the tie reach rank 1 from rank 0, training computes exactly what two whole copies compute, and the
    trained values come back to rank 0 alone."""
    done = _torchrun_script(tmp_path, SKELETON)
    assert done.returncode == 0 and done.stdout.count("skeleton ok") == 2, done.stderr[-3000:]


def test_a_device_map_and_fsdp_are_refused_together(pair, tmp_path, monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    line = _bad(
        [*common(pair), "--parallel", "fsdp", "--device-map", "auto", "--out", "up"], tmp_path, monkeypatch, capsys
    )
    assert "--device-map auto" in line and "--parallel fsdp" in line
