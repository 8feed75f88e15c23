"""Quantized KV caches on the embedded model (`eval --kv-cache`): eval-split perplexity of the original (GQA, 3 KV
heads), its 3 -> 1 svd merge and MLA at the MQA budget (saved form: latent norm folded), each through the full
cache on the same chunked path (the reference) and through fp8, optimum-quanto int4 and HQQ int4/int8 caches, with
the cache bytes measured per window. What a quantized cache costs each layout, relative to its own full cache.
Needs the `kvquant` extra (optimum-quanto, hqq); a spec whose backend is missing is recorded as such.
HEADLAB_BENCH_KV_CACHE_MODELS=mla reruns some models and keeps the saved rows of the others."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # the recovery case builds the same rungs: reuse it

TITLE = "Quantized KV caches: perplexity of the original, a KV merge and MLA through each cache (`eval --kv-cache`)"
EVAL_TOKENS, SEQ_LEN, CHUNK = 2048, 512, 64
CACHES = ("full", "fp8", "quanto-int4", "quanto-int4-kivi", "hqq-int8", "hqq-int4")
MODELS = ("original", "svd", "mla")
LABELS = {"original": "original (GQA, 3 KV heads)", "svd": "3 -> 1 KV heads, svd merge",
          "mla": "MLA, MQA budget (latent norm folded)"}  # fmt: skip


def _model(name, teacher, corpus):
    from recovery import _edited

    if name == "original":
        return teacher
    edited = _edited(name, teacher, corpus, None)
    if name == "mla":  # as convert-mla saves it: the fold changes what the cache holds
        from headlab.kv.mla import fold_latent_norm

        fold_latent_norm(edited.model)
    return edited


def _kept_rows(models: list[str]) -> list[dict]:
    """The saved rows of the models this run does not measure (HEADLAB_BENCH_KV_CACHE_MODELS=mla reruns one)."""
    from benchmark import saved_result

    return [row for row in saved_result("kv_cache").get("rows", []) if row["model"] not in models]


def run(args) -> dict:
    import time

    import torch

    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.errors import HeadlabError
    from headlab.core.loading import load_model
    from headlab.measure.evaluate import perplexity

    corpus = load_corpus(None)
    teacher = load_model(None, device=args.device)
    text = TextSpec(corpus, split="eval", seq_len=SEQ_LEN, batch_size=1, max_tokens=EVAL_TOKENS)
    models = os.environ.get("HEADLAB_BENCH_KV_CACHE_MODELS", ",".join(MODELS)).split(",")
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "chunk": CHUNK, "caches": list(CACHES),
              "threads": torch.get_num_threads(), "load": list(os.getloadavg()), "rows": _kept_rows(models)}  # fmt: skip
    for name in models:
        model = _model(name, teacher, corpus)
        for cache in CACHES:
            start = time.perf_counter()
            try:
                measured = perplexity(model, text=text, kv_cache=cache, kv_chunk=CHUNK, progress=False)
            except HeadlabError as error:  # a backend not installed
                result["rows"].append({"model": name, "cache": cache, "missing": str(error)})
                continue
            row = {"model": name, "cache": cache, "perplexity": measured.perplexity,
                   "kv_cache_bytes": measured.kv_cache_bytes, "scored_tokens": measured.scored_tokens,
                   "seconds": time.perf_counter() - start}  # fmt: skip
            result["rows"].append(row)
            print(row, flush=True)
    return result


def markdown(r: dict) -> str:
    rows = [row for row in r["rows"] if "perplexity" in row]
    full = {row["model"]: row for row in rows if row["cache"] == "full"}
    lines = [
        f"Embedded SmolLM2-135M (float32, {r['threads']} threads, load averages "
        f"{', '.join(f'{x:.1f}' for x in r['load'])} at the start): perplexity on the first {r['eval_tokens']:,} "
        f"eval-split tokens in {r['seq_len']}-token windows, each fed {r['chunk']} tokens at a time through the cache "
        "(so later tokens read the quantized past); `full` is the same chunked path with transformers' plain cache. "
        "`vs full`: the perplexity over the same model's full-cache one. Bytes: the cache after a window's last "
        "chunk, measured from its storage.",
        "",
        "| model | cache | perplexity | vs full | KV cache per window | s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = full.get(row["model"])
        ratio = f"{row['perplexity'] / base['perplexity']:.4f}" if base else ""
        size = f"{row['kv_cache_bytes'] / 2**20:.2f} MiB" if row.get("kv_cache_bytes") else ""
        lines.append(f"| {LABELS.get(row['model'], row['model'])} | {row['cache']} | {row['perplexity']:.3f} | "
                     f"{ratio} | {size} | {row['seconds']:.0f} |")  # fmt: skip
    for row in r["rows"]:
        if "missing" in row:
            lines.append(f"\n{row['model']} / {row['cache']}: {row['missing']}")
    return "\n".join(lines)
