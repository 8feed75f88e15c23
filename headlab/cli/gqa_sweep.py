"""`headlab gqa-sweep`: perplexity against measured KV-cache bytes per token over KV-head counts, groupings and
pooling rules; a table, meta.json and a plot."""

from __future__ import annotations

import math
from pathlib import Path

import click

from headlab.cli._long_context import lengths_of, long_context_option, sweep_help
from headlab.cli.options import (
    calibration_tokens_option,
    data_options,
    guard,
    model_options,
    out_option,
    refine_rounds_option,
    retrieval_kind_option,
    retrieval_len_option,
)
from headlab.cli.parsing import parse_list
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.kv.methods import GROUPINGS, KV_METHODS, POOLS, mla_budget


@click.command("gqa-sweep")
@model_options
@click.option(
    "--kv-heads",
    default=None,
    metavar="G1,G2,...",
    help="KV-head counts [default: every reachable count: the query heads (MHA), the current count and its divisors]",
)
@click.option("--grouping", default=",".join(GROUPINGS), show_default=True, help="comma list of groupings")
@click.option("--pool", default=",".join(POOLS), show_default=True, help="comma list of pooling rules")
@click.option(
    "--method",
    default="mean",
    show_default=True,
    help="comma list of "
    + "; ".join(f"{m.name}: {m.help}" for m in KV_METHODS.values())
    + " (a pooling method gives one row per --pool, a merge one row per grouping)",
)
@calibration_tokens_option(2048, "calibration tokens for similarity grouping and the svd merge")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of --pool random")
@click.option(
    "--mla",
    default=None,
    metavar="BUDGETS",
    help="comma list of convert-mla budgets (gqa, mqa, a count of KV numbers per token per layer such as 48, or a "
    "fraction of the source's cache): add the training-free MLA conversion at each budget to the table and the plot: "
    "the ladder MHA -> GQA -> MQA -> MLA",
)
@click.option(
    "--kv-budgets",
    default=None,
    metavar="F,F",
    help="comma list of fractions of the KV cache: add a per-layer KV-budget row for each (convert-gqa --kv-budget; "
    "svd merge when --method includes svd, else mean pooling); the per-layer costs are measured once, one forward "
    "pass over 1,024 calibration tokens per layer and smaller count",
)
@click.option(
    "--retrieval-weights",
    default=None,
    metavar="W,W",
    help="with --kv-budgets: comma list of retrieval weights, one row per budget and weight, each placed by text NLL "
    "+ W x the NLL increase on synthetic retrieval prompts (convert-gqa --retrieval-weight; 0: text NLL alone); "
    "the retrieval costs are measured once for every weight [default: 0]",
)
@retrieval_len_option("with --retrieval-weights: tokens per retrieval prompt (6 prompts over the calibration split)")
@retrieval_kind_option("with --retrieval-weights")
@refine_rounds_option(
    "with --kv-budgets: after each row's allocation, rounds of local search on the whole layout's measured cost "
    "(convert-gqa --refine-rounds; a round's layout is kept only when it measures better). Each round of each row "
    "costs as much as the per-layer costs"
)
@data_options(default_split="eval", max_tokens=2048, seq_len=512, batch_size=4)
@out_option(required=False, help_text="output directory [default: gqa-sweep]")
@long_context_option(help_text=sweep_help("every variant measured (and each --mla row; a row reusing another's "
                                          "weights is not measured again)"))  # fmt: skip
def command(
    load,
    kv_heads,
    grouping,
    pool,
    method,
    calibration_tokens,
    seed,
    mla,
    kv_budgets,
    retrieval_weights,
    retrieval_len,
    retrieval_kind,
    refine_rounds,
    text,
    out,
    overwrite,
    long_lengths,
):
    """Perplexity and KV-cache bytes per token for each KV-head count x grouping x pool (and MLA budget), with a plot."""
    # start-up: torch, pandas and matplotlib load when the command runs, not for --help
    from headlab.kv.gqa import run_sweep
    from headlab.kv.ladder import run_ladder
    from headlab.measure.longctx import check_passkey_lengths

    out = out or Path("gqa-sweep")
    guard(out, overwrite, {"model": load.spec}, data=text.data)
    budgets = tuple(parse_list(mla, mla_budget, "mla")) if mla else ()
    lengths = lengths_of(long_lengths)
    fractions = tuple(parse_list(kv_budgets, float, "kv-budgets")) if kv_budgets else ()
    for fraction in fractions:  # before loading; the floor of one KV head per layer is checked by the ladder
        if not 0 < fraction <= 1:
            raise HeadlabError(f"--kv-budgets {fraction} must be a fraction of the KV cache in (0, 1]")
    weights = _retrieval_weights(retrieval_weights, fractions, retrieval_len, retrieval_kind)
    if refine_rounds and not fractions:
        raise HeadlabError("--refine-rounds refines the per-layer layouts of --kv-budgets; add --kv-budgets F")
    run = run_ladder if budgets or fractions else run_sweep
    loaded = load()
    if lengths:  # an encoder or a length beyond the model's positions fails before the first conversion
        check_passkey_lengths(loaded, lengths)
    frame, _ = run(
        loaded,
        out,
        overwrite=overwrite,
        **({"mla": budgets} if budgets or fractions else {}),
        **({"kv_budgets": fractions} if fractions else {}),
        # in the resumable run's key only when asked for: runs placed by text NLL alone resume as before
        **({"retrieval_weights": weights, "retrieval_len": retrieval_len} if weights != (0.0,) else {}),
        **({"retrieval_kind": retrieval_kind} if retrieval_kind != "needles" else {}),
        **({"refine_rounds": refine_rounds} if refine_rounds else {}),
        kv_heads=None if kv_heads is None else parse_list(kv_heads, int, "kv-heads"),
        groupings=tuple(parse_list(grouping, str, "grouping", GROUPINGS)),
        pools=tuple(parse_list(pool, str, "pool", POOLS)),
        methods=tuple(parse_list(method, str, "method", tuple(KV_METHODS))),
        text=text,
        calibration_tokens=calibration_tokens,
        seed=seed,
        # in the resumable run's key only when asked for: runs without --long-context resume as before
        **({"long_context": tuple(lengths)} if lengths else {}),
    )
    for row in frame.itertuples():
        same = f"  (= {row.same_as})" if isinstance(row.same_as, str) else ""
        passkey = "".join(f"   passkey@{n:,} {getattr(row, f'passkey_{n}'):4.0%}" for n in dict.fromkeys(lengths or ()))
        click.echo(
            f"{row.variant:<22} perplexity {row.perplexity:10.4f}   KV {human_bytes(row.kv_bytes_per_token):>10}/token"
            f"{passkey}{same}"
        )
    click.echo(f"written: {out}/sweep.csv, sweep.parquet, meta.json, gqa_sweep.png")


def _retrieval_weights(option, fractions, retrieval_len, retrieval_kind) -> tuple[float, ...]:
    """--retrieval-weights as a tuple (default (0.0,): text NLL alone), refused without --kv-budgets or below 0;
    --retrieval-len and --retrieval-kind refused without it."""
    if option is None:
        if retrieval_len != 1024:
            raise HeadlabError("--retrieval-len sizes the prompts of --retrieval-weights; add --retrieval-weights W")
        if retrieval_kind != "needles":
            raise HeadlabError("--retrieval-kind picks what --retrieval-weights scores; add --retrieval-weights W")
        return (0.0,)
    if not fractions:
        raise HeadlabError("--retrieval-weights weighs the per-layer costs of --kv-budgets; add --kv-budgets F")
    weights = tuple(parse_list(option, float, "retrieval-weights"))
    for weight in weights:
        if not (math.isfinite(weight) and weight >= 0):
            raise HeadlabError(f"--retrieval-weights {weight} must be a finite number >= 0")
    return tuple(dict.fromkeys(weights))  # a weight given twice is one row
