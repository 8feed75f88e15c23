"""`headlab stats`: per-head attention statistics on the calibration part of a corpus, collected while the model
keeps its sdpa kernel; writes a tidy table, a wide table (one row per head) and metadata."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.cli.options import data_options, guard, model_options, out_option
from headlab.measure.choices import DETECTION_PATTERN_NAMES, ERROR_MEASURES
from headlab.mechanisms.choices import DEFAULT_CHUNK

DEFAULT_OUT = Path("runs/stats")


@click.command("stats")
@model_options
@data_options(default_split="calibration", max_tokens=8192, seq_len=512, batch_size=4)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="seed of the induction pass's random tokens and of the retrieval pass's prompts",
)
@click.option("--induction/--no-induction", default=True, show_default=True, help="run the induction pass")
@click.option(
    "--induction-len",
    type=click.IntRange(min=2),
    default=64,
    show_default=True,
    help="random tokens per copy (sequences are S tokens repeated twice)",
)
@click.option("--induction-count", type=click.IntRange(min=1), default=8, show_default=True, help="random sequences")
@click.option(
    "--retrieval/--no-retrieval",
    default=True,
    show_default=True,
    help="run the retrieval pass (passkey prompts, causal models with a tokenizer)",
)
@click.option(
    "--retrieval-len",
    type=click.IntRange(min=1),
    default=None,
    help="tokens per passkey prompt, answer included [default: 1024, capped by the model's positions]",
)
@click.option(
    "--retrieval-count",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="passkey prompts, needle depths spread over 0.1 .. 0.9",
)
@click.option(
    "--ov-scores/--no-ov-scores",
    default=True,
    show_default=True,
    help="the weights-only successor and copy_suppression scores (effective OV circuits)",
)
@click.option(
    "--detect",
    type=click.Choice(DETECTION_PATTERN_NAMES),
    multiple=True,
    help="score a TransformerLens detection pattern on the text windows, column detect_NAME (repeatable)",
)
@click.option(
    "--detect-measure",
    type=click.Choice(ERROR_MEASURES),
    default="mul",
    show_default=True,
    help="--detect score: mul = sum(A*P)/sum(A), abs = 1 - sum|A-P|/T (TransformerLens detect_head)",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK,
    show_default=True,
    help="query rows per attention chunk",
)
@out_option(required=False, help_text=f"output directory, written atomically [default: {DEFAULT_OUT}]")
def command(
    load,
    text,
    seed,
    induction,
    induction_len,
    induction_count,
    retrieval,
    retrieval_len,
    retrieval_count,
    ov_scores,
    detect,
    detect_measure,
    chunk_size,
    out,
    overwrite,
):
    """Entropy, confidence, positional, sink, previous-token, distance, streaming, induction, duplicate-token,
    retrieval, output-norm, [CLS]/[SEP], successor and copy-suppression statistics per (layer, head), and optional
    TransformerLens detection patterns: stats.csv/.parquet (tidy), stats_wide.csv/.parquet and meta.json."""
    # torch and transformers load here, not at import: `headlab stats --help` keeps its start-up time short.
    from headlab.measure.stats import head_statistics, wide_statistics, write_statistics

    out = out or DEFAULT_OUT
    guard(out, overwrite, {"model": load.spec}, data=text.data)
    loaded = load()
    tidy = head_statistics(
        loaded,
        text=text,
        induction=induction,
        induction_len=induction_len,
        induction_count=induction_count,
        retrieval=retrieval,
        retrieval_len=retrieval_len,
        retrieval_count=retrieval_count,
        ov=ov_scores,
        detect=tuple(dict.fromkeys(detect)),
        detect_measure=detect_measure,
        seed=seed,
        chunk_size=chunk_size,
    )
    write_statistics(out, tidy, overwrite=overwrite)
    wide = wide_statistics(tidy)
    meta = tidy.attrs["meta"]
    click.echo(f"{len(wide)} heads, {meta['tokens']:,} tokens -> {out}")
    names = ("entropy", "sink_first", "prev_share", "induction", "retrieval", "successor", "copy_suppression")
    for name in (*names, *(f"detect_{pattern}" for pattern in dict.fromkeys(detect))):
        column = wide[name].dropna()
        if len(column):
            top = wide.loc[column.idxmax()]
            click.echo(f"  max {name:<16} {column.max():.3f}  (layer {int(top['layer'])}, head {int(top['head'])})")
