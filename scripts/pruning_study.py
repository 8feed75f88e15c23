#!/usr/bin/env python
"""Pruning study: how much perplexity each model loses as its attention heads are pruned, in several orders.

For every model given on the command line: gradient importance on the calibration split, then perplexity on the eval
split with the lowest fraction f of heads removed, for each f and order (headlab.pruning.sweep.sweep). Writes, under --out:
one sweep run directory per model (sweep.csv/.parquet, meta.json, sweep.png), `study.csv` (all models, with
perplexity relative to each model's unpruned perplexity) and `study.png` (relative perplexity against the fraction
of heads pruned, one colour per model).

    python scripts/pruning_study.py                                     # embedded SmolLM2-135M
    python scripts/pruning_study.py smollm2-135m ./my-checkpoint --data wiki.txt --fractions 0,0.2,0.4 --out study
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from headlab.cli.parsing import parse_list
from headlab.core.data import DEFAULT_CORPUS
from headlab.pruning.sweep import DEFAULT_FRACTIONS, SweepPlan, check_sweep, sweep, write_sweep
from headlab.viz.plots import plot_study

sys.path.insert(0, str(Path(__file__).resolve().parent))  # study_common.py sits beside this script
from study_common import measure_models, run_script, slug, study_arguments, write_study  # noqa: E402

__all__ = ["main", "slug"]  # slug names the per-model directories; callers (tests) read them with it


def own_options(parser) -> None:
    parser.add_argument("--fractions", default=",".join(map(str, DEFAULT_FRACTIONS)), help="fractions of heads")
    parser.add_argument("--orders", default="importance,random", help="pruning orders (headlab sweep --help)")
    parser.add_argument("--seeds", default="0,1", help="seeds the random order averages over")


def arguments(argv=None):
    calibration = ("--calibration-tokens", "calibration tokens for the scores")
    return study_arguments(__doc__, argv, "runs/pruning-study", own_options, calibration)


def main(argv=None) -> Path:
    args = arguments(argv)
    fractions = parse_list(args.fractions, float, "fractions")
    orders, seeds = parse_list(args.orders, str, "orders"), parse_list(args.seeds, int, "seeds")
    check_sweep(fractions, orders, seeds)  # bad input fails before any model is loaded

    def measure(loaded, spec):
        result = sweep(
            loaded,
            SweepPlan(fractions=fractions, orders=orders, seeds=seeds),
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
        print(
            f"{spec}: unpruned perplexity {base:.3f}; at {max(fractions):.0%} pruned: "
            + ", ".join(f"{o} {g['relative_perplexity'].iloc[-1]:.2f}x" for o, g in table.groupby("order", sort=False))
        )
        return table, result

    measured = measure_models(args, measure)
    study = pd.concat(measured.tables, ignore_index=True)
    fig = plot_study(
        study,
        "fraction_pruned",
        "fraction of attention heads pruned",
        style="order",
        title="Pruning heads: perplexity relative to each unpruned model",
    )
    meta = {
        "models": args.models,
        "data": args.data or DEFAULT_CORPUS,
        "fractions": fractions,
        "orders": orders,
        "seeds": seeds,
        "eval_tokens": args.eval_tokens,
        "calibration_tokens": args.calibration_tokens,
        "seq_len": args.seq_len,
    }
    out = write_study(args, study, fig, meta, measured.runs, lambda directory, result: write_sweep(result, directory))
    print(f"wrote {out}/study.csv, study.png and one sweep directory per model")
    return out


if __name__ == "__main__":
    run_script("pruning_study", main)
