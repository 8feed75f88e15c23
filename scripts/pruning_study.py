#!/usr/bin/env python
"""Pruning study: how much perplexity each model loses as its attention heads are pruned, in several orders.

For every model given on the command line: gradient importance on the calibration split, then perplexity on the eval
split with the lowest fraction f of heads removed, for each f and order (headlab.sweep.sweep). Writes, under --out:
one sweep run directory per model (sweep.csv/.parquet, meta.json, sweep.png), `study.csv` (all models, with
perplexity relative to each model's unpruned perplexity) and `study.png` (relative perplexity against the fraction
of heads pruned, one colour per model).

    python scripts/pruning_study.py                                     # embedded SmolLM2-135M
    python scripts/pruning_study.py smollm2-135m ./my-checkpoint --data wiki.txt --fractions 0,0.2,0.4 --out study
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from headlab.errors import HeadlabError
from headlab.fsio import check_out
from headlab.loading import DEFAULT_MODEL, load_model
from headlab.plots import plot_study
from headlab.report_text import parse_list
from headlab.sweep import DEFAULT_FRACTIONS, check_sweep, sweep, write_sweep
from headlab.tables import write_run


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL], help="model specs (hub id, directory, .gguf)")
    parser.add_argument("--data", default=None, help="corpus spec [default: embedded Python reference]")
    parser.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)), help="fractions of heads")
    parser.add_argument("--orders", default="importance,random", help="pruning orders (headlab sweep --help)")
    parser.add_argument("--seeds", default="0,1", help="seeds the random order averages over")
    parser.add_argument("--eval-tokens", type=int, default=1024, help="eval-split tokens per perplexity")
    parser.add_argument("--calibration-tokens", type=int, default=1024, help="calibration tokens for the scores")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/pruning-study"))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec.strip("/")).strip("_") or "model"


def main(argv=None) -> Path:
    args = arguments(argv)
    fractions = parse_list(args.fractions, float, "fractions")
    orders, seeds = parse_list(args.orders, str, "orders"), parse_list(args.seeds, int, "seeds")
    check_sweep(fractions, orders, seeds)  # bad input fails before any model is loaded
    check_out(args.out, args.overwrite)
    tables, runs = [], {}
    for spec in args.models:
        loaded = load_model(spec, device=args.device)
        result = sweep(
            loaded,
            fractions=fractions,
            orders=orders,
            seeds=seeds,
            data=args.data,
            calibration_tokens=args.calibration_tokens,
            eval_tokens=args.eval_tokens,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            progress=not args.quiet,
        )
        table = result.table.assign(model=spec)
        base = table.loc[table["pruned_heads"] == 0, "perplexity"].mean()
        table["relative_perplexity"] = table["perplexity"] / base
        tables.append(table)
        runs[spec] = result
        print(
            f"{spec}: unpruned perplexity {base:.3f}; at {max(fractions):.0%} pruned: "
            + ", ".join(f"{o} {g['relative_perplexity'].iloc[-1]:.2f}x" for o, g in table.groupby("order", sort=False))
        )
    study = pd.concat(tables, ignore_index=True)
    fig = plot_study(
        study,
        "fraction_pruned",
        "fraction of attention heads pruned",
        style="order",
        title="Pruning heads: perplexity relative to each unpruned model",
    )
    meta = {
        "models": args.models,
        "data": args.data or "pydoc-topics",
        "fractions": fractions,
        "orders": orders,
        "seeds": seeds,
        "eval_tokens": args.eval_tokens,
        "calibration_tokens": args.calibration_tokens,
        "seq_len": args.seq_len,
    }
    from headlab.plots import figure_bytes

    out = write_run(
        args.out, {"study": study}, meta, overwrite=args.overwrite, extra_files={"study.png": figure_bytes(fig)}
    )
    for spec, result in runs.items():
        write_sweep(result, out / slug(spec))
    print(f"wrote {out}/study.csv, study.png and one sweep directory per model")
    return out


if __name__ == "__main__":
    try:
        main()
    except HeadlabError as error:
        raise SystemExit(f"pruning_study: error: {error}") from None
