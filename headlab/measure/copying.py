"""In-context copying: a sequence of uniformly random tokens followed by a copy of itself, scored on the copy
(Olsson et al. 2022, "In-context learning and induction heads", their repeated random tokens).

Random tokens carry no meaning and no statistics, so a token of the copy is predictable only by finding its earlier
occurrence and reading the token after it: the induction mechanism that passkey and needle retrieval rest on.
Every token of the copy is a retrieval from half a sequence back, so one forward gives hundreds of scored
retrievals, where a needle prompt gives one answer:
    accuracy = share of copy tokens t (after the copy's first) with argmax p(. | x_<t) = x_t,
    nll = mean over the same tokens of -log p(x_t | x_<t).
The copy's first token is not scored: nothing in the context says the copy starts there. The tokens are drawn from
the model's vocabulary without its special tokens (as the induction statistic draws them, headlab.measure.stats),
seeded per (seed, length, sequence), and fed without special tokens, as the long-context prompts are.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, input_device
from headlab.measure.long_tasks import COPY_SEQUENCES
from headlab.measure.stats import random_token_ids
from headlab.mechanisms.losses import CHUNK_BYTES, final_states

MIN_COPY_LENGTH = 4  # the shortest sequence with a scored token: two tokens, then their copy


def copy_start(length: int) -> int:
    """Where the copy begins in a copy sequence of `length` tokens: after its `length - length // 2` random tokens.
    The copy's first token (at this index) is not scored; the ones after it are."""
    return length - length // 2


def copy_sequence(vocabulary: torch.Tensor, length: int, seed: int = 0, index: int = 0) -> list[int]:
    """Sequence `index` of `length` tokens from `vocabulary` (ids): `length - length // 2` random tokens, then the
    first `length // 2` of them again (seeded by seed, length and index: every length and sequence differs, and
    reruns agree)."""
    if length < MIN_COPY_LENGTH:
        raise HeadlabError(f"a copy sequence needs at least {MIN_COPY_LENGTH} tokens, got {length}")
    generator = torch.Generator().manual_seed((seed * 1_000_003 + length) * 1_009 + index)
    first = vocabulary[torch.randint(len(vocabulary), (copy_start(length),), generator=generator)].tolist()
    return first + first[: length // 2]


@torch.no_grad()
def copy_outcome(loaded: LoadedModel, ids: list[int]) -> tuple[int, int, float]:
    """(scored, correct, summed NLL) of one copy sequence: the copy's tokens after its first, predicted from all
    the tokens before each (greedy argmax for correct). The vocabulary projection runs on chunks of the scored
    positions (losses.final_states), so the [T, V] logits never exist whole."""
    start = copy_start(len(ids))
    inputs = torch.tensor([ids[:-1]], device=input_device(loaded.model))
    states, head = final_states(loaded.model, inputs, torch.ones_like(inputs))  # [1, T-1, C] (or logits, head None)
    rows = states[0, start:]  # position p predicts token p + 1: these predict ids[start + 1:]
    targets = torch.tensor(ids[start + 1 :], device=rows.device)
    chunk = len(rows) if head is None else max(1, CHUNK_BYTES // (4 * head.out_features))
    correct, nll = 0, 0.0
    for first in range(0, len(rows), chunk):
        part = rows[first : first + chunk]
        logits = (part if head is None else head(part)).float()
        wanted = targets[first : first + chunk]
        correct += int((logits.argmax(-1) == wanted).sum())
        nll -= float(torch.log_softmax(logits, -1).gather(1, wanted[:, None]).double().sum())
    return len(targets), correct, nll


def check_copy_request(lengths, sequences: int, max_positions: int | None) -> None:
    """Refuse a copy measurement before any work: too few sequences, too short, or past the model's positions."""
    if sequences < 0:
        raise HeadlabError(f"copy sequences={sequences} must be 0 or more")
    for length in lengths:
        if length < MIN_COPY_LENGTH:
            raise HeadlabError(f"a copy sequence needs at least {MIN_COPY_LENGTH} tokens, got length {length}")
        if max_positions is not None and length > max_positions:
            raise HeadlabError(f"copy length {length:,} is beyond the model's {max_positions:,} positions")


def copy_accuracy(
    loaded: LoadedModel, lengths, sequences: int = COPY_SEQUENCES, seed: int = 0, progress: bool = True
) -> pd.DataFrame:
    """One row per length: `length, sequences, scored, correct, accuracy, nll` over `sequences` copy sequences of
    that many tokens (the copy starts `length - length // 2` tokens back); empty with sequences=0."""
    if loaded.adapter.is_encoder:
        raise HeadlabError("in-context copying needs a causal language model; this one is an encoder (masked LM)")
    lengths = tuple(dict.fromkeys(lengths))
    check_copy_request(lengths, sequences, loaded.max_positions)
    vocabulary = random_token_ids(loaded)
    rows = []
    bar = tqdm(total=len(lengths) * sequences, desc="in-context copying", unit="seq", disable=not progress)
    for length in lengths:
        scored = correct = 0
        nll = 0.0
        for index in range(sequences):
            n, hits, summed = copy_outcome(loaded, copy_sequence(vocabulary, length, seed, index))
            scored, correct, nll = scored + n, correct + hits, nll + summed
            bar.update()
        if sequences:
            rows.append({"length": length, "sequences": sequences, "scored": scored, "correct": correct,
                         "accuracy": correct / scored, "nll": nll / scored})  # fmt: skip
    bar.close()
    return pd.DataFrame(rows, columns=["length", "sequences", "scored", "correct", "accuracy", "nll"])


def copy_record(sequences: int, seed: int) -> dict:
    """What copy_accuracy measured, for a command's meta.json."""
    return {
        "sequences": sequences,
        "seed": seed,
        "scored": "the copy's tokens after its first",
        "accuracy": "greedy argmax equals the copied token",
        "source": "Olsson et al. 2022, repeated random tokens",
        "run": "one teacher-forced forward per sequence in transformers, no KV cache (as NLL by position)",
    }


__all__ = [
    "COPY_SEQUENCES",
    "check_copy_request",
    "copy_accuracy",
    "copy_outcome",
    "copy_record",
    "copy_sequence",
    "copy_start",
]
