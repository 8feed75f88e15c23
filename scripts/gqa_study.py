#!/usr/bin/env python
"""GQA conversion study: what sharing key/value heads costs each model, in perplexity per KV-cache byte saved.

For every model given on the command line: every reachable KV-head count (the query heads, the current count and its
divisors) x grouping (contiguous, similarity) x pooling rule (headlab.kv.gqa.gqa_sweep: mean pooling as in Ainslie et
al. 2023, no uptraining), with perplexity on the eval split and KV-cache bytes per token measured from a real cache.
Models whose architecture cannot hold fewer KV heads (GPT-2, OPT, ...) are skipped with a message. Writes, under
--out: one gqa-sweep directory per model, `study.csv` (all models, perplexity and KV bytes relative to the unchanged
model) and `study.png` (relative perplexity against the relative KV cache, one colour per model).

    python scripts/gqa_study.py                                         # embedded SmolLM2-135M (3 -> 1 KV heads)
    python scripts/gqa_study.py smollm2-135m Qwen/Qwen2.5-0.5B --pools mean,first --out gqa-study
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from headlab.cli.parsing import parse_list
from headlab.core.data import DEFAULT_CORPUS
from headlab.core.errors import HeadlabError
from headlab.core.tables import write_run
from headlab.kv import gqa
from headlab.kv import grouping as kv_grouping
from headlab.viz.plots import figure_bytes, plot_gqa_sweep, plot_study

sys.path.insert(0, str(Path(__file__).resolve().parent))  # study_common.py sits beside this script
from study_common import measure_models, run_script, slug, study_arguments, write_study  # noqa: E402

__all__ = ["main", "slug"]  # slug names the per-model directories; callers (tests) read them with it


def own_options(parser) -> None:
    parser.add_argument("--groupings", default="contiguous,similarity", help="KV groupings")
    parser.add_argument("--pools", default="mean", help="pooling rules: mean, first, random")


def arguments(argv=None):
    calibration = ("--calibration-tokens", "calibration tokens for similarity grouping")
    return study_arguments(__doc__, argv, "runs/gqa-study", own_options, calibration)


def write_model(directory: Path, run) -> None:
    """One gqa-sweep run directory: the model's sweep table (without the study's columns) and its figure."""
    frame, model_meta = run
    columns = [c for c in frame.columns if c not in ("model", "relative_perplexity", "setting")]
    figure = figure_bytes(plot_gqa_sweep(frame, frame["model"].iloc[0]))
    write_run(directory, {"sweep": frame[columns]}, model_meta, extra_files={"gqa_sweep.png": figure})


def main(argv=None) -> Path:
    args = arguments(argv)
    groupings = tuple(parse_list(args.groupings, str, "groupings", kv_grouping.GROUPINGS))
    pools = tuple(parse_list(args.pools, str, "pools", kv_grouping.POOLS))

    def measure(loaded, spec):
        if not loaded.adapter.supports_gqa:
            return f"{loaded.model.config.model_type} cannot hold fewer KV heads"
        frame, meta = gqa.gqa_sweep(
            loaded,
            groupings=groupings,
            pools=pools,
            data=args.data,
            max_tokens=args.eval_tokens,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            calibration_tokens=args.calibration_tokens,
            progress=not args.quiet,
        )
        base = frame.loc[frame["action"] == "keep"].iloc[0]
        frame = frame.assign(model=spec, relative_perplexity=frame["perplexity"] / base["perplexity"])
        frame["relative_kv_bytes"] = frame["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        frame["setting"] = (
            frame["grouping"].fillna(frame["action"]) + "/" + frame["pool"].fillna(frame["method"]).fillna("-")
        )
        best = frame.sort_values("relative_kv_bytes").iloc[0]
        print(
            f"{spec}: {int(base['kv_heads'])} -> {int(best['kv_heads'])} KV heads: "
            f"{best['relative_kv_bytes']:.0%} of the KV cache, {best['relative_perplexity']:.2f}x perplexity"
        )
        return frame, (frame, meta)

    measured = measure_models(args, measure)
    if not measured.tables:
        reasons = "; ".join(f"{k}: {v}" for k, v in measured.skipped.items())
        raise HeadlabError(f"none of the models can hold fewer KV heads: {reasons}")
    study = pd.concat(measured.tables, ignore_index=True)
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
        "skipped": measured.skipped,
        "data": args.data or DEFAULT_CORPUS,
        "groupings": groupings,
        "pools": pools,
        "eval_tokens": args.eval_tokens,
        "calibration_tokens": args.calibration_tokens,
        "seq_len": args.seq_len,
    }
    out = write_study(args, study, fig, meta, measured.runs, write_model)
    print(f"wrote {out}/study.csv, study.png and one gqa-sweep directory per model")
    return out


if __name__ == "__main__":
    run_script("gqa_study", main)
