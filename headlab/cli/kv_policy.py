"""`headlab kv-policy`: a per-KV-head cache policy (whole cache or sinks + recent window) under a KV budget, chosen
from head statistics, written as a table, JSON and DuoAttention's pattern files; optionally measured on long-context
retrieval and NLL by position with a real cache whose bytes are measured."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli.options import data_options, guard, model_options, out_option
from headlab.cli.parsing import parse_list, parse_tokens, token_count
from headlab.core.errors import HeadlabError
from headlab.kv.methods import DEFAULT_SINKS, DEFAULT_WINDOW, GATE_STEPS, POLICY_SCORE_HELP, POLICY_SCORES
from headlab.measure.long_tasks import LONG_TASKS, TRADE_DEPTHS

DEFAULT_OUT = Path("runs/kv_policy")
DEFAULT_CONTEXT = 8192


@click.command("kv-policy")
@model_options
@data_options(
    default_split="calibration",
    max_tokens=4096,
    seq_len=512,
    batch_size=4,
    max_tokens_help="text tokens the streaming statistics read (the retrieval pass adds its own prompts)",
)
@click.option(
    "--budget",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=0.5,
    show_default=True,
    help="KV-cache bytes under the policy as a fraction of the full cache at --context tokens",
)
@click.option(
    "--context",
    default=None,
    metavar="N",
    help=f"context length the budget is counted at (2k = 2048) [default: {DEFAULT_CONTEXT}, capped by the model's "
    "positions]",
)
@click.option(
    "--score",
    type=click.Choice(POLICY_SCORES),
    default=POLICY_SCORES[0],
    show_default=True,
    help="which KV heads keep the whole cache: " + "; ".join(f"{k}: {v}" for k, v in POLICY_SCORE_HELP.items()),
)
@click.option(
    "--gate-steps",
    type=click.IntRange(min=1),
    default=GATE_STEPS,
    show_default=True,
    help="with --score gates: Adam steps of the gate optimisation, each a forward and backward pass over 4 passkey "
    "prompts of 1,024 tokens",
)
@click.option(
    "--retrieval-len",
    default=None,
    metavar="N",
    help="tokens per passkey prompt of the retrieval score (and of --score gates' training); scoring at the context "
    "the policy serves (e.g. 8k) picks the heads that retrieve there, at a cost (docs/kv-policy.md) [default: 1024, "
    "capped by the model's positions]",
)
@click.option(
    "--sinks", type=click.IntRange(min=0), default=DEFAULT_SINKS, show_default=True, help="first tokens every head keeps"
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=DEFAULT_WINDOW,
    show_default=True,
    help="recent tokens a streaming head keeps",
)
@click.option(
    "--stats",
    "stats_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="a `headlab stats` run to take the scores from instead of collecting them",
)
@click.option(
    "--evaluate",
    "evaluate_lengths",
    default=None,
    metavar="N,N",
    help="also measure retrieval (--tasks, depths 0, 0.5, 1) and NLL by position at these lengths, original and "
    "under the policy, with a real cache whose bytes are measured. Slow: a 2k prompt of a 135M model is about 15 s "
    "of 2 CPU cores, twice per prompt [default: off]",
)
@click.option(
    "--tasks",
    default="passkey,niah_multikey",
    show_default=True,
    help="long-context tasks of --evaluate: " + ", ".join(LONG_TASKS),
)
@click.option(
    "--samples", type=click.IntRange(min=1), default=2, show_default=True, help="prompts per (task, length, depth)"
)
@out_option(required=False, help_text=f"output directory, written atomically [default: {DEFAULT_OUT}]")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(  # click passes every option as a parameter
    load,
    text,
    budget,
    context,
    score,
    gate_steps,
    retrieval_len,
    sinks,
    window,
    stats_dir,
    evaluate_lengths,
    tasks,
    samples,
    out,
    overwrite,
    as_json,
):
    """Per-KV-head cache policy under a KV budget: whole cache for the heads the statistics rank highest, attention
    sinks + a recent window for the rest (DuoAttention-style); policy.csv, meta.json and DuoAttention's
    full_attention_heads.tsv + config.json; --evaluate measures it (docs/commands/kv-policy.md)."""
    context_tokens = parse_tokens(context, "context")
    lengths = parse_list(evaluate_lengths, token_count, "evaluate") if evaluate_lengths is not None else None
    task_names = parse_list(tasks, str, "tasks", allowed=tuple(LONG_TASKS))
    if gate_steps != GATE_STEPS and score != "gates":
        raise HeadlabError("--gate-steps sets the training of --score gates; add --score gates")
    retrieval_tokens = parse_tokens(retrieval_len, "retrieval-len")
    if retrieval_tokens is not None and (stats_dir is not None or score == "streaming"):
        raise HeadlabError("--retrieval-len sets the retrieval pass's prompts; a --stats run or --score streaming "
                           "has none to set")  # fmt: skip
    if stats_dir is not None and score == "gates":
        raise HeadlabError("--score gates trains its gates on passkey prompts; it reads no --stats run")
    if stats_dir is not None and not (stats_dir / "stats_wide.csv").is_file():
        raise HeadlabError(f"--stats {stats_dir}: no stats_wide.csv there (a `headlab stats` run directory)")
    out = out or DEFAULT_OUT
    guard(out, overwrite, {"model": load.spec}, data=text.data, stats=stats_dir)
    # start-up: torch, pandas and transformers load when the command runs, not for --help
    from headlab.kv.policy import EvaluationSpec, PolicySpec, policy_run

    evaluation = EvaluationSpec(tuple(lengths), tuple(task_names), TRADE_DEPTHS, samples) if lengths else None
    run = policy_run(
        load(),
        PolicySpec(budget, context_tokens, score, sinks, window, gate_steps, retrieval_tokens),
        text=text,
        stats_dir=stats_dir,
        evaluation=evaluation,
        progress=not as_json,
    )
    run.write(out, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps(run.summary(), indent=2, default=str))
        return
    for line in run.lines():
        click.echo(line)
    click.echo(f"wrote {out}")
