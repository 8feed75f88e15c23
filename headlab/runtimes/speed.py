"""Measured prefill and decode speed with a KV cache, peak memory and the KV-cache bytes actually held, per context
length and batch size, in transformers and in llama.cpp: where head pruning and KV reduction pay off.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.errors import HeadlabError
from headlab.core.fsio import check_out
from headlab.core.loading import LoadedModel, load_model, local_checkpoint
from headlab.core.model_names import DEFAULT_MODEL
from headlab.core.tables import write_run
from headlab.mechanisms.head_cache import HeadPolicyCache, StreamingHeadsLayer, cache_bytes, head_policy, policy_cache
from headlab.mechanisms.quantized_cache import check_kv_cache, new_kv_cache, quantized_cache_bytes
from headlab.runtimes.choices import RUNTIMES
from headlab.runtimes.gguf_export import export_gguf
from headlab.runtimes.llamacpp import Sequences, unavailable
from headlab.viz.plots import figure_bytes, plot_speed


@dataclass
class SpeedSpec:
    """What `measure_speed` runs. Points with more than `prefill_limit` tokens (context x batch) get a KV cache
    filled with random keys/values instead of a timed prefill (decode is still measured on a full cache): a
    bound for slow machines, recorded per row as cache_fill = "synthetic". 0 = always prefill."""

    contexts: tuple[int, ...] = (512, 2048, 8192)
    batches: tuple[int, ...] = (1, 8)
    decode_tokens: int = 16
    prefill_limit: int = 16384
    runtimes: tuple[str, ...] = RUNTIMES
    gguf_type: str = "f32"  # the llama.cpp copy is written in this type (f32 matches transformers' CPU weights)
    seed: int = 0
    kv_cache: str = "full"  # transformers' cache (headlab.mechanisms.choices.KV_CACHES); llama.cpp keeps its f16 cells

    def to_dict(self) -> dict:
        return asdict(self)


class PeakRSS:
    """Peak resident set size of this process while the block runs, sampled every `interval` s from /proc (ru_maxrss
    is a lifetime maximum and cannot show one measurement's peak). On CUDA, the allocator's peak instead."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval, self.peak = device, interval, 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_cache(loaded: LoadedModel, batch: int, context: int, generator: torch.Generator, cache):
    """`cache` (empty) filled with `context` random keys and values per layer in the model's per-layer shapes
    (adapter.cache_shapes: [B, G_l, T, D]; MLA's latent and rotary key): decoding cost depends on the cache's size,
    not on its values. A policy cache's streaming heads then drop what their sinks + window do not keep, as a
    prefill would."""
    for layer in loaded.layers:
        key_shape, value_shape = loaded.adapter.cache_shapes(layer, batch, context)  # MLA: the latent, the rotary key
        keys = torch.randn(key_shape, generator=generator, dtype=torch.float32).to(loaded.device, loaded.dtype)
        values = torch.randn(value_shape, generator=generator, dtype=torch.float32).to(loaded.device, loaded.dtype)
        block = getattr(layer.module, "layer_idx", layer.block)
        cache.update(keys, values, block)
        if isinstance(cache.layers[block], StreamingHeadsLayer):
            cache.layers[block].evict()
    return cache


class PointCache:
    """The cache a speed point decodes with: spec.kv_cache's (new_kv_cache), or with `policies` ({layer index:
    LayerStreaming}, the model running under head_policy) a HeadPolicyCache whose streaming heads store only sinks +
    window. `writing(cache)` is the context its forwards run in; `held(cache)` the bytes it stores."""

    def __init__(self, loaded: LoadedModel, spec: SpeedSpec, policies: dict | None = None):
        self.config, self.kv_cache = loaded.model.config, spec.kv_cache
        self.pure_keys = loaded.adapter.cache_pure_keys
        self.by_block = None
        if policies is not None:
            self.by_block = {layer.block: policies[layer.index] for layer in loaded.layers if layer.index in policies}

    def new(self):
        if self.by_block is None:
            return new_kv_cache(self.config, self.kv_cache, self.pure_keys)
        return HeadPolicyCache(self.config, self.by_block)

    def writing(self, cache):
        return contextlib.nullcontext() if self.by_block is None else policy_cache(cache)

    def held(self, cache) -> int:
        return quantized_cache_bytes(cache) if self.by_block is None else cache_bytes(cache)


@torch.no_grad()
def transformers_point(
    loaded: LoadedModel, context: int, batch: int, spec: SpeedSpec, caches: PointCache | None = None
) -> dict:
    """Prefill of context - decode_tokens tokens (timed, last-position logits only as in generation) or a synthetic
    cache of that length, then `decode_tokens` greedy steps of one token per sequence, so the cache ends holding
    `context` tokens; tokens/s = tokens processed / wall time. The cache is `caches`' (default spec.kv_cache's;
    quantized: the prefill writes it quantized, every decode step reads it back), its bytes what it stores."""
    model, device = loaded.model, loaded.device
    caches = caches or PointCache(loaded, spec)
    context = context - spec.decode_tokens  # tokens in the cache before decoding
    generator = torch.Generator().manual_seed(spec.seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (batch, context), generator=generator).to(device)  # [B, C]
    fill = "prefill" if not spec.prefill_limit or batch * context <= spec.prefill_limit else "synthetic"
    with PeakRSS(device) as peak:
        prefill_s = None
        if fill == "prefill":
            _sync(device)
            start = time.perf_counter()
            cache = caches.new()
            with caches.writing(cache):
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            _sync(device)
            prefill_s = time.perf_counter() - start
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # the model wrote `cache` in place
        else:
            cache, token = synthetic_cache(loaded, batch, context, generator, caches.new()), ids[:, -1:]
        position = torch.full((batch, 1), context, dtype=torch.long, device=device)
        _sync(device)
        start = time.perf_counter()
        with caches.writing(cache):
            for step in range(spec.decode_tokens):
                out = model(input_ids=token, cache=cache, position_ids=position + step, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)  # the model wrote `cache` in place
        _sync(device)
        decode_s = time.perf_counter() - start
    held = caches.held(cache)
    return {
        "kv_cache": spec.kv_cache,
        "cache_fill": fill,
        "prefill_tokens_per_s": batch * context / prefill_s if prefill_s else math.nan,
        "decode_tokens_per_s": batch * spec.decode_tokens / decode_s,
        "decode_ms_per_step": 1000 * decode_s / spec.decode_tokens,
        "kv_cache_bytes": held,
        "kv_cache_note": f"held after {context + spec.decode_tokens} tokens (prefill {context})",
        "peak_memory_bytes": peak.peak,
    }


def llamacpp_point(gguf_path: Path, kv_per_token: int, context: int, batch: int, spec: SpeedSpec, vocab: int) -> dict:
    """llama.cpp with `batch` sequences (headlab.runtimes.llamacpp.Sequences: one KV stream each): every sequence is filled
    with context - decode_tokens - 1 tokens by a timed prefill (above prefill_limit tokens, only the first sequence
    is prefilled and copied into the others: cache_fill "copied", the same cells and so the same decode cost), then
    one untimed step (it carries out the copies), then `decode_tokens` timed steps of one token per sequence, so the
    caches end holding `context` tokens. llama.cpp allocates the cells for the whole context up front (f16)."""
    filled = context - spec.decode_tokens - 1
    generator = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(vocab, (batch, filled), generator=generator).tolist()
    copied = batch > 1 and bool(spec.prefill_limit) and batch * filled > spec.prefill_limit
    prefilled = 1 if copied else batch
    with PeakRSS(torch.device("cpu")) as peak:
        runner = Sequences(gguf_path, per_sequence=context, count=batch)
        try:
            start = time.perf_counter()
            for seq in range(prefilled):
                runner.prefill(seq, ids[seq])
            prefill_s = time.perf_counter() - start
            for seq in range(prefilled, batch):
                runner.copy(0, seq)
            tokens = [row[-1] for row in ids]  # which tokens are decoded does not change the cost of a step
            runner.step(tokens, filled)
            start = time.perf_counter()
            for step in range(spec.decode_tokens):
                runner.step(tokens, filled + 1 + step)
            decode_s = time.perf_counter() - start
            cells = runner.cells
        finally:
            runner.close()
    return {
        "kv_cache": "f16 (llama.cpp)",
        "cache_fill": "copied" if copied else "prefill",
        "prefill_tokens_per_s": prefilled * filled / prefill_s,
        "decode_tokens_per_s": batch * spec.decode_tokens / decode_s,
        "decode_ms_per_step": 1000 * decode_s / spec.decode_tokens,
        "kv_cache_bytes": kv_per_token * cells,
        "kv_cache_note": f"allocated: {cells} cells over {batch} sequence(s) (f16)",
        "peak_memory_bytes": peak.peak,
    }


def check_contexts(limit: int | None, spec: SpeedSpec, label: str) -> None:
    """One line when a context exceeds the model's positions, or leaves no prefill before the decoded tokens."""
    if limit is not None and max(spec.contexts) > limit:
        raise HeadlabError(
            f"context {max(spec.contexts)} exceeds {label}'s maximum positions ({limit}); pass shorter contexts="
        )
    if min(spec.contexts) <= spec.decode_tokens:
        raise HeadlabError(
            f"context {min(spec.contexts)} must exceed decode_tokens={spec.decode_tokens} (the cache ends at the "
            "context length)"
        )


@contextlib.contextmanager
def _gguf_copy(loaded: LoadedModel, spec: SpeedSpec):
    """The model exported to a temporary GGUF file for llama.cpp (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="headlab-speed-") as tmp:
        path = Path(tmp) / "model.gguf"
        export_gguf(loaded, path, outtype=spec.gguf_type, progress=False)
        yield path


def measure_model(loaded: LoadedModel, label: str, spec: SpeedSpec, progress: bool = True, policy=None) -> pd.DataFrame:
    """Every (runtime, context, batch) point for one model: a tidy table, one row per point. With `policy` (a
    headlab.kv.policy.CachePolicy), transformers also decodes under it, from a cache whose streaming heads store only
    sinks + window: rows labelled "<label> + kv-policy"."""
    check_contexts(loaded.max_positions, spec, label)
    policies = policy.layers(loaded) if policy is not None else None  # refuses a policy for another layout
    rows = []
    base = {
        "model": label,
        "query_heads": sum(layer.num_heads for layer in loaded.layers),
        "kv_heads": sum(layer.num_kv_heads for layer in loaded.layers),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
    }
    points = [(c, b) for c in spec.contexts for b in spec.batches]
    for context, batch in tqdm(points, desc=f"speed {label} transformers", disable=not progress, unit="point"):
        rows.append(
            {
                **base,
                "runtime": "transformers",
                "context": context,
                "batch": batch,
                **transformers_point(loaded, context, batch, spec),
            }
        )
    if policies is not None:
        caches = PointCache(loaded, spec, policies)
        with head_policy(loaded.model, loaded.layers, policies):
            for context, batch in tqdm(points, desc=f"speed {label} + kv-policy", disable=not progress, unit="point"):
                point = transformers_point(loaded, context, batch, spec, caches)
                rows.append({**base, "model": f"{label} + kv-policy", "runtime": "transformers", "context": context,
                             "batch": batch, **point, "kv_cache": "kv-policy"})  # fmt: skip
    if "llama.cpp" in spec.runtimes and not unavailable():
        # f16 cells; MLA: the latent and rotary key only (measured: llama.cpp keeps no separate V for deepseek2)
        kv_per_token = sum(loaded.adapter.kv_cache_numbers(layer) * 2 for layer in loaded.layers)
        vocab = loaded.model.config.get_text_config().vocab_size
        with _gguf_copy(loaded, spec) as path:
            for context, batch in tqdm(points, desc=f"speed {label} llama.cpp", disable=not progress, unit="point"):
                point = llamacpp_point(path, kv_per_token, context, batch, spec, vocab)
                rows.append(
                    {
                        **base,
                        "runtime": "llama.cpp",
                        "dtype": spec.gguf_type,
                        "device": "cpu",
                        "context": context,
                        "batch": batch,
                        **point,
                    }
                )
    return pd.DataFrame(rows)


def relative_to_first(table: pd.DataFrame) -> pd.DataFrame:
    """Add decode_speedup and kv_ratio: each model's decode tokens/s and KV bytes over the first model's at the
    same runtime, context and batch."""
    first = table["model"].iloc[0]
    keys = ["runtime", "context", "batch"]
    reference = table[table["model"] == first][[*keys, "decode_tokens_per_s", "kv_cache_bytes"]]
    joined = table.merge(reference, on=keys, how="left", suffixes=("", "_reference"))
    table = table.copy()
    # a left merge keeps the table's row order (not its index): assign by position
    table["decode_speedup"] = (joined["decode_tokens_per_s"] / joined["decode_tokens_per_s_reference"]).to_numpy()
    table["kv_ratio"] = (joined["kv_cache_bytes"] / joined["kv_cache_bytes_reference"]).to_numpy()
    return table


def _label(spec: str | None) -> str:
    return Path(spec).name if spec and Path(spec).expanduser().exists() else (spec or DEFAULT_MODEL)


def _check_positions_first(models: list[str | None], spec: SpeedSpec) -> None:
    """Refuse a too-long context before any model is measured (configs only, for local checkpoints)."""
    # Deferred for start-up time: AutoConfig loads transformers' model registries, which `--help` does not need.
    from transformers import AutoConfig

    for model in models:
        try:
            config = AutoConfig.from_pretrained(local_checkpoint(model)).get_text_config()
        except (HeadlabError, OSError, ValueError):
            continue  # hub ids and GGUF files are checked after loading, before their first measurement
        limit = getattr(config, "max_position_embeddings", None)
        check_contexts(limit if isinstance(limit, int) else None, spec, _label(model))


def check_policy_cache(kv_cache: str) -> None:
    """A KV-cache policy decodes from headlab's own cache (HeadPolicyCache): refuse a quantized --kv-cache beside it."""
    if kv_cache != "full":
        raise HeadlabError("--kv-policy decodes from headlab's policy cache: not with --kv-cache")


def run_speed(
    models: list[str | None],
    spec: SpeedSpec,
    *,
    device: str = "auto",
    dtype: str | None = None,
    out: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    policy=None,
) -> tuple[pd.DataFrame, Path | None]:
    """Measure every model (loaded one at a time) and write the table, metadata and the decode plot to `out`; with
    `policy` (CachePolicy) each model also under that per-KV-head cache policy (measure_model)."""
    check_out(out, overwrite)
    check_kv_cache(spec.kv_cache)
    if policy is not None:
        check_policy_cache(spec.kv_cache)
    _check_positions_first(models, spec)
    frames = []
    for model in models:
        loaded = load_model(model, device=device, dtype=dtype)
        frames.append(measure_model(loaded, _label(model), spec, progress=progress, policy=policy))
        del loaded
    table = relative_to_first(pd.concat(frames, ignore_index=True))
    if out is None:
        return table, None
    figure = plot_speed(table, "decode speed with a KV cache")
    png = figure_bytes(figure)
    plt.close(figure)
    meta = {"command": "speed", "models": [_label(m) for m in models], "spec": spec.to_dict()}
    if policy is not None:
        meta["kv_policy"] = {"sinks": policy.sinks, "window": policy.window, "context": policy.context,
                             "streaming_kv_heads": int((policy.table["policy"] == "streaming").sum())}  # fmt: skip
    write_run(Path(out), {"speed": table}, meta, overwrite=overwrite, extra_files={"speed.png": png})
    return table, Path(out) / "speed.png"
