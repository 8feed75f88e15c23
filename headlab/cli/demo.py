"""`headlab demo`: the report on the embedded SmolLM2-135M and the embedded corpus, written to runs/demo."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from headlab.cli.options import guard, model_options
from headlab.cli.report import report_options
from headlab.core.data import load_corpus
from headlab.reporting.choices import DEMO_OUT


@click.command("demo")
@model_options
@functools.partial(report_options, quick_by_default=True)
@click.option(
    "--out",
    type=click.Path(),
    default=str(DEMO_OUT),
    show_default=True,
    help="report directory; a previous demo's output there is replaced, anything else needs --overwrite",
)
@click.option("--overwrite", is_flag=True, help="replace an existing directory that is not a previous demo")
def command(load, data, text_column, quick, fmt, out, overwrite):
    """Run the analyses on the embedded model and write runs/demo/report.md and report.html: the quick preset less
    recovery, about a minute on 2 CPU cores; --full: every step and sweep point, recovery included (about 3 minutes)."""
    # start-up: torch, pandas and matplotlib load when the command runs, not for --help
    from headlab.reporting.report import DEMO_MARKER, PRESETS, is_demo_run, run_report

    out = Path(out)
    guard(out, overwrite or is_demo_run(out), {"model": load.spec}, data=data)
    load_corpus(data, text_column)
    options = dict(data=data, text_column=text_column, quick=quick, overwrite=overwrite, fmt=fmt, command=DEMO_MARKER)
    # without --full: the quick preset less its recovery step (why: report.PRESETS["demo"])
    report = run_report(load(), out, settings=PRESETS["demo" if quick else "full"], **options)
    for line in report.summary:
        click.echo(f"- {line}")
    click.echo(f"wrote {out}/report.md and {out}/report.html ({len(report.figures)} figures)")
