"""`headlab uptrain`: a short distillation of a converted or pruned model (the student) towards the original (the
teacher), training only the attention projections; saves a verified checkpoint and the perplexity-per-step curve."""

from __future__ import annotations

from pathlib import Path

import click

from headlab.checkpoint import check_checkpoint_out, describe_check
from headlab.loading import DEFAULT_MODEL, DTYPES, load_model
from headlab.uptrain import check_uptrain, save_uptrained, uptrain


@click.command("uptrain")
@click.option("--model", "student", required=True, metavar="SPEC", help="the student: a converted or pruned checkpoint")
@click.option("--teacher", default=None, metavar="SPEC", help=f"the original model [default: embedded {DEFAULT_MODEL}]")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True, help="weights dtype")
@click.option("--data", default=None, metavar="SPEC", help="corpus [default: embedded Python reference text]")
@click.option("--text-column", default=None, help="text column of a table corpus [default: text]")
@click.option("--steps", type=click.IntRange(min=0), default=20, show_default=True, help="optimizer steps")
@click.option("--lr", type=float, default=1e-4, show_default=True, help="AdamW learning rate")
@click.option("--seq-len", type=click.IntRange(min=2), default=128, show_default=True, help="tokens per window")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True, help="windows per step")
@click.option("--eval-every", type=click.IntRange(min=1), default=5, show_default=True, help="steps between evals")
@click.option("--eval-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="eval-split tokens")
@click.option("--eval-seq-len", type=click.IntRange(min=2), default=256, show_default=True)
@click.option("--no-gradient-checkpointing", is_flag=True, help="keep activations (faster, more memory)")
@click.option("--bf16/--no-bf16", default=None, help="bfloat16 autocast [default: on CUDA only]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="checkpoint directory [default: headlab-uptrained]"
)
@click.option("--overwrite", is_flag=True, help="replace an existing output directory")
def command(
    student,
    teacher,
    device,
    dtype,
    data,
    text_column,
    steps,
    lr,
    seq_len,
    batch_size,
    eval_every,
    eval_tokens,
    eval_seq_len,
    no_gradient_checkpointing,
    bf16,
    seed,
    out,
    overwrite,
):
    """Distil --model towards --teacher (KL on calibration text), training only attention parameters; print and save
    the eval perplexity per step (uptrain/curve.csv, curve.png inside the checkpoint)."""

    check_uptrain(steps, lr, eval_every)
    out = out or Path("headlab-uptrained")
    check_checkpoint_out(out, overwrite, student)
    student_model = load_model(student, device=device, dtype=dtype)
    teacher_model = load_model(teacher, device=device, dtype=dtype)
    result = uptrain(
        student_model,
        teacher_model,
        corpus=data,
        text_column=text_column,
        steps=steps,
        lr=lr,
        seq_len=seq_len,
        batch_size=batch_size,
        eval_every=eval_every,
        eval_tokens=eval_tokens,
        eval_seq_len=eval_seq_len,
        gradient_checkpointing=not no_gradient_checkpointing,
        bf16=bf16,
        seed=seed,
    )
    verification = save_uptrained(student_model, result, out, overwrite=overwrite)
    for row in result.curve.dropna(subset=["perplexity"]).itertuples():
        kl = "" if row.kl != row.kl else f"   KL {row.kl:.4f}"
        click.echo(f"step {row.step:>5}   perplexity {row.perplexity:10.4f}{kl}   {row.seconds:7.1f} s")
    if verification:
        click.echo(f"reload check: {describe_check(verification)}")
    click.echo(f"written: {out} (curve: {out}/uptrain/curve.csv, curve.png)")
