"""`headlab longeval`: long-context retrieval accuracy (passkey, RULER-style needles) and NLL by position, with the
needle heatmap, the position curve and the same prompts as lm-eval task files."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli.options import corpus_options, guard, kv_cache_option, kv_policy_option, model_options, out_option
from headlab.cli.parsing import parse_list, token_count
from headlab.core.data import TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.measure.long_tasks import COPY_SEQUENCES, DEFAULT_DEPTHS, DEFAULT_TASKS, LONG_TASKS

DEFAULT_OUT = Path("runs/longeval")
RUNTIMES = ("transformers", "llamacpp")


@click.command("longeval")
@model_options
@corpus_options(
    "eval",
    split_help="which part of the corpus the haystacks and the NLL-by-position sequences come from",
    data_help="haystack text",
)
@click.option(
    "--tasks",
    default=",".join(DEFAULT_TASKS),
    show_default=True,
    help="comma-separated tasks: " + "; ".join(f"{name}: {task.help}" for name, task in LONG_TASKS.items()),
)
@click.option(
    "--lengths",
    default=None,
    metavar="N,N",
    help="context lengths in tokens, prompt and answer together (2k = 2048) [default: 1k,2k,4k,8k on a GPU, 1k on "
    "a CPU (an 8k prompt of a 135M model takes about 100 s of 2 CPU cores); capped by the model's positions]",
)
@click.option(
    "--depths",
    default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
    show_default=True,
    help="needle depths in [0, 1]: 0 before the haystack, 1 after it",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="prompts per (task, length, depth) cell; the cost is one prefill each",
)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the needles and the haystack offsets")
@click.option(
    "--position-sequences",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="sequences of the longest length scored for NLL by position (one forward each; 0: none)",
)
@click.option(
    "--copy-sequences",
    type=click.IntRange(min=0),
    default=COPY_SEQUENCES,
    show_default=True,
    help="random token sequences per length, each followed by its copy, scored on the copy: in-context copying, "
    "the mechanism retrieval rests on (one forward each; 0: none)",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="equal-length prompts per forward pass",
)
@click.option(
    "--runtime",
    type=click.Choice(RUNTIMES),
    default="transformers",
    show_default=True,
    help="llamacpp: decode a .gguf --model through llama.cpp (same prompts, same greedy decode; needs the "
    "llamacpp extra)",
)
@kv_policy_option
@kv_cache_option
@out_option(required=False, help_text=f"output directory, written atomically [default: {DEFAULT_OUT}]")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(  # click passes every option as a parameter
    load,
    data,
    text_column,
    part,
    tasks,
    lengths,
    depths,
    samples,
    seed,
    position_sequences,
    copy_sequences,
    batch_size,
    runtime,
    kv_policy,
    kv_cache,
    out,
    overwrite,
    as_json,
):
    """Long-context retrieval (passkey and RULER-style needles in real text; greedy decode, exact match, 95%
    intervals per length x depth) and NLL by position: tables, figures and lm-eval task files of the same
    prompts (docs/long-context.md)."""
    names = parse_list(tasks, str, "tasks", allowed=tuple(LONG_TASKS))
    length_list = parse_list(lengths, token_count, "lengths") if lengths is not None else None
    depth_list = parse_list(depths, float, "depths")
    gguf = Path(load.spec) if load.spec and str(load.spec).lower().endswith(".gguf") else None
    _check_runtime(runtime, gguf, kv_cache, kv_policy)
    out = out or DEFAULT_OUT
    guard(out, overwrite, {"model": load.spec}, data=data, **{"kv-policy": kv_policy})
    # start-up: torch, pandas and seaborn load when the command runs, not for --help
    from headlab.core.tables import write_run
    from headlab.kv.policy import applied_policy, measured_generate, policy_record, read_policy
    from headlab.measure.longctx import cache_generate, long_context
    from headlab.mechanisms.quantized_cache import check_kv_cache

    check_kv_cache(kv_cache)  # a missing backend package is named before the model loads
    policy = read_policy(kv_policy) if kv_policy is not None else None
    loaded = load()
    generate, caches = None, []
    if runtime == "llamacpp":
        from headlab.runtimes.long_context import llamacpp_generate  # start-up: llama.cpp only when asked for

        generate = llamacpp_generate(loaded, gguf)
    elif kv_cache != "full":  # generation writes and reads the quantized cache, measured per batch
        generate = cache_generate(loaded, kv_cache, caches)
    text = TextSpec(data, text_column, part, max_tokens=None)
    with applied_policy(loaded, policy) as layers:
        if policy is not None:  # generation writes a real policy cache, measured per batch
            generate = measured_generate(loaded, layers, caches)
        result = long_context(
            loaded,
            text=text,
            tasks=names,
            lengths=length_list,
            depths=depth_list,
            samples=samples,
            seed=seed,
            position_sequences_count=position_sequences,
            copy_sequences=copy_sequences,
            batch_size=batch_size,
            generate=generate,
            progress=not as_json,
        )
    result.meta["runtime"] = runtime
    if policy is not None:
        result.meta["kv_policy"] = policy_record(policy, kv_policy, max(result.meta["lengths"]))
        result.meta["kv_policy"]["measured_cache"] = caches
    result.meta["kv_cache"] = kv_cache
    if kv_cache != "full":
        result.meta["kv_cache_measured"] = caches
    write_run(out, result.tables(), result.meta, overwrite=overwrite, extra_files=_run_files(result, loaded.spec, out))
    if as_json:
        click.echo(json.dumps({**result.meta, "lengths_table": result.lengths.to_dict("records"),
                               "positions_table": result.positions.to_dict("records"),
                               "copying_table": result.copying.to_dict("records")}, indent=2, default=str))  # fmt: skip
        return
    _print_result(result, caches if kv_cache != "full" else [], kv_cache, out)


def _check_runtime(runtime: str, gguf: Path | None, kv_cache: str, kv_policy) -> None:
    """The runtime, cache and policy options that cannot go together, refused before anything loads."""
    if kv_cache != "full" and (runtime == "llamacpp" or kv_policy is not None):
        raise HeadlabError("--kv-cache runs in transformers' own cache: not with --runtime llamacpp or --kv-policy")
    if runtime == "llamacpp" and gguf is None:
        raise HeadlabError("--runtime llamacpp decodes a .gguf file: give --model FILE.gguf")
    if runtime == "llamacpp" and kv_policy is not None:
        raise HeadlabError("--kv-policy runs in transformers (headlab's cache), not with --runtime llamacpp")


def _run_files(result, model_name: str | None, out) -> dict:
    """The run directory's files beside its tables: the figures and lm-eval task files of the same prompts."""
    from headlab.runtimes.lm_eval_bridge import long_task_files  # start-up: loads with the run, not for --help
    from headlab.viz.plots import figure_bytes, plot_needle_heatmap, plot_position_nll  # start-up: seaborn

    model_name = model_name or "model"
    figures = {
        "figures/needle_heatmap.png": figure_bytes(plot_needle_heatmap(result.cells, f"{model_name}: retrieval"))
    }
    if not result.curve.empty:
        figures["figures/position_nll.png"] = figure_bytes(
            plot_position_nll(result.curve, f"{model_name}: NLL by position")
        )
    # The YAMLs name their jsonl by absolute path (lm-eval resolves data files from its working directory): the
    # path the run directory will have once published.
    task_files = long_task_files(result.prompt_list, Path(out).resolve() / "lm_eval_tasks")
    return {**figures, **{f"lm_eval_tasks/{name}": content for name, content in task_files.items()}}


def _print_result(result, measured: list, kv_cache: str, out) -> None:
    """The accuracy table with its intervals, the measured quantized-cache bytes per length, NLL by position."""
    shown = result.lengths.assign(
        accuracy=[
            f"{a:.0%} [{lo:.0%}, {hi:.0%}]"
            for a, lo, hi in result.lengths[["accuracy", "ci_low", "ci_high"]].to_numpy()
        ]
    )
    click.echo(shown[["task", "length", "prompts", "correct", "accuracy", "recall"]].to_string(index=False))
    # a --kv-policy run's caches are reported in its meta (measured is empty then)
    for length in sorted({row["length"] for row in measured}):
        rows = [row for row in measured if row["length"] == length]
        per_prompt = sum(row["cache_bytes"] for row in rows) / sum(row["prompts"] for row in rows)
        click.echo(f"{kv_cache} KV cache at length {length}: {human_bytes(per_prompt)} per prompt (measured)")
    if not result.positions.empty:
        click.echo("")
        click.echo(result.positions.to_string(index=False, float_format="{:.4f}".format))
    for row in result.copying.itertuples(index=False):
        predicted = f"{row.accuracy:.1%} of {row.scored:,} copied tokens predicted"
        click.echo(f"copy @ {row.length:,}: {predicted}, NLL {row.nll:.3f}")
    click.echo(f"\nwrote {out}: cells, lengths, prompts, positions, copying, figures/, lm_eval_tasks/ (--include-path)")
