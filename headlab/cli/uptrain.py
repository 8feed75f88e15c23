"""`headlab uptrain`: recover a converted or pruned checkpoint made earlier (the student) towards the original (the
teacher): uptraining (default) or local reconstruction then uptraining; saves a verified checkpoint with the curve."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from headlab.cli.options import guard, guard_checkpoint_space
from headlab.core.errors import HeadlabError
from headlab.core.model_names import DEFAULT_MODEL, DTYPE_NAMES
from headlab.recovery.choices import (
    BF16_DEFAULT,
    DEFAULT_LR,
    DEFAULT_STEPS,
    GENERATED_HELP,
    GENERATED_STARTS,
    LONG_KINDS,
    OBJECTIVES,
    PARALLEL,
    TRAINED,
)


def training_options(function):
    """The uptraining recipe's options (headlab.recovery.uptrain.UptrainConfig fields)."""
    options = [
        click.option(
            "--steps",
            type=int,
            default=DEFAULT_STEPS,
            show_default=True,
            help="the budget: optimiser steps of --accumulation x --batch-size x --seq-len tokens (same model on any "
            "machine)",
        ),
        click.option(
            "--minutes",
            type=float,
            default=None,
            help="optional wall-clock cap (all stages): a stage that reaches it stops cleanly with its best state "
            "[default: no cap]",
        ),
        click.option("--lr", type=float, default=DEFAULT_LR, show_default=True, help="peak AdamW learning rate"),
        click.option("--warmup", type=float, default=0.1, show_default=True, help="fraction of steps warming up"),
        click.option("--clip", type=float, default=1.0, show_default=True, help="gradient-norm clip (0: none)"),
        click.option("--accumulation", type=int, default=1, show_default=True, help="micro-batches per step"),
        click.option("--train", "trained", type=click.Choice(TRAINED), default="attention", show_default=True),
        click.option("--objective", type=click.Choice(OBJECTIVES), default="kl", show_default=True),
        click.option("--ce-weight", type=float, default=0.5, show_default=True, help="CE share of --objective mixed"),
        click.option(
            "--layers-weight",
            type=float,
            default=1.0,
            show_default=True,
            help="--objective kl_layers: weight of the block-output matching term added to the KL",
        ),
        click.option("--seq-len", type=int, default=256, show_default=True, help="tokens per training window"),
        click.option(
            "--batch-size",
            type=int,
            default=4,
            show_default=True,
            help="windows per micro-batch (under torchrun: per process with --parallel data, of all processes "
            "together with --parallel fsdp)",
        ),
        click.option(
            "--long-seq-len",
            type=int,
            default=0,
            show_default=True,
            help="tokens of the long windows mixed into training (0: none)",
        ),
        click.option(
            "--long-every", type=int, default=4, show_default=True, help="every N-th step trains on long windows"
        ),
        click.option(
            "--long-batch-size",
            type=int,
            default=1,
            show_default=True,
            help="long windows per micro-batch (and process under torchrun)",
        ),
        click.option(
            "--long-kind",
            type=click.Choice(LONG_KINDS),
            default="text",
            show_default=True,
            help="what the long windows hold: text (calibration windows) or retrieval (synthetic key-value needle "
            "prompts over the calibration text, distilled on the answer alone)",
        ),
        click.option(
            "--generated",
            type=click.FloatRange(0, 1),
            default=0.0,
            show_default=True,
            help=GENERATED_HELP,
        ),
        click.option(
            "--generated-start",
            type=click.Choice(GENERATED_STARTS),
            default="bos",
            show_default=True,
            help="how each sampled window begins: bos (the BOS token alone) or random (then a token drawn uniformly "
            "from the vocabulary, as LLM-QAT begins its samples)",
        ),
        click.option("--heldout-tokens", type=int, default=2048, show_default=True, help="held-out calibration"),
        click.option("--eval-every", type=int, default=None, help="steps between eval-split perplexities"),
        click.option("--eval-tokens", type=int, default=1024, show_default=True, help="eval-split tokens"),
        click.option("--eval-seq-len", type=int, default=256, show_default=True),
        click.option("--no-gradient-checkpointing", is_flag=True, help="keep activations (faster, more memory)"),
        click.option(
            "--bf16/--no-bf16",
            default=None,
            help=f"bfloat16 autocast of the student and teacher [default: {BF16_DEFAULT}]",
        ),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option(
            "--parallel",
            type=click.Choice(PARALLEL),
            default="data",
            show_default=True,
            help="under torchrun: data (each process a whole student, teacher and AdamW state, --batch-size windows "
            "each) or fsdp (FSDP2 shards them over the processes; --batch-size is all processes' together and "
            "must divide by their number); fsdp needs torchrun",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


@click.command("uptrain")
@click.option("--student", "--model", "student", required=True, metavar="SPEC", help="the converted/pruned checkpoint")
@click.option("--teacher", default=None, metavar="SPEC", help=f"the original model [default: embedded {DEFAULT_MODEL}]")
@click.option("--recover", "stages", default="uptrain", show_default=True, help="stages: local, uptrain or both")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto")
@click.option("--device-map", type=click.Choice(["auto"]), default=None, help="spread each model over the devices")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="float32", show_default=True, help="weights dtype")
@click.option("--data", default=None, metavar="SPEC", help="corpus [default: broad]")
@click.option("--text-column", default=None, help="text column of a table corpus [default: text]")
@training_options
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="checkpoint directory [default: headlab-uptrained]"
)
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
@click.option(
    "--check-weights/--no-check-weights",
    default=True,
    show_default=True,
    help="refuse a student or teacher with a non-finite (nan/inf) weight, naming the tensor",
)
def command(
    student, teacher, stages, device, device_map, dtype, data, text_column, out, overwrite, check_weights, **recipe
):
    """Train --student towards --teacher on calibration text (KL by default, attention parameters only), keep the
    state best on held-out calibration text, and save it with recovery/curve.csv and curve.png."""
    # start-up: torch, transformers and pandas load when the command runs, not for --help
    from headlab.core import distributed
    from headlab.core.checkpoint import describe_check
    from headlab.core.loading import load_model, resolve_device
    from headlab.recovery.recover import (
        RecoverySpec,
        before_after,
        describe_stop,
        parse_stages,
        recover,
        save_recovered,
    )
    from headlab.recovery.uptrain import UptrainConfig  # start-up: torch loads when the command runs

    minutes = recipe.pop("minutes")
    recipe["gradient_checkpointing"] = not recipe.pop("no_gradient_checkpointing")
    config = UptrainConfig(**recipe, minutes=minutes)
    config.check()  # every setting before any model is loaded
    if device_map is not None and config.parallel == "fsdp":
        raise HeadlabError(
            "--device-map auto spreads one process's model over the GPUs and --parallel fsdp shards it over "
            "torchrun's processes: choose one"
        )
    spec = RecoverySpec(stages=parse_stages(stages), minutes=minutes, uptrain=config)
    spec.check()
    out = out or Path("headlab-uptrained")
    guard(out, overwrite, {"student model": student, "teacher": teacher}, data=data, run_dir_bytes=False)
    load = dict(device=device, dtype=dtype, device_map=device_map, check_weights=check_weights)
    per_rank = False
    if config.parallel == "fsdp" and spec.stages == ["uptrain"]:
        # Every rank loads the structure alone and reads its own shards from safetensors checkpoints; other sources
        # (a GGUF file, weights transformers converts on load) load on rank 0's host, which sends each rank its shards.
        # The trained values come back to rank 0's host for saving (headlab.recovery.fsdp.sharded).
        trains_on = resolve_device(device)
        distributed.init(trains_on)  # NCCL for GPUs though the weights load on the host (a world of one: later)
        spec.uptrain = replace(config, shards_on=str(trains_on), whole_after="rank 0")
        per_rank = _readable_in_shards(student, teacher, load)  # the same files: every rank finds the same
        skeleton = per_rank or distributed.rank() > 0  # the group exists once torchrun starts more than one process
        # rank 0 checks the weights either way: loaded, or read from the files one tensor at a time (a skeleton)
        load.update(device="cpu", weights=not skeleton, check_weights=check_weights and distributed.rank() == 0)
    student_model = load_model(student, **load)
    most = student_model.max_positions
    for name in ("seq_len", "eval_seq_len", "long_seq_len"):
        if most is not None and recipe[name] > most:
            option = "--" + name.replace("_", "-")
            raise HeadlabError(f"{option} {recipe[name]} exceeds the model's maximum positions ({most})")
    teacher_model = load_model(teacher, **load)
    guard_checkpoint_space(out, student_model)
    record = recover(student_model, teacher_model, spec, data=data, text_column=text_column)
    meta = {"student": student_model.describe(), "teacher": teacher_model.describe()}
    # torchrun: rank 0 holds the trained weights (data: every rank does; fsdp: gathered back to it); rank 0 writes them
    if not distributed.is_main():
        return
    verification = save_recovered(student_model, out, record, meta, overwrite=overwrite)
    curve = record["tables"].get("curve")
    if curve is not None:
        for row in curve.dropna(subset=["heldout_perplexity"]).itertuples():
            eval_ppl = "" if row.perplexity != row.perplexity else f"   eval perplexity {row.perplexity:10.4f}"
            click.echo(
                f"step {row.step:>5}   held-out perplexity {row.heldout_perplexity:10.4f}{eval_ppl}"
                f"   {row.seconds:7.1f} s"
            )
    for row in before_after(record).itertuples():
        click.echo(f"{row.stage:<8} {row.measure}: {row.before:.4f} -> {row.after:.4f} ({row.seconds:.0f} s)")
    click.echo(f"recovery: {describe_stop(record)}")
    if verification:
        click.echo(f"reload check: {describe_check(verification)}")
    click.echo(f"written: {out} (curve: {out}/recovery/curve.csv, curve.png)")


def _readable_in_shards(student: str | None, teacher: str | None, load: dict) -> bool:
    """Whether every FSDP rank can read its own shards of student and teacher from their files
    (headlab.recovery.fsdp.checkpoint_shards), found on their structures: no weight is loaded."""
    from headlab.core.loading import load_structure  # start-up: torch loads when the command runs
    from headlab.recovery import fsdp

    for spec in (student, teacher):
        structure = load_structure(spec, device="cpu", dtype=load["dtype"], check_weights=False)
        if fsdp.checkpoint_shards(structure) is None:
            return False
    return True
