"""Perplexity (rolling windows), model size and KV-cache arithmetic: how every change is priced.

Perplexity follows lm-evaluation-harness `loglikelihood_rolling` (docs/evaluation.md): the text is tokenized without
special tokens, a prefix token (BOS, else EOS) is put in front so that every token of the text is scored, each
window feeds max_length tokens and scores max_length predictions (the last window reaches back to a full max_length
of context), and word perplexity and bits per byte divide the summed log-likelihood by the words and UTF-8 bytes of
exactly the text scored.
"""

from __future__ import annotations

import math
import re
import resource
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from headlab import distributed
from headlab.data import Corpus, batch_windows, load_corpus, require_tokens, rolling_windows, split_text, tokenize
from headlab.errors import HeadlabError
from headlab.loading import LoadedModel

MLM_PROBABILITY = 0.15
MLM_SEED = 0  # the fixed seed of the masked-LM masking (perplexity and importance)
WINDOW_CONVENTION = "lm-eval loglikelihood_rolling (prefix token; max_length inputs; full-context last window)"


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

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_memory(device: torch.device) -> int:
    """Peak bytes: CUDA allocator peak on GPU; on CPU the process's peak resident set (ru_maxrss, in KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _prefix_token(tokenizer) -> int | None:
    """The token put before the text so its first token is scored too: BOS, else EOS (lm-evaluation-harness)."""
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return None


@torch.no_grad()
def token_nll(model, input_ids, attention_mask, targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL (float64) and count of scored tokens per row: the last len(targets[r]) real positions of row r
    predict targets[r] (position p predicts token p + 1; lm-eval's continuation slice)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
    nll_sum = torch.zeros(input_ids.shape[0], dtype=torch.float64)
    counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
    for row, row_targets in enumerate(targets):
        length, scored = int(attention_mask[row].sum()), len(row_targets)
        log_probs = torch.log_softmax(logits[row, length - scored : length].float(), dim=-1)  # [scored, V]
        picked = log_probs.gather(1, row_targets.to(log_probs.device)[:, None]).flatten()  # [scored]
        # Summed in float32 per window as lm-eval does (float(logits.sum())), so that word perplexity agrees to
        # 1e-6 even over few words; windows are then added in float64.
        nll_sum[row] = -float(picked.sum())
        counts[row] = scored
    return nll_sum, counts


def rolling_nll(loaded: LoadedModel, ids: torch.Tensor, max_length: int, stride: int, batch_size: int, progress=True):
    """Summed NLL, scored-token count, window count and seconds of the rolling windows over `ids` (prefix token
    first, never scored); see data.rolling_windows for the layout."""
    windows = rolling_windows(len(ids), max_length, stride)
    pad_id = loaded.tokenizer.pad_token_id or 0
    device = loaded.device
    totals = torch.zeros(2, dtype=torch.float64)  # summed NLL, scored tokens
    start = time.perf_counter()
    batches = list(batch_windows(ids, distributed.shard(windows), batch_size, pad_id))
    for input_ids, attention_mask, group in tqdm(batches, desc="perplexity", disable=not progress, unit="batch"):
        targets = [ids[w.first_target : w.end + 1] for w in group]
        nll_sum, counts = token_nll(loaded.model, input_ids.to(device), attention_mask.to(device), targets)
        totals += torch.stack([nll_sum.sum(), counts.sum().double()])
    distributed.all_reduce_sum(totals)
    seconds = distributed.all_reduce_max(time.perf_counter() - start)
    return float(totals[0]), int(totals[1]), windows, seconds


def check_max_length(loaded: LoadedModel, max_length: int) -> None:
    """Refuse a window longer than the model's positions (a one-line error instead of an index error)."""
    if loaded.max_positions is not None and max_length > loaded.max_positions:
        raise HeadlabError(
            f"--max-length/--seq-len {max_length} exceeds the model's maximum positions ({loaded.max_positions})"
        )


def perplexity(
    loaded: LoadedModel,
    corpus: Corpus | str | None = None,
    *,
    part: str = "eval",
    seq_len: int = 512,
    stride: int | None = None,
    batch_size: int = 4,
    max_tokens: int | None = 4096,
    text_column: str | None = None,
    progress: bool = True,
) -> Perplexity:
    """Token perplexity exp(-(1/N) sum_i log p(x_i | x_<i)) over the N tokens of the chosen part, plus word
    perplexity and bits per byte (lm-evaluation-harness wikitext definitions), in lm-eval's rolling windows.

    seq_len is the model input length of a window (lm-eval's max_length, the CLI's --max-length); stride (default
    seq_len, lm-eval's layout) < seq_len gives each scored token seq_len - stride tokens of extra context.
    """
    stride = seq_len if stride is None else stride
    check_max_length(loaded, seq_len)
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, text_column)
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
    total_nll, total_count, windows, seconds = rolling_nll(loaded, ids, seq_len, stride, batch_size, progress)
    if not math.isfinite(total_nll):
        raise HeadlabError(
            f"the loss is not finite ({total_nll}); with {str(loaded.dtype)} this is usually overflow: "
            "try --dtype bfloat16 or float32"
        )
    words = len(re.split(r"\s+", text))
    n_bytes = len(text.encode("utf-8"))
    nll = total_nll / total_count
    return Perplexity(
        perplexity=math.exp(nll),
        nll=nll,
        bits_per_token=nll / math.log(2),
        word_perplexity=math.exp(total_nll / words),
        bits_per_byte=total_nll / (n_bytes * math.log(2)),
        byte_perplexity=math.exp(total_nll / n_bytes),
        scored_tokens=total_count,
        words=words,
        bytes=n_bytes,
        tokens_per_s=sum(w.end - w.start for w in windows) / seconds,
        seconds=seconds,
        peak_memory_bytes=_peak_memory(device),
        objective="causal",
        max_length=seq_len,
        stride=stride,
        prefix_token=prefix,
        windows=len(windows),
    )


def masked_lm_batch(tokenizer, rows: list[torch.Tensor], generator: torch.Generator):
    """One masked-LM batch: each row of token ids wrapped as [CLS] row [SEP], 15% of its tokens (at least one) chosen
    with `generator` and replaced by the mask token. Returns input_ids, attention_mask, labels (-100 where not
    scored), each [B, T]. Rows draw from the generator in order, so masks do not depend on how rows are batched."""
    if tokenizer.mask_token_id is None:
        raise HeadlabError("this masked-LM tokenizer has no mask token")
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows) + 2
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)  # [B, T]
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for r, row in enumerate(rows):
        n = len(row)
        input_ids[r, 0], input_ids[r, 1 : n + 1], input_ids[r, n + 1] = cls_id, row, sep_id
        attention_mask[r, : n + 2] = 1
        chosen = torch.rand(n, generator=generator) < MLM_PROBABILITY
        if not chosen.any():
            chosen[torch.randint(n, (1,), generator=generator)] = True
        positions = torch.nonzero(chosen).flatten() + 1
        labels[r, positions] = input_ids[r, positions]
        input_ids[r, positions] = tokenizer.mask_token_id
    return input_ids, attention_mask, labels


@torch.no_grad()
def _masked_lm_loss(loaded, text, seq_len, batch_size, max_tokens, progress) -> Perplexity:
    """Masked-LM loss: 15% of the non-special tokens of each window (fixed seed) replaced by the mask token and
    predicted; perplexity = exp(mean NLL over masked tokens). Not comparable to causal perplexity."""
    tokenizer, model, device = loaded.tokenizer, loaded.model, loaded.device
    ids, text = tokenize(tokenizer, text, max_tokens)
    require_tokens(ids, "the masked-LM text")
    body = seq_len - 2  # room for [CLS] and [SEP]
    if body < 1:
        raise HeadlabError(f"--seq-len {seq_len} is too short for a masked-LM window")
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
        math.exp(nll),
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
        _peak_memory(device),
        "masked-lm (15% fixed-seed masking)",
        seq_len,
        seq_len,
        None,
        len(rows),
        "masked-LM windows of max_length tokens ([CLS] and [SEP] included)",
    )


# ---- size and KV-cache arithmetic ----------------------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


def kv_cache_bytes(
    layers_kv: list[tuple[int, int]], tokens: int = 1, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """KV-cache bytes = 2 (K and V) x sum over attention layers of (KV heads x head_dim) x tokens x batch x bytes."""
    return 2 * sum(g * d for g, d in layers_kv) * tokens * batch * bytes_per_element


def parameter_counts(loaded: LoadedModel) -> dict:
    """Total parameters (tied weights counted once) and those of the attention projections."""
    seen, total = set(), 0
    for parameter in loaded.model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel()
    attention = 0
    for layer in loaded.layers:
        for tensor in loaded.adapter.read(layer).tensors().values():
            if tensor is not None:
                attention += tensor.numel()
    return {"parameters": total, "attention_parameters": attention}


def attention_flops_per_token(loaded: LoadedModel, context: int) -> int:
    """Attention FLOPs per token at a given context: 2 x (projection MACs) + 2 x 2 x H x D x context (QK^T and AV)."""
    flops = 0
    for layer in loaded.layers:
        weights = loaded.adapter.read(layer)
        macs = sum(weights.tensors()[name].numel() for name in ("q", "k", "v", "o"))
        flops += 2 * macs + 4 * layer.num_heads * layer.head_dim * context
    return flops


def model_info(loaded: LoadedModel, context: int = 8192, batch: int = 1, cache_dtype: str | None = None) -> dict:
    """What `headlab info` prints: layout, sizes and the KV-cache ladder (MHA, each GQA-g, MQA)."""
    layers = loaded.layers
    cache_dtype = cache_dtype or str(loaded.dtype).removeprefix("torch.")
    if cache_dtype not in DTYPE_BYTES:
        raise HeadlabError(f"unknown --cache-dtype {cache_dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    element = DTYPE_BYTES[cache_dtype]
    heads = sorted({layer.num_heads for layer in layers})
    kv_heads = sorted({layer.num_kv_heads for layer in layers})
    current = [(layer.num_kv_heads, layer.head_dim) for layer in layers]
    ladder = []
    if len(heads) == 1:  # the ladder needs one head count for all layers
        num_heads = heads[0]
        for g in sorted({g for g in range(1, num_heads + 1) if num_heads % g == 0}, reverse=True):
            name = "MHA" if g == num_heads else "MQA" if g == 1 else f"GQA-{g}"
            per_token = kv_cache_bytes([(g, layer.head_dim) for layer in layers], 1, 1, element)
            ladder.append(
                {
                    "variant": name,
                    "kv_heads": g,
                    "kv_bytes_per_token": per_token,
                    "kv_bytes": per_token * context * batch,
                    "current": [g] * len(layers) == [layer.num_kv_heads for layer in layers],
                }
            )
    per_token = kv_cache_bytes(current, 1, 1, element)
    return {
        "model": loaded.spec,
        "model_type": loaded.model.config.model_type,
        "blocks": len(loaded.adapter.blocks(loaded.model)),
        "attention_layers": len(layers),
        "query_heads": heads[0] if len(heads) == 1 else heads,
        "kv_heads": kv_heads[0] if len(kv_heads) == 1 else kv_heads,
        "head_dim": layers[0].head_dim,
        "total_query_heads": sum(layer.num_heads for layer in layers),
        **parameter_counts(loaded),
        "cache_dtype": cache_dtype,
        "context": context,
        "batch": batch,
        "kv_bytes_per_token": per_token,
        "kv_bytes": per_token * context * batch,
        "ladder": ladder,
    }
