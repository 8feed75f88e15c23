"""Synthetic retrieval windows for uptraining: long-context key-value needle prompts (RULER's single needle and
multi-key) whose haystack is the calibration training text, followed by their answer, with the loss on the answer
alone.

Plain long windows teach the student the text of a long window, of which retrieving one fact from far back is a
vanishing share; recovery restored perplexity at [512, 2k) but no passkey (docs/recovery.md). Here every window is a
retrieval, and distillation (KL to the unedited model, as everywhere in uptraining) is scored on the positions that
predict the answer and the newline after it (DuoAttention, Xiao et al. 2024, likewise calibrates on synthetic
passkey contexts). The prompts come from `headlab.measure.long_tasks.build_prompt`, the generator of the evaluation,
but over the calibration training text (never the held-out or eval text) with seeds of their own, so no evaluation
prompt is ever trained on; and the passkey template (other wording, 5 digits) is never trained on at all, so passkey
accuracy after recovery measures retrieval carried over to a prompt the student has not seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from headlab.core import distributed
from headlab.core.data import right_padded
from headlab.core.errors import HeadlabError
from headlab.measure.long_tasks import Haystack, build_prompt

RETRIEVAL_TASKS = ("niah_single", "niah_multikey")  # the templates trained on, in turn (not passkey: held out)
SEED_OFFSET = 7919  # training prompts' seeds: the run's seed plus this, apart from the evaluation's (0 by default)


def answer_text(answers) -> str:
    """What a correct greedy continuation starts with: the answer after one space, several joined by ', '."""
    return " " + ", ".join(answers)


def retrieval_window(tokenizer, haystack: Haystack, task: str, length: int, depth: float, sample: int, seed: int):
    """(input_ids [1, T], attention_mask [1, T], loss_mask [1, T]) of one prompt of `length` - max_new_tokens tokens,
    then its answer and a newline; loss_mask marks the positions whose logits predict the answer tokens and the
    newline (the last prompt token up to the answer's last token)."""
    prompt = build_prompt(haystack, task, length, depth, sample, seed)
    prompt_ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer_text(prompt.answers) + "\n", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + answer_ids])
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, len(prompt_ids) - 1 : len(prompt_ids) + len(answer_ids) - 1] = True
    return ids, torch.ones_like(ids), loss_mask


def retrieval_batches(tokenizer, text: str, length: int, seed: int, source: str = "calibration", *,
                      batch_size: int = 1, pad_id: int = 0) -> Iterator:  # fmt: skip
    """Endless (input_ids, attention_mask, epoch, loss_mask) of `batch_size` retrieval windows each (right-padded
    with `pad_id` to the longest, padding masked out and never scored): tasks in turn (RETRIEVAL_TASKS), needle
    depths uniform in [0, 1], haystack slices and needles drawn from (seed, count), so the stream is the same on any
    machine. Under torchrun each rank takes every N-th window."""
    haystack = Haystack(tokenizer, text, source)
    if haystack.tokens < length:
        raise HeadlabError(
            f"the calibration text ({haystack.tokens:,} tokens) is too short for {length}-token retrieval windows"
        )
    rng = random.Random(f"retrieval/{seed}")
    count, held = 0, []
    while True:
        task = RETRIEVAL_TASKS[count % len(RETRIEVAL_TASKS)]
        depth = rng.random()
        if count % distributed.world_size() == distributed.rank():
            held.append(retrieval_window(tokenizer, haystack, task, length, round(depth, 4), count, seed + SEED_OFFSET))
            if len(held) == batch_size:
                ids, attention, scored = _padded(held, pad_id)
                yield ids, attention, 0, scored
                held = []
        count += 1


def _padded(windows: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, loss_mask) of the windows stacked, each right-padded to the longest."""
    ids, attention, scored = zip(*((window_ids[0], mask[0], loss_mask[0]) for window_ids, mask, loss_mask in windows))
    return right_padded(ids, pad_id), right_padded(attention, 0), right_padded(scored, False)
