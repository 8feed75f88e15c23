"""Head detectors beside the attention statistics: two weights-only scores through each head's OV circuit and
TransformerLens-style detection patterns scored on streamed attention chunks.

- successor (Gould et al. 2023, "Successor Heads"): the fraction of ordinal pairs (t, succ(t)) for which the head's
  effective OV logits W_U diag(g) W_O,h W_V,h W_E[t] rank succ(t) above every other token of t's sequence (their
  succession score over the ordinal set).
- copy_suppression (McDougall et al. 2023, "Copy Suppression"): the fraction of tokens t of a token set S whose own
  logit W_U[t] . (diag(g) W_O,h W_V,h W_E[t]) is among the k lowest over S (negative copying through the OV circuit).
- detect_<name> (TransformerLens head_detector.detect_head): per sequence sum(A * P) / sum(A) ("mul") or
  1 - sum|A - P| / T ("abs") for a detection pattern P, averaged over sequences.

The effective OV circuit is an approximation (no earlier layers, no MLPs, biases left out, per-layer norms left out,
the final norm as its per-channel gain g only): it reads the token embeddings straight into the head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from headlab.core import distributed
from headlab.core.errors import HeadlabError
from headlab.core.loading import weights_in_memory
from headlab.measure.choices import DETECTION_PATTERN_NAMES, ERROR_MEASURES
from headlab.mechanisms.capture import AttentionChunk

SUPPRESSION_K = 10  # copy suppression: t among the k lowest logits (McDougall et al. 2023 use the bottom 10)
# Copy suppression's token set S: this many most frequent tokens of the text pass (the cost grows as S^2).
SUPPRESSION_TOKENS = 1000
OV_CHUNK = 256  # input tokens per effective-OV block: [H, OV_CHUNK, outputs] logits live at once
# Ordinal sequences of the successor score (Gould et al. 2023's numbers, number words, days, months, letters), each
# also tried with a leading space; only elements that are one token of the model's tokenizer take part.
SUCCESSION_SEQUENCES = {
    "numbers": [str(n) for n in range(1, 21)],
    "number_words": "one two three four five six seven eight nine ten".split(),
    "ordinals": "first second third fourth fifth sixth seventh eighth ninth tenth".split(),
    "weekdays": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "weekday_prefixes": "Mon Tue Wed Thu Fri Sat Sun".split(),
    "months": "January February March April May June July August September October November December".split(),
    "month_prefixes": "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(),
    "letters": [chr(c) for c in range(ord("A"), ord("Z") + 1)],
}
SUCCESSION_MIN = 3  # single-token elements a sequence form needs (with 2, "above every other" is only above t)


# ---- the effective OV circuit ------------------------------------------------------------------------------------


@dataclass
class OVCircuit:
    """The token-side weights of the effective OV circuit: W_E [V_in, C] and W_U diag(g) [V_out, C], g the final
    norm's per-channel gain (as the norm applies it), in a float dtype of at least float32. `ids`: the token ids
    whose rows it holds (sorted), None for the whole vocabulary."""

    embed: torch.Tensor
    unembed: torch.Tensor
    ids: torch.Tensor | None = None

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row positions of token ids `tokens` in embed and unembed."""
        if self.ids is None:
            return tokens
        tokens = tokens.to(self.ids.device)
        position = torch.searchsorted(self.ids, tokens).clamp(max=len(self.ids) - 1)
        if not bool((self.ids[position] == tokens).all()):
            raise HeadlabError("the OV circuit was built for other tokens than it is asked about")
        return position


def ov_circuit(loaded, tokens: torch.Tensor | None = None) -> OVCircuit:
    """The model's effective-OV weights (only the rows of token ids `tokens`, when given: an 8B model's float32
    embedding and unembedding are 2 GiB each); a one-line HeadlabError where the approximation does not apply
    (encoders, no final norm beside the blocks, embeddings narrower or wider than the residual stream)."""
    model, adapter = loaded.model, loaded.adapter
    ids = None if tokens is None else torch.unique(torch.as_tensor(tokens, dtype=torch.long))  # sorted
    # a device map may have offloaded these weights: read them loaded, and keep copies of the rows needed
    with weights_in_memory(
        model.get_input_embeddings(), model.get_output_embeddings(), adapter.final_norm(model).module
    ):
        gain = adapter.final_norm(model).gain.detach().clone()
        unembed, embed = adapter.unembedding(model)[0].detach(), model.get_input_embeddings().weight.detach()
        unembed = unembed.clone() if ids is None else unembed[ids.to(unembed.device)]
        embed = embed.clone() if ids is None else embed[ids.to(embed.device)]
    dtype = torch.promote_types(embed.dtype, torch.float32)
    if embed.shape[1] != unembed.shape[1] or gain.shape[0] != unembed.shape[1]:
        raise HeadlabError(
            f"the input embeddings ({embed.shape[1]}) and the unembedding ({unembed.shape[1]}) differ in width: "
            "no direct embedding path into the heads"
        )
    device = embed.device
    return OVCircuit(embed.to(dtype), (unembed.to(device, dtype) * gain.to(device, dtype)), ids)


def ov_logits(
    loaded, layer, inputs: torch.Tensor, outputs: torch.Tensor | None = None, *, circuit=None, chunk: int = OV_CHUNK
) -> Iterator[tuple[slice, torch.Tensor]]:
    """Effective-OV logits of one layer's heads, a block of input tokens at a time: yields (rows, logits [H, c, n_out])
    with logits[h, r, u] = W_U[u] diag(g) W_O,h W_V,h W_E[inputs[r]] for the token ids `inputs` and `outputs`
    (default: the whole vocabulary). Computed as (W_V W_E[t]) [D] against (W_U diag(g) W_O) [n_out, D] per head, so
    no [vocab x vocab] matrix exists; `chunk` bounds the block (c x n_out per head)."""
    circuit = circuit or ov_circuit(loaded)
    with weights_in_memory(layer.block_module or layer.module):  # offloaded by a device map: read them loaded
        v, o = (w.detach().clone() for w in loaded.adapter.ov_weights(layer))  # [G, D, C], [C, H, D]
    device, dtype = circuit.embed.device, circuit.embed.dtype
    v, o = v.to(device, dtype), o.to(device, dtype)
    if outputs is None and circuit.ids is not None:
        raise HeadlabError("logits over the whole vocabulary need an OV circuit of the whole vocabulary")
    unembed = circuit.unembed if outputs is None else circuit.unembed[circuit.rows(outputs).to(device)]
    right = torch.einsum("uc,chd->hdu", unembed, o)  # [H, D, n_out]: W_U diag(g) W_O,h
    inputs = inputs.to(device)
    for first in range(0, len(inputs), chunk):
        x = circuit.embed[circuit.rows(inputs[first : first + chunk])]  # [c, C]
        z = torch.einsum("tc,gdc->gtd", x, v).repeat_interleave(layer.group_size, dim=0)  # [H, c, D], repeat_kv order
        yield slice(first, first + len(x)), z @ right


def succession_forms(tokenizer) -> list[tuple[str, list[int | None]]]:
    """(form name, token id per element or None where the element is not one token) for every sequence of
    SUCCESSION_SEQUENCES bare and after a space; forms with fewer than SUCCESSION_MIN single tokens and forms that
    repeat an earlier one's ids are left out."""
    forms, seen = [], set()
    unknown = getattr(tokenizer, "unk_token_id", None)
    for name, elements in SUCCESSION_SEQUENCES.items():
        for prefix in ("", " "):
            ids: list[int | None] = []
            for element in elements:
                encoded = tokenizer(prefix + element, add_special_tokens=False)["input_ids"]
                single = len(encoded) == 1 and encoded[0] != unknown and encoded[0] not in ids
                ids.append(encoded[0] if single else None)
            key = tuple(ids)
            if sum(i is not None for i in ids) >= SUCCESSION_MIN and key not in seen:
                seen.add(key)
                forms.append((name if not prefix else f"{name} (after a space)", ids))
    return forms


def successor_scores(loaded, forms, *, circuit=None) -> dict[int, tuple[torch.Tensor, float]]:
    """layer -> (succession score per head [H] float64, pairs counted): the share of pairs (t, succ(t)) of
    consecutive single-token elements of each form for which logits[succ(t)] > logits[u] for every other
    single-token element u of the form (Gould et al. 2023's succession score), logits from ov_logits."""
    circuit = circuit or ov_circuit(loaded)
    tokens = sorted({i for _, ids in forms for i in ids if i is not None})
    where = {token: n for n, token in enumerate(tokens)}
    # (row of t, column of succ(t), columns of the form's tokens) per pair
    pairs = []
    for _, ids in forms:
        columns = torch.tensor([where[i] for i in ids if i is not None])
        for a, b in zip(ids, ids[1:]):
            if a is not None and b is not None:
                pairs.append((where[a], where[b], columns))
    out = {}
    for layer in loaded.layers:
        if not pairs:
            out[layer.index] = (torch.full((layer.num_heads,), math.nan, dtype=torch.float64), 0.0)
            continue
        ids = torch.tensor(tokens)
        logits = torch.cat([block for _, block in ov_logits(loaded, layer, ids, ids, circuit=circuit)], dim=1).cpu()
        hits = torch.zeros(layer.num_heads, dtype=torch.float64)
        for row, successor, columns in pairs:
            values = logits[:, row, columns]  # [H, n_form]
            others = values.masked_fill(columns[None, :] == successor, -math.inf).amax(-1)
            hits += (logits[:, row, successor] > others).double()
        out[layer.index] = (hits / len(pairs), float(len(pairs)))
    return out


def copy_suppression_scores(
    loaded, tokens: torch.Tensor, *, k: int = SUPPRESSION_K, circuit=None
) -> dict[int, tuple[torch.Tensor, float]]:
    """layer -> (copy-suppression score per head [H] float64, tokens counted): the share of tokens t of `tokens` (S)
    whose own effective-OV logit is among the k lowest over S, i.e. fewer than k tokens of S score strictly lower
    (McDougall et al. 2023, over S instead of the whole vocabulary). NaN where S has k tokens or fewer."""
    if k < 1:
        raise HeadlabError(f"copy suppression needs k >= 1, got {k}")
    circuit = circuit or ov_circuit(loaded)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    out = {}
    for layer in loaded.layers:
        if len(tokens) <= k:
            out[layer.index] = (torch.full((layer.num_heads,), math.nan, dtype=torch.float64), 0.0)
            continue
        hits = torch.zeros(layer.num_heads, dtype=torch.float64, device=circuit.embed.device)
        for rows, logits in ov_logits(loaded, layer, tokens, tokens, circuit=circuit):  # [H, c, n]
            local = torch.arange(logits.shape[1], device=logits.device)
            own = logits[:, local, local + rows.start]  # [H, c]
            kth = logits.topk(k, dim=-1, largest=False).values[..., -1]  # [H, c]: the k-th lowest logit
            hits += (own <= kth).sum(-1).double()
        out[layer.index] = ((hits / len(tokens)).cpu(), float(len(tokens)))
    return out


def frequent_tokens(counts: torch.Tensor, n: int, exclude=()) -> torch.Tensor:
    """The (at most) n most frequent token ids of a count vector [V] (ties to the lower id), leaving out ids never
    seen and the ids in `exclude` (special tokens)."""
    counts = counts.clone().double()
    excluded = torch.tensor([i for i in exclude if 0 <= i < len(counts)], dtype=torch.long)
    counts[excluded] = 0
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep the lower id first
    return order[counts[order] > 0][:n]


# ---- detection patterns (TransformerLens head_detector) ------------------------------------------------------------


def previous_token_pattern(tokens: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 of TransformerLens's previous-token pattern: P[i, i-1] = 1."""
    rows = torch.arange(start, stop)
    return (torch.arange(len(tokens))[None, :] == rows[:, None] - 1).float()


def duplicate_token_pattern(tokens: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """TransformerLens's duplicate-token pattern: P[i, j] = 1 where j < i and token j = token i (diagonal zeroed,
    lower triangle)."""
    rows = torch.arange(start, stop)
    earlier = torch.arange(len(tokens))[None, :] < rows[:, None]
    return ((tokens[start:stop, None] == tokens[None, :]) & earlier).float()


def induction_pattern(tokens: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """TransformerLens's induction pattern (the duplicate pattern shifted one key right, column 0 cleared, lower
    triangle): P[i, j] = 1 where 1 <= j <= i and token j-1 = token i."""
    rows = torch.arange(start, stop)
    keys = torch.arange(len(tokens))
    follows = torch.zeros(stop - start, len(tokens), dtype=torch.bool)
    follows[:, 1:] = tokens[start:stop, None] == tokens[None, :-1]
    return (follows & (keys[None, :] <= rows[:, None])).float()


DETECTION_PATTERNS: dict[str, Callable] = dict(
    zip(DETECTION_PATTERN_NAMES, (previous_token_pattern, duplicate_token_pattern, induction_pattern))
)


def resolve_pattern(pattern) -> tuple[str, Callable]:
    """(name, rows function) for a named pattern or a function pattern(tokens [T] long, start, stop) -> [stop-start,
    T] rows; anything else is a one-line HeadlabError."""
    if isinstance(pattern, str):
        if pattern not in DETECTION_PATTERNS:
            raise HeadlabError(f"unknown detection pattern {pattern!r}; use one of {', '.join(DETECTION_PATTERNS)}")
        return pattern, DETECTION_PATTERNS[pattern]
    if callable(pattern):
        return getattr(pattern, "__name__", "pattern"), pattern
    raise HeadlabError(
        f"a detection pattern is a name ({', '.join(DETECTION_PATTERNS)}) or a function, got {pattern!r}"
    )


def check_error_measure(error_measure: str) -> str:
    if error_measure not in ERROR_MEASURES:
        raise HeadlabError(f"unknown error_measure={error_measure!r}; use one of {', '.join(ERROR_MEASURES)}")
    return error_measure


class PatternDetector:
    """TransformerLens's detect_head score of one detection pattern, streamed chunk by chunk (no T x T map).

    Per sequence of T real tokens (A its attention, P the pattern over its real tokens): "mul" sum(A * P) / sum(A),
    "abs" 1 - sum|A - P| / T (TransformerLens's 1 - mean|A - P| * T, without its rounding to 3 decimals), sums over
    every (query, key) pair; exclude_bos / exclude_current_token drop key 0 / the diagonal from both, as
    TransformerLens does. Scores are averaged over sequences of at least 2 tokens (TransformerLens refuses shorter).
    """

    def __init__(self, layers, pattern, error_measure: str = "mul", *, exclude_bos=False, exclude_current_token=False):
        self.name, self.pattern = resolve_pattern(pattern)
        self.error_measure = check_error_measure(error_measure)
        self.exclude_bos, self.exclude_current_token = exclude_bos, exclude_current_token
        self.layers = {layer.index: layer for layer in layers}
        self.sums = {i: torch.zeros(layer.num_heads, dtype=torch.float64) for i, layer in self.layers.items()}
        self.counts = {i: torch.zeros(layer.num_heads, dtype=torch.float64) for i, layer in self.layers.items()}
        self._batch: dict[int, torch.Tensor] = {}  # layer -> [2, B, H]: mul (numerator, denominator); abs (error, -)
        self._rows: dict[tuple, torch.Tensor] = {}  # (start, c, device, dtype) -> [B, c, T] pattern rows
        self._positions: list[torch.Tensor] = []  # per sequence: positions of its real tokens
        self._tokens: list[torch.Tensor] = []
        self._width = 0

    def set_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The next batch's tokens [B, T] and mask [B, T]; settles the previous batch's per-sequence scores."""
        self._settle()
        real, ids = attention_mask.bool().cpu(), input_ids.cpu()
        self._positions = [row.nonzero()[:, 0] for row in real]
        self._tokens = [ids[b, positions] for b, positions in enumerate(self._positions)]
        self._width = ids.shape[1]
        self._rows.clear()

    def _pattern_rows(self, start: int, c: int, device, dtype) -> torch.Tensor:
        """[B, c, T] pattern rows of queries start..start+c-1 at padded positions (0 on padding), once per chunk
        position and batch (every layer reads the same rows)."""
        key = (start, c, device, dtype)
        if key not in self._rows:
            out = torch.zeros(len(self._tokens), c, self._width)
            for b, (positions, tokens) in enumerate(zip(self._positions, self._tokens)):
                inside = ((positions >= start) & (positions < start + c)).nonzero()[:, 0]  # real indices in the chunk
                if not len(inside):
                    continue
                low, high = int(inside[0]), int(inside[-1]) + 1
                rows = torch.as_tensor(self.pattern(tokens, low, high)).float()
                if tuple(rows.shape) != (high - low, len(tokens)):
                    raise HeadlabError(
                        f"detection pattern {self.name!r} gave rows of shape {tuple(rows.shape)} for queries "
                        f"{low}..{high - 1} of {len(tokens)} tokens; expected {(high - low, len(tokens))}"
                    )
                out[b, (positions[low:high] - start)[:, None], positions[None, :]] = rows
            self._rows[key] = out.to(device, dtype)
        return self._rows[key]

    def on_chunk(self, chunk: AttentionChunk) -> None:
        p = chunk.probs  # [B, H, c, Tk]
        B, H, c, Tk = p.shape
        pattern = self._pattern_rows(chunk.start, c, p.device, p.dtype)  # [B, c, T]
        weights = p * chunk.query_valid[:, None, :, None].to(p.dtype)  # padding query rows never count
        inside, beyond = pattern[:, None, :, :Tk], pattern[:, :, Tk:]
        keep = self._kept(B, c, Tk, chunk.start, p.device)  # [B, 1, c, Tk] or None
        if self.error_measure == "mul":
            if keep is not None:
                weights = weights * keep
            # vecdot over keys, then a sum over rows: one read of the chunk per product
            packed = torch.stack([torch.linalg.vecdot(weights, inside).sum(-1), weights.sum((2, 3))])  # [2, B, H]
        else:
            error = (weights - inside).abs()
            if keep is not None:
                error = error * keep
            # Keys past Tk are invisible to every row of the chunk (A = 0 there): |0 - P| = P.
            total = error.sum((2, 3)) + beyond.sum((1, 2))[:, None]
            packed = torch.stack([total, torch.zeros_like(total)])
        index = chunk.layer.index
        self._batch[index] = self._batch[index] + packed.to(self._batch[index]) if index in self._batch else packed

    def _kept(self, B: int, c: int, Tk: int, start: int, device) -> torch.Tensor | None:
        """[B, 1, c, Tk] float: 0 on the first real key (exclude_bos) and on each query's own key
        (exclude_current_token), 1 elsewhere; None when nothing is excluded."""
        if not (self.exclude_bos or self.exclude_current_token):
            return None
        keep = torch.ones(B, 1, c, Tk, device=device)
        if self.exclude_bos:
            for b, positions in enumerate(self._positions):
                if len(positions) and int(positions[0]) < Tk:
                    keep[b, :, :, int(positions[0])] = 0
        if self.exclude_current_token:
            rows = torch.arange(c, device=device)
            on = rows + start < Tk
            keep[:, :, rows[on], rows[on] + start] = 0
        return keep

    def _settle(self) -> None:
        """Turn the finished batch's per-sequence sums into scores and add them to the per-head totals."""
        lengths = torch.tensor([len(t) for t in self._tokens], dtype=torch.float64)
        for index, packed in self._batch.items():
            first, second = packed.double().cpu()  # [B, H] each
            if self.error_measure == "mul":
                counted = (lengths[:, None] >= 2) & (second > 0)
                score = first / torch.where(counted, second, 1.0)
            else:
                counted = (lengths[:, None] >= 2).expand_as(first)
                score = 1.0 - first / lengths.clamp(min=1)[:, None]
            self.sums[index] += torch.where(counted, score, 0.0).sum(0)
            self.counts[index] += counted.double().sum(0)
        self._batch.clear()

    def reduce(self) -> None:
        """Under torchrun, add every process's totals (every rank runs the same collectives in the same order)."""
        self._settle()
        if not distributed.active():
            return
        for index in self.layers:
            packed = distributed.all_reduce_sum(torch.cat([self.sums[index], self.counts[index]]))
            self.sums[index], self.counts[index] = packed.split(len(self.sums[index]))

    def means(self) -> dict[int, tuple[torch.Tensor, float]]:
        """layer -> (mean score per head [H] float64, NaN without counted sequences; sequences counted)."""
        self._settle()
        out = {}
        for index in self.layers:
            counts = self.counts[index]
            mean = torch.where(counts > 0, self.sums[index] / counts.clamp(min=1), math.nan)
            out[index] = (mean, float(counts.max()))
        return out
