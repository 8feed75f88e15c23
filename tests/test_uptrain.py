"""Uptraining (headlab.recovery.uptrain): losses and the schedule by hand, a student equal to its teacher stays put with zero
loss, best-state keeping returns the start when every step hurts, held-out and training text never overlap, the
stream covers all windows, pruned heads stay pruned, and the recovery pipeline saves a verified checkpoint."""

from __future__ import annotations

import copy
import json
import math
import time

import pandas as pd
import pytest
import torch
from models import tiny_model
from slow_clock import ScaledClock, slow_machine
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import Corpus, split_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.pruning import prune as P
from headlab.recovery.reconstruct import dead_heads
from headlab.recovery.recover import RecoverySpec, describe_stop, parse_stages, recover, save_recovered
from headlab.recovery.uptrain import (
    UptrainConfig,
    attention_parameters,
    distillation_loss,
    heldout_split,
    layer_matching_loss,
    learning_rate,
    stream_batches,
    token_losses,
    trained_parameters,
    uptrain,
)

CORPUS = Corpus("sample", [SAMPLE_TEXT * 6])
SMALL = dict(seq_len=32, batch_size=4, heldout_tokens=128, eval_tokens=128, eval_seq_len=32, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_distillation_and_cross_entropy_by_hand():
    t = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]])
    s = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]]])
    valid = torch.tensor([[True, False]])
    p, q = torch.softmax(t[0, 0], -1), torch.softmax(s[0, 0], -1)
    assert float(distillation_loss(s, t, valid)) == pytest.approx(float((p * (p.log() - q.log())).sum()), rel=1e-6)
    assert float(distillation_loss(t, t, torch.ones(1, 2, dtype=torch.bool))) == pytest.approx(0.0, abs=1e-7)
    ids = torch.tensor([[0, 2]])
    _, ce = token_losses(s, None, ids, torch.ones(1, 2, dtype=torch.bool))  # predicts token 2 from position 0
    assert float(ce) == pytest.approx(-math.log(float(q[2])), rel=1e-6)


def test_layer_matching_by_hand():
    teacher = (torch.zeros(1, 2, 2), torch.tensor([[[3.0, 4.0], [1.0, 0.0]]]), torch.tensor([[[0.0, 2.0], [5.0, 5.0]]]))
    student = (torch.ones(1, 2, 2), torch.tensor([[[3.0, 0.0], [1.0, 0.0]]]), torch.tensor([[[0.0, 1.0], [0.0, 0.0]]]))
    valid = torch.tensor([[True, False]])  # position 1 is padding: its errors must not count
    # entry 0 (the embeddings) is skipped; block 1: 16 / 25 at position 0; block 2: 1 / 4
    assert float(layer_matching_loss(student, teacher, valid)) == pytest.approx((16 / 25 + 1 / 4) / 2, rel=1e-6)
    assert float(layer_matching_loss(teacher, teacher, torch.ones(1, 2, dtype=torch.bool))) == 0.0


def test_layer_matching_objective_brings_block_outputs_closer():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    ids = tiny_tokenizer()(SAMPLE_TEXT[:200], return_tensors="pt")["input_ids"]
    valid = torch.ones_like(ids, dtype=torch.bool)

    def error() -> float:
        with torch.no_grad():
            s = student.model(input_ids=ids, output_hidden_states=True).hidden_states
            t = teacher.model(input_ids=ids, output_hidden_states=True).hidden_states
        return float(layer_matching_loss(s, t, valid))

    before = error()
    result = uptrain(student, teacher, data=CORPUS, steps=8, lr=1e-3, objective="kl_layers", **SMALL)
    assert "block-output" in result.meta["objective"]
    assert result.curve["loss"].iloc[1] > result.curve["kl"].iloc[1]  # the matching term is in the loss
    assert error() < before


def test_learning_rate_warmup_then_cosine():
    config = UptrainConfig(steps=10, lr=1.0, warmup=0.2)
    lrs = [learning_rate(s, 10, config) for s in range(1, 11)]
    assert lrs[:2] == [0.5, 1.0]
    expected = [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(1, 9)]
    assert lrs[2:] == pytest.approx(expected) and lrs[-1] == pytest.approx(0.0)


def test_heldout_tail_and_training_text_do_not_overlap():
    tokenizer = tiny_tokenizer()
    text = split_text(CORPUS, "calibration").text
    train, heldout = heldout_split(tokenizer, text, 100)
    assert len(heldout) == 100 and text.startswith(train)
    assert torch.equal(heldout, tiny_tokenizer()(text[len(train) :], return_tensors="pt")["input_ids"][0])


def test_the_stream_covers_every_window_before_repeating():
    tokenizer = tiny_tokenizer()
    text = "abcdefghij" * 40  # 400 tokens -> 25 windows of 16
    config = UptrainConfig(seq_len=16, batch_size=5)
    stream = stream_batches(tokenizer, text, config, pad_id=3, chunk_chars=160)
    first = [next(stream) for _ in range(5)]
    assert {epoch for *_, epoch in first} == {0}
    assert sum(int(mask.sum()) for _, mask, _ in first) == 400  # the whole text, no cap
    assert next(stream)[2] == 1  # then the next epoch


def test_trained_groups():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    attention = {id(p) for p in attention_parameters(loaded)}
    norms = {id(p) for p in trained_parameters(loaded, "norms")}
    everything = {id(p) for p in trained_parameters(loaded, "all")}
    named = dict(loaded.model.named_parameters())
    assert attention == {id(p) for n, p in named.items() if "self_attn" in n}
    assert norms - attention == {id(p) for n, p in named.items() if "norm" in n and "self_attn" not in n}
    assert everything == {id(p) for p in loaded.model.parameters()}


def test_student_equal_to_teacher_keeps_zero_loss_and_weights():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    before = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    result = uptrain(student, teacher, data=CORPUS, steps=4, lr=1e-3, **SMALL)
    assert (result.curve["loss"].iloc[1:] == 0).all()
    assert all(torch.equal(before[n], p) for n, p in student.model.named_parameters())


def test_best_state_is_the_start_when_every_step_hurts():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    before = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    result = uptrain(student, teacher, data=CORPUS, steps=4, lr=30.0, warmup=0.0, clip=0.0, heldout_every=1, **SMALL)
    checked = result.curve["heldout_perplexity"].dropna()
    assert (checked.iloc[1:] > checked.iloc[0]).all()  # every step made held-out text worse ...
    assert result.meta["kept_step"] == 0  # ... so the start is what comes back
    assert all(torch.equal(before[n], p) for n, p in student.model.named_parameters())


def test_non_finite_loss_names_the_step():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    with torch.no_grad():
        student.layers[0].module.q_proj.weight.mul_(float("inf"))
    with pytest.raises(HeadlabError, match=r"not finite at step 1.*lower the learning rate \(lr=\)"):
        uptrain(student, teacher, data=CORPUS, steps=2, **{**SMALL, "eval_tokens": 0})


def test_uptraining_lowers_held_out_loss_and_keeps_pruned_heads_dead(tmp_path):
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    P.apply_mask(student, [{0, 3}, {1}])
    frozen = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    trained = {id(p) for p in attention_parameters(student)}
    # the tiny random teacher is no better than its student on text, so the LM loss is what lowers held-out loss here
    result = uptrain(student, teacher, data=CORPUS, steps=12, lr=1e-2, objective="ce", heldout_every=3, **SMALL)
    assert result.meta["heldout_perplexity_after"] < result.meta["heldout_perplexity_before"]
    assert [dead_heads(student, layer) for layer in student.layers] == [[0, 3], [1]]
    for name, param in student.model.named_parameters():
        if id(param) not in trained:
            assert torch.equal(param.detach(), frozen[name]), f"{name} is not an attention parameter but moved"
    assert all(p.requires_grad for p in student.model.parameters())  # restored
    curve = result.curve
    assert curve["step"].tolist() == list(range(13)) and curve["tokens"].is_monotonic_increasing
    assert curve["perplexity"].notna().sum() == 2  # eval split: start and end only, by default


def test_bad_settings_fail_before_work():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    for settings, fragment in [
        (dict(lr=0.0), "lr=0.0 must be a positive number"),
        (dict(lr=-1e-4), "lr=-0.0001 must be"),
        (dict(steps=-1), "steps=-1 must be"),
        (dict(minutes=0), "minutes=0 must be"),
        (dict(steps=None), "steps=None must be"),
        (dict(objective="mse"), "objective='mse'"),
        (dict(trained="mlp"), "trained='mlp'"),
        (dict(warmup=1.5), "warmup=1.5 must be"),
    ]:
        with pytest.raises(HeadlabError, match=fragment):
            uptrain(teacher, teacher, data=CORPUS, progress=False, **settings)
    with pytest.raises(HeadlabError, match="unknown or repeated"):
        parse_stages("local,global")


def test_recover_pipeline_saves_a_verified_checkpoint(tmp_path):
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    spec = RecoverySpec(
        minutes=None, uptrain=UptrainConfig(steps=3, **{k: v for k, v in SMALL.items() if k != "progress"})
    )
    spec.local_tokens, spec.local_seq_len = 256, 32
    record = recover(student, teacher, spec, data=CORPUS, progress=False)
    assert record["local"]["error_after"] <= record["local"]["error_before"]
    verification = save_recovered(student, tmp_path / "out", record, {"what": "test"})
    assert verification["loader"].startswith("transformers.")
    curve = pd.read_csv(tmp_path / "out" / "recovery" / "curve.csv")
    assert len(curve) == 4 and (tmp_path / "out" / "recovery" / "curve.png").stat().st_size > 5_000
    assert len(pd.read_csv(tmp_path / "out" / "recovery" / "local.csv")) == 2


def test_cli_uptrain_and_convert_gqa_recover(tmp_path, capsys):
    save_tiny("llama", tmp_path / "teacher")
    teacher = from_model(__import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "teacher"))
    gqa.convert(teacher, 1)
    teacher.model.save_pretrained(tmp_path / "student")
    tiny_tokenizer().save_pretrained(tmp_path / "student")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 6)
    args = ["uptrain", "--student", tmp_path / "student", "--teacher", tmp_path / "teacher", "--data", corpus]
    args += [
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--heldout-tokens",
        "128",
        "--eval-tokens",
        "128",
        "--eval-seq-len",
        "32",
    ]
    code, out, err = run_cli([*args, "--device", "cpu", "--out", tmp_path / "up"], capsys)
    assert code == 0, err
    assert "held-out perplexity" in out and (tmp_path / "up" / "recovery" / "curve.csv").exists()
    code, _, err = run_cli([*args, "--out", tmp_path / "up"], capsys)
    assert code == 2 and "exists" in err
    convert = ["convert-gqa", "--model", tmp_path / "teacher", "--device", "cpu", "--kv-heads", "1", "--data", corpus]
    convert += ["--seq-len", "32", "--max-tokens", "128", "--recover", "local,uptrain", "--recover-steps", "3"]
    sampled = ["--recover-generated", "0.5", "--recover-generated-start", "random"]
    code, out, err = run_cli([*convert, *sampled, "--out", tmp_path / "gqa"], capsys)
    assert code == 0, err
    assert "after recovery (local+uptrain, " in out and (tmp_path / "gqa" / "recovery" / "local.csv").exists()
    recorded = json.loads((tmp_path / "gqa" / "headlab.json").read_text())["recovery"]["uptrain"]
    assert recorded["config"]["generated"] == 0.5 and recorded["calibration"]["generated"]["windows"] == 3 * 2
    assert recorded["config"]["generated_start"] == "random"
    prune = ["prune", "--model", tmp_path / "teacher", "--device", "cpu", "--data", corpus, "--seq-len", "32"]
    prune += ["--heads", "0:0;1:2", "--max-tokens", "128", "--recover", "local"]
    code, out, err = run_cli([*prune, "--out", tmp_path / "pruned"], capsys)
    assert code == 0, err
    assert "after recovery (local, " in out
    reloaded = from_model(__import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "pruned"))
    assert [dead_heads(reloaded, layer) for layer in reloaded.layers] == [[0], [2]]


def test_sigterm_during_recovery_leaves_no_partial_output(tmp_path):
    """SIGTERM while uptraining runs: exit code 130 and nothing written (not even a staging directory)."""
    import os
    import signal
    import subprocess
    import sys

    save_tiny("llama", tmp_path / "teacher")
    save_tiny("llama", tmp_path / "student", seed=1)
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 40)
    out = tmp_path / "out"
    args = ["uptrain", "--student", tmp_path / "student", "--teacher", tmp_path / "teacher", "--device", "cpu"]
    args += ["--data", tmp_path / "text.txt", "--seq-len", "32", "--eval-seq-len", "32", "--heldout-tokens", "64"]
    process = subprocess.Popen(
        [sys.executable, "-m", "headlab", *map(str, args), "--steps", "100000", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    seen = b""
    while b"uptrain:" not in seen:  # the progress bar shows training has started
        chunk = process.stderr.read1(256)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err.decode(errors="replace")
    assert "Traceback" not in err.decode(errors="replace")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student", "teacher", "text.txt"]


@pytest.mark.slow
def test_the_demos_recovery_budget_lowers_the_svd_merged_perplexity():
    """The embedded model merged 3 -> 1 (svd): local reconstruction on 1,024 tokens then 12 uptraining steps (the
    demo's budget) lower eval-split perplexity (every choice is made on calibration text)."""
    from headlab.core.data import calibration_batches, load_corpus
    from headlab.core.loading import load_model
    from headlab.measure.evaluate import perplexity
    from headlab.recovery.recover import teacher_copy

    teacher = load_model(None, device="cpu")
    corpus = load_corpus(None)
    student = teacher_copy(teacher)
    batches = calibration_batches(student.tokenizer, corpus, seq_len=256, batch_size=4, max_tokens=1024)
    gqa.convert(student, 1, method="svd", batches=batches)
    eval_args = dict(split="eval", seq_len=256, batch_size=4, max_tokens=512, progress=False)
    before = perplexity(student, corpus, **eval_args).perplexity
    config = UptrainConfig(steps=12, seq_len=128, heldout_tokens=512, eval_tokens=0, gradient_checkpointing=False)
    spec = RecoverySpec(uptrain=config, local_tokens=1024)
    record = recover(student, teacher, spec, data=corpus, progress=False)
    after = perplexity(student, corpus, **eval_args).perplexity
    assert record["local"]["error_after"] < record["local"]["error_before"]
    assert after < before


# ---- budgets in tokens and steps; minutes only a cap ---------------------------------------------------------------


def _recovered_weights(monkeypatch, factor: float, minutes=None):
    """The tiny 2 -> 1 merge recovered (local + 4 uptraining steps) on a machine `factor` times slower."""
    slow_machine(monkeypatch, factor)
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    config = UptrainConfig(steps=4, **{k: v for k, v in SMALL.items() if k != "progress"})
    spec = RecoverySpec(minutes=minutes, uptrain=config, local_tokens=256, local_seq_len=32)
    record = recover(student, teacher, spec, data=CORPUS, progress=False)
    monkeypatch.undo()
    return {k: v.clone() for k, v in student.model.state_dict().items()}, record


def test_token_budgets_give_identical_weights_on_a_fast_and_a_slow_machine(monkeypatch):
    fast, record_fast = _recovered_weights(monkeypatch, 1.0)
    slow, record_slow = _recovered_weights(monkeypatch, 10_000.0)  # each real second reads as almost three hours
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)
    for record in (record_fast, record_slow):
        assert not record["stopped_on_time"] and record["uptrain"]["steps_run"] == 4
        assert record["tokens_seen"] == record["local"]["calibration"]["tokens"] + record["uptrain"]["tokens_seen"]
    assert record_fast["tokens_seen"] == record_slow["tokens_seen"] > 0


def test_a_minutes_cap_too_small_ends_recovery_cleanly_with_a_note(monkeypatch):
    """On a slow machine a cap of one minute is spent at once: no error, every stage stopped with its best state
    (never worse on held-out text than the start), and the record says so."""
    _, record = _recovered_weights(monkeypatch, 1e6, minutes=1.0)
    assert record["stopped_on_time"] and record["minutes_cap"] == 1.0
    assert record["local"]["layers_stopped_on_time"] >= 1
    assert record["local"]["error_after"] <= record["local"]["error_before"]
    up = record["uptrain"]
    assert up["stopped_on_time"] and up["steps_run"] == 0 and up["tokens_seen"] == 0
    assert "stopped at the 1-minute cap with the best state so far" in describe_stop(record)


def test_uptraining_cap_stops_at_the_best_state_so_far(monkeypatch):
    from headlab.recovery import uptrain as uptrain_module

    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    clock = ScaledClock(1.0)
    steps = []
    real_step = uptrain_module._train_step

    def step_then_slow_down(*args):  # after two steps the machine becomes a million times slower
        steps.append(1)
        if len(steps) == 2:
            clock.factor, clock.origin = 1e6, time.perf_counter()
        return real_step(*args)

    monkeypatch.setattr(uptrain_module, "time", clock)
    monkeypatch.setattr(uptrain_module, "_train_step", step_then_slow_down)
    settings = {k: v for k, v in SMALL.items() if k != "progress"}
    result = uptrain(student, teacher, data=CORPUS, progress=False, steps=50, minutes=0.5, **settings)
    meta = result.meta
    assert meta["stopped_on_time"] and meta["stopped_by"] == "the --minutes cap"
    assert meta["steps_run"] == 2 and meta["steps_planned"] == 50
    assert meta["heldout_perplexity_after"] <= meta["heldout_perplexity_before"]
    assert meta["heldout_perplexity_after"] == result.curve["heldout_perplexity"].min()


def test_cli_cap_too_small_exits_0_and_saves_with_a_note(tmp_path, capsys):
    save_tiny("llama", tmp_path / "teacher")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 6)
    convert = ["convert-gqa", "--model", tmp_path / "teacher", "--device", "cpu", "--kv-heads", "1", "--data", corpus]
    convert += ["--seq-len", "32", "--max-tokens", "128", "--recover", "local,uptrain", "--recover-minutes", "1e-7"]
    code, out, err = run_cli([*convert, "--out", tmp_path / "gqa"], capsys)
    assert code == 0, err
    assert "stopped at the 1e-07-minute cap with the best state so far" in out
    meta = json.loads((tmp_path / "gqa" / "recovery" / "meta.json").read_text())
    assert meta["stopped_on_time"] and meta["uptrain"]["skipped"]


def test_cli_recovery_saves_identical_weights_on_a_fast_and_a_slow_machine(tmp_path, capsys, monkeypatch):
    """`convert-gqa --recover local,uptrain` and `prune --recover ...` twice, the second time on a machine 10,000 times
    slower as the clocks see it: the same saved weights, byte for byte."""
    from safetensors.torch import load_file

    save_tiny("llama", tmp_path / "teacher")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 6)
    common = ["--model", tmp_path / "teacher", "--device", "cpu", "--data", corpus, "--seq-len", "32"]
    commands = {
        "gqa": ["convert-gqa", *common, "--kv-heads", "1", "--max-tokens", "128"],
        "pruned": ["prune", *common, "--heads", "0:0;1:2", "--max-tokens", "128"],
    }
    recovery = ["--recover", "local,uptrain", "--recover-steps", "3"]
    for name, args in commands.items():
        code, _, err = run_cli([*args, *recovery, "--out", tmp_path / f"{name}-fast"], capsys)
        assert code == 0, err
        with monkeypatch.context() as slow:
            slow_machine(slow, 10_000.0)
            code, _, err = run_cli([*args, *recovery, "--out", tmp_path / f"{name}-slow"], capsys)
        assert code == 0, err
        fast = load_file(tmp_path / f"{name}-fast" / "model.safetensors")
        slow_weights = load_file(tmp_path / f"{name}-slow" / "model.safetensors")
        assert fast.keys() == slow_weights.keys() and all(torch.equal(fast[k], slow_weights[k]) for k in fast)


@pytest.mark.parametrize("forced, expected", [("native", True), ("float32", False)])
def test_bf16_autocast_by_default_where_bfloat16_products_are_native(monkeypatch, forced, expected):
    """CUDA always; a CPU only with native bfloat16 kernels (HEADLAB_CPU_MATMUL forces the probe's answer), since
    elsewhere torch's bfloat16 products are far slower than float32's."""
    from headlab.recovery.uptrain import default_bf16

    monkeypatch.setenv("HEADLAB_CPU_MATMUL", forced)
    assert default_bf16(torch.device("cpu")) is expected
    assert default_bf16(torch.device("cuda")) is True
    assert default_bf16(torch.device("meta")) is False


def test_recover_bf16_and_generated_options_reach_the_uptraining_config():
    """--recover-bf16 / --no-recover-bf16 on prune, convert-gqa and convert-mla set UptrainConfig.bf16; without
    either the default (None: default_bf16 of the device) stands. --recover-generated and --recover-generated-start
    set the sampled share and its start."""
    from headlab.cli._recovery import recovery_spec

    base = dict(stages="uptrain", minutes=None, steps=2, lr=1e-4, objective="kl", parallel="data", bf16=None)
    base |= dict(generated=0.0, generated_start="bos")
    assert recovery_spec({**base, "bf16": False}).uptrain.bf16 is False
    assert recovery_spec({**base, "bf16": True}).uptrain.bf16 is True
    assert recovery_spec(base).uptrain.bf16 is None
    sampled = recovery_spec({**base, "generated": 0.5, "generated_start": "random"}).uptrain
    assert sampled.generated == 0.5 and sampled.generated_start == "random"
    assert recovery_spec(base).uptrain.generated == 0.0
