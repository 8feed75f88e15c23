"""`headlab attribute`: per-head direct logit attribution on a text, and per-head activation patching between a clean
and a corrupted prompt; writes tidy tables, layer x head heatmaps and metadata."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli.options import guard, model_options, out_option, read_text_option
from headlab.core.errors import HeadlabError

DEFAULT_OUT = Path("runs/attribute")
TOP = 10  # heads listed on the terminal per table


def _answers(answers, clean) -> list[str] | None:
    if answers is None:
        return None
    if clean is None:
        raise HeadlabError("--answers applies to activation patching: give --clean and --corrupted too")
    parts = answers.split(",")
    if len(parts) != 2 or not all(parts):
        raise HeadlabError(f"--answers {answers!r}: give two tokens, correct,incorrect (e.g. ' Paris, London')")
    return parts


@click.command("attribute")
@model_options
@click.option(
    "--text", default=None, help="text whose next-token logit is attributed to heads (direct logit attribution)"
)
@click.option(
    "--text-file",
    type=click.Path(path_type=Path),
    default=None,
    help="read the attributed text from a UTF-8 file instead of --text",
)
@click.option("--clean", default=None, help="clean prompt of activation patching (with --corrupted)")
@click.option("--corrupted", default=None, help="corrupted prompt, the same number of tokens as --clean")
@click.option(
    "--answers",
    default=None,
    metavar="A,B",
    help="patching's correct and incorrect answer tokens, as the tokenizer writes them (leading spaces count) "
    "[default: the clean run's top token, the corrupted run's top other token]",
)
@click.option(
    "--target",
    default=None,
    metavar="TOKEN",
    help="one token whose logit is attributed at the last position of --text, and patching's correct answer "
    "[default: the text's own last token, predicted from the position before]",
)
@click.option(
    "--positions",
    type=click.Choice(["last", "all"]),
    default="last",
    show_default=True,
    help="attribute at the last position only or at every position",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="patched copies of the corrupted prompt per forward pass",
)
@out_option(required=False, help_text=f"output directory, written atomically [default: {DEFAULT_OUT}]")
@click.option("--json", "as_json", is_flag=True, help="print the metadata and the top heads as JSON")
def command(load, text, text_file, clean, corrupted, answers, target, positions, batch_size, out, overwrite, as_json):
    """Direct logit attribution per head (--text) and activation patching per head (--clean, --corrupted):
    dla.csv/.parquet, patching.csv/.parquet, figures/ and meta.json."""
    text = read_text_option(text, text_file)
    if (clean is None) != (corrupted is None):
        raise HeadlabError("activation patching needs both --clean and --corrupted")
    if text is None and clean is None:
        raise HeadlabError("give --text/--text-file (direct logit attribution) or --clean and --corrupted (patching)")
    answer_tokens = _answers(answers, clean)
    out = out or DEFAULT_OUT
    guard(out, overwrite, {"model": load.spec}, **{"text-file": text_file})
    # start-up: torch, pandas and seaborn load when the command runs, not for --help
    from headlab.core.tables import write_run
    from headlab.measure.attribution import activation_patching, direct_logit_attribution
    from headlab.viz.plots import figure_bytes, plot_attribution_heatmap, plot_patching_heatmap

    loaded = load()
    model = loaded.spec or "model"
    tables, meta, figures = {}, {**loaded.describe()}, {}
    if text is not None:
        dla = direct_logit_attribution(loaded, text, target=target, positions=positions)
        tables["dla"] = dla
        meta["dla"] = {k: v for k, v in dla.attrs["meta"].items() if k not in meta}
        figures["figures/dla.png"] = figure_bytes(plot_attribution_heatmap(dla, model))
    if clean is not None:
        patching = activation_patching(
            loaded,
            clean,
            corrupted,
            target=target,
            answer_tokens=answer_tokens,
            batch_size=batch_size,
            progress=not as_json,
        )
        tables["patching"] = patching
        meta["patching"] = {k: v for k, v in patching.attrs["meta"].items() if k not in meta}
        figures["figures/patching.png"] = figure_bytes(plot_patching_heatmap(patching, model))
    write_run(out, tables, meta, overwrite=overwrite, extra_files=figures)
    top = {}
    if "dla" in tables:
        last = tables["dla"][tables["dla"]["position"] == tables["dla"]["position"].max()]
        top["dla"] = last.reindex(last["contribution"].abs().sort_values(ascending=False).index).head(TOP)
    if "patching" in tables:
        top["patching"] = tables["patching"].sort_values("recovered", ascending=False).head(TOP)
    if as_json:
        shown = {name: frame.to_dict("records") for name, frame in top.items()}
        click.echo(json.dumps({"out": str(out), **meta, "top": shown}, indent=2, default=str))
        return
    if "dla" in meta:
        record = meta["dla"]["per_position"][-1]
        click.echo(
            f"direct logit attribution of {record['target']!r} at position {record['position']} "
            f"({record['token']!r}): logit {record['logit']:.4f} = heads {record['heads_total']:.4f} + rest "
            f"{record['rest']:.4f} + lm_head bias {record['lm_head_bias']:.4f}"
            f" (error {meta['dla']['sum_check']['max_abs_error']:.2g})"
        )
        click.echo(top["dla"][["name", "kv_head", "contribution"]].to_string(index=False, float_format="{:.4f}".format))
    if "patching" in meta:
        info = meta["patching"]
        names = info["answers"]
        click.echo(
            f"\nactivation patching, logit({names['correct']!r}) - logit({names['incorrect']!r}): clean "
            f"{info['clean_metric']:.4f}, corrupted {info['corrupted_metric']:.4f}"
        )
        click.echo(
            top["patching"][["name", "kv_head", "patched", "recovered"]].to_string(
                index=False, float_format="{:.4f}".format
            )
        )
    click.echo(f"\nwrote {out}: {', '.join(tables)}, figures/, meta.json")
