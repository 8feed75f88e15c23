"""In-context copying (headlab.measure.copying): the sequences, the score against a hand-made copier and an
obvious per-position implementation, and its place in long_context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_text import save_tiny

from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model
from headlab.measure.copying import copy_accuracy, copy_outcome, copy_sequence
from headlab.measure.stats import random_token_ids

VOCAB = 50


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model")), device="cpu")


def test_sequences_are_seeded_copies_without_special_tokens(tiny):
    vocabulary = random_token_ids(tiny)
    special = set(tiny.tokenizer.all_special_ids) | {tiny.model.config.eos_token_id}
    assert not special & set(vocabulary.tolist())
    for length in (4, 9, 64):
        ids = copy_sequence(vocabulary, length, seed=3, index=1)
        first = length - length // 2
        assert len(ids) == length and ids[first:] == ids[: length // 2]
        assert ids == copy_sequence(vocabulary, length, seed=3, index=1)  # reruns agree
    assert copy_sequence(vocabulary, 64, index=0) != copy_sequence(vocabulary, 64, index=1)
    assert copy_sequence(vocabulary, 64, seed=0) != copy_sequence(vocabulary, 64, seed=1)
    with pytest.raises(HeadlabError, match="at least 4 tokens"):
        copy_sequence(vocabulary, 3)


class _Shifted(torch.nn.Module):
    """Logits that put all mass on the token `lag` positions back of the next one (lag = half: a perfect copier of
    copy sequences; lag = 1: predicts the current token again)."""

    def __init__(self, lag: int):
        super().__init__()
        self.lag = lag
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=VOCAB))

    def forward(self, input_ids, attention_mask=None):
        T = input_ids.shape[1]
        logits = torch.zeros(1, T, VOCAB)
        for p in range(T):
            source = p + 1 - self.lag  # position p predicts token p + 1
            if 0 <= source < T:
                logits[0, p, input_ids[0, source]] = 30.0
        return SimpleNamespace(logits=logits)


def _loaded(model) -> SimpleNamespace:
    return SimpleNamespace(model=model, tokenizer=SimpleNamespace(all_special_ids=[0, 1]),
                           adapter=SimpleNamespace(is_encoder=False), max_positions=None)  # fmt: skip


def test_a_perfect_copier_scores_every_token_and_a_repeater_only_its_coincidences():
    vocabulary = torch.arange(2, VOCAB)
    for length in (10, 11):
        ids = copy_sequence(vocabulary, length, seed=5)
        start = length - length // 2
        scored, correct, nll = copy_outcome(_loaded(_Shifted(start)), ids)
        assert scored == length // 2 - 1 and correct == scored
        by_hand = -torch.log_softmax(torch.tensor([30.0] + [0.0] * (VOCAB - 1)), 0)[0].item()
        assert nll == pytest.approx(scored * by_hand, rel=1e-6)
        _, repeats, _ = copy_outcome(_loaded(_Shifted(1)), ids)
        assert repeats == sum(ids[t] == ids[t - 1] for t in range(start + 1, length))


@torch.no_grad()
def test_copy_outcome_matches_a_forward_per_position(tiny):
    ids = copy_sequence(random_token_ids(tiny), 40, seed=2)
    scored, correct, nll = copy_outcome(tiny, ids)
    hits, total = 0, 0.0
    for t in range(21, 40):  # the copy starts at 20; its first token is not scored
        logits = tiny.model(input_ids=torch.tensor([ids[:t]])).logits[0, -1].double()
        hits += int(logits.argmax()) == ids[t]
        total -= float(torch.log_softmax(logits, 0)[ids[t]])
    assert (scored, correct) == (19, hits)
    assert nll == pytest.approx(total, rel=1e-4)


def test_copy_accuracy_rows_and_refusals(tiny):
    table = copy_accuracy(tiny, (12, 12, 20), sequences=3, progress=False)  # a length given twice is measured once
    assert table["length"].tolist() == [12, 20] and table["scored"].tolist() == [3 * 5, 3 * 9]
    assert ((table["correct"] / table["scored"]) == table["accuracy"]).all()
    assert copy_accuracy(tiny, (12,), sequences=0, progress=False).empty
    with pytest.raises(HeadlabError, match="beyond the model's"):
        copy_accuracy(tiny, (tiny.max_positions + 2,), progress=False)
    with pytest.raises(HeadlabError, match="must be 0 or more"):
        copy_accuracy(tiny, (12,), sequences=-1, progress=False)
