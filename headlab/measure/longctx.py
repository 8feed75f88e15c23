"""Quality where KV compression pays: long-context retrieval accuracy (headlab.measure.long_tasks' prompts, greedy
decoding with the KV cache, exact match) and perplexity by position (NLL of tokens in position buckets of long
sequences), on any model headlab holds in memory.

Accuracy per (task, length, depth) cell and per (task, length) comes with a Wilson score interval (Wilson 1927):
(p + z^2/2n ± z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.96 for 95%.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.data import DOCUMENT_SEPARATOR, TextSpec, split_text, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, input_device
from headlab.measure.copying import COPY_SEQUENCES, check_copy_request, copy_accuracy, copy_record
from headlab.measure.evaluate import _prefix_token
from headlab.measure.long_tasks import (
    DEFAULT_DEPTHS,
    DEFAULT_TASKS,
    LONG_TASKS,
    TRADE_DEPTHS,
    TRADE_SAMPLES,
    Haystack,
    LongPrompt,
    check_grid,
    make_prompts,
    score,
)
from headlab.mechanisms.losses import final_states, picked_log_probs
from headlab.mechanisms.quantized_cache import check_kv_cache, new_kv_cache, quantized_cache_bytes

DECODING = "greedy, KV cache, stop at the first newline (lm-eval generate_until with until=['\\n'])"
PROMPT_TOKENS = "the prompt's tokens without special tokens (lm-eval generate_until's encoding)"
POSITION_EDGES = (0, 512, 2048, 4096, 8192)  # NLL-by-position buckets [0, 512), [512, 2k), [2k, 4k), [4k, 8k)
CURVE_BIN = 128  # tokens per point of the NLL-by-position curve


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion correct/total (Wilson 1927); (0, 1) for no trials."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def cut_answer(text: str) -> str:
    """The answer as lm-eval's generate_until keeps it: the generated text up to the first newline."""
    return text.split("\n", 1)[0]


Generate = Callable[[list[LongPrompt], int], list[str]]  # (prompts of one length, max new tokens) -> texts


@torch.no_grad()
def transformers_generate(loaded: LoadedModel, prompts: list[LongPrompt], max_new_tokens: int, cache=None) -> list[str]:
    """Greedy continuations of equal-length prompts in one batch (no padding needed): one prefill, then
    `max_new_tokens` cached decode steps, through the model's own generate(); `cache`: the transformers Cache to
    fill (default: generate's own)."""
    tokenizer = loaded.tokenizer
    ids = torch.tensor([tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts])
    ids = ids.to(input_device(loaded.model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = loaded.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        use_cache=True,
        **({"cache": cache} if cache is not None else {}),
    )
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out.cpu()]


def recorded_generate(loaded: LoadedModel, new_cache, record: list[dict], measure, *, writing=None, **columns):
    """A `generate` that decodes each batch into a fresh cache `new_cache()` (inside `writing(cache)` when given, a
    context the cache must be active in) and appends one row per batch to `record`: length, prompts, `columns`,
    cache_bytes (`measure(cache)` after the last decode step), cache_slots (tokens cached)."""

    def generate(batch, budget):
        cache = new_cache()
        with writing(cache) if writing is not None else contextlib.nullcontext():
            texts = transformers_generate(loaded, batch, budget, cache=cache)
        record.append({"length": batch[0].length, "prompts": len(batch), **columns, "cache_bytes": measure(cache),
                       "cache_slots": cache.get_seq_length()})  # fmt: skip
        return texts

    return generate


def cache_generate(loaded: LoadedModel, kv_cache: str, record: list[dict]) -> Generate:
    """recorded_generate into a fresh `kv_cache` cache per batch (headlab.mechanisms.quantized_cache.new_kv_cache: the
    prefill writes it, every decode step reads it back); cache_bytes are quantized_cache_bytes (packed integers or fp8
    with their scales, plus any full-precision residual), and each row names the kv_cache."""
    check_kv_cache(kv_cache)
    return recorded_generate(
        loaded,
        lambda: new_kv_cache(loaded.model.config, kv_cache, loaded.adapter.cache_pure_keys),
        record,
        quantized_cache_bytes,
        kv_cache=kv_cache,
    )


def _batches(prompts: list[LongPrompt], batch_size: int):
    """Prompts grouped by (task, length) in their order, `batch_size` at a time: a batch shares one length (no
    padding) and one decode budget."""
    groups: dict[tuple, list[LongPrompt]] = {}
    for prompt in prompts:
        groups.setdefault((prompt.task, prompt.length), []).append(prompt)
    for group in groups.values():
        for start in range(0, len(group), batch_size):
            yield group[start : start + batch_size]


def answer_prompts(prompts: list[LongPrompt], generate: Generate, batch_size: int = 1, progress: bool = True):
    """One row per prompt: what was generated (cut at its first newline), whether it is correct, its recall."""
    rows = []
    bar = tqdm(total=len(prompts), desc="long-context prompts", unit="prompt", disable=not progress)
    for batch in _batches(prompts, batch_size):
        start = time.perf_counter()
        texts = generate(batch, LONG_TASKS[batch[0].task].max_new_tokens)
        seconds = (time.perf_counter() - start) / len(batch)
        for prompt, generated in zip(batch, texts):
            answer = cut_answer(generated)
            correct, recall = score(prompt.task, answer, prompt.answers)
            rows.append(
                {
                    "task": prompt.task,
                    "length": prompt.length,
                    "depth": prompt.depth,
                    "sample": prompt.sample,
                    "depth_actual": prompt.depth_actual,
                    "needle_token": prompt.needle_token,
                    "answers": " ".join(prompt.answers),
                    "generated": answer,
                    "correct": bool(correct),
                    "recall": float(recall),
                    "seconds": seconds,
                }
            )
        bar.update(len(batch))
    bar.close()
    return pd.DataFrame(rows)


def accuracy_table(outcomes: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Accuracy (share correct), its 95% Wilson interval and the mean recall per group of `by` columns."""
    rows = []
    for key, group in outcomes.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        n, hits = len(group), int(group["correct"].sum())
        low, high = wilson_interval(hits, n)
        rows.append({**dict(zip(by, key)), "prompts": n, "correct": hits, "accuracy": hits / n,
                     "ci_low": low, "ci_high": high, "recall": float(group["recall"].mean())})  # fmt: skip
    return pd.DataFrame(rows)


def position_sequences(text: TextSpec, tokenizer, length: int, count: int) -> tuple[list[list[int]], str]:
    """`count` token sequences of `length` tokens for NLL by position: the part's documents that are long enough,
    in order, else consecutive slices of the part's text joined (which of the two is returned as the source)."""
    part = split_text(text.corpus, text.split)
    long_docs = []
    for document in part.text.split(DOCUMENT_SEPARATOR):
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            long_docs.append(ids[:length])
        if len(long_docs) == count:
            return long_docs, "documents"
    joined = tokenizer(part.text, add_special_tokens=False)["input_ids"]
    slices = [joined[i : i + length] for i in range(0, len(joined) - length + 1, length)][:count]
    if len(slices) < count:
        raise HeadlabError(
            f"the {text.split} part of corpus {text.corpus_name!r} has {len(joined):,} tokens: too short for "
            f"{count} sequence(s) of {length:,}; give a longer text (data=) or fewer position_sequences="
        )
    return slices, "joined text"


@torch.no_grad()
def position_nll(loaded: LoadedModel, sequences: list[list[int]], progress: bool = True) -> torch.Tensor:
    """NLL [S, T] of every token of each sequence given the tokens before it, the prefix token (BOS, else EOS: as
    lm-eval's rolling perplexity) in front so that position 0 is scored too; one forward per sequence."""
    prefix = _prefix_token(loaded.tokenizer)
    device = input_device(loaded.model)
    rows = []
    for ids in tqdm(sequences, desc="NLL by position", unit="seq", disable=not progress):
        if prefix is not None:
            inputs, targets = torch.tensor([prefix] + ids[:-1]), torch.tensor(ids)
        else:  # without a prefix the first token has no prediction: score from position 1
            inputs, targets = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
        states, head = final_states(loaded.model, inputs[None].to(device), torch.ones(1, len(inputs), device=device))
        nll = -picked_log_probs(states[0], head, targets).double().cpu()
        rows.append(nll if prefix is not None else torch.cat([torch.full((1,), math.nan, dtype=torch.float64), nll]))
    return torch.stack(rows)


def position_tables(nll: torch.Tensor, edges=POSITION_EDGES, bin_size: int = CURVE_BIN) -> tuple[pd.DataFrame, ...]:
    """(buckets, curve): mean NLL and perplexity of the tokens in each [start, end) position bucket, and per bin of
    `bin_size` positions for the curve."""
    length = nll.shape[1]

    def rows(bounds):
        out = []
        for start, end in bounds:
            values = nll[:, start:end]
            values = values[~torch.isnan(values)]
            if len(values):
                mean = float(values.mean())
                out.append({"start": start, "end": end, "tokens": len(values), "nll": mean,
                            "perplexity": math.exp(mean)})  # fmt: skip
        return pd.DataFrame(out)

    cut = [e for e in edges if e < length] + [length]
    buckets = rows(list(zip(cut, cut[1:])))
    curve = rows([(s, min(s + bin_size, length)) for s in range(0, length, bin_size)])
    return buckets, curve


@dataclass
class LongContext:
    """Result of `long_context`: per-prompt outcomes, accuracy per cell (task, length, depth) and per length (task,
    length), NLL per position bucket and per curve bin, in-context copying per length (headlab.measure.copying),
    and what ran in meta."""

    prompts: pd.DataFrame
    cells: pd.DataFrame
    lengths: pd.DataFrame
    positions: pd.DataFrame
    curve: pd.DataFrame
    meta: dict = field(default_factory=dict)
    prompt_list: list[LongPrompt] = field(default_factory=list)  # the prompts themselves (lm-eval task files)
    copying: pd.DataFrame = field(default_factory=pd.DataFrame)

    def tables(self) -> dict[str, pd.DataFrame]:
        return {"prompts": self.prompts, "cells": self.cells, "lengths": self.lengths, "positions": self.positions,
                "position_curve": self.curve, "copying": self.copying}  # fmt: skip

    def copy_accuracy_at(self, length: int) -> float:
        """The in-context copy accuracy at `length` (KeyError where it was not measured)."""
        row = self.copying[self.copying["length"] == length] if not self.copying.empty else self.copying
        if row.empty:
            raise KeyError(f"copy@{length}")
        return float(row["accuracy"].iloc[0])

    def accuracy(self, task: str, length: int) -> float:
        row = self.lengths[(self.lengths["task"] == task) & (self.lengths["length"] == length)]
        if row.empty:
            raise KeyError(f"{task}@{length}")
        return float(row["accuracy"].iloc[0])


def default_lengths(loaded: LoadedModel) -> tuple[int, ...]:
    """1k, 2k, 4k, 8k on an accelerator; 1k on a CPU, so that a first run (10 prompts, 250 s of CPU time) takes
    about 2 minutes on 2 cores: one 8k prefill of a 135M model takes about 100 s there (docs/long-context.md).
    Capped by the model's maximum positions either way."""
    lengths = (1024, 2048, 4096, 8192) if loaded.device.type != "cpu" else (1024,)
    limit = loaded.max_positions
    kept = tuple(n for n in lengths if limit is None or n <= limit)
    if not kept:
        raise HeadlabError(
            f"the model's maximum positions ({limit}) are below the shortest default length; give lengths="
        )
    return kept


@takes_text(split="eval", max_tokens=None)
def long_context(
    loaded: LoadedModel,
    *,
    text: TextSpec,
    tasks=DEFAULT_TASKS,
    lengths=None,
    depths=DEFAULT_DEPTHS,
    samples: int = 2,
    seed: int = 0,
    position_sequences_count: int = 1,
    copy_sequences: int = COPY_SEQUENCES,
    batch_size: int = 1,
    generate: Generate | None = None,
    progress: bool = True,
) -> LongContext:
    """Retrieval accuracy on the tasks x lengths x depths x samples prompts, NLL by position over
    `position_sequences_count` sequences of the longest length (0: none), on the haystack text of `text` (its corpus
    and split), and in-context copying over `copy_sequences` random sequences of each length (0: none). `generate`
    runs prompts on another runtime (llama.cpp); default transformers' generate. NLL by position and copying are
    teacher-forced forwards of `loaded` itself, whatever `generate` runs on."""
    if loaded.adapter.is_encoder:
        raise HeadlabError("long-context tasks need a causal language model; this one is an encoder (masked LM)")
    for task in tasks:
        LONG_TASKS[task]  # an unknown name fails here, before any work
    lengths = tuple(lengths) if lengths else default_lengths(loaded)
    check_grid(lengths, depths, loaded.max_positions)
    if position_sequences_count < 0:
        raise HeadlabError(f"position_sequences_count={position_sequences_count} must be 0 or more")
    check_copy_request(lengths, copy_sequences, loaded.max_positions)
    part = split_text(text.corpus, text.split)
    start = time.perf_counter()
    haystack = Haystack(loaded.tokenizer, part.text, text.corpus_name)
    prompts = make_prompts(haystack, tasks, lengths, depths, samples, seed)
    generate = generate or (lambda batch, budget: transformers_generate(loaded, batch, budget))
    outcomes = answer_prompts(prompts, generate, batch_size, progress)
    answer_seconds = time.perf_counter() - start
    positions = curve = pd.DataFrame()
    position_source, position_seconds = None, 0.0
    if position_sequences_count:
        start = time.perf_counter()
        sequences, position_source = position_sequences(text, loaded.tokenizer, max(lengths), position_sequences_count)
        positions, curve = position_tables(position_nll(loaded, sequences, progress))
        position_seconds = time.perf_counter() - start
    start = time.perf_counter()
    copying = copy_accuracy(loaded, lengths, copy_sequences, seed, progress)
    copy_seconds = time.perf_counter() - start
    meta = {
        **loaded.describe(),
        **part.describe(),
        "tasks": {t: {"help": LONG_TASKS[t].help, "scoring": LONG_TASKS[t].definition} for t in tasks},
        "lengths": list(lengths),
        "depths": list(depths),
        "samples": samples,
        "seed": seed,
        "decoding": DECODING,
        "prompt_tokens": PROMPT_TOKENS,
        "interval": "95% Wilson score interval",
        "answer_seconds": answer_seconds,
        "position_sequences": position_sequences_count,
        "position_length": max(lengths) if position_sequences_count else None,
        "position_source": position_source,
        "position_seconds": position_seconds,
        "copying": {**copy_record(copy_sequences, seed), "seconds": copy_seconds},
    }
    return LongContext(
        prompts=outcomes,
        cells=accuracy_table(outcomes, ["task", "length", "depth"]),
        lengths=accuracy_table(outcomes, ["task", "length"]),
        positions=positions,
        curve=curve,
        meta=meta,
        prompt_list=prompts,
        copying=copying,
    )


def check_passkey_lengths(loaded: LoadedModel, lengths) -> None:
    """Refuse passkey_columns' lengths before any work: an encoder, or a length beyond the model's positions."""
    if loaded.adapter.is_encoder:
        raise HeadlabError("long-context tasks need a causal language model; this one is an encoder (masked LM)")
    check_grid(lengths, TRADE_DEPTHS, loaded.max_positions)


def passkey_columns(loaded: LoadedModel, text: TextSpec, lengths) -> dict:
    """Passkey retrieval of `loaded` as it is now, on the trade grid (TRADE_DEPTHS x TRADE_SAMPLES prompts per length,
    haystack from the eval part of `text`), and its in-context copying (COPY_SEQUENCES sequences per length), as
    table columns: `passkey_<length>` the fraction of prompts answered correctly at that length, `passkey_prompts`
    the prompts per length, `copy_<length>` the copy accuracy (what the sweeps add with --long-context)."""
    lengths = tuple(dict.fromkeys(lengths))  # a length given twice is measured once
    result = long_context(
        loaded,
        text=text.but(split="eval", max_tokens=None),
        tasks=("passkey",),
        lengths=lengths,
        depths=TRADE_DEPTHS,
        samples=TRADE_SAMPLES,
        position_sequences_count=0,
        progress=False,
    )
    columns = {f"passkey_{length}": result.accuracy("passkey", length) for length in lengths}
    copying = {f"copy_{length}": result.copy_accuracy_at(length) for length in lengths}
    return {**columns, "passkey_prompts": int(result.lengths["prompts"].max()), **copying}


def passkey_record(lengths) -> dict:
    """What passkey_columns measured, for a sweep's meta.json `long_context` entry."""
    return {"lengths": list(lengths), "depths": list(TRADE_DEPTHS), "samples": TRADE_SAMPLES, "task": "passkey",
            "copying": copy_record(COPY_SEQUENCES, 0),
            "columns": "passkey_<length>: fraction of prompts correct; passkey_prompts: prompts per length; "
                       "copy_<length>: in-context copy accuracy (headlab.measure.copying)"}  # fmt: skip


__all__ = [
    "LongContext",
    "accuracy_table",
    "answer_prompts",
    "check_passkey_lengths",
    "cut_answer",
    "default_lengths",
    "long_context",
    "passkey_columns",
    "passkey_record",
    "position_nll",
    "position_sequences",
    "position_tables",
    "recorded_generate",
    "transformers_generate",
    "wilson_interval",
]
