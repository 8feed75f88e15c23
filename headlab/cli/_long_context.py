"""--long-context N,N of the commands that write a compressed checkpoint (prune, convert-gqa, convert-mla): long-context
retrieval and NLL by position of the model before the change and of the checkpoint written, side by side
(headlab.measure.longctx) and in-context copying (headlab.measure.copying), saved beside the checkpoint as
long_context.csv, long_context_positions.csv and long_context_copying.csv. The sweeps
(sweep, gqa-sweep) take the option too, with their own help: passkey columns on every model they measure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from headlab.cli.parsing import parse_list, token_count
from headlab.measure.long_tasks import TRADE_DEPTHS, TRADE_SAMPLES

TRADE_HELP = (
    "also measure passkey retrieval (depths 0, 0.5, 1; 2 prompts each), NLL by position and in-context copying "
    "(2 random sequences repeated) at these lengths (2k = 2048), before the change and on the checkpoint written; "
    "a 2k prompt of a 135M model is about 15 s of 2 CPU cores [default: off]"
)


def sweep_help(measured: str) -> str:
    """The --long-context help of a sweep whose measured models are `measured` (with their count by default)."""
    return (
        "also measure passkey retrieval (depths 0, 0.5, 1; 2 prompts each: 6 prompts per length) at these lengths "
        f"(2k = 2048) on {measured}, as columns passkey_N (accuracy) and passkey_prompts, and in-context copying "
        "(2 random sequences repeated, per length) as copy_N. Slow: a 2k prompt of a "
        "135M model is about 15 s of 2 CPU cores, so about 90 s per 2k length per model measured [default: off]"
    )


def long_context_option(function=None, *, help_text: str = TRADE_HELP):
    """The --long-context N,N option (as `long_lengths`); `@long_context_option` or, with another help text,
    `@long_context_option(help_text=...)`."""
    option = click.option("--long-context", "long_lengths", default=None, metavar="N,N", help=help_text)
    return option if function is None else option(function)


def lengths_of(long_lengths: str | None) -> list[int] | None:
    """The parsed --long-context lengths (checked before any model work), or None when not asked for."""
    return None if long_lengths is None else parse_list(long_lengths, token_count, "long-context")


def measure(loaded, text, lengths, progress: bool):
    """Retrieval and NLL by position of `loaded` on the eval part of the command's text."""
    from headlab.measure.longctx import long_context  # start-up: torch loads when the command runs

    return long_context(loaded, text=text.but(split="eval", max_tokens=None), lengths=lengths,
                        depths=TRADE_DEPTHS, samples=TRADE_SAMPLES, progress=progress)  # fmt: skip


def record_trade(out: Path, before, load, lengths, text, progress: bool) -> list[str]:
    """Measure the checkpoint at `out` (loaded back as the command's model spec loads) like `before`, write both as
    tables into `out` (one file at a time, each atomically) and return the lines to print."""
    import pandas as pd  # start-up: pandas loads when the command runs

    from headlab.core.fsio import atomic_write_text  # start-up: only when --long-context was asked for

    written = replace(load, spec=str(out))()  # the checkpoint as a user would load it, not the model in memory
    after = measure(written, text, lengths, progress)
    lengths_table = pd.concat([before.lengths.assign(model="before"), after.lengths.assign(model="after")])
    positions = pd.concat([before.positions.assign(model="before"), after.positions.assign(model="after")])
    copying = pd.concat([before.copying.assign(model="before"), after.copying.assign(model="after")])
    atomic_write_text(Path(out) / "long_context.csv", lengths_table.to_csv(index=False))
    atomic_write_text(Path(out) / "long_context_positions.csv", positions.to_csv(index=False))
    atomic_write_text(Path(out) / "long_context_copying.csv", copying.to_csv(index=False))
    lines = []
    for row in after.lengths.itertuples(index=False):
        was = before.accuracy(row.task, row.length)
        lines.append(f"{row.task} @ {row.length:,}: {was:.0%} before, {row.accuracy:.0%} after ({row.prompts} prompts)")
    for row in after.copying.itertuples(index=False):
        was = before.copy_accuracy_at(row.length)
        lines.append(f"copy @ {row.length:,}: {was:.0%} before, {row.accuracy:.0%} after ({row.scored} tokens)")
    return lines
