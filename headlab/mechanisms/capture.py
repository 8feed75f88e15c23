"""Capture of attention probabilities in one attention computation: a transformers attention function that hands
softmax(QK^T * scale + mask) to a callback in bounded query chunks (no T x T map outlives its chunk) and, where
measured faster, computes the layer's output from those chunks (probabilities x V) instead of calling sdpa again.

The function is registered with transformers' AttentionInterface (and sdpa's mask function with
AttentionMaskInterface under the same name, so layers receive exactly the mask sdpa would get). `capture_attention`
switches a model to it and restores the original implementation on exit, also after an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headlab.core.arch import AttentionLayer
from headlab.core.errors import HeadlabError
from headlab.mechanisms.choices import DEFAULT_CHUNK

FUNCTION_NAME = "headlab_capture"  # must not contain "sdpa": transformers would run its sdpa fallback checks on it
# Where a captured layer's output comes from. "chunks": probabilities x V from the chunks the statistics read, so
# attention is computed once; "sdpa": the fused kernel beside the chunks (attention computed twice). "auto" takes
# the faster of the two as measured by scripts/bench_cases/stats.py per device type (docs/performance.md); a device
# type not measured yet keeps sdpa.
OUTPUTS = ("auto", "chunks", "sdpa")
# Device types where the chunked output measured faster than sdpa beside the chunks (BENCHMARKS.md "Head
# statistics", `python scripts/benchmark.py --case stats`), 4 x 512 tokens, medians: 1.18x a plain forward against
# 1.30x for a second sdpa call on a 2-core AMD EPYC, 1.21x against 1.31x on a 2-core Intel Xeon. No GPU has been
# measured, so CUDA keeps sdpa until a run there says otherwise.
MEASURED_FASTER_FROM_CHUNKS: dict[str, bool] = {"cpu": True}

# id(attention module) -> (capture, layer); the attention interface is global, so dispatch is by module identity.
_ACTIVE: dict[int, tuple[AttentionCapture, AttentionLayer]] = {}


@dataclass
class AttentionChunk:
    """Attention weights of query rows [start, start + c) of one layer, with the visibility they were computed under.

    Rows of padding queries are present (their weights are meaningless) and flagged by `query_valid`. Tk may be cut
    short of the sequence: keys past it are invisible to every row of the chunk (their weights are 0).
    """

    layer: AttentionLayer
    # [B, H, c, Tk] float32 (float64 for a float64 model), rows sum to 1 (less the sink mass with attention sinks)
    probs: torch.Tensor
    visible: torch.Tensor  # [B, 1, c, Tk] bool: key j visible to query i (causal, padding, sliding window)
    start: int  # absolute index of the first query row
    query_valid: torch.Tensor  # [B, c] bool: the query is a real (non-padding) token
    token_valid: torch.Tensor  # [B, Tk] bool: the key is a real token
    # [B, H, c, Tk] the logits the softmax saw (finfo.min where not visible): with them ln p = scores - lse, so
    # entropy needs no second exponential pass over the chunk.
    scores: torch.Tensor | None = None
    sinks: bool = False  # learned sink logits took part in the softmax (rows sum to less than 1)

    @property
    def rows(self) -> torch.Tensor:
        """Absolute query indices of the chunk's rows, [c]."""
        return torch.arange(self.start, self.start + self.probs.shape[2], device=self.probs.device)


def _visibility(mask, module, kwargs, Tq, Tk, device) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(visible [B|1, 1|H, Tq, Tk] bool, additive float bias or None) for the mask transformers passed.

    sdpa's mask function returns None for a pure causal (or unpadded bidirectional) batch and lets the kernel use
    is_causal; the same rule as sdpa_attention_forward decides which of the two the None stands for. The third
    value says the visibility is the plain causal pattern.
    """
    if mask is None:
        is_causal = kwargs.get("is_causal")
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if is_causal and Tq > 1:
            rows = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)  # sdpa aligns causal masks upper-left
            return (rows >= torch.arange(Tk, device=device)[None, :])[None, None], None, True
        return torch.ones(1, 1, Tq, Tk, dtype=torch.bool, device=device), None, False
    if mask.dtype == torch.bool:
        return mask, None, False
    # A float mask is additive (0 where visible, a large negative number where not).
    bias = mask.to(torch.promote_types(mask.dtype, torch.float32))
    return bias > torch.finfo(torch.float32).min / 2, bias, False


def _last_key(seen: torch.Tensor, causal: bool, unmasked: bool, causal_end: int) -> int:
    """1 + the last key index any row of the chunk sees ([B|1, 1|H, c, Tk] visibility): keys after it (the causal
    future) are skipped, about half the work."""
    Tk = seen.shape[-1]
    if causal:
        return min(Tk, causal_end)
    if unmasked:
        return Tk
    columns = seen.any(-2).flatten(0, -2).any(0).nonzero()  # visible key indices of the chunk
    return int(columns.max()) + 1 if len(columns) else 1


def _hide(scores: torch.Tensor, hidden: torch.Tensor) -> None:
    """Set scores [B, H, c, Tk'] of hidden keys to finfo.min, in place. finfo.min, not -inf: rows with no visible key
    (padding queries) stay finite instead of NaN. Only columns from the first hidden one are written: for a causal
    chunk that is its diagonal block."""
    columns = hidden.flatten(0, -2).any(0).nonzero()  # hidden key indices of the chunk
    if len(columns):
        first = int(columns.min())
        scores[..., first:].masked_fill_(hidden[..., first:], torch.finfo(scores.dtype).min)


def output_from_chunks(output: str, device: torch.device) -> bool:
    """Whether a captured layer's output is probabilities x V from the chunks (True) or a second sdpa call."""
    if output not in OUTPUTS:
        raise HeadlabError(f"unknown attention output source {output!r}; use one of {', '.join(OUTPUTS)}")
    if output == "auto":
        return MEASURED_FASTER_FROM_CHUNKS.get(device.type, False)
    return output == "chunks"


def _attention_function(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: sdpa for the output, plus the chunked probabilities for captured layers."""
    entry = _ACTIVE.get(id(module))
    if entry is None:  # a module headlab does not analyse (e.g. a vision tower): plain sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    capture, layer = entry
    return capture.forward(layer, module, query, key, value, attention_mask, kwargs)


def register() -> str:
    """Register headlab's attention function and sdpa's mask function under FUNCTION_NAME (idempotent)."""
    # Deferred for start-up time: both pull in transformers' modeling_utils, which the commands that import this
    # module only need once they load a model.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FUNCTION_NAME, _attention_function)
    AttentionMaskInterface.register(FUNCTION_NAME, sdpa_mask)
    return FUNCTION_NAME


@dataclass(slots=True)
class _LayerCall:
    """One captured layer call made ready for chunking: the operands in the working dtype (float32, float64 for a
    float64 model, so the statistics keep their float32 error against float64 whatever the model's dtype;
    docs/performance.md), the visibility, and which queries and keys are real tokens."""

    q: torch.Tensor  # [B, G, R, Tq, D] with the scale folded in; query head h = g * R + r reads KV head g
    k: torch.Tensor  # [B, G, D, Tk]
    v: torch.Tensor | None  # [B, G, Tk, Dv] when the output comes from the chunks, else None
    value_dtype: torch.dtype
    work: torch.dtype
    visible: torch.Tensor  # [B|1, 1|H, Tq, Tk] bool
    hidden: torch.Tensor  # ~visible, once per call rather than per chunk
    bias: torch.Tensor | None  # additive float mask
    causal: bool  # the visibility is the plain causal pattern
    unmasked: bool  # transformers passed no mask
    offset: int  # Tk - Tq
    softcap: float | None
    sinks: torch.Tensor | None  # [H] learned sink logits
    position_bias: torch.Tensor | None
    query_valid: torch.Tensor  # [B, Tq] bool
    token_valid: torch.Tensor  # [B, Tk] bool

    @classmethod
    def prepare(cls, module, query, key, value, attention_mask, kwargs, from_chunks: bool, grad: bool) -> _LayerCall:
        """The call's operands and masks from transformers' arguments (query [B, H, Tq, D], key/value
        [B, G, Tk, D]); `grad`: keep the graph to the inputs (gradients through the chunked output)."""
        B, H, Tq, D = query.shape
        G, Tk = key.shape[1], key.shape[2]
        work = torch.promote_types(query.dtype, torch.float32)
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else D**-0.5  # sdpa's default
        visible, bias, causal = _visibility(attention_mask, module, kwargs, Tq, Tk, query.device)
        offset = Tk - Tq
        # A real token always sees itself, so the mask's diagonal tells which tokens are padding.
        diagonal = visible[:, 0].diagonal(offset=offset, dim1=-2, dim2=-1)  # [B|1, Tq]
        query_valid = diagonal.expand(B, Tq)  # [B, Tq]
        token_valid = torch.ones(B, Tk, dtype=torch.bool, device=query.device)  # [B, Tk]
        token_valid[:, offset:] = query_valid
        R = H // G  # repeat_kv: query head h reads KV head h // R
        # Scale folded into the queries: one pass over [B, H, T, D] instead of one per score chunk.
        q = (query if grad else query.detach()).to(work).reshape(B, G, R, Tq, D) * scaling  # [B, G, R, Tq, D]
        k = (key if grad else key.detach()).to(work).transpose(-1, -2)  # [B, G, D, Tk]
        v = (value if grad else value.detach()).to(work) if from_chunks else None  # [B, G, Tk, Dv]
        return cls(
            q, k, v, value.dtype, work, visible, ~visible, bias, causal, attention_mask is None, offset,
            kwargs.get("softcap"), kwargs.get("s_aux"), kwargs.get("position_bias"), query_valid, token_valid,
        )  # fmt: skip

    def weights(
        self, start: int, stop: int, end: int, causal_block: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, probabilities) [B, H, c, end] of query rows [start, stop) over keys [0, end): softmax of the
        scaled logits, soft-capped, plus mask and position biases, hidden keys at finfo.min, with the sink logit.
        causal_block: [>= c, >= c] 0 on and below the diagonal, finfo.min above, for a causal mask; else None."""
        B, G, R, _, D = self.q.shape
        H, c = G * R, stop - start
        # Query heads of one KV group side by side: [B, G, R*c, D] @ [B, G, D, Tk'] with no copy of K per head.
        scores = (self.q[:, :, :, start:stop].reshape(B, G, R * c, D) @ self.k[..., :end]).view(B, H, c, end)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.bias is not None:
            scores = scores + self.bias[..., start:stop, :end]
        if self.position_bias is not None:
            scores = scores + self.position_bias[..., start:stop, :end].to(self.work)
        if causal_block is not None:
            # A causal chunk hides the strict upper triangle of its diagonal block. Adding a cached 0 / finfo.min
            # block is one vectorised pass; masked_fill_ with the broadcast bool mask measured 5x slower on CPU
            # (Intel Xeon, 4 x 9 x 128 x 128). finfo.min + s rounds to finfo.min for any |s| < 1e31.
            first = start + self.offset
            scores[..., first:end] += causal_block[: stop - start, : end - first]
        else:
            _hide(scores, self.hidden[..., start:stop, :end])
        if self.sinks is not None:
            sink = self.sinks.to(self.work).reshape(1, H, 1, 1).expand(B, H, c, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, H, c, Tk']
        else:
            probs = torch.softmax(scores, dim=-1)  # [B, H, c, Tk']
        return scores, probs


class AttentionCapture:
    """Computes each captured layer's attention weights in query chunks and passes them to `on_chunk`.

    on_chunk(chunk: AttentionChunk) sees every chunk of every captured layer; on_output(layer, output [B, T, H, D],
    token_valid [B, T]) sees each layer's attention output before the output projection (and before any output
    gate, which gated families apply after the attention function). `output`: where the layer's output comes from
    (OUTPUTS; soft-capped and sink layers always take it from the chunks, which sdpa cannot compute).

    `rows` (set per batch, [T] bool; None: every row): the query rows `on_chunk` needs. Chunks holding none of them
    are not computed and the output comes from sdpa, so a pass that reads a few rows of a long sequence (the
    retrieval score's answer rows) costs about a plain forward instead of every T x T map. Soft-capped and sink
    layers still compute every chunk.
    """

    def __init__(
        self,
        on_chunk: Callable[[AttentionChunk], None],
        on_output: Callable[[AttentionLayer, torch.Tensor, torch.Tensor], None] | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        output: str = "auto",
    ):
        if chunk_size < 1:
            raise HeadlabError(f"chunk size must be positive, got {chunk_size}")
        output_from_chunks(output, torch.device("cpu"))  # validates the name before any forward
        self.on_chunk, self.on_output, self.chunk_size, self.output = on_chunk, on_output, chunk_size, output
        self.calls = 0  # layer calls captured (tests check the function really ran)
        self.rows: torch.Tensor | None = None
        self.chunks_run = 0  # chunks computed (tests check that `rows` skips the others)
        self._blocks: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> causal diagonal block

    def forward(self, layer, module, query, key, value, attention_mask, kwargs):
        """One layer call: the chunked weights to `on_chunk`, the output from the chunks or from sdpa beside them
        (decoding steps against a cache go straight to sdpa)."""
        Tq, Tk = query.shape[2], key.shape[2]
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        # sdpa has no soft-capping or sinks: those layers get their output from the chunked weights (eager's math).
        exact = softcap is not None or sinks is not None
        if Tq != Tk and not exact:
            # Decoding against a cache: the statistics are defined on full forward passes only.
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        self.calls += 1
        starts = self._chunk_starts(Tq, None if exact else self.rows)
        every_chunk = len(starts) == len(range(0, Tq, self.chunk_size))
        from_chunks = exact or (every_chunk and output_from_chunks(self.output, query.device))
        grad = torch.is_grad_enabled() and from_chunks
        with torch.set_grad_enabled(grad):
            call = _LayerCall.prepare(module, query, key, value, attention_mask, kwargs, from_chunks, grad)
            outputs = self._run_chunks(layer, call, starts)
        if from_chunks:
            attn_output = torch.cat(outputs, dim=2).transpose(1, 2).to(value.dtype).contiguous()  # [B, Tq, H, D]
        else:
            attn_output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if self.on_output is not None and Tq == Tk:
            with torch.no_grad():
                self.on_output(layer, attn_output.detach(), call.query_valid)
        return attn_output, None

    def _causal_block(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[chunk, chunk] additive causal mask of a diagonal block (0 on and below the diagonal, finfo.min above),
        made once per dtype and device."""
        key = (dtype, device)
        if key not in self._blocks:
            block = torch.full((self.chunk_size, self.chunk_size), torch.finfo(dtype).min, dtype=dtype, device=device)
            self._blocks[key] = block.triu_(1)
        return self._blocks[key]

    def _chunk_starts(self, Tq: int, rows: torch.Tensor | None) -> list[int]:
        """First rows of the query chunks to compute: every chunk, or those holding a row of `rows` ([Tq] bool)."""
        starts = list(range(0, Tq, self.chunk_size))
        if rows is None:
            return starts
        if rows.shape != (Tq,):
            raise HeadlabError(f"the capture's rows have shape {tuple(rows.shape)}, the call has {Tq} queries")
        wanted = rows.detach().cpu()  # one host copy per call, not a device sync per chunk
        return [start for start in starts if bool(wanted[start : start + self.chunk_size].any())]

    def _run_chunks(self, layer: AttentionLayer, call: _LayerCall, starts: list[int]) -> list[torch.Tensor]:
        """The query chunks of one call that begin at `starts`: their weights to `on_chunk`; returns the chunks'
        outputs [B, H, c, D] when the layer's output comes from them (else an empty list)."""
        B, G, R, Tq, D = call.q.shape
        H, Tk = G * R, call.k.shape[-1]
        outputs = []
        block = self._causal_block(call.work, call.q.device) if call.causal else None
        for start in starts:
            self.chunks_run += 1
            stop = min(start + self.chunk_size, Tq)
            c = stop - start
            seen = call.visible[..., start:stop, :]  # [B|1, 1|H, c, Tk]
            end = _last_key(seen, call.causal, call.unmasked, stop + call.offset)
            seen = seen[..., :end]
            scores, probs = call.weights(start, stop, end, block)  # each [B, H, c, Tk']
            if call.v is not None:
                # Rounded to the value dtype first, as eager attention does (a no-op for float32 models).
                weights = probs.to(call.value_dtype).to(call.work).reshape(B, G, R * c, end)
                # Dv, the value width, may differ from the query/key width D (MLA: qk_nope + qk_rope vs v_head_dim).
                outputs.append((weights @ call.v[:, :, :end]).view(B, H, c, call.v.shape[-1]))  # [B, H, c, Dv]
                probs, scores = probs.detach(), scores.detach()
            if Tq == Tk:
                chunk = AttentionChunk(
                    layer,
                    probs,
                    seen.expand(B, -1, -1, -1),
                    start,
                    call.query_valid[:, start:stop],
                    call.token_valid[:, :end],
                    scores,
                    call.sinks is not None,
                )
                with torch.no_grad():
                    self.on_chunk(chunk)
        return outputs


def _configs(model: nn.Module) -> list:
    """Every config whose _attn_implementation the model's (sub)models read."""
    from transformers import PreTrainedModel  # deferred for start-up time: it loads transformers' modeling_utils

    seen, configs = set(), []
    pending = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        configs.append(config)
        pending += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if getattr(config, key, None)]
    return configs


@contextlib.contextmanager
def capture_attention(
    model: nn.Module,
    layers: list[AttentionLayer],
    on_chunk: Callable[[AttentionChunk], None],
    on_output: Callable | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    output: str = "auto",
):
    """Run `model` with headlab's attention function on `layers`; yields the AttentionCapture.

    The model's original attention implementation (of every sub-config) is restored on exit, also after an
    exception. Layers not in `layers` run plain sdpa meanwhile.
    """
    capture = AttentionCapture(on_chunk, on_output, chunk_size, output)
    register()
    entries = [(layer, (capture, layer)) for layer in layers]
    with routed(model, FUNCTION_NAME, _ACTIVE, entries, "is already being captured; captures cannot nest"):
        yield capture


@contextlib.contextmanager
def routed(model: nn.Module, function_name: str, table: dict, entries, nested: str):
    """Run `model` with the registered attention function `function_name`, which dispatches by module identity
    through `table`: each (layer, entry) of `entries` is stored as table[id(layer.module)] for the block; modules not
    in it run plain sdpa. A layer already in `table` is refused ("layer i <nested>"). Every config's attention
    implementation and the table are restored on exit, also after an exception."""
    for layer, _ in entries:
        if id(layer.module) in table:
            raise HeadlabError(f"layer {layer.index} {nested}")
    saved = [(config, config._attn_implementation_internal) for config in _configs(model)]
    try:
        for layer, entry in entries:
            table[id(layer.module)] = entry
        model.set_attn_implementation(function_name)
        yield
    finally:
        for layer, _ in entries:
            table.pop(id(layer.module), None)
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


__all__ = [
    "AttentionCapture",
    "AttentionChunk",
    "FUNCTION_NAME",
    "OUTPUTS",
    "capture_attention",
    "output_from_chunks",
    "register",
    "routed",
]
