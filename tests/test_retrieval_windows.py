"""Retrieval windows in uptraining (headlab.recovery.retrieval_windows): key-value needle prompts over the calibration
text, the loss on the answer alone, never the passkey template; checked against the prompt generator and a KL by
hand."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from models import tiny_model
from tiny_text import tiny_tokenizer

from headlab.core.data import load_corpus, split_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.measure.long_tasks import Haystack, build_prompt
from headlab.recovery import retrieval_windows as RW
from headlab.recovery.uptrain import UptrainConfig, distillation_loss, uptrain

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTH = 800  # the tiny tokenizer is one token per character: a needle prompt needs a few hundred


def _text() -> str:
    return split_text(load_corpus("broad"), "calibration").text[:60_000]


def test_the_loss_covers_exactly_the_answer_and_its_newline():
    tokenizer = tiny_tokenizer()
    haystack = Haystack(tokenizer, _text(), "calibration")
    ids, attention, scored = RW.retrieval_window(tokenizer, haystack, "niah_multikey", LENGTH, 0.3, 5, 11)
    prompt = build_prompt(haystack, "niah_multikey", LENGTH, 0.3, 5, 11)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert ids[0, : prompt.prompt_tokens].tolist() == encode(prompt.text) and bool(attention.all())
    # scored position t predicts token t + 1: the predicted tokens are the answer after a space, then a newline
    predicted = ids[0, 1:][scored[0, :-1]]
    assert predicted.tolist() == encode(RW.answer_text(prompt.answers) + "\n")
    assert not scored[0, -1] and int(scored.sum()) == len(predicted) == len(ids[0]) - prompt.prompt_tokens


def test_the_stream_is_deterministic_alternates_templates_and_never_asks_for_the_passkey():
    tokenizer, text = tiny_tokenizer(), _text()
    first = list(itertools.islice(RW.retrieval_batches(tokenizer, text, LENGTH, seed=3), 4))
    again = list(itertools.islice(RW.retrieval_batches(tokenizer, text, LENGTH, seed=3), 4))
    other = next(RW.retrieval_batches(tokenizer, text, LENGTH, seed=4))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]) for a, b in zip(first, again))
    assert not torch.equal(first[0][0], other[0])
    texts = ["".join(tokenizer.convert_ids_to_tokens(ids[0].tolist())) for ids, *_ in first]
    assert all(text.count("special magic number") >= 2 and "pass key" not in text for text in texts)
    assert "passkey" not in RW.RETRIEVAL_TASKS
    with pytest.raises(HeadlabError, match="too short"):
        next(RW.retrieval_batches(tokenizer, text[:300], LENGTH, seed=0))


def test_batched_windows_are_the_single_windows_right_padded_and_never_scored_in_the_padding():
    tokenizer, text = tiny_tokenizer(), _text()
    singles = list(itertools.islice(RW.retrieval_batches(tokenizer, text, LENGTH, seed=3), 4))
    batches = list(itertools.islice(RW.retrieval_batches(tokenizer, text, LENGTH, seed=3, batch_size=2, pad_id=7), 2))
    for batch, pair in zip(batches, (singles[:2], singles[2:])):
        ids, attention, epoch, scored = batch
        assert ids.shape[0] == 2 and epoch == 0
        for row, (single_ids, _, _, single_scored) in enumerate(pair):
            width = single_ids.shape[1]
            assert torch.equal(ids[row, :width], single_ids[0]) and torch.equal(scored[row, :width], single_scored[0])
            assert bool(attention[row, :width].all()) and not bool(attention[row, width:].any())
            assert bool((ids[row, width:] == 7).all()) and not bool(scored[row, width:].any())
    # windows of unequal length (answers of other token counts): the shorter one is padded, its padding unscored
    short = (torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[False, True, False]]))
    long = (torch.tensor([[4, 5, 6, 7, 8]]), torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool))
    ids, attention, scored = RW._padded([short, long], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert attention.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert scored.tolist() == [[False, True, False, False, False], [True] * 5]


def _pair():
    teacher = from_model(tiny_model("llama", max_position_embeddings=1024), tiny_tokenizer())
    student = from_model(copy.deepcopy(teacher.model), tiny_tokenizer())
    gqa.convert(student, 1)
    return teacher, student


def test_a_retrieval_step_distills_on_the_answer_alone():
    """One step, a retrieval step: its loss is taken before the optimiser moves anything, so the curve's KL is the KL
    of the first stream window's answer positions under the starting weights, computed here by hand."""
    teacher, student = _pair()
    start = copy.deepcopy(student.model)
    corpus = load_corpus("broad")
    settings = dict(seq_len=32, batch_size=4, heldout_tokens=128, eval_tokens=0, eval_seq_len=32)
    result = uptrain(student, teacher, data=corpus, steps=1, lr=1e-3, long_seq_len=LENGTH, long_every=1,
                     long_kind="retrieval", gradient_checkpointing=False, bf16=False, progress=False,
                     **settings)  # fmt: skip  # float32 like the reference by hand
    assert result.meta["calibration"]["long_windows"]["kind"] == "retrieval"
    from headlab.recovery.uptrain import _data  # the same training text the run streamed from

    streams, _, _, _ = _data(student, corpus, UptrainConfig(long_seq_len=LENGTH, long_kind="retrieval", **settings))
    ids, attention, _, scored = next(streams[1])
    with torch.no_grad():
        student_logits, teacher_logits = start(ids).logits, teacher.model(ids).logits
        by_hand = distillation_loss(student_logits, teacher_logits, scored)
        everywhere = distillation_loss(student_logits, teacher_logits, attention.bool())
    assert result.curve["kl"].iloc[1] == pytest.approx(float(by_hand), rel=1e-5)
    assert float(by_hand) != pytest.approx(float(everywhere), rel=1e-3)  # the mask made a difference


@pytest.mark.parametrize(
    ("settings", "message"),
    [(dict(long_kind="retrieval"), "needs long_seq_len"), (dict(long_kind="needles", long_seq_len=64), "long_kind")],
)
def test_bad_long_kinds_fail_before_work(settings, message):
    with pytest.raises(HeadlabError, match=message):
        UptrainConfig(**settings).check()
