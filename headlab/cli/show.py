"""`headlab show`: an interactive, self-contained HTML page of every head's attention on one text (the top-k keys of
each query, in query pages), plus heatmap PNGs of chosen heads."""

from __future__ import annotations

import re
from pathlib import Path

import click

from headlab.cli.options import guard, model_options, out_option, read_text_option
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.measure.choices import DEFAULT_SHOW_TOKENS, DEFAULT_TOP_K, MAX_TOP_K
from headlab.viz.choices import DEFAULT_PAGE

DEFAULT_OUT = Path("runs/show")
PAGE_FILE = "attention.html"
HEAD = re.compile(r"L(\d+)H(\d+)")


def parse_heads(value: str | None) -> list[tuple[int, int]]:
    """`L3H2,L10H1` (TransformerLens's head names) -> [(3, 2), (10, 1)], repeats dropped."""
    if value is None:
        return []
    heads = []
    for part in value.split(","):
        match = HEAD.fullmatch(part.strip())
        if match is None:
            raise HeadlabError(f"--heads {value!r}: {part.strip()!r} is not a head name such as L3H2")
        heads.append((int(match[1]), int(match[2])))
    return list(dict.fromkeys(heads))


def check_heads(heads: list[tuple[int, int]], layer_heads: dict[int, int]) -> None:
    """Every chosen head exists in the loaded model's layout (pruned models keep fewer heads in some layers)."""
    for layer, head in heads:
        if layer not in layer_heads:
            last = max(layer_heads, default=-1)
            raise HeadlabError(f"--heads L{layer}H{head}: the model has attention layers L0 .. L{last}")
        if head >= layer_heads[layer]:
            raise HeadlabError(
                f"--heads L{layer}H{head}: layer {layer} has {layer_heads[layer]} heads (H0 .. H{layer_heads[layer] - 1})"
            )


@click.command("show")
@model_options
@click.option("--text", default=None, help="the text whose attention is shown")
@click.option(
    "--text-file", type=click.Path(path_type=Path), default=None, help="read the text from a UTF-8 file instead"
)
@click.option(
    "--top-k",
    type=click.IntRange(min=1, max=MAX_TOP_K),
    default=DEFAULT_TOP_K,
    show_default=True,
    help="keys kept per query and head (the rest's mass is noted)",
)
@click.option(
    "--chunk",
    type=click.IntRange(min=1),
    default=DEFAULT_PAGE,
    show_default=True,
    help="query rows per page of the viewer (the page decodes one page of one head at a time)",
)
@click.option("--heads", default=None, metavar="NAMES", help="heads to draw as PNG heatmaps too, e.g. L3H2,L10H1")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help=f"tokens of the text shown; the rest is cut [default: {DEFAULT_SHOW_TOKENS}, capped by the model's positions]",
)
@out_option(required=False, help_text=f"output directory, written atomically [default: {DEFAULT_OUT}]")
def command(load, text, text_file, top_k, chunk, heads, max_tokens, out, overwrite):
    """Every head's attention on one text as a self-contained page (a layer x head picker, the text coloured by a
    query's attention, query pages, a matrix per page): attention.html, heads.csv/.parquet, tokens.csv/.parquet,
    figures/L{layer}H{head}.png (--heads) and meta.json."""
    text = read_text_option(text, text_file)
    if text is None:
        raise HeadlabError("give --text or --text-file")
    chosen = parse_heads(heads)
    out = out or DEFAULT_OUT
    guard(out, overwrite, {"model": load.spec}, **{"text-file": text_file})
    # start-up: torch, pandas and seaborn load when the command runs, not for --help
    from headlab.core.tables import head_name, write_run
    from headlab.measure.attention_view import attention_topk, text_tokens
    from headlab.viz.plots import figure_bytes, plot_attention_map
    from headlab.viz.viewer import dense_map, view_page

    loaded = load()
    text_tokens(loaded, text, max_tokens)  # bad input fails before the forward pass
    layer_heads = {layer.index: layer.num_heads for layer in loaded.layers}
    check_heads(chosen, layer_heads)
    view = attention_topk(loaded, text, top_k=top_k, max_tokens=max_tokens)
    summary = view.summary()
    model = loaded.spec or "model"
    cut = f", the first {view.meta['tokens']:,} of {view.meta['text_tokens']:,}" if view.meta["truncated"] else ""
    page = view_page(view, model, chunk)
    files: dict[str, str | bytes] = {PAGE_FILE: page}
    for layer, head in chosen:
        grid = dense_map(view.keys[layer][head], view.weights[layer][head], len(view.tokens))
        figure = plot_attention_map(
            grid, view.tokens, title=f"{head_name(layer, head)} of {model}", note=f"top {view.top_k} keys per query"
        )
        files[f"figures/{head_name(layer, head)}.png"] = figure_bytes(figure)
    page_bytes = len(page.encode("utf-8"))
    meta = {
        **loaded.describe(),
        **view.meta,
        "page": {"file": PAGE_FILE, "bytes": page_bytes, "queries_per_page": chunk},
        "figures": [f"figures/{head_name(layer, head)}.png" for layer, head in chosen],
    }
    write_run(out, {"heads": summary, "tokens": view.token_table()}, meta, overwrite=overwrite, extra_files=files)
    click.echo(
        f"{len(summary)} heads, {len(view.tokens):,} tokens{cut}, top {view.top_k} keys -> {out / PAGE_FILE} "
        f"({human_bytes(page_bytes)})"
    )
    for layer, head in chosen:
        click.echo(f"  {out / 'figures' / (head_name(layer, head) + '.png')}")
