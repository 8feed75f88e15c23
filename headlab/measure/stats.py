"""Per-(layer, head) attention statistics that stream: entropy, confidence, positional, sink, previous-token, distance,
streaming (sinks + recent window), induction, duplicate-token, retrieval, output norm and [CLS]/[SEP] shares, reduced
chunk by chunk from headlab's attention capture; beside them the weights-only successor and copy-suppression scores
and TransformerLens-style detection patterns (headlab.measure.detectors).

Definitions and sources: docs/commands/stats.md "Statistics", the docstring of StatisticsCollector and, for successor,
copy_suppression and detect_<name>, headlab.measure.detectors: successor = share of ordinal pairs (t, succ(t)) whose
effective OV logits rank succ(t) first in t's sequence (Gould et al. 2023); copy_suppression = share of tokens t whose
own effective OV logit is among the 10 lowest (McDougall et al. 2023); detect_<name> = TransformerLens detect_head.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core import distributed
from headlab.core.data import TextSpec, right_padded, split_text, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.tables import write_run
from headlab.measure.detectors import (
    SUPPRESSION_K,
    SUPPRESSION_TOKENS,
    PatternDetector,
    check_error_measure,
    copy_suppression_scores,
    frequent_tokens,
    ov_circuit,
    resolve_pattern,
    succession_forms,
    successor_scores,
)
from headlab.measure.long_tasks import HEADER, LONG_TASKS, Haystack, build_prompt
from headlab.mechanisms.capture import DEFAULT_CHUNK, AttentionChunk, capture_attention

STREAMING_WINDOWS = (16, 64, 256)  # recent-window sizes W of the stream_<W> statistics (KV-cache policies read them)
# Wide-table columns, in order; other modules (importance, plots, KV-cache policies) rely on these names.
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
    *(f"stream_{window}" for window in STREAMING_WINDOWS),
    "induction",
    "duplicate_token",
    "retrieval",
    "output_norm",
    "cls_share",
    "sep_share",
    "successor",
    "copy_suppression",
)
# Everything a collector sums (STATISTICS less is_positional, which is derived from positional_prev/next, and the
# weights-only successor and copy_suppression).
_NOT_SUMMED = ("is_positional", "successor", "copy_suppression")
ACCUMULATED = tuple(name for name in STATISTICS if name not in _NOT_SUMMED)
HEAD_COLUMNS = ("layer", "head", "kv_head", "name")  # the head columns of both tables; name is "L{layer}H{head}"
POSITIONAL_THRESHOLD = 0.9  # Voita et al. 2019
SINK_TOKENS = 4  # StreamingLLM keeps 4 initial tokens
RETRIEVAL_LEN = 1024  # default passkey prompt length (prompt and answer), capped by the model's positions
RETRIEVAL_DEPTHS = (0.1, 0.9)  # needle depths are spread evenly over this range across the retrieval prompts
RETRIEVAL_TASK = "passkey"
# A corpus part longer than this many characters (or 16 per prompt token, whichever is more) is cut there for the
# retrieval haystack: tokenizing a whole hub dataset for four prompts would cost more than the statistics.
HAYSTACK_CHARS = 2_000_000
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
    "stream_<W>": "attention mass on the first 4 real tokens (the sinks) plus the keys j with |i-j| < W (for causal "
    "models i-W < j <= i; encoders get the symmetric window), a key in both sets counted once; rows whose visible "
    "keys all lie inside sinks + window (nothing left to evict: early rows, sliding-window layers with a window "
    "<= W) are not counted, so a head has NaN when no row reaches past the window",
    "induction": "separate pass on seeded random tokens repeated twice (after a BOS/CLS prefix when the tokenizer "
    "has one): attention from i to i-(S-1) over the second copy",
    "duplicate_token": "the induction pass's sequences: attention from i to i-S (the same token in the first copy) "
    "over the second copy",
    "successor/copy_suppression": "weights only (no text), through each head's effective OV circuit W_U diag(g) W_O "
    "W_V W_E (no earlier layers or MLPs, biases and per-layer norms left out, the final norm as its gain g); NaN for "
    "encoders, models without a final norm beside the blocks, and (successor) without a tokenizer: meta says why",
    "detect_<name>": "TransformerLens detect_head on the text pass's windows: a score per window, averaged over "
    "windows of at least 2 real tokens",
    "retrieval": "separate pass on passkey prompts (headlab.measure.long_tasks, haystack from the corpus part in use, "
    "after a BOS when the tokenizer has one) with the true answer appended: the query row whose next token is a "
    "pass-key token (tokens that are only whitespace left out) attends to the same token at the same offset of the "
    "pass key in the needle's first sentence ('The pass key is N'); rows whose needle token is not visible "
    "(sliding-window layers) are not counted; NaN for encoders, models without a tokenizer, and (default length "
    "only) models whose positions or corpus part are too short for a prompt: the reason is in meta 'retrieval'",
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
    (Olsson et al. 2022); [CLS]/[SEP] shares (Clark et al. 2019); streaming mass stream_W = sum_{j in S u R_W(i)}
    A_ij, S the first 4 real tokens, R_W(i) the keys with |i-j| < W (StreamingLLM's sinks + recent window, Xiao et
    al. 2023; DuoAttention's streaming heads, Xiao et al. 2024); retrieval A_{i,t(i)} with t(i) the needle token the
    answer token after i copies (Wu et al. 2024's retrieval heads, as attention mass instead of argmax copy events);
    duplicate token A_{i,i-S} (TransformerLens's duplicate-token heads, on the induction pass's sequences).

    A pass with per-query targets reports A_{i, target(i)} under each target's name (`set_batch(targets={name:
    target})`, or `set_batch(target=...)` for `target_name`); `induction_only` collects only those (induction and
    retrieval passes). `windows`: the W of stream_W.
    """

    def __init__(
        self,
        layers,
        *,
        is_encoder: bool = False,
        induction_only: bool = False,
        target_name: str = "induction",
        windows: tuple[int, ...] = STREAMING_WINDOWS,
    ):
        self.layers = {layer.index: layer for layer in layers}
        self.is_encoder, self.induction_only = is_encoder, induction_only
        self.target_name, self.windows = target_name, tuple(windows)
        self.sums: dict[int, dict[str, torch.Tensor]] = {i: {} for i in self.layers}  # name -> [H] float64
        self.counts: dict[int, dict[str, float]] = {i: {} for i in self.layers}  # name -> counted rows
        # layer -> names of one chunk's statistics -> [S, H + 1] float64 (sums per head, then rows), until _settle
        self._pending: dict[int, dict[tuple[str, ...], torch.Tensor]] = {i: {} for i in self.layers}
        self.sep_keys: torch.Tensor | None = None  # [B, T] bool, SEP positions of the current batch
        self.targets: dict[str, torch.Tensor] = {}  # name -> [B, T] long, target key per query (-1: none)

    def set_batch(
        self, sep_keys: torch.Tensor | None = None, target: torch.Tensor | None = None, targets: dict | None = None
    ) -> None:
        """Per-batch side information: SEP key positions (encoders) and per-query targets by name (induction,
        duplicate_token, retrieval; `target` alone is reported as `target_name`)."""
        self.sep_keys = sep_keys
        self.targets = dict(targets or {})
        if target is not None:
            self.targets[self.target_name] = target

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

        for name, target in self.targets.items():
            share, present = at(target[:, chunk.start : chunk.start + c].to(p.device))
            items.append((name, share, w * present))
        if self.induction_only:
            if not items:
                return
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
        if self.windows:
            items += self._streaming(p, visible, rows, real & (rank <= SINK_TOKENS), num_visible, w)
        self._add(layer, items)

    def _streaming(
        self, p: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor, num_visible, w
    ) -> list:
        """(stream_W, values [B, H, c], row weights [B, c]) per window W: the mass on the sink keys (`sinks` [B, Tk]
        bool, the first SINK_TOKENS real tokens) and on the keys with |i-j| < W, on the rows where some visible key
        lies outside both. One cumulative sum over keys per chunk serves every window: the window's mass is
        C[i, min(i+W-1, Tk-1)] - C[i, i-W] (keys past a causal query weigh 0, so the same difference gives the causal
        window i-W < j <= i), and the sinks outside the window are SINK_TOKENS gathered columns. The sum starts at
        the lowest window edge of the chunk, start - max W, since the difference cancels everything before it: its
        width stays chunk + max W however long the sequence (a cumulative sum costs about ten maximum reductions on
        CPU)."""
        B, H, c, Tk = p.shape
        slots = torch.arange(1, SINK_TOKENS + 1, device=p.device)
        # [B, Tk, S]: key j is the s-th sink; its position (0 where there is none: masked by `has`)
        which = sinks[:, :, None] & (sinks.long().cumsum(1)[:, :, None] == slots)
        has, where = which.any(1), which.to(torch.uint8).argmax(1)  # [B, S]
        sink_seen = visible.gather(-1, where[:, None, :].expand(B, c, SINK_TOKENS)) & has[:, None, :]  # [B, c, S]
        sink_mass = p.gather(-1, where[:, None, None, :].expand(B, H, c, SINK_TOKENS)) * sink_seen[:, None]
        apart = (where[:, None, :] - rows[None, :, None]).abs()  # [B, c, S], |sink - i|
        first = max(0, int(rows[0]) - max(self.windows))  # lowest column any window edge of the chunk reads
        mass = p[..., first:].cumsum(-1)  # [B, H, c, Tk - first]: C[i, j] - C[i, first - 1]
        seen = visible[..., first:].cumsum(-1, dtype=torch.int32)  # [B, c, Tk - first]: visible keys, likewise
        items = []
        for window in self.windows:
            # C at the window's upper edge (clamped to the last key, past which C no longer changes) minus C at
            # i - W, the last key below the window (none below key 0).
            high = (rows + window - 1).clamp(max=Tk - 1) - first  # [c]
            low = (rows - window).clamp(min=first, max=Tk - 1) - first  # [c]
            below = rows >= window  # [c]: a key lies below the window
            outside = apart >= window  # [B, c, S]: sink not already in the window
            value = _span(mass, low, high, below) + (sink_mass * outside[:, None]).sum(-1)
            kept = _span(seen, low, high, below) + (sink_seen & outside).sum(-1)  # visible keys kept, [B, c]
            items.append((f"stream_{window}", value, w * (num_visible > kept)))
        return items

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
        names = dict.fromkeys([*ACCUMULATED, *(f"stream_{window}" for window in self.windows)])
        for index, layer in self.layers.items():
            for name in names:
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


def _span(cum: torch.Tensor, low: torch.Tensor, high: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """cum[..., i, high_i] - cum[..., i, low_i] (the second term only where below_i): a sum over keys
    (low_i, high_i] per row from a cumulative sum over keys [..., c, K]; low, high [c] long, below [c] bool."""
    shape = (*cum.shape[:-1], 1)
    top = cum.gather(-1, high[:, None].expand(shape))[..., 0]
    return top - cum.gather(-1, low[:, None].expand(shape))[..., 0] * below.to(cum.dtype)


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


def special_token_ids(loaded) -> set[int]:
    """The tokenizer's special ids and the config's pad/BOS/EOS/image/video ids: tokens no random or frequent-token
    set should hold."""
    config = loaded.model.config.get_text_config()
    special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "image_token_id", "video_token_id"):
        if isinstance(getattr(config, name, None), int):
            special.add(getattr(config, name))
    return special


def random_token_ids(loaded) -> torch.Tensor:
    """The ids random-token probes draw from (the induction pass, in-context copying): the model's vocabulary
    without special_token_ids."""
    vocab = int(loaded.model.config.get_text_config().vocab_size)
    special = special_token_ids(loaded)
    return torch.tensor([i for i in range(vocab) if i not in special])


def induction_batches(loaded, *, length: int, count: int, seed: int, batch_size: int):
    """Seeded random tokens repeated twice, [prefix] x x [suffix], with two targets per query of the second copy:
    "induction" i-(S-1), the token after the previous occurrence of its own token (TransformerLens / Olsson et al.
    2022), and "duplicate_token" i-S, that previous occurrence itself (TransformerLens's duplicate-token heads).
    Yields (input_ids [B, T], attention_mask [B, T], {name: target [B, T]})."""
    allowed = random_token_ids(loaded)
    prefix, suffix = _frame_tokens(loaded)
    generator = torch.Generator().manual_seed(seed)
    for first in range(0, count, batch_size):
        n = min(batch_size, count - first)
        tokens = allowed[torch.randint(len(allowed), (n, length), generator=generator)]  # [n, S]
        ids = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(n, -1), tokens, tokens], dim=1)
        ids = torch.cat([ids, torch.tensor(suffix, dtype=torch.long).expand(n, -1)], dim=1)  # [n, T]
        induction = torch.full(ids.shape, -1, dtype=torch.long)  # [n, T]
        second = torch.arange(len(prefix) + length, len(prefix) + 2 * length)
        induction[:, second] = second - (length - 1)
        duplicate = torch.full(ids.shape, -1, dtype=torch.long)  # [n, T]
        duplicate[:, second] = second - length
        yield ids, torch.ones_like(ids), {"induction": induction, "duplicate_token": duplicate}


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


def retrieval_depths(count: int) -> list[float]:
    """`count` needle depths spread evenly over RETRIEVAL_DEPTHS, ends included (the middle for one prompt)."""
    low, high = RETRIEVAL_DEPTHS
    if count == 1:
        return [round((low + high) / 2, 6)]
    return [round(low + (high - low) * k / (count - 1), 6) for k in range(count)]


def retrieval_minimum(tokenizer) -> int:
    """Tokens a passkey prompt needs besides most of its haystack: header, needle, question and the answer budget,
    plus 8 haystack tokens (the needle's digits, hence its token count, vary by prompt)."""
    spec = LONG_TASKS[RETRIEVAL_TASK]
    needles = spec.make(random.Random(0))
    text = HEADER + "".join(needles.facts) + needles.question
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + spec.max_new_tokens + 8


def retrieval_sequences(
    loaded, text: TextSpec, *, length: int | None = None, count: int = 4, seed: int = 0
) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """The retrieval pass's teacher-forced passkey sequences and its meta record: ([(ids, target), ...], meta).

    Each sequence is [BOS] + a passkey prompt of headlab.measure.long_tasks (`length` tokens with the answer budget:
    default RETRIEVAL_LEN capped by the model's positions; haystack from `text`'s corpus part; depths from
    retrieval_depths; seeded by `seed`) + the answer's tokens. target[i] is the needle position of the pass-key token
    that token i+1 copies (-1 elsewhere). An encoder, a model without a tokenizer, or (default length only) a model or
    corpus part too short for a prompt gives no sequences and meta["skipped"]; an explicit `length` that cannot
    hold a prompt, or a tokenizer that does not keep the pass key's tokens, is a HeadlabError.
    """
    if count < 1:
        raise HeadlabError(f"retrieval_count={count} must be at least 1")
    limit, tokenizer = loaded.max_positions, loaded.tokenizer
    if length is not None and limit is not None and length > limit:
        raise HeadlabError(f"retrieval_len={length} exceeds the model's maximum positions ({limit})")
    meta = {"task": RETRIEVAL_TASK, "length": length, "prompts": count, "seed": seed, "depths": retrieval_depths(count)}
    if loaded.adapter.is_encoder:
        return [], dict(meta, skipped="encoder: no next token copies the needle")
    if tokenizer is None:
        return [], dict(meta, skipped="the model has no tokenizer")
    explicit = length is not None
    length = length if explicit else (RETRIEVAL_LEN if limit is None else min(RETRIEVAL_LEN, limit))
    meta["length"] = length
    minimum = retrieval_minimum(tokenizer)
    if length < minimum:
        if explicit:
            raise HeadlabError(f"retrieval_len={length} is below the {minimum} tokens a passkey prompt needs")
        return [], dict(meta, skipped=f"the model's {limit} positions are fewer than a passkey prompt's {minimum}")
    part = split_text(text.corpus, text.split)
    haystack_text = part.text[: max(HAYSTACK_CHARS, 16 * length)]
    haystack = Haystack(tokenizer, haystack_text, text.corpus_name)
    if haystack.tokens < length:
        if explicit:
            raise HeadlabError(
                f"the {text.split} part of the corpus has {haystack.tokens:,} tokens, fewer than retrieval_len={length}"
            )
        return [], dict(meta, skipped=f"the corpus part has {haystack.tokens:,} tokens, fewer than {length}")
    prefix = _frame_tokens(loaded)[0]
    sequences, actual, rows = [], [], []
    for sample, depth in enumerate(meta["depths"]):
        prompt = build_prompt(haystack, RETRIEVAL_TASK, length, depth, sample, seed)
        ids, target = _copy_targets(tokenizer, prompt, prefix)
        if len(ids) > length:
            raise HeadlabError(f"a retrieval sequence of {len(ids)} tokens exceeds retrieval_len={length}")
        sequences.append((ids, target))
        actual.append(round(prompt.depth_actual, 4))
        rows.append(sum(t >= 0 for t in target))
    source = {**part.describe(), "corpus": text.corpus_name, "haystack_chars": len(haystack_text)}
    meta.update(depths_actual=actual, answer_rows=rows, prefix_tokens=prefix, source=source)
    return sequences, meta


def _copy_targets(tokenizer, prompt, prefix: list[int]) -> tuple[list[int], list[int]]:
    """(prefix + prompt + answer token ids, target per position) for one passkey prompt: the answer is the pass key
    after a space, as the question ("... The pass key is") calls for; its tokens are found in the needle's first
    sentence ("The pass key is N"), and row i, whose next token is answer token k, targets needle token k."""
    value = prompt.answers[0]
    encoded = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    full = tokenizer(prompt.text + " " + value, add_special_tokens=False)["input_ids"]
    answer = full[len(encoded) :]
    if full[: len(encoded)] != encoded or "".join(tokenizer.decode(answer).split()) != value:
        raise HeadlabError(f"the tokenizer does not round-trip the pass key {value!r} after the prompt")
    # The needle starts at prompt.needle_token; its first pass key comes before the second ("... N is the pass key").
    span = len(tokenizer(prompt.facts[0], add_special_tokens=False)["input_ids"])
    first, last = max(0, prompt.needle_token - 1), min(prompt.needle_token + span + 2, len(encoded)) - len(answer)
    found = next((m for m in range(first, last + 1) if encoded[m : m + len(answer)] == answer), None)
    if found is None:
        raise HeadlabError(f"the pass key {value!r} is tokenized differently in the needle and in the answer")
    ids = prefix + encoded + answer
    target = [-1] * len(ids)
    start = len(prefix) + len(encoded)  # position of answer token 0
    for k, token in enumerate(answer):
        if tokenizer.decode([token]).strip():  # a whitespace-only token copies no digit of the pass key
            target[start + k - 1] = len(prefix) + found + k
    return ids, target


def retrieval_batches(sequences, *, batch_size: int, pad_id: int = 0):
    """retrieval_sequences' sequences, right-padded `batch_size` at a time: (input_ids, attention_mask,
    {"retrieval": target})."""
    for first in range(0, len(sequences), batch_size):
        group = sequences[first : first + batch_size]
        input_ids, mask = _ids_and_mask([ids for ids, _ in group], pad_id)  # [B, T] each
        target = right_padded([keys for _, keys in group], -1, width=input_ids.shape[1], dtype=torch.long)  # [B, T]
        yield input_ids, mask, {"retrieval": target}


def _ids_and_mask(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows right-padded with pad_id into [B, T] input_ids, and their attention mask (1 on the real tokens)."""
    input_ids = right_padded(rows, pad_id, dtype=torch.long)
    return input_ids, right_padded([[1] * len(ids) for ids in rows], 0, dtype=torch.long)


def retrieval_statistics(
    loaded,
    *,
    text: TextSpec,
    length: int | None = None,
    count: int = 4,
    seed: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = True,
) -> tuple[dict[int, torch.Tensor], dict]:
    """The retrieval score alone (no text pass): ({layer: [H] float64, NaN where not counted}, meta record)."""
    sequences, meta = retrieval_sequences(loaded, text, length=length, count=count, seed=seed)
    nan = {layer.index: torch.full((layer.num_heads,), math.nan, dtype=torch.float64) for layer in loaded.layers}
    if not sequences:
        return nan, meta
    means = _collect_retrieval(loaded, sequences, text.batch_size, chunk_size, progress)
    return {i: means[i]["retrieval"][0] if "retrieval" in means[i] else nan[i] for i in nan}, meta


@dataclass(frozen=True)
class StatsPlan:
    """What `head_statistics` collects besides the text pass, each field also a keyword of its own.

    induction: the pass on `induction_count` sequences of `induction_len` seeded random tokens repeated twice
    (induction and duplicate_token); retrieval: the pass on `retrieval_count` passkey prompts of `retrieval_len` tokens
    (default 1024 capped by the model's positions); ov: the weights-only successor and copy_suppression scores;
    detect: TransformerLens detection patterns scored on the text pass (names of headlab.measure.detectors'
    DETECTION_PATTERNS or functions), with `detect_measure` "mul" or "abs"; seed: the induction tokens and passkey
    prompts.
    """

    induction: bool = True
    induction_len: int = 64
    induction_count: int = 8
    retrieval: bool = True
    retrieval_len: int | None = None
    retrieval_count: int = 4
    ov: bool = True
    detect: tuple = ()
    detect_measure: str = "mul"
    seed: int = 0


PLAN_KEYWORDS = tuple(field.name for field in fields(StatsPlan))


@takes_text(split="calibration", seq_len=512, max_tokens=8192)
def head_statistics(
    loaded,
    batches=None,
    *,
    text: TextSpec,
    plan: StatsPlan | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = True,
    **settings,
) -> pd.DataFrame:
    """Per-head statistics as a tidy table `layer, head, kv_head, name, statistic, value` (meta in
    `.attrs["meta"]`).

    `batches`: an iterable of (input_ids [B, T], attention_mask [B, T], ...) tuples, or None to take the windows of
    `text` (a TextSpec; the loose keywords data, split, seq_len, batch_size, max_tokens, text_column also work;
    default: calibration part of the embedded corpus, 512-token windows, 8,192 tokens). Encoder windows get
    [CLS] .. [SEP] around them (2 of the seq_len tokens). See `wide_statistics` for one row per head.
    `plan` (StatsPlan), or any of its fields as a keyword (induction=False, seed=1, detect=("previous_token",), ...):
    the induction pass (random tokens repeated, induction and duplicate_token), the retrieval pass (passkey prompts
    on the haystack of `text`'s corpus part; retrieval_sequences), the weights-only successor and copy_suppression
    scores (copy suppression over the SUPPRESSION_TOKENS most frequent tokens of the text pass) and detection
    patterns scored on the text pass (column detect_<name>).
    """
    unknown = sorted(set(settings) - set(PLAN_KEYWORDS))
    if unknown:
        raise TypeError(f"head_statistics() got unexpected keyword arguments: {', '.join(unknown)}")
    plan = replace(plan or StatsPlan(), **settings)
    check_error_measure(plan.detect_measure)
    detect = [resolve_pattern(pattern) for pattern in plan.detect]  # unknown names fail before any pass
    prefix, suffix = _frame_tokens(loaded)
    framed = loaded.adapter.is_encoder and len(prefix) == 1 and len(suffix) == 1
    if plan.induction:
        _check_induction(loaded, plan.induction_len, plan.induction_count, len(prefix) + len(suffix))
    # Built before any pass, so that a bad retrieval_len or tokenizer fails before the work.
    sequences, retrieval_meta = [], None
    if plan.retrieval:
        sequences, retrieval_meta = retrieval_sequences(
            loaded, text, length=plan.retrieval_len, count=plan.retrieval_count, seed=plan.seed
        )
    data_meta = {}
    if batches is None:
        batches = _statistics_windows(loaded, text, framed)
        data_meta = dict(batches.meta, seq_len=text.seq_len, framed_with_cls_sep=framed)
    frame = (prefix, suffix) if framed and data_meta else None
    detectors = [PatternDetector(loaded.layers, fn, plan.detect_measure) for _, fn in detect]
    means, tokens, frequency = _collect_text_statistics(loaded, batches, frame, chunk_size, progress, detectors)
    for (name, _), detector in zip(detect, detectors):
        for index, values in detector.means().items():
            means[index][f"detect_{name}"] = values
    induction_meta = None
    if plan.induction:
        induction_meta = _add_induction(loaded, plan, text.batch_size, chunk_size, progress, means)
        induction_meta.update(prefix_tokens=prefix, suffix_tokens=suffix)
    if sequences:
        for index, values in _collect_retrieval(loaded, sequences, text.batch_size, chunk_size, progress).items():
            if "retrieval" in values:
                means[index]["retrieval"] = values["retrieval"]
    ov_meta = _ov_statistics(loaded, means, frequency) if plan.ov else None
    extra = [f"detect_{name}" for name, _ in detect]
    table, denominators = _tidy_statistics(loaded.layers, means, extra)
    table.attrs["meta"] = {
        **loaded.describe(),
        "data": data_meta or {"data": "caller batches"},
        "tokens": tokens,
        "seq_len": data_meta.get("seq_len") if data_meta else None,
        "seed": plan.seed,
        "chunk_size": chunk_size,
        "induction": induction_meta,
        "retrieval": retrieval_meta,
        **(ov_meta or {"successor": None, "copy_suppression": None}),
        "detect": {"patterns": extra, "error_measure": plan.detect_measure} if detect else None,
        **_conventions(loaded),
        "denominators": denominators,
    }
    return table


def _add_induction(loaded, plan: StatsPlan, batch_size: int, chunk_size: int, progress: bool, means: dict) -> dict:
    """The induction pass (random tokens repeated): its per-head means added to `means`; returns its meta record."""
    settings = dict(length=plan.induction_len, count=plan.induction_count, seed=plan.seed, batch_size=batch_size)
    for index, values in _collect_induction(loaded, settings, chunk_size, progress).items():
        means[index].update(values)
    return {"length": plan.induction_len, "sequences": plan.induction_count, "seed": plan.seed}


def _conventions(loaded) -> dict:
    """The constants and model facts every statistics table is read with (windows, thresholds, blocks, edge rules)."""
    return {
        "streaming_windows": list(STREAMING_WINDOWS),
        "positional_threshold": POSITIONAL_THRESHOLD,
        "sink_tokens": SINK_TOKENS,
        "blocks": {layer.index: layer.block for layer in loaded.layers},
        "output_norm_before_gate": loaded.adapter.gated,
        "edge_rules": EDGE_RULES,
    }


def _ov_statistics(loaded, means: dict, frequency: torch.Tensor) -> dict:
    """Add successor and copy_suppression to `means` (where they apply) and return their meta records: the sequence
    forms and pairs, the token set, or why a score is NaN."""
    successor = {"sequences": [], "pairs": 0}
    suppression = {
        "k": SUPPRESSION_K,
        "tokens": 0,
        "source": f"the {SUPPRESSION_TOKENS} most frequent text-pass tokens",
    }
    forms = succession_forms(loaded.tokenizer) if loaded.tokenizer is not None else []
    tokens = frequent_tokens(frequency, SUPPRESSION_TOKENS, special_token_ids(loaded))
    used = torch.tensor([i for _, ids in forms for i in ids if i is not None] + tokens.tolist(), dtype=torch.long)
    try:
        circuit = ov_circuit(loaded, used)  # the rows of the tokens scored only, not the whole vocabulary
    except HeadlabError as error:  # the approximation does not apply to this model: NaN, and the reason in meta
        reason = str(error)
        return {"successor": dict(successor, skipped=reason), "copy_suppression": dict(suppression, skipped=reason)}
    if loaded.tokenizer is None:
        successor["skipped"] = "the model has no tokenizer"
    else:
        successor["sequences"] = [name for name, _ in forms]
        scores = successor_scores(loaded, forms, circuit=circuit)
        for index, values in scores.items():
            means[index]["successor"] = values
        successor["pairs"] = int(next(iter(scores.values()))[1]) if scores else 0
        if not successor["pairs"]:
            successor["skipped"] = "no ordinal sequence has consecutive single-token elements"
    suppression["tokens"] = len(tokens)
    if len(tokens) <= SUPPRESSION_K:
        suppression["skipped"] = f"{len(tokens)} distinct tokens in the text pass, not more than k={SUPPRESSION_K}"
    else:
        for index, values in copy_suppression_scores(loaded, tokens, circuit=circuit).items():
            means[index]["copy_suppression"] = values
    return {"successor": successor, "copy_suppression": suppression}


def detect_heads(
    loaded,
    pattern,
    texts_or_batches,
    error_measure: str = "mul",
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    batch_size: int = 4,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
) -> dict[int, torch.Tensor]:
    """TransformerLens's detect_head, streamed: {layer: score per head [H] float64, NaN without a counted sequence}.

    Per sequence (A the head's attention, P the pattern, T real tokens): "mul" sum(A * P) / sum(A), "abs"
    1 - sum|A - P| / T (TransformerLens head_detector), averaged over sequences of at least 2 tokens. `pattern`: a
    name of DETECTION_PATTERNS (previous_token, duplicate_token, induction) or a function (tokens [T] long, start,
    stop) -> [stop - start, T] giving the rows of the queries a chunk holds. `texts_or_batches`: a text or a list of
    texts (each one sequence, after BOS or framed by [CLS] .. [SEP] as TransformerLens's to_tokens prepends BOS), or
    (input_ids [B, T], attention_mask [B, T], ...) batches whose padding is left out of every sequence.
    """
    detector = PatternDetector(
        loaded.layers, pattern, error_measure, exclude_bos=exclude_bos, exclude_current_token=exclude_current_token
    )
    if isinstance(texts_or_batches, str):
        texts_or_batches = [texts_or_batches]
    batches = texts_or_batches
    if isinstance(texts_or_batches, (list, tuple)) and all(isinstance(t, str) for t in texts_or_batches):
        batches = _text_batches(loaded, list(texts_or_batches), batch_size)
    with torch.no_grad(), capture_attention(loaded.model, loaded.layers, detector.on_chunk, None, chunk_size):
        for batch in tqdm(batches, desc=f"detect {detector.name}", disable=not progress, unit="batch"):
            input_ids, attention_mask = batch[0], batch[1]
            detector.set_batch(input_ids, attention_mask)
            loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
    detector.reduce()
    return {index: mean for index, (mean, _) in detector.means().items()}


def _text_batches(loaded, texts: list[str], batch_size: int) -> list:
    """Each text tokenized alone between the frame tokens (BOS; [CLS] .. [SEP]), right-padded `batch_size` at a time:
    [(input_ids, attention_mask)]."""
    if loaded.tokenizer is None:
        raise HeadlabError("the model has no tokenizer; pass token batches instead of texts")
    if not texts:
        raise HeadlabError("no texts to detect heads on")
    prefix, suffix = _frame_tokens(loaded)
    encoded = [prefix + loaded.tokenizer(t, add_special_tokens=False)["input_ids"] + suffix for t in texts]
    longest = max(len(ids) for ids in encoded)
    if loaded.max_positions is not None and longest > loaded.max_positions:
        raise HeadlabError(f"a text of {longest} tokens exceeds the model's {loaded.max_positions} positions")
    pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0
    batches = []
    for first in range(0, len(encoded), batch_size):
        batches.append(_ids_and_mask(encoded[first : first + batch_size], pad))  # [B, T] each
    return batches


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


def _collect_text_statistics(loaded, batches, frame, chunk_size: int, progress: bool, detectors=()):
    """Every statistic but induction and retrieval, summed over the batches (this process's share under torchrun) and
    reduced: (per-layer means, tokens seen, count of each token id [V] float64). frame: ([CLS], [SEP]) ids to wrap each
    window in, or None. `detectors` (PatternDetector) read the same chunks and are reduced here too."""
    tokenizer, adapter = loaded.tokenizer, loaded.adapter
    sep_id = getattr(tokenizer, "sep_token_id", None) if adapter.is_encoder else None
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    collector = StatisticsCollector(loaded.layers, is_encoder=adapter.is_encoder)
    tokens = 0
    vocab = int(loaded.model.config.get_text_config().vocab_size)
    frequency = torch.zeros(vocab, dtype=torch.float64)
    if distributed.active():  # torchrun: this process takes its share of the windows
        batches = distributed.shard(list(batches))
    total = len(batches) if hasattr(batches, "__len__") else None

    def on_chunk(chunk: AttentionChunk) -> None:
        collector.on_chunk(chunk)
        for detector in detectors:
            detector.on_chunk(chunk)

    capture = capture_attention(loaded.model, loaded.layers, on_chunk, collector.on_output, chunk_size)
    with torch.no_grad(), capture:
        for batch in tqdm(batches, total=total, desc="attention statistics", disable=not progress, unit="batch"):
            input_ids, attention_mask = batch[0], batch[1]
            if frame is not None:
                input_ids, attention_mask = _frame_encoder_batch(
                    input_ids, attention_mask, *frame[0], *frame[1], pad_id
                )
            sep_keys = (input_ids == sep_id) if sep_id is not None else None
            collector.set_batch(sep_keys=None if sep_keys is None else sep_keys.to(loaded.device))
            for detector in detectors:
                detector.set_batch(input_ids, attention_mask)
            loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
            tokens += int(attention_mask.sum())
            seen = input_ids[attention_mask.bool()].cpu()
            frequency += torch.bincount(seen[seen < vocab], minlength=vocab).double()
    collector.reduce()
    for detector in detectors:
        detector.reduce()
    frequency = distributed.all_reduce_sum(frequency) if distributed.active() else frequency
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
    return means, tokens, frequency


def _collect_induction(loaded, settings: dict, chunk_size: int, progress: bool) -> dict:
    """Induction and duplicate-token scores on repeated random-token sequences (induction_batches with `settings`),
    per layer."""
    runs = induction_batches(loaded, **settings)
    steps = math.ceil(settings["count"] / settings["batch_size"])
    return _collect_targets(loaded, "induction", runs, steps, chunk_size, progress)


def _collect_retrieval(loaded, sequences, batch_size: int, chunk_size: int, progress: bool) -> dict:
    """Retrieval scores on retrieval_sequences' teacher-forced passkey prompts, per layer."""
    tokenizer = loaded.tokenizer
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    runs = retrieval_batches(sequences, batch_size=batch_size, pad_id=pad)
    return _collect_targets(loaded, "retrieval", runs, math.ceil(len(sequences) / batch_size), chunk_size, progress)


def _collect_targets(loaded, name: str, runs, steps: int, chunk_size: int, progress: bool) -> dict:
    """Per-layer means of A[i, target(i)] over (input_ids, attention_mask, {target name: target}) batches, each
    reported under its target's name (`name`: the pass, for the progress bar)."""
    collector = StatisticsCollector(loaded.layers, induction_only=True)
    if distributed.active():
        runs = distributed.shard(list(runs))
        steps = len(runs)
    capturing = capture_attention(loaded.model, loaded.layers, collector.on_chunk, None, chunk_size)
    with torch.no_grad(), capturing as capture:
        for input_ids, attention_mask, targets in tqdm(
            runs, total=steps, desc=name, disable=not progress, unit="batch"
        ):
            collector.set_batch(targets={key: target.to(loaded.device) for key, target in targets.items()})
            # Only rows with a target are read: the other chunks are skipped (the retrieval pass reads a few
            # answer rows of each long prompt).
            wanted = [(target >= 0).any(0) for target in targets.values()]  # [T] each
            capture.rows = torch.stack(wanted).any(0) if wanted else None
            loaded.model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
    collector.reduce()
    return collector.means()


def head_name(layer: int, head: int) -> str:
    """TransformerLens's name of a head, "L{layer}H{head}" (layer: headlab's attention-layer index)."""
    return f"L{layer}H{head}"


def _tidy_statistics(layers, means: dict, extra=()) -> tuple[pd.DataFrame, dict]:
    """The tidy table (one row per layer, head and statistic: STATISTICS, then the `extra` names) and each
    statistic's per-layer denominators."""
    rows, denominators = [], {}
    for layer in layers:
        values = means[layer.index]
        prev, nxt = values["positional_prev"][0], values["positional_next"][0]
        positional = (torch.maximum(prev.nan_to_num(0.0), nxt.nan_to_num(0.0)) >= POSITIONAL_THRESHOLD).double()
        for name in (*STATISTICS, *extra):
            if name == "is_positional":
                column = positional
            elif name in values:
                column, count = values[name]
                denominators.setdefault(name, {})[layer.index] = count
            else:
                column = torch.full((layer.num_heads,), math.nan, dtype=torch.float64)
            for head in range(layer.num_heads):
                label = head_name(layer.index, head)
                rows.append((layer.index, head, layer.kv_head_of(head), label, name, float(column[head])))
    table = pd.DataFrame(rows, columns=[*HEAD_COLUMNS, "statistic", "value"])
    return table, {name: [counts.get(i) for i in sorted(counts)] for name, counts in denominators.items()}


def wide_statistics(tidy: pd.DataFrame) -> pd.DataFrame:
    """One row per head: `layer, head, kv_head, name` ("L{layer}H{head}", TransformerLens's naming) and one column
    per statistic (STATISTICS order, then detect_<name> columns in the tidy table's order; NaN where n/a)."""
    if "name" not in tidy:  # a tidy table written before the name column
        tidy = tidy.assign(name=[head_name(la, h) for la, h in zip(tidy["layer"], tidy["head"])])
    wide = tidy.pivot(index=list(HEAD_COLUMNS), columns="statistic", values="value")
    extra = [name for name in dict.fromkeys(tidy["statistic"]) if name not in STATISTICS]
    wide = wide.reindex(columns=[name for name in (*STATISTICS, *extra) if name in wide.columns]).reset_index()
    wide.columns.name = None
    if "is_positional" in wide:
        wide["is_positional"] = wide["is_positional"].astype(bool)
    wide.attrs = dict(tidy.attrs)
    return wide


def write_statistics(out: Path, tidy: pd.DataFrame, *, overwrite: bool = False) -> Path:
    """`stats.csv/.parquet` (tidy), `stats_wide.csv/.parquet` (one row per head) and meta.json, atomically."""

    meta = dict(tidy.attrs.get("meta", {}))
    return write_run(out, {"stats": tidy, "stats_wide": wide_statistics(tidy)}, meta, overwrite=overwrite)
