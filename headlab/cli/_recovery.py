"""--recover options shared by convert-gqa and prune: hand the edited model straight to recovery (headlab.recovery.recover)."""

from __future__ import annotations

import functools
from dataclasses import replace

import click

from headlab.core.data import TextSpec
from headlab.recovery.choices import (
    BF16_DEFAULT,
    DEFAULT_LR,
    DEFAULT_STEPS,
    GENERATED_HELP,
    GENERATED_STARTS,
    OBJECTIVES,
    PARALLEL,
)


def recovery_options(function=None, *, generated: float = 0.0, generated_start: str = "bos"):
    """--recover, --recover-steps, --recover-minutes, --recover-lr, --recover-objective, --recover-parallel,
    --recover-bf16, --recover-generated, --recover-generated-start. Used bare (`@recovery_options`) or with a command's
    own defaults for the sampled share (`@recovery_options(generated=0.5, generated_start="random")`)."""
    if function is None:
        return functools.partial(recovery_options, generated=generated, generated_start=generated_start)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        options = {name: kwargs.pop(f"recover_{name}") for name in RECOVERY_OPTION_NAMES}
        if options["parallel"] == "fsdp" and _defaulted("recover_generated"):
            # sampling is not built under FSDP (UptrainConfig.check refuses it): a command whose default samples
            # shards without it, as asked, rather than refusing an option the user never gave
            options["generated"] = 0.0
        return function(*args, recovery_options=options, **kwargs)

    for option in reversed(_recovery_click_options(generated, generated_start)):
        wrapper = option(wrapper)
    return wrapper


# recovery_options' keys, each read from the command's --recover-NAME option (--recover itself is `recover_stages`)
RECOVERY_OPTION_NAMES = ("stages", "minutes", "steps", "lr", "objective", "parallel", "bf16", "generated",
                         "generated_start")  # fmt: skip


def _recovery_click_options(generated: float, generated_start: str) -> list:
    """The click options of recovery_options, in --help's order, with the command's defaults for the sampled share."""
    return [
        click.option(
            "--recover",
            "recover_stages",
            default=None,
            metavar="STAGES",
            help="after editing, recover towards the original: local (layer-wise reconstruction), uptrain, or "
            "local,uptrain; the recovered model is what gets saved",
        ),
        click.option(
            "--recover-steps",
            type=int,
            default=DEFAULT_STEPS,
            show_default=True,
            help="uptraining budget in optimiser steps of 4 x 256 calibration tokens (on 2 CPU cores about 5 s each "
            "with bfloat16 kernels, 8 s without); "
            "local reconstruction reads 4,096 calibration tokens. A budget gives the same model on any machine",
        ),
        click.option(
            "--recover-minutes",
            type=float,
            default=None,
            help="optional wall-clock cap on all recovery stages together: a stage that reaches it stops cleanly, "
            "keeps its best state, and the record says so [default: no cap]",
        ),
        click.option(
            "--recover-lr", type=float, default=DEFAULT_LR, show_default=True, help="uptraining learning rate"
        ),
        click.option(
            "--recover-objective",
            type=click.Choice(OBJECTIVES),
            default="kl",
            show_default=True,
            help="uptraining loss",
        ),
        click.option(
            "--recover-parallel",
            type=click.Choice(PARALLEL),
            default="data",
            show_default=True,
            help="uptraining under torchrun: data (whole copies) or fsdp (FSDP2-sharded student, teacher and AdamW "
            "state; the batch of 4 windows is all processes' together); fsdp needs torchrun",
        ),
        click.option(
            "--recover-generated",
            type=click.FloatRange(0, 1),
            default=generated,
            show_default=True,
            help=GENERATED_HELP,
        ),
        click.option(
            "--recover-generated-start",
            type=click.Choice(GENERATED_STARTS),
            default=generated_start,
            show_default=True,
            help="with --recover-generated: each sampled window begins at BOS alone, or at BOS and a random token",
        ),
        click.option(
            "--recover-bf16/--no-recover-bf16",
            default=None,
            help=f"uptraining in bfloat16 autocast (student and teacher) [default: {BF16_DEFAULT}]",
        ),
    ]


def _defaulted(name: str) -> bool:
    """Whether the running command's option `name` took its default (the user did not give it)."""
    return click.get_current_context().get_parameter_source(name) is click.core.ParameterSource.DEFAULT


def recovery_spec(options: dict, seq_len: int | None = None, batch_size: int | None = None):
    """The checked RecoverySpec of the options, or None without --recover (checked before any model is loaded)."""
    # start-up: torch loads when the command runs, not for --help
    from headlab.recovery.recover import RecoverySpec, parse_stages
    from headlab.recovery.uptrain import UptrainConfig

    stages = parse_stages(options["stages"])
    if not stages:
        return None
    config = UptrainConfig(steps=options["steps"], minutes=options["minutes"], lr=options["lr"])
    config = replace(config, objective=options["objective"], parallel=options["parallel"], bf16=options["bf16"],
                     generated=options["generated"], generated_start=options["generated_start"])  # fmt: skip
    spec = RecoverySpec(stages=stages, minutes=options["minutes"], uptrain=config)
    spec.check()
    return spec


def recovery_for(spec, loaded, text: TextSpec, progress: bool, *, edits_in_place: bool = True):
    """A function(student) -> record for convert/prune to call on their edited model; the teacher is a copy of
    `loaded` taken now, before the edit, or `loaded` itself for a command that builds a new model and leaves `loaded`
    untouched (edits_in_place False: convert-mla), which saves a second copy. Recovery reads the calibration split
    of `text`'s corpus."""
    if spec is None:
        return None
    from headlab.recovery.recover import recover, teacher_copy  # start-up: torch loads when the command runs

    teacher = teacher_copy(loaded) if edits_in_place else loaded
    if not edits_in_place:
        teacher.model.requires_grad_(False)  # a teacher only gives targets (teacher_copy freezes its copy alike)

    def run(student):
        return recover(student, teacher, spec, data=text.data, text_column=text.text_column, progress=progress)

    return run
