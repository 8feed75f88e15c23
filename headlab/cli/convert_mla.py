"""`headlab convert-mla`: MHA/GQA -> multi-head latent attention, saved as a vanilla deepseek_v3 checkpoint (dense
MLPs) verified by reloading it; training-free and calibrated (docs/mla.md)."""

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
    streaming_options,
)
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.kv.methods import MLA_BUDGET_HELP, mla_budget
from headlab.recovery.choices import MLA_RECOVERY_GENERATED, MLA_RECOVERY_GENERATED_START


def _step_line(step: dict) -> str:
    how = "exact" if step.get("exact") else "approximate"
    if "max_abs_logit_diff" in step:
        how += f", max |logit diff| {step['max_abs_logit_diff']:.3g}"
    if "attention_output_rel_error_mean" in step:
        how += f", attention-output rel. error {step['attention_output_rel_error_mean']:.3g} (layer mean)"
    if "calibration_nll" in step:
        before, after = step["calibration_nll"]
        how += f", calibration NLL {before:.4f} -> {after:.4f}"
    if "window" in step:  # sliding_window: measured in rope_truncation
        how += f", window {step['window']} in layers {', '.join(map(str, step['layers']))} (cost in rope_truncation)"
    if "max_relative_frequency_change" in step:  # layer_rope: measured in rope_truncation
        changes = step["max_relative_frequency_change"]
        layers = ", ".join(map(str, changes))
        how += f", rotary frequencies moved by up to {max(changes.values()):.1%} in layers {layers} (cost in rope_truncation)"
    return how


STREAMING_MEMORY = "1GiB"  # --streaming without --max-memory: what the calibration passes may hold of the weights


def _run_streaming(load, plan: dict, text, calibration_tokens, out, overwrite, max_shard_size, as_json) -> None:
    """convert-mla --streaming: calibration on the source with its blocks offloaded (--max-memory, default
    STREAMING_MEMORY), then one attention layer converted and written at a time (headlab.kv.mla_streaming)."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.cli.parsing import parse_bytes
    from headlab.core.checkpoint import describe_check
    from headlab.core.fsio import check_free_space
    from headlab.core.loading import local_checkpoint, weight_file_bytes
    from headlab.kv.mla import plan_mla
    from headlab.kv.mla_streaming import check_streamable, convert_mla_streaming, gram_bytes

    source = local_checkpoint(load.spec)
    max_shard_bytes = parse_bytes(max_shard_size, "max-shard-size")
    limit = load.max_memory or parse_bytes(STREAMING_MEMORY, "max-memory")
    loaded = load.load(device_map="auto", max_memory=limit)
    mla_plan = plan_mla(loaded, **plan, resident=False)
    check_streamable(mla_plan)  # before the calibration passes
    needed = weight_file_bytes(source) + gram_bytes(loaded)
    check_free_space(out, needed, "the source's weight files, plus the layers' calibration Grams")
    calibration = text.resolved().but(split="calibration", max_tokens=calibration_tokens, batch_size=4)
    batches = calibration.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    record = convert_mla_streaming(loaded, source, out, mla_plan, batches, overwrite=overwrite,
                                   max_shard_bytes=max_shard_bytes, progress=not as_json)  # fmt: skip
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
        return
    layout = record["plan"]
    rows = [
        ("MLA layout", f"latent {layout['kv_lora_rank']} + rope {layout['rope_dim']} per token per layer (streaming)"),
        (
            "KV cache per token",
            f"{human_bytes(record['kv_bytes_per_token_before'])} -> "
            f"{human_bytes(record['kv_bytes_per_token_after'])} (arithmetic)",
        ),  # fmt: skip
        ("latent norms folded", str(record["latent_norm_fold"]["norms_folded"])),
        ("structural check", describe_check(record["verification"])),
        ("shards", f"{len(record['shards'])} ({human_bytes(record['bytes_written'])})"),
        ("measured", record["measured"]),
        ("written", record["out"]),
    ]
    print_rows(rows)


def print_summary(record: dict) -> None:
    """The target layout, before/after perplexity and KV bytes, each step exact or approximate, the reload check."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.checkpoint import describe_check
    from headlab.recovery.recover import describe_stop

    plan = record["plan"]
    weight = f"; key weight {plan['key_weight']:g} measured" if "key_weight_search" in record else ""
    rows = [
        ("MLA layout", f"latent {plan['kv_lora_rank']} + rope {plan['rope_dim']} per token per layer "
                       f"(full rank {plan['full_rank']}; rope dim {plan['rope_choice']}{weight})"),
    ]  # fmt: skip
    if plan.get("q_lora_rank") is not None:
        rows.append(("query", f"low rank {plan['q_lora_rank']} (q_a -> q_b)"))
    if "parameters" in record:
        count = record["parameters"]
        rows.append(("parameters", f"{count['source']:,} -> {count['converted']:,}"))
    rope = record.get("rope")
    if rope and rope["source_type"] != "default":  # scaled RoPE: say that it was carried, and how closely
        rows.append(("RoPE", f"{rope['source_type']} carried exactly (kept frequencies max rel. diff "
                             f"{rope['frequencies_max_rel_diff']:.1g}, magnitude folded into the queries)"))  # fmt: skip
    for tried in record.get("rope_dim_search", []):
        rows.append(
            (f"  tried {tried['kv_lora_rank']}+{tried['rope_dim']}", f"calibration NLL {tried['calibration_nll']:.4f}")
        )
    for tried in record.get("key_weight_search", []):
        rows.append((f"  key weight {tried['key_weight']:g}", f"calibration NLL {tried['calibration_nll']:.4f}"))
    before, after = record.get("perplexity_before"), record.get("perplexity_after")
    if before and after:
        rows.append(("perplexity", f"{before['perplexity']:.4f} -> {after['perplexity']:.4f}"))
        if record.get("perplexity_recovered"):
            stop = describe_stop(record["recovery"])
            rows.append((f"after recovery ({stop})", f"{record['perplexity_recovered']['perplexity']:.4f}"))
        rows.append(("scored tokens", f"{after['scored_tokens']:,}"))
    rows.append(("KV cache per token", f"{human_bytes(record['measured_kv_bytes_per_token_before'])} -> "
                 f"{human_bytes(record['measured_kv_bytes_per_token_after'])} (measured from a real cache)"))  # fmt: skip
    for name, step in record["steps"].items():
        rows.append((f"step {name}", _step_line(step)))
    fold = record["latent_norm_fold"]
    rows.append(("step latent_norm_fold", f"eps dominance, max |logit diff| {fold['max_abs_logit_diff']:.3g}"))
    rows.append(("reload check", describe_check(record["verification"])))
    rows.append(("written", record["out"]))
    print_rows(rows)


@click.command("convert-mla")
@model_options
@click.option("--budget", default=None, help=MLA_BUDGET_HELP)
@click.option("--kv-lora-rank", type=int, default=None, help="latent size R (instead of --budget)")
@click.option(
    "--rope-dim",
    type=int,
    default=None,
    help="rotary dims r of the shared key: an even divisor of the rotary dims [default: all of them when the latent "
    "is then full rank, else the best of rd, rd/2, rd/4 on the calibration split]",
)
@click.option(
    "--q-lora-rank",
    type=int,
    default=None,
    help="a low-rank query path (q_a -> q_b) of this rank, below the hidden size: fewer parameters and query FLOPs, "
    "at a measured cost (step query_rank) [default: one full-rank q_proj]",
)
@calibration_tokens_option(2048, "calibration tokens (the calibration split) for the conversion")
@click.option("--no-eval", is_flag=True, help="skip the before/after perplexity")
@data_options(default_split="eval", max_tokens=2048, seq_len=512, batch_size=1)
@out_option(required=False, help_text="checkpoint directory (written atomically) [default: headlab-mla]")
# MLA's recovery distils on half the teacher's own samples by default: measured better than calibration text alone on
# every domain, in and out of the calibration's (docs/recovery.md, the default recipe)
@recovery_options(generated=MLA_RECOVERY_GENERATED, generated_start=MLA_RECOVERY_GENERATED_START)
@long_context_option
@streaming_options("convert")
@click.option("--json", "as_json", is_flag=True, help="print the JSON record instead of a table")
def command(  # click passes every option as a parameter
    load,
    budget,
    kv_lora_rank,
    rope_dim,
    q_lora_rank,
    calibration_tokens,
    no_eval,
    text,
    out,
    overwrite,
    recovery_options,
    long_lengths,
    streaming,
    max_shard_size,
    as_json,
):
    """Convert GQA/MHA attention to multi-head latent attention (a deepseek_v3 checkpoint) at a KV budget.

    With --recover, the converted model is trained towards the original without its latent norms (plain linear
    latent attention) and the norms are folded in at save (docs/mla.md)."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.core.loading import check_room_for_copy
    from headlab.kv.mla import convert_mla_checkpoint

    recovery = recovery_spec(recovery_options)
    lengths = lengths_of(long_lengths)
    out = Path(out) if out is not None else Path("headlab-mla")
    guard(out, overwrite, {"model": load.spec}, data=text.data, run_dir_bytes=False)
    if budget is None and kv_lora_rank is None:
        raise HeadlabError("give a KV budget: --budget gqa|mqa|COUNT|FRACTION, or --kv-lora-rank R --rope-dim r")
    if budget is not None:
        try:
            budget = mla_budget(budget)  # before loading: an unreadable budget costs no model load
        except ValueError as error:
            raise HeadlabError(f"--budget: {error}") from None
    if load.dtype == "float16":
        raise HeadlabError(
            "--dtype float16 cannot hold the latent-norm fold (its tiny latents underflow); use float32 or bfloat16"
        )
    if streaming:
        if recovery is not None or lengths:
            raise HeadlabError("--streaming never holds the converted model: drop --recover and --long-context")
        plan = dict(budget=budget, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, q_lora_rank=q_lora_rank)
        return _run_streaming(load, plan, text, calibration_tokens, out, overwrite, max_shard_size, as_json)
    loaded = load()
    guard_checkpoint_space(out, loaded)
    check_room_for_copy(loaded, "convert-mla builds the MLA model beside the loaded one")
    before = measure(loaded, text, lengths, not as_json) if lengths else None
    record = convert_mla_checkpoint(
        loaded,
        out,
        budget=budget,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        q_lora_rank=q_lora_rank,
        text=text,
        calibration_tokens=calibration_tokens,
        evaluate=not no_eval,
        overwrite=overwrite,
        progress=not as_json,
        # the conversion builds a new model and leaves `loaded` untouched: it is the teacher itself, not a copy
        recovery=recovery_for(recovery, loaded, text, not as_json, edits_in_place=False),
    )
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
    else:
        print_summary(record)
    if before is not None:
        for line in record_trade(out, before, load, lengths, text, not as_json):
            click.echo(line)
