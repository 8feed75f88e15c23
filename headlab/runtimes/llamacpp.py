"""llama.cpp as a second runtime (the optional `llama-cpp-python` package, extra `llamacpp`): load an exported GGUF
file and compare its next-token log-probabilities with transformers' on the same token ids.
"""

from __future__ import annotations

import collections
import ctypes
import math
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from headlab.core.data import TextSpec, require_tokens, split_text, takes_text, tokenize
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.measure.evaluate import _prefix_token

INSTALL = "pip install llama-cpp-python  (or pip install 'headlab[llamacpp]'; builds llama.cpp from source)"
GGML_TYPE_F32 = 0  # ggml_type of an f32 KV cache: verification keeps the cache in full precision


def unavailable() -> str | None:
    """None when llama_cpp imports, else the reason (tests skip with it, commands refuse with it)."""
    try:
        import llama_cpp  # noqa: F401 - optional: the llamacpp extra may not be installed
    except Exception as error:  # noqa: BLE001 - a broken native build raises OSError, RuntimeError, ...
        return f"llama-cpp-python is not usable ({type(error).__name__}: {error}); {INSTALL}"
    return None


def require() -> None:
    reason = unavailable()
    if reason:
        raise HeadlabError(reason)


def threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def versions() -> dict:
    """What runs: llama-cpp-python's version, libllama's (`llama_version()`), and the ggml version and commit the
    library was built from (`ggml_commit()`: the llama.cpp checkout's short hash, "-dirty" when patched); a value
    the library does not export is None."""
    require()
    import llama_cpp  # optional: the llamacpp extra (require() said so above if missing)

    out = {"llama_cpp_python": getattr(llama_cpp, "__version__", None)}
    library = getattr(llama_cpp.llama_cpp, "_lib", None)  # libllama, through which ggml's symbols resolve
    for key, symbol in (("llama", "llama_version"), ("ggml", "ggml_version"), ("commit", "ggml_commit")):
        try:
            function = getattr(library, symbol)
        except AttributeError:  # an older build without it (or no handle at all)
            out[key] = None
            continue
        function.argtypes, function.restype = [], ctypes.c_char_p
        value = function()
        out[key] = value.decode(errors="replace") if value else None
    return out


GGML_TYPES = {"F32": 0, "Q8_0": 8}  # ggml.h: enum ggml_type, the types quantize's overrides name


def quantize(source: Path, target: Path, ftype: str, nthread: int | None = None, tensor_types=None, imatrix=None):
    """llama.cpp's own quantizer, as `llama-quantize source target FTYPE` runs it: llama_model_quantize with file
    type LLAMA_FTYPE_MOSTLY_<ftype> and its per-tensor recipe (src/llama-quant.cpp); `nthread` defaults to the CPUs
    this process may use; `tensor_types` ({regex: ggml type name, e.g. "F32"}) overrides the recipe for the tensors
    whose names match (`llama-quantize --tensor-type PATTERN=TYPE`); `imatrix` ({GGUF tensor name: float32 [input
    features]}, the mean squares llama-quantize --imatrix reads from a file) weights each matrix's rounding, none when
    None. A failure is one line with llama.cpp's last error message."""
    require()
    import llama_cpp  # optional: the llamacpp extra (require() said so above if missing)
    from llama_cpp import _logger  # llama-cpp-python's log callback, put back afterwards

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads() if nthread is None else nthread
    tensor_types = tensor_types or {}
    overrides = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()  # NULL-pattern terminated
    for slot, (pattern, type_name) in zip(overrides, tensor_types.items()):
        slot.pattern, slot.type = pattern.encode(), GGML_TYPES[type_name]
    if tensor_types:
        params.tt_overrides = overrides
    if imatrix:  # a NULL-name terminated array of (name, data, size); `entries` keeps the buffers alive meanwhile
        entries = [(name.encode(), np.ascontiguousarray(values, dtype=np.float32)) for name, values in imatrix.items()]
        table = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for slot, (name, values) in zip(table, entries):
            slot.name, slot.size = name, values.size
            slot.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        params.imatrix = table
    recent: collections.deque[str] = collections.deque(maxlen=32)

    # llama.cpp logs a line per tensor: keep the last few (not echoed), to say why a quantization failed. Levels are
    # not used: ggml renumbered them (ERROR 3 -> 4) and llama-cpp-python still maps the old numbers.
    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        if text:
            recent.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        status = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(target), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if status != 0:
        failed = [line for line in recent if "failed to quantize:" in line]  # llama_model_quantize's own summary
        why = failed[-1].split("failed to quantize:", 1)[1] if failed else (recent[-1] if recent else "")
        why = " ".join(why.split()) or f"status {status}"
        raise HeadlabError(f"llama.cpp could not quantize to {ftype}: {why}")


def open_model(path: Path, n_ctx: int, *, logits_all: bool = False, f32_cache: bool = False, n_batch: int = 512):
    """A llama_cpp.Llama on `path` (CPU, quiet). f32_cache keeps K and V in float32 (llama.cpp's default is f16)."""
    require()
    from llama_cpp import Llama  # optional: the llamacpp extra (require() said so above if missing)

    kwargs = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if f32_cache else {}
    try:
        return Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=min(n_batch, n_ctx),
            n_ubatch=min(n_batch, n_ctx),
            n_threads=threads(),
            logits_all=logits_all,
            verbose=False,
            **kwargs,
        )
    except (ValueError, RuntimeError) as error:
        raise HeadlabError(f"llama.cpp cannot load {path}: {error}") from None


class Sequences:
    """A llama.cpp context holding `count` independent sequences of up to `per_sequence` tokens each, through
    llama-cpp-python's low-level batch API (the `Llama` class runs one sequence).

    kv_unified is off, so every sequence has its own KV stream and its attention reads only its own cells, as in
    transformers' batched cache; a decode step is one llama_decode of `count` tokens, one per sequence. Flash
    attention stays disabled, as in `open_model` (llama-cpp-python's default)."""

    def __init__(self, path: Path, per_sequence: int, count: int, n_batch: int = 512):
        require()
        import llama_cpp  # optional: the llamacpp extra (require() said so above if missing)
        from llama_cpp import _internals  # the model/context/batch wrappers `Llama` itself is built on
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # errors only, as Llama(verbose=False) sets it: llama.cpp logs every context it builds
        self._api = llama_cpp
        try:
            self._model = _internals.LlamaModel(
                path_model=str(path), params=llama_cpp.llama_model_default_params(), verbose=False
            )
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = per_sequence * count
            params.n_batch = params.n_ubatch = max(min(n_batch, per_sequence), count)
            params.n_seq_max = count
            params.kv_unified = False
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            params.n_threads = params.n_threads_batch = threads()
            self._context = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        except (ValueError, RuntimeError) as error:
            self.close()
            raise HeadlabError(f"llama.cpp cannot load {path}: {error}") from None
        self.count, self.n_batch = count, int(params.n_batch)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    @property
    def cells(self) -> int:
        """KV cells allocated over all sequences (llama.cpp pads each stream to a multiple of 256)."""
        return int(self._api.llama_n_ctx(self._context.ctx))

    def _decode(self, entries: list[tuple[int, int, int]]) -> None:
        """One llama_decode of (token, position, sequence) entries; logits only for each sequence's last entry."""
        batch = self._batch
        batch.n_tokens = len(entries)
        last = {seq: i for i, (_, _, seq) in enumerate(entries)}
        for i, (token, position, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = last[seq] == i
        status = self._api.llama_decode(self._context.ctx, batch)
        if status != 0:
            raise HeadlabError(f"llama.cpp could not decode a batch of {len(entries)} tokens (status {status})")

    def prefill(self, seq: int, ids: list[int]) -> None:
        """Feed a sequence's tokens at positions 0.. in chunks of n_batch."""
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            self._decode([(token, start + i, seq) for i, token in enumerate(chunk)])

    def copy(self, source: int, target: int) -> None:
        """Give `target` a copy of `source`'s cache (a whole-stream buffer copy, carried out at the next decode)."""
        self._api.llama_memory_seq_cp(self._api.llama_get_memory(self._context.ctx), source, target, -1, -1)

    def step(self, tokens: list[int], position: int) -> None:
        """One decode step: tokens[s] appended to sequence s at `position`."""
        self._decode([(token, position, seq) for seq, token in enumerate(tokens)])

    def logits(self, seq: int) -> np.ndarray:
        """The logits [V] the last step computed for sequence `seq` (a copy: the next decode overwrites them)."""
        vocab = self._api.llama_vocab_n_tokens(self._api.llama_model_get_vocab(self._model.model))
        row = self._api.llama_get_logits_ith(self._context.ctx, seq)
        return np.ctypeslib.as_array(row, shape=(vocab,)).copy()

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            self._api.llama_batch_free(self._batch)
            self._batch = None
        for part in ("_context", "_model"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
                setattr(self, part, None)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@torch.no_grad()
def compare_logprobs(loaded: LoadedModel, gguf_path: Path, windows: list[torch.Tensor], progress: bool = False) -> dict:
    """Run each window of token ids through transformers and through llama.cpp (f32 KV cache, logits of every
    position) and compare: token perplexity exp(-mean log p(x_i | x_<i)) of each runtime over the same scored
    tokens, their relative difference, and the worst |logit difference| over every position and vocabulary entry."""
    longest = max(len(w) for w in windows)
    llm = open_model(gguf_path, n_ctx=longest, logits_all=True, f32_cache=True)
    nll = {"transformers": 0.0, "llama.cpp": 0.0}
    scored, worst, worst_logprob, largest = 0, 0.0, 0.0, 0.0
    try:
        for ids in tqdm(windows, desc="llama.cpp vs transformers", unit="window", disable=not progress):
            reference = loaded.model(input_ids=ids[None].to(loaded.device)).logits[0].double().cpu().numpy()  # [T, V]
            llm.reset()
            llm.eval(ids.tolist())
            got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [T, V]
            targets = ids[1:].numpy()
            for name, logits in (("transformers", reference), ("llama.cpp", got)):
                log_probs = _log_softmax(logits[:-1])
                nll[name] -= float(log_probs[np.arange(len(targets)), targets].sum())
            worst = max(worst, float(np.abs(got - reference).max()))
            worst_logprob = max(worst_logprob, float(np.abs(_log_softmax(got) - _log_softmax(reference)).max()))
            largest = max(largest, float(np.abs(reference).max()))
            scored += len(targets)
    finally:
        llm.close() if hasattr(llm, "close") else None
    ppl = {name: math.exp(total / scored) for name, total in nll.items()}
    return {
        "perplexity_transformers": ppl["transformers"],
        "perplexity_llamacpp": ppl["llama.cpp"],
        "relative_difference": abs(ppl["llama.cpp"] - ppl["transformers"]) / ppl["transformers"],
        "max_abs_logit_diff": worst,
        "max_abs_logprob_diff": worst_logprob,
        "max_abs_logit": largest,
        "scored_tokens": scored,
        "windows": len(windows),
        "kv_cache": "f32",
    }


def window_length(loaded: LoadedModel, seq_len: int) -> int:
    """The verification window: `seq_len` tokens, capped at the model's max positions (config
    max_position_embeddings) when it has them."""
    limit = loaded.max_positions
    return min(seq_len, int(limit)) if limit else seq_len


@takes_text(split="eval", max_tokens=512, seq_len=256)
def eval_windows(loaded: LoadedModel, data=None, *, text: TextSpec) -> list[torch.Tensor]:
    """Consecutive windows of the text's token ids (`data`, when given, is its corpus), each starting with the
    prefix token (BOS, else EOS) as in headlab's perplexity, so every text token is scored once. A window is at most
    the model's positions long (`window_length`): past them neither runtime computes what the model was made for."""
    if data is not None:
        text = text.but(data=data)
    corpus = text.corpus
    ids, _ = tokenize(loaded.tokenizer, split_text(corpus, text.split).text, text.max_tokens)
    require_tokens(ids, f"the {text.split} part of corpus {corpus.spec!r}")
    prefix = _prefix_token(loaded.tokenizer)
    body = window_length(loaded, text.seq_len) - (prefix is not None)
    if body < 1:
        raise HeadlabError(f"seq_len={text.seq_len}: a window needs at least 2 tokens (the prefix token and one more)")
    windows = []
    for start in range(0, len(ids), body):
        chunk = ids[start : start + body]
        if prefix is not None:
            chunk = torch.cat([torch.tensor([prefix]), chunk])
        if len(chunk) >= 2:
            windows.append(chunk)
    return windows
