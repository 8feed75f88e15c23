"""`headlab convert-gqa`: fewer KV heads by pooling groups of them (Ainslie et al. 2023), saved as a checkpoint
that vanilla transformers loads, verified by reloading it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli._long_context import lengths_of, long_context_option, measure, record_trade
from headlab.cli._recovery import recovery_for, recovery_options, recovery_spec
from headlab.cli.options import (
    calibration_tokens_option,
    data_options,
    guard,
    guard_checkpoint_space,
    model_options,
    out_option,
    print_rows,
    refine_rounds_option,
    retrieval_kind_option,
    retrieval_len_option,
    streaming_options,
)
from headlab.cli.parsing import parse_bytes
from headlab.core.errors import HeadlabError
from headlab.core.fsio import check_free_space
from headlab.core.units import human_bytes
from headlab.kv.methods import GROUPINGS, KV_METHODS, POOLS


def print_summary(record: dict) -> None:
    """Before/after perplexity and KV bytes per token, the groups and the reload check, one line each."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.checkpoint import describe_check
    from headlab.recovery.recover import describe_stop

    conversion = record["conversion"]
    per_layer = conversion.get("kv_heads_per_layer")
    after = record["kv_heads_after"] if per_layer is None else ",".join(map(str, per_layer)) + " (per layer)"
    rows = [("KV heads", f"{record['kv_heads_before']} -> {after}")]
    before, after = record.get("perplexity_before"), record.get("perplexity_after")
    if before and after:
        rows.append(("perplexity", f"{before['perplexity']:.4f} -> {after['perplexity']:.4f}"))
        if record.get("perplexity_recovered"):
            stop = describe_stop(record["recovery"])
            rows.append((f"after recovery ({stop})", f"{record['perplexity_recovered']['perplexity']:.4f}"))
        rows.append(("scored tokens", f"{after['scored_tokens']:,}"))
    if "measured_kv_bytes_per_token_before" in record:
        before, after, how = (
            record["measured_kv_bytes_per_token_before"],
            record["measured_kv_bytes_per_token_after"],
            "measured from a real cache",
        )
    else:  # layer-by-layer conversion never runs the model
        before, after, how = record["kv_bytes_per_token_before"], record["kv_bytes_per_token_after"], "arithmetic"
    rows.append(("KV cache per token", f"{human_bytes(before)} -> {human_bytes(after)} ({how})"))
    if per_layer is not None:
        rows.append(("KV budget", f"{conversion['fraction']:g} of the cache, {conversion['method']} per layer, "
                                  f"predicted loss increase {record['predicted_loss_increase']:.4f} nats"))  # fmt: skip
        if "refinement" in conversion:
            rounds = conversion["refinement"]["rounds"]
            kept = [r for r in rounds if r["kept"]]
            start, end = rounds[0]["objective_before"], (kept[-1]["objective_proposed"] if kept else None)
            change = f"measured cost {start:.4f} -> {end:.4f}" if kept else "the additive layout measured best"
            rows.append(("refinement", f"{len(kept)} of {len(rounds)} round(s) kept, {change}"))
    elif conversion["action"] == "pool":
        methods = sorted(set(conversion["methods"]))
        how = conversion["pool"]
        if conversion.get("method") == "svd":
            merge = conversion["merge"]
            how = f"svd merge (keys {merge['keys']}, values {merge['values']}, {merge['calibration_tokens']:,} calib tokens)"
        rows.append(("pool / grouping", f"{how} / {conversion['grouping']} ({', '.join(methods)})"))
        rows.append(("layers permuted", str(conversion["permuted_layers"])))
        rows.append(("groups, layer 0", str(conversion["groups"][0])))
    check = record["verification"]
    rows.append(("reload check", describe_check(check)))
    if "shards" in record:
        rows.append(("shards", f"{len(record['shards'])} ({human_bytes(record['bytes_written'])})"))
    rows.append(("written", record["out"]))
    print_rows(rows)


def show(record: dict, as_json: bool) -> None:
    """The JSON record, or the one-line-per-fact summary."""
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
    else:
        print_summary(record)


def streaming_bytes(source, direction: str, kv_heads: int | None) -> int:
    """Bytes a layer-by-layer conversion writes, estimated before it starts: the source's weight files (pooling only
    shrinks them), plus for expansion the repeated K and V projections, 2 x layers x hidden x head_dim x added KV
    heads x the stored element size."""
    from transformers import AutoConfig  # here, not at the top: importing transformers costs start-up time

    from headlab.core.arch import adapter_for  # start-up: torch loads with the adapters
    from headlab.core.loading import weight_file_bytes

    total = weight_file_bytes(source)
    if direction != "expand":
        return total
    config = AutoConfig.from_pretrained(source)
    text = config.get_text_config()
    fields = adapter_for(config).layout_fields(config)
    added = max(0, (kv_heads or fields["num_heads"]) - fields["num_kv_heads"])
    itemsize = 4 if str(getattr(text, "dtype", "float32")).endswith("float32") else 2
    return total + 2 * text.num_hidden_layers * text.hidden_size * fields["head_dim"] * added * itemsize


def run_streaming(load, kv_heads, out, *, overwrite, direction, max_shard_size, as_json, pool="mean", seed=0):
    """The --streaming path of convert-gqa and expand-kv: files in, files out, the model is never run."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.kv.streaming import convert_streaming

    source = load.streamed_source()
    max_bytes = parse_bytes(max_shard_size, "max-shard-size")
    check_free_space(out, streaming_bytes(source, direction, kv_heads), "the source's weight files, plus KV growth")
    record = convert_streaming(
        source,
        kv_heads,
        out,
        pool=pool,
        seed=seed,
        direction=direction,
        overwrite=overwrite,
        max_shard_bytes=max_bytes,
        progress=not as_json,
    )
    show(record, as_json)


def _check_count_options(
    kv_heads, kv_budget, allow_empty_layer, refine_rounds, retrieval_weight, retrieval_kind, streaming, grouping
) -> None:
    """The KV-head count options that cannot go together, refused before anything loads: one of --kv-heads and
    --kv-budget, and the per-layer budget's own options only with it."""
    if (kv_heads is None) == (kv_budget is None):
        raise HeadlabError("give --kv-heads N (every layer) or --kv-budget FRACTION (per layer), one of them")
    if allow_empty_layer and kv_budget is None:
        raise HeadlabError("--allow-empty-layer applies to --kv-budget (per-layer counts); add --kv-budget FRACTION")
    if refine_rounds and kv_budget is None:
        raise HeadlabError("--refine-rounds refines a per-layer layout; add --kv-budget FRACTION")
    if retrieval_weight and kv_budget is None:
        raise HeadlabError("--retrieval-weight weighs per-layer costs; add --kv-budget FRACTION")
    if retrieval_kind != "needles" and not retrieval_weight:
        raise HeadlabError("--retrieval-kind picks what --retrieval-weight scores; add --retrieval-weight W")
    if kv_budget is not None and not 0 < kv_budget <= 1:  # before loading; the layers' floor is checked after
        raise HeadlabError(f"--kv-budget {kv_budget} must be a fraction of the original KV cache in (0, 1]")
    if kv_budget is not None and (streaming or grouping != "contiguous"):
        raise HeadlabError(
            "--kv-budget measures each layer's options on the model and pools contiguous groups: drop --streaming "
            "and --grouping similarity"
        )


@click.command("convert-gqa")
@model_options
@click.option("--kv-heads", type=int, default=None, help="KV heads after conversion; must divide the current count")
@click.option(
    "--kv-budget",
    type=float,
    default=None,
    metavar="FRACTION",
    help="instead of --kv-heads: keep this fraction of the KV cache, each layer its own KV-head count (a divisor of "
    "its count), placed by measured per-layer costs (one forward pass over --search-tokens per layer and count; "
    "about 1 s each on the embedded 135M model, 2 CPU cores); layers that differ load with headlab's loader",
)
@click.option(
    "--allow-empty-layer",
    is_flag=True,
    help="with --kv-budget: a layer (not the first) may lose its attention entirely, 0 KV heads; only llama.cpp "
    "(export-gguf -> deci) then caches nothing for it, transformers keeps one zero-output head",
)
@click.option(
    "--search-tokens",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="with --kv-budget: calibration tokens each per-layer cost is measured on",
)
@click.option(
    "--retrieval-weight",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="with --kv-budget: add this weight x each layer's NLL increase on the answers of synthetic retrieval "
    "prompts (needle and multi-key over the calibration text) to its cost, so that the layers retrieval runs "
    "through keep their heads; 0: text NLL alone. One more forward pass per layer and count over the prompts",
)
@retrieval_len_option("with --retrieval-weight: tokens per retrieval prompt (6 prompts)")
@retrieval_kind_option("with --retrieval-weight")
@refine_rounds_option(
    "with --kv-budget: after the allocation, rounds of local search on the whole layout's measured cost (each "
    "layer's options re-measured with the others converted, since per-layer costs do not add up; a round's layout "
    "is kept only when it measures better). Each round costs as much as the per-layer costs"
)
@click.option(
    "--method",
    type=click.Choice(tuple(KV_METHODS)),
    default="mean",
    show_default=True,
    help="; ".join(f"{m.name}: {m.help}" for m in KV_METHODS.values()),
)
@click.option(
    "--pool", type=click.Choice(POOLS), default="mean", show_default=True, help="how a group becomes one head"
)
@click.option(
    "--grouping",
    type=click.Choice(GROUPINGS),
    default="contiguous",
    show_default=True,
    help="contiguous: transformers' layout; similarity: group KV heads that behave alike on calibration text",
)
@calibration_tokens_option(2048, "calibration tokens for similarity grouping and the svd merge")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of --pool random")
@click.option("--no-eval", is_flag=True, help="skip the before/after perplexity")
# One window per forward: perplexity does not depend on the batch size, and 4 x 512 logits over a large
# vocabulary would double the peak memory of an in-memory conversion (see BENCHMARKS.md, memory).
@data_options(default_split="eval", max_tokens=2048, seq_len=512, batch_size=1)
@out_option(required=False, help_text="checkpoint directory (written atomically) [default: headlab-gqa]")
@streaming_options("convert")
@recovery_options
@long_context_option
@click.option("--json", "as_json", is_flag=True, help="print the JSON record instead of a table")
def command(  # click passes every option as a parameter
    load,
    kv_heads,
    kv_budget,
    allow_empty_layer,
    search_tokens,
    retrieval_weight,
    retrieval_len,
    retrieval_kind,
    refine_rounds,
    method,
    pool,
    grouping,
    calibration_tokens,
    seed,
    no_eval,
    text,
    out,
    overwrite,
    streaming,
    max_shard_size,
    recovery_options,
    long_lengths,
    as_json,
):
    """Pool groups of KV heads into one (MHA -> GQA, GQA -> fewer groups or MQA) and save a checkpoint."""
    # start-up: torch loads when the command runs
    from headlab.kv.gqa import PoolSpec, convert_budget_checkpoint, convert_checkpoint

    out = Path(out) if out is not None else Path("headlab-gqa")
    guard(out, overwrite, {"model": load.spec}, data=text.data, run_dir_bytes=False)
    recovery = recovery_spec(recovery_options)
    lengths = lengths_of(long_lengths)
    _check_count_options(kv_heads, kv_budget, allow_empty_layer, refine_rounds, retrieval_weight, retrieval_kind,
                         streaming, grouping)  # fmt: skip
    if streaming:
        if lengths is not None:
            raise HeadlabError("--streaming never runs the model, so it cannot measure --long-context")
        if recovery is not None:
            raise HeadlabError("--streaming never runs the model, so it cannot --recover; convert in memory")
        if method != "mean" or grouping != "contiguous":
            raise HeadlabError(
                "--streaming converts weights without running the model, so it takes --method mean and --grouping "
                "contiguous only (similarity grouping and the svd merge need activations)"
            )
        return run_streaming(
            load,
            kv_heads,
            out,
            overwrite=overwrite,
            direction="pool",
            max_shard_size=max_shard_size,
            as_json=as_json,
            pool=pool,
            seed=seed,
        )
    loaded = load()
    guard_checkpoint_space(out, loaded)
    if kv_budget is not None:
        from headlab.kv.budget import BudgetSpec, check_budget_spec  # start-up: torch loads when the command runs

        budget = BudgetSpec(kv_budget, method=method, pool=pool, seed=seed, search_tokens=search_tokens,
                            allow_empty_layer=allow_empty_layer, retrieval_weight=retrieval_weight,
                            retrieval_len=retrieval_len, retrieval_kind=retrieval_kind,
                            refine_rounds=refine_rounds)  # fmt: skip
        check_budget_spec(loaded, budget)  # before the long-context measurement
    before = measure(loaded, text, lengths, not as_json) if lengths else None  # before the conversion edits it
    common = dict(text=text, calibration_tokens=calibration_tokens, evaluate=not no_eval, overwrite=overwrite,
                  progress=not as_json, recovery=recovery_for(recovery, loaded, text, not as_json))  # fmt: skip
    if kv_budget is not None:
        record = convert_budget_checkpoint(loaded, budget, out, **common)
    else:
        spec = PoolSpec(pool=pool, grouping=grouping, method=method, seed=seed)
        record = convert_checkpoint(loaded, kv_heads, out, spec, **common)
    show(record, as_json)
    if before is not None:
        for line in record_trade(out, before, load, lengths, text, not as_json):
            click.echo(line)
