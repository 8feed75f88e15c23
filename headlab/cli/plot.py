"""`headlab plot`: redraw every figure of a run directory (a report or one command's output) from its saved tables,
with no model."""

from __future__ import annotations

import os
from pathlib import Path

import click

from headlab.core.errors import HeadlabError
from headlab.core.fsio import guard_output
from headlab.viz.choices import FORMATS


@click.command("plot")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="figure directory [default: RUN_DIR/figures]"
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="png", show_default=True, help="figure format")
def command(run_dir, out, fmt):
    """Heatmaps of every statistic and of importance, importance scatters, the pruning and GQA sweeps, the
    attention gallery and the KV grouping: whatever tables RUN_DIR (or its subdirectories) holds."""
    # RUN_DIR first: a file or FIFO there would otherwise be reported as the figure folder's problem
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        kind = "a file" if run_dir.is_file() else "not a regular file or folder (a FIFO or device?)"
        raise HeadlabError(f"RUN_DIR {run_dir} is {kind}; give the folder of a run (its tables and meta.json)")
    # Figures go into an existing folder too (no --overwrite), but never onto or around a table being drawn.
    tables = sorted(run_dir.rglob("*.csv")) + sorted(run_dir.rglob("*.parquet")) if run_dir.is_dir() else []
    target = out if out is not None else run_dir / "figures"
    if os.path.lexists(target) and not target.is_dir():
        # plot has no --overwrite: the guard's advice about overwriting would point at an option it lacks
        what = f"--out {target}" if out is not None else f"the figure folder {target} (RUN_DIR/figures)"
        raise HeadlabError(f"{what} is a file, not a folder; move it away or give another --out")
    guard_output(target, True, {f"table {path.name}": path for path in tables}, option="--out")
    from headlab.viz.plots import plot_run  # start-up: pandas and matplotlib load when the command runs

    written = plot_run(run_dir, out, fmt)
    for path in written:
        click.echo(str(path))
    click.echo(f"{len(written)} figures")
