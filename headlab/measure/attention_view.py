"""The largest attention weights of every head for one text, streamed: for each (layer, head, query) the top-k keys
and their weights, and the mass of the keys left out, collected chunk by chunk from headlab's attention capture so
no layer's T x T map is ever held (what `headlab show` draws; headlab.viz.viewer writes the page).

Definition: for query i of head h, A_i = softmax(q_i K^T * scaling + mask) (the capture's weights, as eager attention
computes them); keys(i) = the k largest A_ij (ties to the lower key index as torch.topk breaks them), rest(i) =
sum_j A_ij - sum_{j in keys(i)} A_ij (1 - the kept mass; less with learned attention sinks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from headlab.core.errors import HeadlabError
from headlab.core.tables import head_name
from headlab.measure.choices import DEFAULT_SHOW_TOKENS, DEFAULT_TOP_K, MAX_TOP_K
from headlab.mechanisms.capture import DEFAULT_CHUNK, AttentionChunk, capture_attention

MAX_TEXT_TOKENS = 65536  # the page stores key gaps in 16 bits (headlab.viz.viewer)


@dataclass
class TopKAttention:
    """The top-k attention of one text: per attention layer arrays over (head, query, rank).

    keys[layer]: [H, T, k] int32 key index, -1 where the query sees fewer than k keys (the causal start);
    weights[layer]: [H, T, k] float32, descending along k (0 where the key is -1); rest[layer]: [H, T] float32, the
    mass of the keys left out. `heads` is one row per head (layer, head, kv_head, name) in the model's layout, so
    pruned, GQA and MLA models show the heads they have.
    """

    tokens: list[str]  # each token as the tokenizer decodes it alone
    token_ids: list[int]
    heads: pd.DataFrame
    top_k: int
    keys: dict[int, np.ndarray] = field(repr=False)
    weights: dict[int, np.ndarray] = field(repr=False)
    rest: dict[int, np.ndarray] = field(repr=False)
    meta: dict = field(default_factory=dict)

    @property
    def layer_heads(self) -> dict[int, int]:
        """Attention-layer index -> its number of query heads (0 for a layer pruned empty)."""
        return {index: int(array.shape[0]) for index, array in self.keys.items()}

    def summary(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, name`, `confidence` (mean over queries of the largest weight,
        Voita et al. 2019) and `topk_mass` (mean over queries of the mass the kept keys hold)."""
        confidence, kept = [], []
        for layer, head in zip(self.heads["layer"], self.heads["head"]):
            confidence.append(float(self.weights[layer][head, :, 0].mean()))
            kept.append(float(self.weights[layer][head].sum(-1).mean()))
        return self.heads.assign(confidence=confidence, topk_mass=kept)

    def token_table(self) -> pd.DataFrame:
        return pd.DataFrame({"position": range(len(self.tokens)), "token_id": self.token_ids, "token": self.tokens})


def text_tokens(loaded, text: str, max_tokens: int | None = None) -> tuple[list[int], int]:
    """(token ids of `text` as the tokenizer writes them by default, BOS included, cut to max_tokens; the count
    before the cut). max_tokens None: DEFAULT_SHOW_TOKENS capped by the model's positions."""
    if loaded.tokenizer is None:
        raise HeadlabError("the model has no tokenizer: show reads text")
    if not isinstance(text, str) or not text.strip():
        raise HeadlabError("text is empty: give a text to show")
    limit = loaded.max_positions
    if max_tokens is None:
        max_tokens = min(DEFAULT_SHOW_TOKENS, limit or DEFAULT_SHOW_TOKENS)
    if max_tokens < 1:
        raise HeadlabError(f"max_tokens={max_tokens} must be at least 1")
    if limit is not None and max_tokens > limit:
        raise HeadlabError(f"max_tokens={max_tokens} exceeds the model's maximum positions ({limit})")
    if max_tokens > MAX_TEXT_TOKENS:
        raise HeadlabError(f"max_tokens={max_tokens} is more than a page holds ({MAX_TEXT_TOKENS})")
    ids = list(loaded.tokenizer(text)["input_ids"])
    if not ids:
        raise HeadlabError(f"text {text[:40]!r} has no tokens")
    return ids[:max_tokens], len(ids)


def _check_top_k(top_k: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise HeadlabError(f"top_k={top_k!r} must be a whole number from 1 to {MAX_TOP_K}")


class TopKCollector:
    """on_chunk for capture_attention: keeps the top-k keys of every query row of batch row 0 (one text), per layer,
    in preallocated arrays [H, T, k] (the only per-text memory: 8 bytes x H x T x k per layer)."""

    def __init__(self, layers, tokens: int, top_k: int):
        self.k = min(top_k, tokens)
        self.keys = {layer.index: np.full((layer.num_heads, tokens, self.k), -1, np.int32) for layer in layers}
        self.weights = {layer.index: np.zeros((layer.num_heads, tokens, self.k), np.float32) for layer in layers}
        self.rest = {layer.index: np.zeros((layer.num_heads, tokens), np.float32) for layer in layers}

    def on_chunk(self, chunk: AttentionChunk) -> None:
        probs = chunk.probs[0].float()  # [H, c, Tk]
        H, c, Tk = probs.shape
        if H == 0:
            return
        k = min(self.k, Tk)
        values, indices = torch.topk(probs, k, dim=-1, sorted=True)  # [H, c, k]
        values = values.cpu()
        indices = indices.to(torch.int32).cpu()
        # A key the query cannot see has weight exactly 0 (its logit was finfo.min): not a kept key; rows of the
        # causal start see fewer than k keys.
        present = values > 0
        index, rows = chunk.layer.index, slice(chunk.start, chunk.start + c)
        self.weights[index][:, rows, :k] = torch.where(present, values, 0.0).numpy()
        self.keys[index][:, rows, :k] = torch.where(present, indices, -1).numpy()
        total = probs.sum(-1).cpu()  # [H, c]: 1, less the sink mass with attention sinks
        self.rest[index][:, rows] = (total - values.sum(-1)).clamp_min(0.0).numpy()


def attention_topk(
    loaded,
    text: str,
    *,
    top_k: int = DEFAULT_TOP_K,
    max_tokens: int | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> TopKAttention:
    """The top-k keys per query of every head of `loaded` on `text` (one forward pass under the attention capture,
    `chunk_size` query rows at a time). The text is cut to `max_tokens` tokens (default 2,048, capped by the
    model's positions); meta records the count before the cut."""
    _check_top_k(top_k)
    ids, total = text_tokens(loaded, text, max_tokens)
    layers = loaded.layers
    collector = TopKCollector(layers, len(ids), top_k)
    input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    with torch.no_grad(), capture_attention(loaded.model, layers, collector.on_chunk, None, chunk_size):
        loaded.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    rows = [(layer.index, h, layer.kv_head_of(h), head_name(layer.index, h)) for layer in layers
            for h in range(layer.num_heads)]  # fmt: skip
    heads = pd.DataFrame(rows, columns=["layer", "head", "kv_head", "name"])
    tokens = [loaded.tokenizer.decode([token]) for token in ids]
    meta = {
        "tokens": len(ids),
        "text_tokens": total,
        "truncated": total > len(ids),
        "top_k": collector.k,
        "chunk_size": chunk_size,
        "layers": [
            {"layer": layer.index, "block": layer.block, "heads": layer.num_heads, "kv_heads": layer.num_kv_heads}
            for layer in layers
        ],
        "definition": "keys(i) = the k largest softmax(q_i K^T * scaling + mask)_j; rest(i) = sum_j A_ij - kept",
    }
    return TopKAttention(tokens, ids, heads, collector.k, collector.keys, collector.weights, collector.rest, meta)


__all__ = ["TopKAttention", "TopKCollector", "attention_topk", "text_tokens"]
