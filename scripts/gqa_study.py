#!/usr/bin/env python
"""GQA conversion study: what sharing key/value heads costs each model, in perplexity per KV-cache byte saved.

For every model given on the command line: every reachable KV-head count (the query heads, the current count and its
divisors) x grouping (contiguous, similarity) x pooling rule (headlab.gqa.gqa_sweep: mean pooling as in Ainslie et
al. 2023, no uptraining), with perplexity on the eval split and KV-cache bytes per token measured from a real cache.
Models whose architecture cannot hold fewer KV heads (GPT-2, OPT, ...) are skipped with a message. Writes, under
--out: one gqa-sweep directory per model, `study.csv` (all models, perplexity and KV bytes relative to the unchanged
model) and `study.png` (relative perplexity against the relative KV cache, one colour per model).

    python scripts/gqa_study.py                                         # embedded SmolLM2-135M (3 -> 1 KV heads)
    python scripts/gqa_study.py smollm2-135m Qwen/Qwen2.5-0.5B --pools mean,first --out gqa-study
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from headlab import gqa, kv_heads
from headlab.errors import HeadlabError
from headlab.fsio import check_out
from headlab.loading import DEFAULT_MODEL, load_model
from headlab.plots import figure_bytes, plot_gqa_sweep, plot_study
from headlab.report_text import parse_list
from headlab.tables import write_run


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL], help="model specs (hub id, directory, .gguf)")
    parser.add_argument("--data", default=None, help="corpus spec [default: embedded Python reference]")
    parser.add_argument("--groupings", default="contiguous,similarity", help="KV groupings")
    parser.add_argument("--pools", default="mean", help="pooling rules: mean, first, random")
    parser.add_argument("--eval-tokens", type=int, default=1024, help="eval-split tokens per perplexity")
    parser.add_argument("--calib-tokens", type=int, default=1024, help="calibration tokens for similarity grouping")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/gqa-study"))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec.strip("/")).strip("_") or "model"


def main(argv=None) -> Path:
    args = arguments(argv)
    groupings = tuple(parse_list(args.groupings, str, "groupings", kv_heads.GROUPINGS))
    pools = tuple(parse_list(args.pools, str, "pools", kv_heads.POOLS))
    check_out(args.out, args.overwrite)
    tables, runs, skipped = [], {}, {}
    for spec in args.models:
        loaded = load_model(spec, device=args.device)
        if not loaded.adapter.supports_gqa:
            skipped[spec] = f"{loaded.model.config.model_type} cannot hold fewer KV heads"
            print(f"{spec}: skipped ({skipped[spec]})")
            continue
        frame, meta = gqa.gqa_sweep(
            loaded,
            groupings=groupings,
            pools=pools,
            corpus=args.data,
            max_tokens=args.eval_tokens,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            calib_tokens=args.calib_tokens,
            progress=not args.quiet,
        )
        base = frame.loc[frame["action"] == "keep"].iloc[0]
        frame = frame.assign(model=spec, relative_perplexity=frame["perplexity"] / base["perplexity"])
        frame["relative_kv_bytes"] = frame["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        frame["setting"] = frame["grouping"].fillna(frame["action"]) + "/" + frame["pool"].fillna("-")
        tables.append(frame)
        runs[spec] = (frame, meta)
        best = frame.sort_values("relative_kv_bytes").iloc[0]
        print(
            f"{spec}: {int(base['kv_heads'])} -> {int(best['kv_heads'])} KV heads: "
            f"{best['relative_kv_bytes']:.0%} of the KV cache, {best['relative_perplexity']:.2f}x perplexity"
        )
    if not tables:
        raise HeadlabError(
            "none of the models can hold fewer KV heads: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())
        )
    study = pd.concat(tables, ignore_index=True)
    study = study[study["same_as"].isna()]  # a repeated variant would sit on the row it repeats
    fig = plot_study(
        study.sort_values("relative_kv_bytes"),
        "relative_kv_bytes",
        "KV-cache bytes per token / the model's own",
        style="setting",
        title="Sharing KV heads: perplexity relative to each unchanged model",
    )
    meta = {
        "models": args.models,
        "skipped": skipped,
        "data": args.data or "pydoc-topics",
        "groupings": groupings,
        "pools": pools,
        "eval_tokens": args.eval_tokens,
        "calib_tokens": args.calib_tokens,
        "seq_len": args.seq_len,
    }
    out = write_run(
        args.out, {"study": study}, meta, overwrite=args.overwrite, extra_files={"study.png": figure_bytes(fig)}
    )
    for spec, (frame, model_meta) in runs.items():
        columns = [c for c in frame.columns if c not in ("model", "relative_perplexity", "setting")]
        write_run(
            out / slug(spec),
            {"sweep": frame[columns]},
            model_meta,
            extra_files={"gqa_sweep.png": figure_bytes(plot_gqa_sweep(frame, spec))},
        )
    print(f"wrote {out}/study.csv, study.png and one gqa-sweep directory per model")
    return out


if __name__ == "__main__":
    try:
        main()
    except HeadlabError as error:
        raise SystemExit(f"gqa_study: error: {error}") from None
