"""Windows sampled from the teacher in uptraining (headlab.recovery.teacher_samples, UptrainConfig.generated): the
cached sampler against a slow one that reruns the whole prefix per token, the sampled distribution against the
teacher's softmax, the batch mix, the record and the refusals."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from models import tiny_model
from tiny_text import tiny_tokenizer

from headlab.core.data import load_corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.recovery import teacher_samples as TS
from headlab.recovery.uptrain import UptrainConfig, _data, stream_batches, uptrain

pytestmark = pytest.mark.usefixtures("one_thread")


def _teacher(name: str = "llama"):
    return from_model(tiny_model(name), tiny_tokenizer())


@torch.no_grad()
def _slow_samples(teacher, count: int, seq_len: int, generator: torch.Generator, start="bos") -> torch.Tensor:
    """The obvious sampler: the whole prefix through the model for every token, no cache."""
    ids = torch.full((count, 1), teacher.tokenizer.bos_token_id, dtype=torch.long)
    if start == "random":  # then a uniform draw among the non-special ids, listed by hand
        special = set(teacher.tokenizer.all_special_ids)
        pool = torch.tensor([i for i in range(teacher.model.config.vocab_size) if i not in special])
        ids = torch.cat([ids, pool[torch.randint(len(pool), (count, 1), generator=generator)]], dim=1)
    while ids.shape[1] < seq_len:
        logits = teacher.model(input_ids=ids).logits[:, -1]
        ids = torch.cat([ids, torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)], dim=1)
    return ids


@pytest.mark.parametrize("name, start", [("llama", "bos"), ("qwen3", "bos"), ("llama", "random")])
def test_the_cached_sampler_draws_what_the_slow_one_draws(name, start):
    teacher = _teacher(name)
    fast = TS.sample_windows(teacher, 5, 12, torch.Generator().manual_seed(3), start=start)
    slow = _slow_samples(teacher, 5, 12, torch.Generator().manual_seed(3), start=start)
    assert fast.shape == (5, 12) and torch.equal(fast, slow)
    assert bool((fast[:, 0] == teacher.tokenizer.bos_token_id).all())


def test_a_random_start_draws_every_ordinary_token_and_no_special_one():
    teacher = _teacher()
    second = TS.sample_windows(teacher, 3000, 2, torch.Generator().manual_seed(1), start="random")[:, 1]
    special = set(teacher.tokenizer.all_special_ids)
    assert not special & set(second.tolist())
    ordinary = teacher.model.config.vocab_size - len(special)
    assert len(set(second.tolist())) == ordinary  # 3,000 uniform draws over 124 ids miss none (p < 1e-8)
    with pytest.raises(HeadlabError, match="unknown start"):
        TS.sample_windows(teacher, 1, 4, torch.Generator(), start="middle")


def test_samples_follow_the_teachers_distribution_at_temperature_one():
    """The first sampled token over 4,000 windows against softmax(logits) after BOS: no top-k, top-p or temperature
    narrows it (total variation within sampling noise, about 0.5 sqrt(V / n) = 0.09 at most for 128 tokens)."""
    teacher = _teacher()
    first = TS.sample_windows(teacher, 4000, 2, torch.Generator().manual_seed(0))[:, 1]
    with torch.no_grad():
        logits = teacher.model(input_ids=torch.tensor([[teacher.tokenizer.bos_token_id]])).logits[0, -1]
    expected = torch.softmax(logits.float(), -1)
    observed = torch.bincount(first, minlength=expected.numel()).float() / first.numel()
    assert 0.5 * float((observed - expected).abs().sum()) < 0.09
    # the sampled support is the teacher's, not its top few tokens
    assert int((observed > 0).sum()) > 0.5 * int((expected > 1 / 4000).sum())


def test_the_same_seed_gives_the_same_windows_and_chunks_are_served_in_order():
    teacher = _teacher()
    a = TS.TeacherSamples(teacher, seq_len=6, seed=1, chunk=4)
    b = TS.TeacherSamples(teacher, seq_len=6, seed=1, chunk=4)
    taken = torch.cat([a.take(3), a.take(3)])  # two chunks: the second starts after the first's fourth window
    assert torch.equal(taken, b.take(6)) and a.windows == 6 and len(a.pending) == 2
    assert not torch.equal(taken, TS.TeacherSamples(teacher, seq_len=6, seed=2, chunk=4).take(6))
    bounded = TS.TeacherSamples(teacher, seq_len=6, seed=1, chunk=4, limit=5)
    bounded.take(3), bounded.take(3)  # a chunk of 4, then what is asked beyond the limit of 5 (2 more), not 4
    assert bounded.sampled == 6 and bounded.windows == 6 and not bounded.pending
    with pytest.raises(HeadlabError, match="teacher"):
        TS.TeacherSamples(None, seq_len=6, seed=0)


def test_a_mixed_batch_is_the_calibration_batch_then_the_samples():
    teacher = _teacher()
    tokenizer, text = teacher.tokenizer, load_corpus("broad").text[:20_000]
    config = UptrainConfig(seq_len=16, batch_size=4, generated=0.5)
    student = from_model(copy.deepcopy(teacher.model), tokenizer)
    streams, _, record, samples = _data(student, load_corpus("broad"), config, teacher)
    assert record["generated"]["windows_per_batch"] == 2 and samples is not None
    reference_samples = TS.TeacherSamples(teacher, seq_len=16, seed=config.seed, chunk=TS.CHUNK)
    half = UptrainConfig(seq_len=16, batch_size=2)
    mixed = TS.mixed_batches(stream_batches(tokenizer, text, half, tokenizer.pad_token_id),
                             TS.TeacherSamples(teacher, 16, config.seed), 2, tokenizer.pad_token_id)  # fmt: skip
    own = stream_batches(tokenizer, text, half, tokenizer.pad_token_id)  # the calibration windows alone
    for (ids, mask, _), (own_ids, own_mask, _) in itertools.islice(zip(mixed, own), 3):
        width = own_ids.shape[1]
        assert (
            ids.shape == (4, 16) and torch.equal(ids[:2, :width], own_ids) and torch.equal(mask[:2, :width], own_mask)
        )
        assert not mask[:2, width:].any() and bool(mask[2:].all())
        assert torch.equal(ids[2:], reference_samples.take(2))
    short, _ = streams
    ids, mask, _ = next(short)
    assert ids.shape[0] == 4 and bool(mask[2:].all()) and bool((ids[2:, 0] == tokenizer.bos_token_id).all())
    only = TS.mixed_batches(None, TS.TeacherSamples(teacher, 16, 0), 4, tokenizer.pad_token_id)
    assert next(only)[0].shape == (4, 16)


def test_uptraining_with_generated_windows_records_them_and_keeps_the_held_out_rule():
    teacher = _teacher()
    student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    gqa.convert(student, 1)
    settings = dict(seq_len=16, batch_size=4, heldout_tokens=64, eval_tokens=0, gradient_checkpointing=False)
    result = uptrain(student, teacher, data="broad", steps=3, lr=1e-3, generated=0.75, bf16=False, progress=False,
                     **settings)  # fmt: skip
    generated = result.meta["calibration"]["generated"]
    assert generated["windows_per_batch"] == 3 and generated["windows"] == generated["windows_sampled"] == 9
    assert generated["sampling_seconds"] > 0
    assert result.meta["config"]["generated"] == 0.75
    assert result.meta["heldout_perplexity_after"] <= result.meta["heldout_perplexity_before"]
    # 3 steps x (3 whole sampled windows + 1 calibration window, shorter at a chunk's end) of 16 tokens
    assert 3 * 3 * 16 < result.meta["tokens_seen"] <= 3 * 4 * 16


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(generated=1.5), r"generated=1.5 must be a share"),
        (dict(generated=-0.1), r"generated=-0.1 must be a share"),
        (dict(generated=0.1, batch_size=4), r"rounds to none"),
        (dict(generated=0.5, parallel="fsdp"), r"not available with parallel=fsdp"),
        (dict(generated=0.5, generated_start="middle"), r"unknown generated_start"),
    ],
)
def test_bad_generated_shares_are_refused(settings, message):
    with pytest.raises(HeadlabError, match=message):
        UptrainConfig(**settings).check()


def test_generated_windows_need_a_teacher():
    teacher = _teacher()
    student = from_model(copy.deepcopy(teacher.model), teacher.tokenizer)
    with pytest.raises(HeadlabError, match="sampled from the teacher"):
        uptrain(student, None, data="broad", steps=1, objective="ce", generated=0.5, seq_len=16, heldout_tokens=64,
                eval_tokens=0, progress=False)  # fmt: skip
