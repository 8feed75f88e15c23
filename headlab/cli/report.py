"""`headlab report`: every analysis on any model (info, statistics, importance, attention gallery, pruning sweep,
GQA sweep and grouping), then report.md and a self-contained report.html with the figures and tables."""

from __future__ import annotations

import click

from headlab.cli.options import model_options, out_option
from headlab.plots import FORMATS


def report_options(function):
    """Options shared by `headlab report` and `headlab demo`."""
    function = click.option(
        "--format", "fmt", type=click.Choice(FORMATS), default="png", show_default=True, help="figure format"
    )(function)
    function = click.option("--quick", is_flag=True, help="fewer tokens and sweep points (about half the time)")(
        function
    )
    function = click.option("--text-column", default=None, help="text column of a table corpus [default: text]")(
        function
    )
    return click.option(
        "--data",
        default=None,
        metavar="SPEC",
        help="corpus: .txt/.jsonl/.csv/.parquet file, datasets directory or hub 'name:config:split' "
        "[default: embedded Python reference text]",
    )(function)


@click.command("report")
@model_options
@report_options
@out_option(required=True, help_text="report directory (written atomically)")
def command(load, data, text_column, quick, fmt, out, overwrite):
    """Analyse a model end to end and write OUT/report.md and OUT/report.html, each step's tables under OUT
    (redraw the figures with `headlab plot OUT`)."""
    # torch and transformers load here, not at import: `headlab report --help` keeps its start-up time short.
    from headlab.data import load_corpus
    from headlab.report import check_report_out, run_report

    check_report_out(out, overwrite)
    load_corpus(data, text_column)
    report = run_report(load(), out, data=data, text_column=text_column, quick=quick, overwrite=overwrite, fmt=fmt)
    for line in report.summary:
        click.echo(f"- {line}")
    click.echo(f"wrote {out}/report.md and {out}/report.html ({len(report.figures)} figures)")
