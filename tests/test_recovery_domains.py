"""Recovery on the multi-domain calibration corpus: the held-out set mixes every domain and is never trained on, a
state better overall but worse on one domain is refused, and a stage that makes a domain worse is undone."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import tiny_model
from tiny_text import tiny_tokenizer

from headlab.core import corpora
from headlab.core.data import load_corpus
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.recovery import recover as R
from headlab.recovery.uptrain import (
    UptrainConfig,
    _Best,
    _calibration_documents,
    attention_parameters,
    combined,
    heldout_sets,
    uptrain,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(seq_len=32, batch_size=4, heldout_tokens=128, eval_tokens=64, eval_seq_len=32)


def test_the_held_out_set_mixes_every_domain_and_is_never_trained_on():
    corpus = load_corpus("broad")
    train, sets = heldout_sets(tiny_tokenizer(), corpus, 400)
    assert list(sets) == list(corpora.BROAD_DOMAINS)
    assert all(len(ids) == 100 for ids in sets.values())  # equal shares
    calibration = _calibration_documents(corpus)
    for name in corpora.BROAD_DOMAINS:
        last = [doc for domain, doc in calibration if domain == name][-1]
        assert last not in train  # the chunk the held-out tokens come from is not in the training text
    assert len(train) > 0.9 * corpus.cut


def test_combined_held_out_perplexity_by_hand():
    assert combined({"a": 4.0, "b": 16.0}) == pytest.approx(8.0)  # exp(mean(ln 4, ln 16))
    assert combined({"only": 7.5}) == pytest.approx(7.5)


def test_a_state_better_overall_but_worse_on_one_domain_is_refused():
    param = torch.nn.Parameter(torch.zeros(2))
    best = _Best.of([param], {"prose": 10.0, "code": 10.0})
    with torch.no_grad():
        param.fill_(1.0)
    best.offer([param], {"prose": 4.0, "code": 10.5}, step=1)  # combined 6.5 < 10, but code got worse
    assert best.step == 0 and best.refused == [{"step": 1, "worse_domains": ["code"]}]
    with torch.no_grad():
        param.fill_(2.0)
    best.offer([param], {"prose": 9.0, "code": 9.9}, step=2)
    assert best.step == 2 and best.domains == {"prose": 9.0, "code": 9.9}
    with torch.no_grad():
        param.fill_(3.0)
    best.restore([param])
    assert torch.equal(param.detach(), torch.full((2,), 2.0))


def _pair():
    teacher = from_model(tiny_model("llama"), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    return teacher, student


def test_uptraining_on_broad_records_every_held_out_domain():
    teacher, student = _pair()
    result = uptrain(student, teacher, data=load_corpus("broad"), steps=2, lr=1e-3, progress=False, **SMALL)
    meta = result.meta
    assert set(meta["heldout_domains_before"]) == set(corpora.BROAD_DOMAINS)
    assert all(meta["heldout_domains_after"][d] <= meta["heldout_domains_before"][d] for d in corpora.BROAD_DOMAINS)
    assert meta["heldout_perplexity_before"] == pytest.approx(combined(meta["heldout_domains_before"]))
    assert {f"heldout_{d}" for d in corpora.BROAD_DOMAINS} <= set(result.curve.columns)
    assert math.isfinite(result.curve["heldout_prose"].iloc[0])


def test_a_local_stage_that_hurts_a_domain_is_undone(monkeypatch):
    """A deliberately harmful local stage (the real reconstruction, then noise on every attention weight): the gate
    measures a held-out domain got worse and puts the attention parameters back as they were."""
    teacher, student = _pair()
    before = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    real = R.reconstruct

    def harmful(student, teacher, batches, local, progress=True):
        table = real(student, teacher, batches, local, progress=progress)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in attention_parameters(student):
                p.add_(3 * torch.randn(p.shape, generator=generator))
        return table

    monkeypatch.setattr(R, "reconstruct", harmful)
    spec = R.RecoverySpec(stages=["local"], uptrain=UptrainConfig(**SMALL))
    spec.local_tokens, spec.local_seq_len = 128, 32
    record = R.recover(student, teacher, spec, data=load_corpus("broad"), progress=False)
    local = record["local"]
    assert local["kept"] is False and local["not_kept_because"].startswith("held-out perplexity rose on")
    worse = [
        d
        for d in corpora.BROAD_DOMAINS
        if local["heldout_domains_of_the_stage"][d] > local["heldout_domains_before"][d]
    ]
    assert worse and all(d in local["not_kept_because"] for d in worse)
    assert all(torch.equal(before[n], p.detach()) for n, p in student.model.named_parameters())


def test_a_local_stage_that_helps_is_kept():
    teacher, student = _pair()
    spec = R.RecoverySpec(stages=["local"], uptrain=UptrainConfig(**SMALL))
    spec.local_tokens, spec.local_seq_len = 128, 32
    record = R.recover(student, teacher, spec, data=load_corpus("broad"), progress=False)
    local = record["local"]
    after, start = local["heldout_domains_after"], local["heldout_domains_before"]
    assert all(after[d] <= start[d] for d in start)
    assert local["kept"] == (local["heldout_domains_of_the_stage"] == after)


def test_long_windows_join_the_mix_every_nth_step():
    teacher, student = _pair()
    corpus = load_corpus("broad")
    result = uptrain(
        student, teacher, data=corpus, steps=4, lr=1e-3, long_seq_len=64, long_every=2, progress=False, **SMALL
    )
    tokens = result.curve["tokens"].diff().iloc[1:].tolist()  # tokens per step: 4 x 32 short, 1 x 64 long
    assert tokens == [128, 64, 128, 64]
    assert result.meta["calibration"]["long_windows"] == {"seq_len": 64, "every": 2, "kind": "text", "batch_size": 1}


def test_long_windows_past_the_models_positions_fail_before_work():
    teacher, student = _pair()
    with pytest.raises(Exception, match="long_seq_len=128 exceeds the model's maximum positions"):
        uptrain(student, teacher, data=load_corpus("broad"), steps=1, long_seq_len=128, progress=False, **SMALL)
