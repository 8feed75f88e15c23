"""`headlab prune`: remove attention heads (mask or physical) and save a checkpoint verified by reloading it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli._long_context import lengths_of, long_context_option, measure, record_trade
from headlab.cli._recovery import recovery_for, recovery_options, recovery_spec
from headlab.cli.options import (
    allow_foreign_option,
    calibration_tokens_option,
    compensate_option,
    data_options,
    guard,
    guard_checkpoint_space,
    low_memory_option,
    model_options,
    out_option,
    print_rows,
    streaming_options,
)
from headlab.cli.parsing import parse_bytes
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.pruning.choices import BUDGETS, DEFAULT_CALIBRATION_TOKENS, MODES, SELECTS, UNITS
from headlab.pruning.score_sources import SCORE_SOURCES
from headlab.recovery.choices import COMPENSATIONS


@click.command("prune")
@model_options
@data_options(
    default_split="eval",
    max_tokens=1024,
    seq_len=256,
    batch_size=4,
    max_tokens_help="eval-split tokens the perplexity before and after is measured on (two forward passes, about 2 s "
    "per 1,024 tokens each on the embedded model, 2 CPU cores); calibration text is bounded by --calibration-tokens",
)
@out_option(required=False, help_text="checkpoint directory to write (atomically) [default: headlab-pruned]")
@click.option("--scores", default=None, metavar="PATH", help="importance run / CSV with layer, head, importance|score")
@click.option("--heads", default=None, metavar="'L:h,h;L:h'", help="prune exactly these heads")
@click.option("--fraction", type=float, default=None, help="fraction of heads (or KV groups) to prune [default: 0.2]")
@click.option("--count", type=click.IntRange(min=0), default=None, help="number of heads (or KV groups) to prune")
@click.option("--per-layer", is_flag=True, help="prune the fraction/count within every layer, not globally")
@click.option(
    "--unit", type=click.Choice(UNITS), default="head", show_default=True, help="what one pruning step removes"
)
@click.option("--uniform", is_flag=True, help="same number removed in every layer (or KV group): vanilla-loadable")
@click.option("--iterative", type=click.IntRange(min=1), default=None, metavar="STEPS", help="re-score after each step")
@click.option("--allow-empty-layer", is_flag=True, help="allow removing every head of a layer")
@click.option(
    "--mode", type=click.Choice(MODES), default="mask", show_default=True, help="zero heads or slice them out"
)
@click.option(
    "--method",
    type=click.Choice(SCORE_SOURCES.names(choosable=True)),
    default="grad",
    show_default=True,
    help="per-head score source when no --scores is given (see docs/selection.md)",
)
@click.option(
    "--select",
    type=click.Choice(SELECTS),
    default="rank",
    show_default=True,
    help="rank: lowest --method scores; fisher-block: joint per-layer Fisher; obs: reconstruction-aware (structured "
    "OBS, predicts the --compensate ridge refit)",
)
@click.option(
    "--budget",
    type=click.Choice(BUDGETS),
    default=None,
    help="how many heads each layer gives up: global ranking [default], per-layer (= --per-layer), uniform "
    "(= --uniform), search (measured per-layer loss curves, exact allocation)",
)
@click.option(
    "--search-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="calibration tokens each --budget search measurement runs on (one forward pass over them per layer and "
    "path step)",
)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of --method random")
@calibration_tokens_option(
    DEFAULT_CALIBRATION_TOKENS,
    "calibration-split tokens the scores, the OBS statistics and the --compensate refit read. Cost on the embedded "
    "135M model, 2 idle CPU cores: the gradient pass takes about 5 s per 1,024 tokens (8,192: about 40 s; 16,384: "
    "about 80 s), 3x that with --low-memory; --compensate adds a forward pass, about half that",
)
@low_memory_option
@compensate_option(
    COMPENSATIONS,
    "refit the kept heads' output projection on calibration text (--compensate = ridge: least squares with a "
    "held-out-chosen ridge; --compensate bias: FLAP-style, o_proj bias only)",
)
@recovery_options
@long_context_option
@streaming_options("prune")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@allow_foreign_option
def command(  # click passes every option as a parameter
    load,
    text,
    out,
    overwrite,
    scores,
    heads,
    fraction,
    count,
    per_layer,
    unit,
    uniform,
    iterative,
    allow_empty_layer,
    mode,
    method,
    select,
    budget,
    search_tokens,
    seed,
    calibration_tokens,
    low_memory,
    compensate,
    recovery_options,
    long_lengths,
    streaming,
    max_shard_size,
    as_json,
    allow_foreign_scores,
):
    """Prune the lowest-scoring heads (importance computed on the calibration split unless --scores/--heads),
    print perplexity (eval split), parameters, attention FLOPs and KV-cache bytes before and after, and save a
    checkpoint that is reloaded and compared before the command returns."""
    # start-up: torch, transformers and pandas load when the command runs, not for --help
    from headlab.core.validate import check_table_origin
    from headlab.pruning.prune import PruneSpec, Selection, check_request, prune

    if text.split != "eval":
        raise HeadlabError("prune scores perplexity on the eval split; importance always uses the calibration split")
    out = Path(out) if out is not None else Path("headlab-pruned")
    guard(out, overwrite, {"model": load.spec}, data=text.data, scores=scores, run_dir_bytes=False)  # before loading
    recovery = recovery_spec(recovery_options)
    lengths = lengths_of(long_lengths)
    spec = PruneSpec(fraction, count, per_layer, unit, uniform, allow_empty_layer)
    if streaming:
        if compensate is not None or recovery is not None or lengths:
            raise HeadlabError("--streaming never runs the model: drop --compensate, --recover and --long-context")
        selection = Selection(heads=heads, scores=scores, iterative=iterative, select=select, budget=budget)
        return _run_streaming(load, spec, selection, mode, out, overwrite, max_shard_size, as_json,
                              allow_foreign_scores)  # fmt: skip
    loaded = load()
    text = text.resolved()  # one corpus for scoring, compensation, perplexity and recovery
    guard_checkpoint_space(out, loaded)
    check_table_origin(scores, loaded, "--scores", allow_foreign_scores)
    selection = Selection(
        heads=heads,
        scores=scores,
        method=method,
        iterative=iterative,
        select=select,
        budget=budget,
        seed=seed,
        calibration_tokens=calibration_tokens,
        search_tokens=search_tokens,
        low_memory=low_memory,
    )
    if lengths:  # a bad request fails before the long-context measurement, not after it
        check_request(loaded, spec, selection, mode=mode, compensate=compensate, out=out, overwrite=overwrite)
    before = measure(loaded, text, lengths, not as_json) if lengths else None  # before pruning edits it
    result = prune(
        loaded,
        spec,
        selection,
        mode=mode,
        text=text,
        eval_tokens=text.max_tokens,
        compensate=compensate,
        recovery=recovery_for(recovery, loaded, text, not as_json),
        out=out,
        overwrite=overwrite,
        progress=not as_json,
    )
    if as_json:
        click.echo(json.dumps(result.meta | {"out": str(result.out), "verification": result.verification}, indent=2))
    else:
        _show(result, mode)
    if before is not None:
        for line in record_trade(out, before, load, lengths, text, not as_json):
            click.echo(line)


def _run_streaming(load, spec, selection, mode, out, overwrite, max_shard_size, as_json, allow_foreign) -> None:
    """prune --streaming: files in, files out, one attention module in memory; the model is never run."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.checkpoint import describe_check
    from headlab.core.fsio import check_free_space
    from headlab.core.loading import weight_file_bytes
    from headlab.pruning.streaming import prune_streaming

    source = load.streamed_source()
    check_free_space(out, weight_file_bytes(source), "the source's weight files (pruning only shrinks them)")
    record = prune_streaming(source, spec, selection, out=out, mode=mode, overwrite=overwrite,
                             max_shard_bytes=parse_bytes(max_shard_size, "max-shard-size"),
                             allow_foreign_scores=allow_foreign, progress=not as_json)  # fmt: skip
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
        return
    rows = [("pruned heads", f"{record['pruned_heads']} of {record['total_heads']} ({mode} mode, streaming)")]
    rows += _cost_rows(record["costs_before"], record["costs_after"], "arithmetic")
    rows += [("checkpoint", str(out)), ("loads with", _LOADERS[record["loader"]])]
    rows.append(("structural check", describe_check(record["verification"])))
    rows.append(("shards", f"{len(record['shards'])} ({human_bytes(record['bytes_written'])})"))
    print_rows(rows + _notes(record))


_LOADERS = {
    "vanilla": "vanilla AutoModel.from_pretrained",
    "headlab": "headlab (per-layer layout; vanilla transformers refuses it)",
}


def _cost_rows(b: dict, a: dict, how: str = "") -> list[tuple[str, str]]:
    """Parameters, heads, attention FLOPs and KV bytes, before -> after (costs() dictionaries)."""
    kv_how = f" ({how})" if how else ""
    return [
        ("parameters", f"{b['parameters']:,} -> {a['parameters']:,}"),
        ("query heads / KV heads", f"{b['query_heads']} / {b['kv_heads']} -> {a['query_heads']} / {a['kv_heads']}"),
        (
            f"attention FLOPs/token @{b['flops_context']}",
            f"{b['attention_flops_per_token']:,} -> {a['attention_flops_per_token']:,}",
        ),
        (
            "KV cache per token",
            f"{human_bytes(b['kv_bytes_per_token'])} -> {human_bytes(a['kv_bytes_per_token'])}{kv_how}",
        ),
    ]


def _notes(meta: dict) -> list[tuple[str, str]]:
    """The padding-head note and the spanning-norm warning of a prune record."""
    notes = []
    if meta.get("padding_heads"):
        notes.append(
            (
                "note",
                f"{meta['padding_heads']} pruned query heads kept as zero-output padding so that KV groups stay "
                "equal (--uniform avoids this)",
            )
        )
    if meta.get("approximate"):
        notes.append(("warning", "this architecture's q/k norm spans heads: physical pruning is approximate"))
    return notes


def _show(result, mode: str) -> None:
    """The before/after table a prune prints: perplexity, recovery, compensation, costs, checkpoint, notes."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.checkpoint import describe_check
    from headlab.recovery.recover import describe_stop

    b, a = result.before, result.after
    rows = [
        ("pruned heads", f"{result.num_pruned} of {result.meta['total_heads']} ({mode} mode)"),
        ("perplexity", f"{result.ppl_before:.4f} -> {result.ppl_after:.4f}"),
    ]
    if result.meta.get("recovery"):
        stop = describe_stop(result.meta["recovery"])
        rows.append((f"after recovery ({stop})", f"{result.meta['perplexity_recovered']:.4f}"))
    compensation = result.meta.get("compensation")
    if compensation:
        rows.append(
            (
                f"compensation ({compensation['method']})",
                f"block-output error on calibration {compensation['error_before']:.4f} -> "
                f"{compensation['error_after']:.4f} (mean relative, per layer)",
            )
        )
    rows += _cost_rows(b, a)
    equivalent = result.meta.get("physical_equivalent")
    if equivalent:
        rows.append(
            (
                "physical prune would give",
                f"{equivalent['parameters']:,} parameters, {equivalent['attention_flops_per_token']:,} FLOPs/token, "
                f"{human_bytes(equivalent['kv_bytes_per_token'])} KV/token",
            )
        )
    rows += [("checkpoint", str(result.out)), ("loads with", _LOADERS[result.loader])]
    if result.verification:
        rows.append(("reload check", describe_check(result.verification)))
    print_rows(rows + _notes(result.meta))
