"""`headlab eval`: sliding-window perplexity on the evaluation part of a corpus."""

from __future__ import annotations

import json

import click

from headlab.cli.options import data_options, model_options
from headlab.evaluate import perplexity
from headlab.report_text import human_bytes


@click.command("eval")
@model_options
@data_options(default_split="eval", max_tokens=4096, seq_len=512, batch_size=4)
@click.option(
    "--stride",
    type=int,
    default=None,
    help="tokens the window moves by; each scored token gets up to seq-len - stride extra context "
    "[default: seq-len, no overlap]",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(load, data, text_column, part, max_tokens, seq_len, batch_size, stride, as_json):
    """Perplexity, NLL, bits per token, word perplexity and bits per byte (lm-evaluation-harness definitions)."""
    loaded = load()
    result = perplexity(
        loaded,
        data,
        part=part,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size,
        max_tokens=max_tokens,
        text_column=text_column,
        progress=not as_json,
    )
    if as_json:
        click.echo(
            json.dumps(
                {**loaded.describe(), "data": data or "pydoc-topics", "split": part, **result.to_dict()}, indent=2
            )
        )
        return
    rows = [
        ("objective", result.objective),
        ("perplexity", f"{result.perplexity:.4f}"),
        ("mean NLL (nats/token)", f"{result.nll:.5f}"),
        ("bits per token", f"{result.bits_per_token:.5f}"),
        ("word perplexity", f"{result.word_perplexity:.4f}"),
        ("bits per byte", f"{result.bits_per_byte:.5f}"),
        ("scored tokens", f"{result.scored_tokens:,}"),
        ("words / bytes", f"{result.words:,} / {result.bytes:,}"),
        ("seq-len / stride", f"{result.seq_len} / {result.stride}"),
        ("tokens/s", f"{result.tokens_per_s:,.1f}"),
        ("peak memory", human_bytes(result.peak_memory_bytes)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")
