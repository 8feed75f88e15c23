"""Per-(layer, head) attention statistics that stream: entropy, confidence, positional, sink, previous-token, distance,
induction, output norm and [CLS]/[SEP] shares, reduced chunk by chunk from headlab's attention capture.

Definitions and sources: /README.md "headlab stats" and the docstring of StatisticsCollector.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core import distributed
from headlab.core.data import TextSpec, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.tables import write_run
from headlab.mechanisms.capture import DEFAULT_CHUNK, AttentionChunk, capture_attention

# Wide-table columns, in order; other modules (importance, plots) rely on these names.
STATISTICS = (
    "entropy",
    "normalized_entropy",
    "confidence",
    "positional_prev",
    "positional_next",
    "is_positional",
    "sink_first",
    "sink_first4",
    "prev_share",
    "self_share",
    "mean_distance",
    "induction",
    "output_norm",
    "cls_share",
    "sep_share",
)
# Everything a collector sums (STATISTICS less is_positional, which is derived from positional_prev/next).
ACCUMULATED = (
    "entropy",
    "normalized_entropy",
    "confidence",
    "positional_prev",
    "positional_next",
    "sink_first",
    "sink_first4",
    "prev_share",
    "self_share",
    "mean_distance",
    "induction",
    "output_norm",
    "cls_share",
    "sep_share",
)
POSITIONAL_THRESHOLD = 0.9  # Voita et al. 2019
SINK_TOKENS = 4  # StreamingLLM keeps 4 initial tokens
EDGE_RULES = {
    "queries": "every statistic averages over real (non-padding) query positions only",
    "normalized_entropy": "entropy of row i / ln(keys visible to i); rows seeing a single key are excluded",
    "positional_prev/prev_share": "rows whose key i-1 is visible (not the first token, not masked)",
    "positional_next": "rows whose key i+1 is visible: encoders only (NaN for causal models)",
    "argmax": "ties go to the lowest key index (torch.max)",
    "sink_first/sink_first4": "attention to the first 1 / 4 real tokens of the sequence; rows that see none of "
    "them (sliding-window layers) are excluded",
    "cls_share": "encoders: attention to the first real token ([CLS]); NaN for causal models",
    "sep_share": "encoders: summed attention to the tokenizer's sep_token positions; rows seeing no SEP excluded",
    "induction": "separate pass on seeded random tokens repeated twice (after a BOS/CLS prefix when the tokenizer "
    "has one): attention from i to i-(S-1) over the second copy",
    "output_norm": "L2 norm of each head's attention output before the output projection (and before the output "
    "gate of gated-attention families), averaged over real tokens",
    "attention_sinks": "with learned sink logits the weights over keys sum to less than 1; statistics use those "
    "weights as they are",
    "decoding": "statistics come from full forward passes; cached decoding steps are not collected",
}


class StatisticsCollector:
    """Streaming per-head accumulators (float64 sums and row counts) for every captured layer.

    For a weight matrix A (rows: queries i, columns: keys j), averaged over counted rows (REFERENCE.md):
    entropy -sum_j A_ij ln A_ij (Clark et al. 2019); confidence max_j A_ij and positional argmax_j A_ij = i-1 / i+1
    (Voita et al. 2019); sink mass sum_{j in first k real tokens} A_ij (Xiao et al. 2023); prev/self share A_{i,i-1},
    A_ii (Clark et al. 2019); mean distance sum_j A_ij |i-j| (ViT attention distance); induction A_{i,i-(S-1)}
    (Olsson et al. 2022); [CLS]/[SEP] shares (Clark et al. 2019).
    """

    def __init__(self, layers, *, is_encoder: bool = False, induction_only: bool = False):
        self.layers = {layer.index: layer for layer in layers}
        self.is_encoder, self.induction_only = is_encoder, induction_only
        self.sums: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self.layers}  # name -> [H] float64
        self.counts: dict[int, dict[str, float]] = {i: {} for i in self.layers}  # name -> counted rows
        # layer -> names of one chunk's statistics -> [S, H + 1] float64 (sums per head, then rows), until _settle
        self._pending: dict[int, dict[tuple[str, ...], torch.Tensor]] = {i: {} for i in self.layers}
        self.sep_keys: torch.Tensor | None = None  # [B, T] bool, SEP positions of the current batch
        self.target: torch.Tensor | None = None  # [B, T] long, induction key per query (-1: none)

    def set_batch(self, sep_keys: torch.Tensor | None = None, target: torch.Tensor | None = None) -> None:
        """Per-batch side information: SEP key positions (encoders) and induction targets."""
        self.sep_keys, self.target = sep_keys, target

    def _add(self, layer: int, items: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Accumulate each (name, values [B, H, c], row weights [B, c] (0/1)) of one chunk: sum_rows w * value per
        head, and sum_rows w. All of a chunk's statistics are reduced in one product (a dozen per chunk, each with
        its own small ops, cost more than the reductions themselves), and the row counts stay tensors on the device
        (no host synchronisation per chunk on a GPU)."""
        dtype = items[0][1].dtype
        values = torch.stack([value.to(dtype) for _, value, _ in items])  # [S, B, H, c]
        weights = torch.stack([weight.to(dtype) for _, _, weight in items])  # [S, B, c]
        totals = (values * weights[:, :, None]).sum((1, 3))  # [S, H]
        packed = torch.cat([totals, weights.sum((1, 2))[:, None]], dim=1).double()  # [S, H + 1]: sums, row count
        _accumulate(self._pending[layer], tuple(name for name, _, _ in items), packed)

    def _settle(self) -> None:
        """Move the per-chunk-layout accumulators into `sums` / `counts` by statistic name."""
        for index, groups in self._pending.items():
            for names, packed in groups.items():
                counts = packed[:, -1].cpu()
                for row, name in enumerate(names):
                    _accumulate(self.sums[index], name, packed[row, :-1])
                    self.counts[index][name] = self.counts[index].get(name, 0.0) + float(counts[row])
            groups.clear()

    def on_chunk(self, chunk: AttentionChunk) -> None:
        p = chunk.probs  # [B, H, c, Tk]
        B, H, c, Tk = p.shape
        layer = chunk.layer.index
        visible = chunk.visible[:, 0]  # [B, c, Tk]
        w = chunk.query_valid.to(p.dtype)  # [B, c]
        rows = chunk.rows  # [c]
        items = []

        def at(keys: torch.Tensor):
            """(A[b, h, i, keys[b, i]] [B, H, c], key visible [B, c] bool) for one key index per row."""
            index = keys.clamp(0, Tk - 1)  # [B, c]
            present = (keys >= 0) & (keys < Tk) & visible.gather(-1, index[..., None])[..., 0]
            return p.gather(-1, index[:, None, :, None].expand(B, H, c, 1))[..., 0], present

        if self.target is not None:
            share, present = at(self.target[:, chunk.start : chunk.start + c].to(p.device))
            items.append(("induction", share, w * present))
        if self.induction_only:
            self._add(layer, items)
            return

        confidence = p.amax(-1)  # [B, H, c]
        # sum_j A_ij: 1 but with learned sinks (a matrix-vector product: one fast read)
        mass = (p @ p.new_ones(Tk)) if chunk.sinks else None
        if chunk.scores is not None:
            # ln A_ij = s_ij - lse_i, and lse_i = max_j s_ij - ln max_j A_ij (the softmax is monotone: both maxima
            # sit at the same key), so -sum_j A_ij ln A_ij = lse_i sum_j A_ij - sum_j A_ij s_ij: one read of the
            # weights and scores instead of a log and an exp over the chunk.
            lse = chunk.scores.amax(-1) - confidence.clamp_min(torch.finfo(p.dtype).tiny).log()  # [B, H, c]
            # vecdot, not einsum: einsum's batched [1, Tk] @ [Tk, 1] products measured 3.5x slower on CPU.
            entropy = (lse if mass is None else lse * mass) - torch.linalg.vecdot(p, chunk.scores)  # [B, H, c]
            # Padding rows see no key (all scores finfo.min): their value is meaningless and may overflow.
            entropy = torch.where(chunk.query_valid[:, None, :], entropy, 0.0)
        else:
            entropy = -torch.special.xlogy(p, p).sum(-1)  # [B, H, c]
        items.append(("entropy", entropy, w))
        num_visible = visible.sum(-1)  # [B, c]
        normalizer = num_visible.clamp(min=2).to(p.dtype).log()  # [B, c]
        items.append(("normalized_entropy", entropy / normalizer[:, None], w * (num_visible > 1).to(p.dtype)))
        items.append(("confidence", confidence, w))

        expand = rows.expand(B, c)  # [B, c]
        prev, has_prev = at(expand - 1)
        items.append(("prev_share", prev, w * has_prev))
        prev_is_argmax = _is_first_argmax(p, expand - 1, prev, confidence, has_prev)
        items.append(("positional_prev", prev_is_argmax, w * has_prev))
        following, has_next = at(expand + 1)
        next_is_argmax = _is_first_argmax(p, expand + 1, following, confidence, has_next)
        items.append(("positional_next", next_is_argmax, w * has_next))
        own, has_self = at(expand)
        items.append(("self_share", own, w * has_self))
        items.append(("mean_distance", self._mean_distance(p, visible, rows, mass), w))

        # Key sets as columns of one matrix so one matmul gives every share: first, first 4, SEP.
        real = chunk.token_valid  # [B, Tk]
        rank = real.long().cumsum(-1)  # [B, Tk], 1 at the first real token
        sets = [real & (rank == 1), real & (rank <= SINK_TOKENS)]
        if self.sep_keys is not None:
            sets.append(real & self.sep_keys[:, :Tk].to(p.device).bool())
        keys = torch.stack(sets, dim=-1).to(p.dtype)  # [B, Tk, m]
        # Only columns up to the last key of any set take part (4 columns for a causal batch without padding).
        columns = keys.flatten(0, 1).any(-1).nonzero()
        width = int(columns.max()) + 1 if len(columns) else 1
        keys = keys[:, :width]  # [B, Tk', m]
        shares = p[..., :width] @ keys[:, None]  # [B, H, c, m]
        sees = (visible[..., :width].to(keys.dtype) @ keys) > 0  # [B, c, m]
        items.append(("sink_first", shares[..., 0], w * sees[..., 0]))
        items.append(("sink_first4", shares[..., 1], w * sees[..., 1]))
        if self.is_encoder:
            items.append(("cls_share", shares[..., 0], w * sees[..., 0]))
            if self.sep_keys is not None:
                items.append(("sep_share", shares[..., 2], w * sees[..., 2]))
        self._add(layer, items)

    @staticmethod
    def _mean_distance(
        p: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor, mass: torch.Tensor | None
    ) -> torch.Tensor:
        """sum_j A_ij |i - j| per row, [B, H, c]. Where no key after its query is visible (causal layers) it is
        i sum_j A_ij - sum_j A_ij j: one matrix-vector product, a fast read of the chunk instead of a product with a
        [c, Tk] distance matrix. mass: sum_j A_ij [B, H, c], or None where rows sum to 1 (no sinks)."""
        keys = torch.arange(p.shape[-1], device=p.device)  # [Tk]
        if bool((visible & (keys[None, :] > rows[:, None])).any()):  # a key after its query: bidirectional
            distance = (rows[:, None] - keys[None, :]).abs().to(p.dtype)  # [c, Tk]
            return torch.einsum("bhct,ct->bhc", p, distance)
        here = rows.to(p.dtype)  # [c]
        return (here if mass is None else here * mass) - p @ keys.to(p.dtype)

    def on_output(self, layer, output: torch.Tensor, valid: torch.Tensor) -> None:
        if self.induction_only:
            return
        norms = output.to(torch.promote_types(output.dtype, torch.float32)).norm(dim=-1).transpose(1, 2)  # [B, H, T]
        self._add(layer.index, [("output_norm", norms, valid)])

    def reduce(self) -> None:
        """Under torchrun, add every process's sums and counts (every rank runs the same collectives, in the same
        order, even one that saw no batch)."""
        self._settle()
        if not distributed.active():
            return
        for index, layer in self.layers.items():
            for name in ACCUMULATED:
                total = self.sums[index].get(name)
                if total is None:
                    total = torch.zeros(layer.num_heads, dtype=torch.float64)
                packed = torch.cat([total.double().cpu(), torch.tensor([self.counts[index].get(name, 0.0)])])
                distributed.all_reduce_sum(packed)
                if packed[-1] > 0:
                    self.sums[index][name], self.counts[index][name] = packed[:-1], float(packed[-1])

    def means(self) -> dict[int, dict[str, tuple[torch.Tensor, float]]]:
        """layer -> statistic -> (mean per head [H] float64, NaN without counted rows; rows counted)."""
        self._settle()
        out = {}
        for index, layer in self.layers.items():
            out[index] = {}
            for name, total in self.sums[index].items():
                count = self.counts[index][name]
                mean = total / count if count > 0 else torch.full((layer.num_heads,), math.nan, dtype=torch.float64)
                out[index][name] = (mean.cpu(), count)
        return out


def _accumulate(store: dict, key, value: torch.Tensor) -> None:
    """store[key] += value; a sum stays on the device of its first value (device maps put layers on different
    devices)."""
    store[key] = store[key] + value.to(store[key].device) if key in store else value


def _is_first_argmax(
    p: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, top: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """[B, H, c] float: 1 where key keys[b, i] is argmax_j p[b, h, i, j], ties to the lowest index (torch.argmax).

    value = p at that key, top = max_j p (both [B, H, c]), present [B, c] bool: the key exists and is visible. A key whose weight is not the row's maximum is not the
    argmax; only the rows where it is one (candidates) need the argmax itself, to settle ties. max with indices over
    the whole chunk measured 3-7x slower than amax on CPU, so it runs on the candidate rows alone.
    """
    candidate = (value == top) & present[:, None, :]
    result = candidate.to(p.dtype)
    if bool(candidate.any()):
        rows = p[candidate]  # [n, Tk]
        index = keys[:, None, :].expand_as(candidate)[candidate]  # [n]
        result[candidate] = (rows.argmax(-1) == index).to(p.dtype)
    return result


def _frame_encoder_batch(input_ids, attention_mask, cls_id: int, sep_id: int, pad_id: int):
    """[CLS] window [SEP] per right-padded row, as the tokenizer frames a single sequence."""
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1)  # [B]
    ids = torch.full((B, T + 2), pad_id, dtype=input_ids.dtype)  # [B, T + 2]
    mask = torch.zeros((B, T + 2), dtype=attention_mask.dtype)  # [B, T + 2]
    for row, n in enumerate(lengths.tolist()):
        ids[row, 0], ids[row, 1 : n + 1], ids[row, n + 1] = cls_id, input_ids[row, :n], sep_id
        mask[row, : n + 2] = 1
    return ids, mask


def induction_batches(loaded, *, length: int, count: int, seed: int, batch_size: int):
    """Seeded random tokens repeated twice, [prefix] x x [suffix], with the induction target of each query:
    query i in the second copy reads key i-(S-1), the token after the previous occurrence of its own token
    (TransformerLens / Olsson et al. 2022). Yields (input_ids [B, T], attention_mask [B, T], target [B, T])."""
    config = loaded.model.config.get_text_config()
    tokenizer = loaded.tokenizer
    vocab = int(config.vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "image_token_id", "video_token_id"):
        if isinstance(getattr(config, name, None), int):
            special.add(getattr(config, name))
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    prefix, suffix = _frame_tokens(loaded)
    generator = torch.Generator().manual_seed(seed)
    for first in range(0, count, batch_size):
        n = min(batch_size, count - first)
        tokens = allowed[torch.randint(len(allowed), (n, length), generator=generator)]  # [n, S]
        ids = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(n, -1), tokens, tokens], dim=1)
        ids = torch.cat([ids, torch.tensor(suffix, dtype=torch.long).expand(n, -1)], dim=1)  # [n, T]
        target = torch.full(ids.shape, -1, dtype=torch.long)  # [n, T]
        second = torch.arange(len(prefix) + length, len(prefix) + 2 * length)
        target[:, second] = second - (length - 1)
        yield ids, torch.ones_like(ids), target


def _frame_tokens(loaded) -> tuple[list[int], list[int]]:
    """Tokens put around a window: [CLS] .. [SEP] for encoders, BOS .. for causal models (when the tokenizer has
    them; none without a tokenizer)."""
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return [], []
    if loaded.adapter.is_encoder:
        cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
        return ([cls] if cls is not None else []), ([sep] if sep is not None else [])
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []), []


@takes_text(split="calibration", seq_len=512, max_tokens=8192)
def head_statistics(
    loaded,
    batches=None,
    *,
    text: TextSpec,
    induction: bool = True,
    induction_len: int = 64,
    induction_count: int = 8,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = True,
) -> pd.DataFrame:
    """Per-head statistics as a tidy table `layer, head, kv_head, statistic, value` (meta in `.attrs["meta"]`).

    `batches`: an iterable of (input_ids [B, T], attention_mask [B, T], ...) tuples, or None to take the windows of
    `text` (a TextSpec; the loose keywords data, split, seq_len, batch_size, max_tokens, text_column also work;
    default: calibration part of the embedded corpus, 512-token windows, 8,192 tokens). Encoder windows get
    [CLS] .. [SEP] around them (2 of the seq_len tokens). See `wide_statistics` for one row per head.
    """
    prefix, suffix = _frame_tokens(loaded)
    framed = loaded.adapter.is_encoder and len(prefix) == 1 and len(suffix) == 1
    if induction:
        _check_induction(loaded, induction_len, induction_count, len(prefix) + len(suffix))
    data_meta = {}
    if batches is None:
        batches = _statistics_windows(loaded, text, framed)
        data_meta = dict(batches.meta, seq_len=text.seq_len, framed_with_cls_sep=framed)
    frame = (prefix, suffix) if framed and data_meta else None
    means, tokens = _collect_text_statistics(loaded, batches, frame, chunk_size, progress)
    induction_meta = None
    if induction:
        settings = dict(length=induction_len, count=induction_count, seed=seed, batch_size=text.batch_size)
        for index, values in _collect_induction(loaded, settings, chunk_size, progress).items():
            means[index]["induction"] = values["induction"]
        induction_meta = {
            "length": induction_len,
            "sequences": induction_count,
            "seed": seed,
            "prefix_tokens": prefix,
            "suffix_tokens": suffix,
        }
    table, denominators = _tidy_statistics(loaded.layers, means)
    table.attrs["meta"] = {
        **loaded.describe(),
        "data": data_meta or {"data": "caller batches"},
        "tokens": tokens,
        "seq_len": data_meta.get("seq_len") if data_meta else None,
        "seed": seed,
        "chunk_size": chunk_size,
        "induction": induction_meta,
        "positional_threshold": POSITIONAL_THRESHOLD,
        "sink_tokens": SINK_TOKENS,
        "blocks": {layer.index: layer.block for layer in loaded.layers},
        "output_norm_before_gate": loaded.adapter.gated,
        "denominators": denominators,
        "edge_rules": EDGE_RULES,
    }
    return table


def _check_induction(loaded, length: int, count: int, frame_tokens: int) -> None:
    if length < 2 or count < 1:
        raise HeadlabError(f"induction needs length >= 2 and count >= 1, got {length}, {count}")
    need = 2 * length + frame_tokens
    if loaded.max_positions is not None and need > loaded.max_positions:
        raise HeadlabError(f"induction sequences of {need} tokens exceed the model's {loaded.max_positions} positions")


def _statistics_windows(loaded, text: TextSpec, framed: bool):
    """The text's windows, 2 tokens shorter when [CLS]/[SEP] frame them, after checking the window length."""
    if text.seq_len < (4 if framed else 2):
        raise HeadlabError(f"seq_len={text.seq_len} must be at least {4 if framed else 2}")
    if loaded.max_positions is not None and text.seq_len > loaded.max_positions:
        raise HeadlabError(f"seq_len={text.seq_len} exceeds the model's maximum positions ({loaded.max_positions})")
    if loaded.tokenizer is None:
        raise HeadlabError("the model has no tokenizer; pass token batches instead of a corpus")
    return text.batches(loaded.tokenizer, seq_len=text.seq_len - 2 if framed else text.seq_len)


def _collect_text_statistics(loaded, batches, frame, chunk_size: int, progress: bool):
    """Every statistic but induction, summed over the batches (this process's share under torchrun) and reduced:
    (per-layer means, tokens seen). frame: ([CLS], [SEP]) ids to wrap each window in, or None."""
    tokenizer, adapter = loaded.tokenizer, loaded.adapter
    sep_id = getattr(tokenizer, "sep_token_id", None) if adapter.is_encoder else None
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    collector = StatisticsCollector(loaded.layers, is_encoder=adapter.is_encoder)
    tokens = 0
    if distributed.active():  # torchrun: this process takes its share of the windows
        batches = distributed.shard(list(batches))
    total = len(batches) if hasattr(batches, "__len__") else None
    capture = capture_attention(loaded.model, loaded.layers, collector.on_chunk, collector.on_output, chunk_size)
    with torch.no_grad(), capture:
        for batch in tqdm(batches, total=total, desc="attention statistics", disable=not progress, unit="batch"):
            input_ids, attention_mask = batch[0], batch[1]
            if frame is not None:
                input_ids, attention_mask = _frame_encoder_batch(
                    input_ids, attention_mask, *frame[0], *frame[1], pad_id
                )
            sep_keys = (input_ids == sep_id) if sep_id is not None else None
            collector.set_batch(sep_keys=None if sep_keys is None else sep_keys.to(loaded.device))
            loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
            tokens += int(attention_mask.sum())
    collector.reduce()
    tokens = int(distributed.all_reduce_sum(torch.tensor(float(tokens), dtype=torch.float64)))
    if tokens == 0:
        raise HeadlabError("no tokens to collect statistics on")
    means = collector.means()
    # Entropy is defined for every head whenever any token was seen: a NaN/inf there means the attention itself
    # overflowed (typically float16), not a missing statistic.
    if not all(bool(torch.isfinite(values["entropy"][0]).all()) for values in means.values() if "entropy" in values):
        raise HeadlabError(
            f"attention statistics are not finite with {str(loaded.dtype).removeprefix('torch.')} "
            "(overflow?); try dtype='bfloat16' or 'float32'"
        )
    return means, tokens


def _collect_induction(loaded, settings: dict, chunk_size: int, progress: bool) -> dict:
    """Induction scores on repeated random-token sequences (induction_batches with `settings`), per layer."""
    inductor = StatisticsCollector(loaded.layers, induction_only=True)
    runs = induction_batches(loaded, **settings)
    steps = math.ceil(settings["count"] / settings["batch_size"])
    if distributed.active():
        runs = distributed.shard(list(runs))
        steps = len(runs)
    with torch.no_grad(), capture_attention(loaded.model, loaded.layers, inductor.on_chunk, None, chunk_size):
        for input_ids, attention_mask, target in tqdm(
            runs, total=steps, desc="induction", disable=not progress, unit="batch"
        ):
            inductor.set_batch(target=target.to(loaded.device))
            loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
    inductor.reduce()
    return inductor.means()


def _tidy_statistics(layers, means: dict) -> tuple[pd.DataFrame, dict]:
    """The tidy table (one row per layer, head and statistic) and each statistic's per-layer denominators."""
    rows, denominators = [], {}
    for layer in layers:
        values = means[layer.index]
        prev, nxt = values["positional_prev"][0], values["positional_next"][0]
        positional = (torch.maximum(prev.nan_to_num(0.0), nxt.nan_to_num(0.0)) >= POSITIONAL_THRESHOLD).double()
        for name in STATISTICS:
            if name == "is_positional":
                column = positional
            elif name in values:
                column, count = values[name]
                denominators.setdefault(name, {})[layer.index] = count
            else:
                column = torch.full((layer.num_heads,), math.nan, dtype=torch.float64)
            for head in range(layer.num_heads):
                rows.append((layer.index, head, layer.kv_head_of(head), name, float(column[head])))
    table = pd.DataFrame(rows, columns=["layer", "head", "kv_head", "statistic", "value"])
    return table, {name: [counts.get(i) for i in sorted(counts)] for name, counts in denominators.items()}


def wide_statistics(tidy: pd.DataFrame) -> pd.DataFrame:
    """One row per head: `layer, head, kv_head` and one column per statistic (STATISTICS order; NaN where n/a)."""
    wide = tidy.pivot(index=["layer", "head", "kv_head"], columns="statistic", values="value")
    wide = wide.reindex(columns=[name for name in STATISTICS if name in wide.columns]).reset_index()
    wide.columns.name = None
    if "is_positional" in wide:
        wide["is_positional"] = wide["is_positional"].astype(bool)
    wide.attrs = dict(tidy.attrs)
    return wide


def write_statistics(out: Path, tidy: pd.DataFrame, *, overwrite: bool = False) -> Path:
    """`stats.csv/.parquet` (tidy), `stats_wide.csv/.parquet` (one row per head) and meta.json, atomically."""

    meta = dict(tidy.attrs.get("meta", {}))
    return write_run(out, {"stats": tidy, "stats_wide": wide_statistics(tidy)}, meta, overwrite=overwrite)
