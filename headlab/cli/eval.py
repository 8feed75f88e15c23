"""`headlab eval`: perplexity in lm-eval's rolling windows on the evaluation part of a corpus, or lm-eval tasks."""

from __future__ import annotations

import json

import click

from headlab.cli.options import (
    data_options,
    guard,
    kv_cache_option,
    kv_policy_option,
    model_options,
    out_option,
    print_rows,
    task_options,
)
from headlab.cli.parsing import parse_list
from headlab.core.corpora import DEFAULT_EVAL_DOMAINS, DOMAINS
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.measure.choices import DEFAULT_KV_CHUNK


@click.command("eval")
@model_options
@data_options(default_split="eval", max_tokens=4096, seq_len=512, batch_size=4, perplexity_windows=True)
@click.option(
    "--stride",
    type=int,
    default=None,
    help="new tokens scored per window after the first; each gets max-length - stride extra context "
    "[default: max-length, lm-eval's layout]",
)
@task_options(
    "comma-separated lm-eval tasks to run instead of perplexity (needs the lmeval extra); --max-length applies "
    "only when given, else lm-eval's default for the model"
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="at most this many documents per task")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="few-shot examples per task")
@out_option(required=False, help_text="with --tasks: write tasks.csv/.parquet and meta.json here (atomically)")
@click.option(
    "--domains",
    default=",".join(DEFAULT_EVAL_DOMAINS),
    show_default=True,
    metavar="LIST",
    help=f"comma-separated built-in text domains ({', '.join(DOMAINS)}) whose eval split is also scored, one "
    "perplexity run each, in a table after the corpus's; none: no domains",
)
@kv_policy_option
@kv_cache_option
@click.option(
    "--kv-chunk",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="perplexity feeds each window N tokens per forward through the --kv-cache cache, each chunk attending to "
    f"the cached earlier ones (same windows, same scored tokens) [default: {DEFAULT_KV_CHUNK} with a quantized "
    "--kv-cache; one forward per window with full]",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(  # click passes every option as a parameter
    load,
    text,
    stride,
    domains,
    tasks,
    include_path,
    limit,
    num_fewshot,
    out,
    overwrite,
    kv_policy,
    kv_cache,
    kv_chunk,
    as_json,
):
    """Perplexity, NLL, bits per token, word perplexity and bits per byte (lm-evaluation-harness definitions and
    windows: docs/evaluation.md), then the perplexity of built-in text domains (--domains), or lm-eval tasks
    (--tasks) on the model as loaded."""
    context = click.get_current_context()
    if kv_policy is not None and (kv_cache != "full" or kv_chunk is not None):
        raise HeadlabError("--kv-cache and --kv-chunk run without --kv-policy (its masked attention has no cache)")
    if tasks is not None:
        if kv_cache != "full" or kv_chunk is not None:
            raise HeadlabError("--kv-cache and --kv-chunk go with perplexity, not with --tasks")
        if context.get_parameter_source("domains").name != "DEFAULT":
            raise HeadlabError("--domains goes with perplexity, not with --tasks")
        explicit = context.get_parameter_source("seq_len").name != "DEFAULT"
        _run_tasks(
            load,
            tasks,
            include_path,
            text.seq_len if explicit else None,
            text.batch_size,
            limit,
            num_fewshot,
            out,
            overwrite,
            as_json,
            kv_policy,
        )
        return
    if out is not None or include_path is not None:
        raise HeadlabError("--out and --include-path go with --tasks")
    names = () if domains.strip().lower() == "none" else parse_list(domains, str, "domains", allowed=tuple(DOMAINS))
    # start-up: torch loads when the command runs, not for --help
    from headlab.kv.policy import applied_policy, policy_record, read_policy
    from headlab.measure.evaluate import cache_chunks, domain_perplexities, perplexity

    cache_chunks(kv_cache, kv_chunk)  # a missing backend package is named before the model loads
    policy = read_policy(kv_policy) if kv_policy is not None else None
    loaded = load()
    with applied_policy(loaded, policy):
        caching = dict(kv_cache=kv_cache, kv_chunk=kv_chunk)
        result = perplexity(loaded, text=text, stride=stride, progress=not as_json, **caching)
        table = None
        if names:  # the corpus's row is the result above where it is the eval split (the default), else measured again
            reuse = result if text.split == "eval" else None
            table = domain_perplexities(
                loaded, names, text=text, stride=stride, progress=not as_json, measured=reuse, **caching
            )
    under = policy_record(policy, kv_policy, result.max_length) if policy is not None else None
    if as_json:
        record = {**loaded.describe(), "data": text.corpus_name, "split": text.split, **result.to_dict()}
        if table is not None:
            record["domains"] = table.to_dict("records")
        if under is not None:
            record["kv_policy"] = under
        click.echo(json.dumps(record, indent=2))
        return
    print_rows(_perplexity_rows(result, under, kv_policy))
    if table is not None:
        click.echo("\neval split of each text (docs/evaluation.md, Out-of-domain perplexity):")
        _echo_domains(table)


def _perplexity_rows(result, under: dict | None, kv_policy) -> list[tuple[str, str]]:
    """The perplexity run's summary as (label, value) rows: every measure, the windows, speed and memory, the measured
    KV cache, and the policy it ran under (`under`, from the policy file `kv_policy`)."""
    rows = [
        ("objective", result.objective),
        ("perplexity", f"{result.perplexity:.4f}"),
        ("mean NLL (nats/token)", f"{result.nll:.5f}"),
        ("bits per token", f"{result.bits_per_token:.5f}"),
        ("word perplexity", f"{result.word_perplexity:.4f}"),
        ("bits per byte", f"{result.bits_per_byte:.5f}"),
        ("scored tokens", f"{result.scored_tokens:,}"),
        ("words / bytes", f"{result.words:,} / {result.bytes:,}"),
        ("max-length / stride", f"{result.max_length} / {result.stride} ({result.windows} windows)"),
        ("windows ran as", result.path),
        ("tokens/s", f"{result.tokens_per_s:,.1f}"),
        ("peak memory", human_bytes(result.peak_memory_bytes)),
    ]
    if result.kv_cache_bytes is not None:
        rows.append(("KV cache per window", f"{human_bytes(result.kv_cache_bytes)} ({result.kv_cache}, measured)"))
    if under is not None:
        fraction = under["kv_fraction_at"]["fraction"]
        rows.append(("KV policy", f"{kv_policy}: {fraction:.3f} of the cache at max-length (masked)"))
    return rows


def _echo_domains(table) -> None:
    """One line per text: domain, role, perplexity, bits per byte, scored tokens."""
    cells = [("domain", "role", "perplexity", "bits per byte", "tokens")]
    cells += [
        (r.domain, r.role, f"{r.perplexity:.4f}", f"{r.bits_per_byte:.5f}", f"{r.scored_tokens:,}")
        for r in table.itertuples()
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        left = [f"{cell:<{w}}" for cell, w in zip(row[:2], widths[:2])]
        right = [f"{cell:>{w}}" for cell, w in zip(row[2:], widths[2:])]
        click.echo("  ".join(left + right).rstrip())


def _run_tasks(  # click's options, passed on
    load, tasks, include_path, max_length, batch_size, limit, num_fewshot, out, overwrite, as_json, kv_policy
):
    """lm-eval tasks on the loaded model; names, YAMLs and the output directory are checked before loading it."""
    # start-up: torch, pandas and lm-eval load when the command runs, not for --help
    from headlab.core.tables import write_run
    from headlab.kv.policy import applied_policy, policy_record, read_policy
    from headlab.runtimes.lm_eval_bridge import run_tasks, task_manager

    names = parse_list(tasks, str, "tasks")
    manager = task_manager(names, include_path)
    if out is not None:
        guard(out, overwrite, {"model": load.spec}, **{"include-path": include_path, "kv-policy": kv_policy})
    policy = read_policy(kv_policy) if kv_policy is not None else None
    loaded = load()
    with applied_policy(loaded, policy):
        result = run_tasks(
            loaded,
            names,
            include_path=include_path,
            max_length=max_length,
            batch_size=batch_size,
            limit=limit,
            num_fewshot=num_fewshot,
            manager=manager,
        )
    meta = {**loaded.describe(), **result.meta}
    if policy is not None:
        meta["kv_policy"] = policy_record(policy, kv_policy, policy.context)
    if out is not None:
        write_run(out, {"tasks": result.table}, meta, overwrite=overwrite)
    if as_json:
        click.echo(json.dumps({**meta, "results": result.table.to_dict("records")}, indent=2, default=str))
        return
    click.echo(result.table[["task", "metric", "value", "stderr"]].to_string(index=False, float_format="{:.4f}".format))
    if out is not None:
        click.echo(f"\nwrote {out}/tasks.csv, tasks.parquet, meta.json")
