"""Perplexity (rolling windows, lm-evaluation-harness conventions): how every change is judged; costs are in costs.py.

Perplexity follows lm-evaluation-harness `loglikelihood_rolling` (docs/evaluation.md): the text is tokenized without
special tokens, a prefix token (BOS, else EOS) is put in front so that every token of the text is scored, each
window feeds max_length tokens and scores max_length predictions (the last window reaches back to a full max_length
of context), and word perplexity and bits per byte divide the summed log-likelihood by the words and UTF-8 bytes of
exactly the text scored.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from headlab.core import corpora, distributed
from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
from headlab.core.data import (
    MLM_SEED,
    Corpus,
    TextSpec,
    batch_windows,
    load_corpus,
    masked_lm_batch,
    require_tokens,
    rolling_windows,
    split_text,
    takes_text,
    tokenize,
)
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.measure.choices import DEFAULT_KV_CHUNK
from headlab.measure.costs import peak_memory
from headlab.mechanisms.losses import final_states, picked_log_probs
from headlab.mechanisms.quantized_cache import check_kv_cache, new_kv_cache, quantized_cache_bytes

if TYPE_CHECKING:  # annotations only
    import pandas as pd

WINDOW_CONVENTION = "lm-eval loglikelihood_rolling (prefix token; max_length inputs; full-context last window)"
ONE_FORWARD = "one forward per window (no KV cache)"


@dataclass
class CacheChunks:
    """The chunked path of `perplexity`: each window fed `chunk` tokens per forward through a fresh `kv_cache`
    cache per batch (headlab.mechanisms.quantized_cache.new_kv_cache), so every chunk attends to the earlier chunks
    as the cache returns them; `cache_bytes` receives the first batch's cache bytes per window after its last
    chunk."""

    kv_cache: str
    chunk: int
    cache_bytes: int | None = None
    pure_keys: tuple[bool, bool] = (True, False)  # the adapter's cache_pure_keys (a "-kivi" cache's axes)

    def describe(self) -> str:
        return f"chunks of {self.chunk} tokens through a {self.kv_cache} KV cache"


@dataclass
class Perplexity:
    """Result of `perplexity`; nll is the mean negative log-likelihood per scored token in nats."""

    perplexity: float
    nll: float
    bits_per_token: float
    word_perplexity: float
    bits_per_byte: float
    byte_perplexity: float
    scored_tokens: int
    words: int
    bytes: int
    tokens_per_s: float
    seconds: float
    peak_memory_bytes: int
    objective: str  # "causal" or "masked-lm (15% fixed-seed masking)"
    max_length: int  # model input tokens per window (lm-eval's max_length; --seq-len is the same option)
    stride: int
    prefix_token: int | None
    windows: int = 0
    convention: str = WINDOW_CONVENTION
    kv_cache: str = "full"
    path: str = ONE_FORWARD  # or CacheChunks.describe(): how each window ran
    kv_cache_bytes: int | None = None  # chunked path: the cache's bytes per window after the window's last chunk

    def to_dict(self) -> dict:
        return asdict(self)


def _prefix_token(tokenizer) -> int | None:
    """The token put before the text so its first token is scored too: BOS, else EOS (lm-evaluation-harness)."""
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return None


@torch.no_grad()
def token_nll(model, input_ids, attention_mask, targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL (float64) and count of scored tokens per row: the last len(targets[r]) real positions of row r
    predict targets[r] (position p predicts token p + 1; lm-eval's continuation slice). The vocabulary projection runs
    on chunks of the scored positions (losses.final_states), so the [B, T, V] logits never exist whole: they would
    be most of the memory a command needs beyond the model (402 MB at the defaults for SmolLM2's 49,152 tokens)."""
    states, head = final_states(model, input_ids, attention_mask)  # [B, T, C] (or [B, T, V] logits, head None)
    nll_sum = torch.zeros(input_ids.shape[0], dtype=torch.float64)
    counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
    for row, row_targets in enumerate(targets):
        length, scored = int(attention_mask[row].sum()), len(row_targets)
        picked = picked_log_probs(states[row, length - scored : length], head, row_targets)  # [scored]
        # Summed in float32 per window as lm-eval does (float(logits.sum())), so that word perplexity agrees to
        # 1e-6 even over few words; windows are then added in float64.
        nll_sum[row] = -float(picked.sum())
        counts[row] = scored
    return nll_sum, counts


@torch.no_grad()
def calibration_nll(model: torch.nn.Module, batches, device) -> float:
    """Mean next-token NLL over the calibration windows (one window per forward, to bound the logits' memory)."""
    total, count = 0.0, 0
    for input_ids, attention_mask, *_ in batches:
        for row in range(input_ids.shape[0]):
            ids, mask = input_ids[row : row + 1].to(device), attention_mask[row : row + 1].to(device)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # [1, T, V]
            targets = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
            total += float(loss)
            count += int((targets != -100).sum())
    return total / max(count, 1)


@torch.no_grad()
def chunked_token_nll(model, input_ids, attention_mask, targets: list[torch.Tensor], chunks: CacheChunks):
    """token_nll with each window fed chunks.chunk tokens per forward into a fresh chunks.kv_cache cache: chunk
    [s, e) attends to positions [0, e), the earlier ones as the cache stores them (quantized caches: dequantized),
    so a quantized cache changes what later tokens see, as in generation. Same rows, positions and targets as
    token_nll, and the same float32 sum per window (lm-eval's); the logits exist one chunk at a time."""
    lengths = attention_mask.sum(dim=1).tolist()
    firsts = [length - len(row_targets) for length, row_targets in zip(lengths, targets)]  # first scored position
    picked: list[list[torch.Tensor]] = [[] for _ in targets]
    cache = new_kv_cache(model.config, chunks.kv_cache, chunks.pure_keys)
    for start in range(0, input_ids.shape[1], chunks.chunk):
        end = min(start + chunks.chunk, input_ids.shape[1])
        # The 2D mask spans the cached positions and this chunk; right padding only ever follows a row's tokens.
        logits = model(
            input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, :end], cache=cache, use_cache=True
        ).logits  # [B, e - s, V]
        for row, row_targets in enumerate(targets):
            low, high = max(start, firsts[row]), min(end, lengths[row])
            if low < high:
                wanted = row_targets[low - firsts[row] : high - firsts[row]]
                picked[row].append(picked_log_probs(logits[row, low - start : high - start], None, wanted))
    if chunks.cache_bytes is None:
        chunks.cache_bytes = quantized_cache_bytes(cache) // input_ids.shape[0]
    nll_sum = torch.tensor([-float(torch.cat(row).sum()) for row in picked], dtype=torch.float64)
    return nll_sum, torch.tensor([len(row_targets) for row_targets in targets], dtype=torch.long)


def rolling_nll(  # the windows' layout, then how they run
    loaded: LoadedModel,
    ids: torch.Tensor,
    max_length: int,
    stride: int,
    batch_size: int,
    progress=True,
    chunks: CacheChunks | None = None,
):
    """Summed NLL, scored-token count, window count and seconds of the rolling windows over `ids` (prefix token
    first, never scored); see data.rolling_windows for the layout. `chunks`: run each window in chunks through a KV
    cache (chunked_token_nll) instead of one forward."""
    windows = rolling_windows(len(ids), max_length, stride)
    pad_id = loaded.tokenizer.pad_token_id or 0
    device = loaded.device
    totals = torch.zeros(2, dtype=torch.float64)  # summed NLL, scored tokens
    start = time.perf_counter()
    batches = list(batch_windows(ids, distributed.shard(windows), batch_size, pad_id))
    missing = 0  # FSDP2 (lockstep): forwards this rank owes the others, agreed on before any of them runs
    if distributed.active() and distributed.lockstep(loaded.model) and chunks is None:
        missing = int(distributed.all_reduce_max(float(len(batches)))) - len(batches)
    for input_ids, attention_mask, group in tqdm(batches, desc="perplexity", disable=not progress, unit="batch"):
        targets = [ids[w.first_target : w.end + 1] for w in group]
        if chunks is None:
            nll_sum, counts = token_nll(loaded.model, input_ids.to(device), attention_mask.to(device), targets)
        else:
            nll_sum, counts = chunked_token_nll(
                loaded.model, input_ids.to(device), attention_mask.to(device), targets, chunks
            )
        totals += torch.stack([nll_sum.sum(), counts.sum().double()])
    _forwards_in_step(loaded.model, ids, missing, device)
    distributed.all_reduce_sum(totals)
    seconds = distributed.all_reduce_max(time.perf_counter() - start)
    return float(totals[0]), int(totals[1]), windows, seconds


@torch.no_grad()
def _forwards_in_step(model, ids: torch.Tensor, missing: int, device) -> None:
    """A sharded (FSDP2) model all-gathers its layers in every forward, on every rank together: a rank whose share of
    the windows made fewer batches runs the `missing` forwards the rank with the most ran more, on two tokens,
    unscored."""
    stand_in = ids[:2][None].to(device)
    for _ in range(missing):
        model(input_ids=stand_in, attention_mask=torch.ones_like(stand_in))


def check_max_length(loaded: LoadedModel, max_length: int) -> None:
    """Refuse a window longer than the model's positions (a one-line error instead of an index error)."""
    if loaded.max_positions is not None and max_length > loaded.max_positions:
        raise HeadlabError(f"max_length={max_length} exceeds the model's maximum positions ({loaded.max_positions})")


@takes_text(split="eval", seq_len=512, max_tokens=4096)
def perplexity(
    loaded: LoadedModel,
    data: Corpus | str | None = None,
    *,
    text: TextSpec,
    stride: int | None = None,
    progress: bool = True,
    kv_cache: str = "full",
    kv_chunk: int | None = None,
) -> Perplexity:
    """Token perplexity exp(-(1/N) sum_i log p(x_i | x_<i)) over the N tokens of the chosen part, plus word
    perplexity and bits per byte (lm-evaluation-harness wikitext definitions), in lm-eval's rolling windows.

    `text`: a TextSpec (the loose keywords split, seq_len, batch_size, max_tokens, text_column also work; `data`,
    when given, is its corpus). Its seq_len is the model input length of a window (lm-eval's max_length, the CLI's
    --max-length); stride (default seq_len, lm-eval's layout) < seq_len gives each scored token seq_len - stride
    tokens of extra context.

    kv_cache (headlab.mechanisms.choices.KV_CACHES) other than "full", or a kv_chunk, runs each window in chunks of
    kv_chunk tokens (default DEFAULT_KV_CHUNK) through that cache (chunked_token_nll; same windows, same scored
    tokens): a single forward never reads a cache, so only this path shows what a quantized cache costs.
    """
    if data is not None:
        text = text.but(data=data)
    part, seq_len, batch_size, max_tokens = text.split, text.seq_len, text.batch_size, text.max_tokens
    stride = seq_len if stride is None else stride
    check_max_length(loaded, seq_len)
    chunks = cache_chunks(kv_cache, kv_chunk, loaded.adapter.cache_pure_keys)
    if chunks is not None and loaded.adapter.is_encoder:
        raise HeadlabError("--kv-cache and --kv-chunk need a causal language model; this one is an encoder (masked LM)")
    corpus = text.corpus
    text_part = split_text(corpus, part)
    if loaded.adapter.is_encoder:
        return _masked_lm_loss(loaded, text_part.text, seq_len, batch_size, max_tokens, progress)

    ids, text = tokenize(loaded.tokenizer, text_part.text, max_tokens)
    require_tokens(ids, f"the {part} part of corpus {corpus.spec!r}")
    prefix = _prefix_token(loaded.tokenizer)
    if prefix is not None:
        ids = torch.cat([torch.tensor([prefix]), ids])
    device = loaded.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    total_nll, total_count, windows, seconds = rolling_nll(loaded, ids, seq_len, stride, batch_size, progress, chunks)
    if not math.isfinite(total_nll):
        raise HeadlabError(
            f"the loss is not finite ({total_nll}); with {str(loaded.dtype)} this is usually overflow: "
            "try dtype='bfloat16' or 'float32'"
        )
    words = len(re.split(r"\s+", text))
    n_bytes = len(text.encode("utf-8"))
    nll = total_nll / total_count
    return Perplexity(
        perplexity=exp_or_inf(nll),
        nll=nll,
        bits_per_token=nll / math.log(2),
        word_perplexity=exp_or_inf(total_nll / words),
        bits_per_byte=total_nll / (n_bytes * math.log(2)),
        byte_perplexity=exp_or_inf(total_nll / n_bytes),
        scored_tokens=total_count,
        words=words,
        bytes=n_bytes,
        tokens_per_s=sum(w.end - w.start for w in windows) / seconds,
        seconds=seconds,
        peak_memory_bytes=peak_memory(device),
        objective="causal",
        max_length=seq_len,
        stride=stride,
        prefix_token=prefix,
        windows=len(windows),
        kv_cache=kv_cache,
        path=ONE_FORWARD if chunks is None else chunks.describe(),
        kv_cache_bytes=None if chunks is None else chunks.cache_bytes,
    )


def cache_chunks(
    kv_cache: str = "full", kv_chunk: int | None = None, pure_keys: tuple[bool, bool] = (True, False)
) -> CacheChunks | None:
    """How perplexity runs its windows: None (one forward each) for the full cache without kv_chunk, else
    CacheChunks(kv_cache, kv_chunk or DEFAULT_KV_CHUNK, pure_keys: the adapter's cache_pure_keys); an unknown spec, a
    missing backend package or a chunk below 1 is refused in one line."""
    check_kv_cache(kv_cache)
    if kv_chunk is not None and kv_chunk < 1:
        raise HeadlabError(f"kv_chunk={kv_chunk} must be at least 1")
    if kv_cache == "full" and kv_chunk is None:
        return None
    return CacheChunks(kv_cache, kv_chunk or DEFAULT_KV_CHUNK, pure_keys=pure_keys)


def domain_perplexities(
    loaded: LoadedModel,
    domains: Sequence[str] | str | None = DEFAULT_EVAL_DOMAINS,
    *,
    text: TextSpec,
    stride: int | None = None,
    progress: bool = True,
    measured: Perplexity | None = None,
    kv_cache: str = "full",
    kv_chunk: int | None = None,
) -> pd.DataFrame:
    """Eval-split perplexity of `text`'s own corpus, then of each named built-in domain, in the same windows.

    One row per text: `perplexity` (see `perplexity`) of the eval split of text's corpus (role "calibration
    corpus"), then of each domain of `domains` (headlab.core.corpora.DOMAINS; a list or a comma-separated string;
    None or empty: none) with text's seq_len, batch_size, max_tokens and `stride`. A domain's role is "in
    calibration" where the calibration corpus is `broad` and the domain one of its BROAD_DOMAINS, else "held out"; a
    domain that is text's corpus itself is not repeated. Columns: domain (the corpus spec), role, perplexity, nll,
    bits_per_byte, scored_tokens. `measured`: the perplexity of text's eval split when already computed (e.g. by
    `headlab eval`), reused as the first row; kv_cache, kv_chunk: as in `perplexity`, for every row. Costs one
    perplexity run per domain (plus one for the corpus).
    """
    import pandas as pd  # start-up: as elsewhere in headlab, pandas loads with the first table

    names = check_domains(domains)  # before any model work
    text = text.but(split="eval").resolved()
    own = text.corpus_name
    calibrated_on_broad = own == corpora.BROAD
    if measured is None:
        measured = perplexity(loaded, text=text, stride=stride, progress=progress, kv_cache=kv_cache, kv_chunk=kv_chunk)
    results = [(own, "calibration corpus", measured)]
    for name in names:
        if name == own:
            continue
        role = "in calibration" if calibrated_on_broad and name in corpora.BROAD_DOMAINS else "held out"
        domain = text.but(data=load_corpus(name), text_column=None)
        scored = perplexity(loaded, text=domain, stride=stride, progress=progress, kv_cache=kv_cache, kv_chunk=kv_chunk)
        results.append((name, role, scored))
    return pd.DataFrame(
        [
            {"domain": name, "role": role, "perplexity": r.perplexity, "nll": r.nll,
             "bits_per_byte": r.bits_per_byte, "scored_tokens": r.scored_tokens}
            for name, role, r in results
        ]
    )  # fmt: skip


def check_domains(domains: Sequence[str] | str | None) -> tuple[str, ...]:
    """The domain names of `domains` (a list, or a comma-separated string; None: none), without repeats; an unknown
    name is refused with the choices."""
    if domains is None:
        return ()
    names = [d.strip() for d in domains.split(",")] if isinstance(domains, str) else list(domains)
    names = [name for name in dict.fromkeys(names) if name]
    unknown = [name for name in names if name not in corpora.DOMAINS]
    if unknown:
        raise HeadlabError(f"unknown domain {unknown[0]!r}; use some of {', '.join(corpora.DOMAINS)}")
    return tuple(names)


def exp_or_inf(x: float) -> float:
    """exp(x), or inf where it leaves float64's range: word perplexity over text without whitespace (Chinese,
    Japanese), whose lm-eval word count is one per whitespace-separated run, so a document of hundreds of tokens
    counts as one word (docs/evaluation.md); lm-eval's own math.exp raises there."""
    return math.exp(x) if x < LARGEST_EXPONENT else math.inf


LARGEST_EXPONENT = math.log(sys.float_info.max)


@torch.no_grad()
def _masked_lm_loss(loaded, text, seq_len, batch_size, max_tokens, progress) -> Perplexity:
    """Masked-LM loss: 15% of the non-special tokens of each window (fixed seed) replaced by the mask token and
    predicted; perplexity = exp(mean NLL over masked tokens). Not comparable to causal perplexity."""
    tokenizer, model, device = loaded.tokenizer, loaded.model, loaded.device
    ids, text = tokenize(tokenizer, text, max_tokens)
    require_tokens(ids, "the masked-LM text")
    body = seq_len - 2  # room for [CLS] and [SEP]
    if body < 1:
        raise HeadlabError(f"seq_len={seq_len} is too short for a masked-LM window")
    generator = torch.Generator().manual_seed(MLM_SEED)
    rows = [ids[i : i + body] for i in range(0, len(ids), body)]
    total_nll, total_count, start = 0.0, 0, time.perf_counter()
    for first in tqdm(range(0, len(rows), batch_size), desc="masked-LM loss", disable=not progress, unit="batch"):
        input_ids, attention_mask, labels = masked_lm_batch(tokenizer, rows[first : first + batch_size], generator)
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()  # [B, T, V]
        scored = labels != -100
        total_nll += float(-log_probs[scored].gather(1, labels[scored][:, None]).sum())
        total_count += int(scored.sum())
    seconds = time.perf_counter() - start
    nll = total_nll / total_count
    words, n_bytes = len(re.split(r"\s+", text)), len(text.encode("utf-8"))
    return Perplexity(
        exp_or_inf(nll),
        nll,
        nll / math.log(2),
        float("nan"),
        float("nan"),
        float("nan"),
        total_count,
        words,
        n_bytes,
        len(ids) / seconds,
        seconds,
        peak_memory(device),
        "masked-lm (15% fixed-seed masking)",
        seq_len,
        seq_len,
        None,
        len(rows),
        "masked-LM windows of max_length tokens ([CLS] and [SEP] included)",
    )
