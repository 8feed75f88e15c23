"""Uptraining (headlab.uptrain): the KL loss against a hand computation, only attention parameters move, the
calibration loss falls on a tiny converted model, and the saved checkpoint and curve come back."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab import gqa
from headlab.data import Corpus, calibration_batches
from headlab.errors import HeadlabError
from headlab.loading import from_model
from headlab.uptrain import attention_parameters, distillation_loss, save_uptrained, uptrain


def test_distillation_loss_by_hand():
    t = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]])
    s = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]]])
    valid = torch.tensor([[True, False]])
    p = torch.softmax(t[0, 0], -1)
    q = torch.softmax(s[0, 0], -1)
    expected = float((p * (p.log() - q.log())).sum())
    assert float(distillation_loss(s, t, valid)) == pytest.approx(expected, rel=1e-6)
    assert float(distillation_loss(t, t, torch.ones(1, 2, dtype=torch.bool))) == pytest.approx(0.0, abs=1e-7)


def _pair():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    return teacher, student


def _calibration_kl(student, teacher, corpus):
    total = []
    for ids, mask, _ in calibration_batches(student.tokenizer, corpus, seq_len=32, batch_size=4, max_tokens=512):
        with torch.no_grad():
            total.append(float(distillation_loss(student.model(ids).logits, teacher.model(ids).logits, mask.bool())))
    return sum(total) / len(total)


def test_uptraining_lowers_the_calibration_loss_and_trains_attention_only(tmp_path):
    teacher, student = _pair()
    corpus = Corpus("sample", [SAMPLE_TEXT * 4])
    before = _calibration_kl(student, teacher, corpus)
    frozen = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    trained = {id(p) for p in attention_parameters(student)}
    result = uptrain(
        student,
        teacher,
        corpus=corpus,
        steps=12,
        lr=5e-4,
        seq_len=32,
        batch_size=4,
        eval_every=4,
        eval_tokens=256,
        eval_seq_len=32,
        progress=False,
    )
    after = _calibration_kl(student, teacher, corpus)
    assert after < 0.8 * before
    for name, param in student.model.named_parameters():
        changed = not torch.equal(param.detach(), frozen[name])
        if id(param) not in trained:
            assert not changed, f"{name} is not an attention parameter but moved"
    assert all(p.requires_grad for p in student.model.parameters())  # restored
    curve = result.curve
    assert curve["step"].tolist() == list(range(13))
    assert curve["perplexity"].notna().sum() == 4  # steps 0, 4, 8, 12
    assert math.isnan(curve["kl"].iloc[0]) and curve["kl"].iloc[1:].notna().all()
    verification = save_uptrained(student, result, tmp_path / "up")
    assert verification["loader"].startswith("transformers.")
    saved = pd.read_csv(tmp_path / "up" / "uptrain" / "curve.csv")
    assert len(saved) == 13 and (tmp_path / "up" / "uptrain" / "curve.png").stat().st_size > 5_000


def test_bad_settings_fail_before_work():
    teacher, student = _pair()
    with pytest.raises(HeadlabError, match="--lr"):
        uptrain(student, teacher, lr=0.0, progress=False)
    with pytest.raises(HeadlabError, match="--steps"):
        uptrain(student, teacher, steps=-1, progress=False)


def test_cli_uptrain(tmp_path, capsys):
    save_tiny("llama", tmp_path / "teacher")
    teacher = from_model(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "teacher"), tiny_tokenizer()
    )
    gqa.convert(teacher, 1)
    teacher.model.save_pretrained(tmp_path / "student")
    tiny_tokenizer().save_pretrained(tmp_path / "student")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    args = ["uptrain", "--model", tmp_path / "student", "--teacher", tmp_path / "teacher", "--data", corpus]
    args += ["--steps", "3", "--seq-len", "32", "--eval-every", "3", "--eval-tokens", "128", "--eval-seq-len", "32"]
    code, out, err = run_cli([*args, "--device", "cpu", "--out", tmp_path / "up"], capsys)
    assert code == 0, err
    assert "perplexity" in out and (tmp_path / "up" / "config.json").exists()
    code, _, err = run_cli([*args, "--out", tmp_path / "up"], capsys)
    assert code == 2 and "exists" in err
