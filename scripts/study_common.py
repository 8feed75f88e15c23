"""What the study scripts (pruning_study.py, gqa_study.py) share: the command line, the loop over models, writing
`study.csv` / `study.png` with one run directory per model, and the one-line error on bad input.

Each script keeps only its own part: its sweep options, what it measures per model, its meta and its figure.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from headlab.core.errors import HeadlabError
from headlab.core.fsio import check_out
from headlab.core.loading import LoadedModel, load_model
from headlab.core.model_names import DEFAULT_MODEL
from headlab.core.tables import write_run
from headlab.viz.plots import figure_bytes


def study_arguments(
    doc: str,
    argv,
    default_out: str,
    add_own: Callable[[argparse.ArgumentParser], None],
    calibration: tuple[str, str],
) -> argparse.Namespace:
    """The command line of a study script: its docstring as help (first paragraph, then the rest as epilog), the
    models and --data, the script's own options (`add_own`), the token budgets (--eval-tokens and `calibration`:
    (flag, help) of its calibration budget), the
    window shape, --device and the output options."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL], help="model specs (hub id, directory, .gguf)")
    parser.add_argument("--data", default=None, help="corpus spec [default: embedded Python reference]")
    add_own(parser)
    parser.add_argument("--eval-tokens", type=int, default=1024, help="eval-split tokens per perplexity")
    parser.add_argument(calibration[0], type=int, default=1024, help=calibration[1])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def slug(spec: str) -> str:
    """A model spec as a directory name: 'Qwen/Qwen2.5-0.5B' -> 'Qwen_Qwen2.5-0.5B'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec.strip("/")).strip("_") or "model"


@dataclass
class Measured:
    """What the loop over models gathered: one study table per measured model, what each model's own run
    directory is written from, and the models skipped with the reason."""

    tables: list[pd.DataFrame] = field(default_factory=list)
    runs: dict[str, object] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def measure_models(
    args: argparse.Namespace, measure: Callable[[LoadedModel, str], tuple[pd.DataFrame, object] | str]
) -> Measured:
    """Check --out, then load each model in turn (one in memory at a time) and measure it: `measure(loaded, spec)`
    returns (study table, run) or, for a model it cannot measure, the reason, which is printed and recorded."""
    check_out(args.out, args.overwrite)  # an existing --out fails before any model is loaded
    measured = Measured()
    for spec in args.models:
        result = measure(load_model(spec, device=args.device), spec)
        if isinstance(result, str):
            measured.skipped[spec] = result
            print(f"{spec}: skipped ({result})")
            continue
        table, run = result
        measured.tables.append(table)
        measured.runs[spec] = run
    return measured


def write_study(
    args: argparse.Namespace,
    study: pd.DataFrame,
    figure,
    meta: dict,
    runs: dict[str, object],
    write_model: Callable[[Path, object], None],
) -> Path:
    """--out/study.csv (+ .parquet, meta.json) and study.png, written atomically, then each model's own run
    directory under it, named by slug(spec), through `write_model(directory, run)`."""
    out = write_run(
        args.out, {"study": study}, meta, overwrite=args.overwrite, extra_files={"study.png": figure_bytes(figure)}
    )
    for spec, run in runs.items():
        write_model(out / slug(spec), run)
    return out


def run_script(name: str, main: Callable[[], object]) -> None:
    """Run a study's main(); bad input ends in one line `NAME: error: ...` (exit code 1), never a traceback."""
    try:
        main()
    except HeadlabError as error:
        raise SystemExit(f"{name}: error: {error}") from None
