"""Short uptraining (`headlab uptrain`): distil a converted or pruned student towards its original (the teacher) by
the KL divergence of their next-token distributions on calibration text, training only the attention projections.

Loss (per unpadded token, averaged): KL(p_teacher || p_student) = sum_v p_t(v) (ln p_t(v) - ln p_s(v)) — the
logit distillation of Hinton et al. 2015 at temperature 1; Ainslie et al. 2023 uptrain with the LM loss instead.
Trained: every parameter of each attention module and its output projection (the K/V projections a conversion
changed and the Q/O maps it folded into); everything else is frozen. The perplexity curve is on the eval split.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.checkpoint import save_checkpoint
from headlab.data import Corpus, calibration_batches, load_corpus
from headlab.errors import HeadlabError
from headlab.evaluate import perplexity
from headlab.fsio import atomic_directory
from headlab.loading import LoadedModel, check_resident
from headlab.recompute import activation_checkpointing
from headlab.tables import write_run

CURVE_DIR = "uptrain"  # inside the saved checkpoint: curve.csv/.parquet, meta.json, curve.png


@dataclass
class UptrainResult:
    curve: pd.DataFrame  # step, kl (training batch), perplexity (eval split; NaN between evaluations), seconds
    meta: dict = field(default_factory=dict)
    verification: dict | None = None


def attention_parameters(loaded: LoadedModel) -> list[torch.nn.Parameter]:
    """Parameters of every softmax-attention module and its output projection (through the adapter), deduplicated."""
    seen, params = set(), []
    for layer in loaded.layers:
        for module in (layer.module, loaded.adapter.out_proj(layer)):
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
    return params


def distillation_loss(student_logits, teacher_logits, valid) -> torch.Tensor:
    """Mean over valid positions of KL(p_teacher || p_student) (nats); logits [B, T, V], valid [B, T] bool."""
    log_s = torch.log_softmax(student_logits.float(), -1)
    log_t = torch.log_softmax(teacher_logits.to(student_logits.device).float(), -1)  # device maps: the LM heads'
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, T]
    return kl[valid.to(kl.device)].mean()


def check_uptrain(steps: int, lr: float, eval_every: int) -> None:
    if steps < 0:
        raise HeadlabError(f"--steps must be >= 0, got {steps}")
    if not (lr > 0 and math.isfinite(lr)):
        raise HeadlabError(f"--lr must be a positive number, got {lr}")
    if eval_every < 1:
        raise HeadlabError(f"--eval-every must be >= 1, got {eval_every}")


def uptrain(
    student: LoadedModel,
    teacher: LoadedModel,
    *,
    corpus: Corpus | str | None = None,
    text_column: str | None = None,
    steps: int = 20,
    lr: float = 1e-4,
    seq_len: int = 128,
    batch_size: int = 4,
    eval_every: int = 5,
    eval_tokens: int | None = 1024,
    eval_seq_len: int = 256,
    gradient_checkpointing: bool = True,
    bf16: bool | None = None,
    seed: int = 0,
    progress: bool = True,
) -> UptrainResult:
    """AdamW on the student's attention parameters for `steps` batches of calibration windows (cycled), the teacher's
    logits as targets; eval-split perplexity at step 0, every `eval_every` steps and at the end. In place.

    bf16: autocast to bfloat16 (default: on CUDA only). gradient_checkpointing: transformers' checkpointing of the
    blocks (less memory, one more forward per step)."""

    check_uptrain(steps, lr, eval_every)
    check_resident(student, "uptraining")
    if student.tokenizer is not None and teacher.tokenizer is not None:
        if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
            raise HeadlabError(
                "the student and the teacher use different tokenizers; distillation needs one vocabulary"
            )
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, text_column)
    device = student.device
    bf16 = device.type == "cuda" if bf16 is None else bf16
    batches = calibration_batches(
        student.tokenizer,
        corpus,
        part="calibration",
        seq_len=seq_len,
        batch_size=batch_size,
        max_tokens=max(steps, 1) * batch_size * seq_len,
        max_positions=student.max_positions,
    )
    model = student.model
    params = attention_parameters(student)
    trained = {id(p) for p in params}
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    eval_args = dict(part="eval", seq_len=eval_seq_len, max_tokens=eval_tokens, batch_size=batch_size)

    def evaluate() -> float:
        model.eval()
        return perplexity(student, corpus, progress=False, **eval_args).perplexity

    rows = [{"step": 0, "kl": math.nan, "perplexity": evaluate(), "seconds": 0.0}]
    start = time.perf_counter()
    data = list(batches)
    restore = contextlib.ExitStack()
    checkpointing = restore.enter_context(activation_checkpointing(model, gradient_checkpointing))
    try:
        bar = tqdm(range(1, steps + 1), desc="uptrain", disable=not progress, unit="step")
        for step in bar:
            input_ids, attention_mask, *_ = data[(step - 1) % len(data)]
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            with torch.no_grad():
                teacher_logits = teacher.model(
                    input_ids=input_ids.to(teacher.device),
                    attention_mask=attention_mask.to(teacher.device),
                    use_cache=False,
                ).logits.to(device)  # [B, T, V]
            model.eval()  # no dropout; activation_checkpointing still recomputes the blocks
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            loss = distillation_loss(logits, teacher_logits, attention_mask.bool())
            if not torch.isfinite(loss):
                raise HeadlabError(f"the distillation loss is not finite at step {step}; lower --lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            row = {
                "step": step,
                "kl": float(loss.detach()),
                "perplexity": math.nan,
                "seconds": time.perf_counter() - start,
            }
            if step % eval_every == 0 or step == steps:
                row["perplexity"] = evaluate()
            rows.append(row)
            bar.set_postfix(kl=f"{float(loss.detach()):.4f}")
    finally:
        restore.close()
        model.eval()
        optimizer.zero_grad(set_to_none=True)
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
    curve = pd.DataFrame(rows)
    meta = {
        "student": student.describe(),
        "teacher": teacher.describe(),
        "objective": "mean KL(p_teacher || p_student) per token, temperature 1",
        "trained_parameters": sum(p.numel() for p in params),
        "steps": steps,
        "lr": lr,
        "optimizer": "AdamW (weight decay 0)",
        "seq_len": seq_len,
        "batch_size": batch_size,
        "gradient_checkpointing": checkpointing,
        "bf16_autocast": bf16,
        "seed": seed,
        "calibration": batches.meta,
        "eval": {"data": corpus.spec, **eval_args},
        "seconds": time.perf_counter() - start,
    }
    return UptrainResult(curve, meta)


def plot_curve(curve: pd.DataFrame, title: str = ""):
    """Eval perplexity (and training KL) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    evaluated = curve.dropna(subset=["perplexity"])
    ax.plot(evaluated["step"], evaluated["perplexity"], marker="o", label="perplexity (eval split)")
    ax.set_xlabel("step")
    ax.set_ylabel("perplexity")
    if evaluated["perplexity"].max() / max(evaluated["perplexity"].min(), 1e-9) > 20:
        ax.set_yscale("log")
    right = ax.twinx()
    trained = curve.dropna(subset=["kl"])
    right.plot(trained["step"], trained["kl"], color="tab:orange", alpha=0.6, label="KL to teacher (batch)")
    right.set_ylabel("KL (nats / token)")
    lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize=8)
    ax.set_title(title or "uptraining towards the teacher")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def save_uptrained(student: LoadedModel, result: UptrainResult, out, *, overwrite: bool = False) -> dict:
    """The checkpoint (verified by a reload, headlab.checkpoint) with the curve (CSV, Parquet, PNG) under uptrain/."""
    import matplotlib.pyplot as plt

    fig = plot_curve(result.curve, f"uptraining {student.spec}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        verification = save_checkpoint(student.model, student.tokenizer, staging, overwrite=True, meta=result.meta)
        write_run(
            staging / CURVE_DIR, {"curve": result.curve}, result.meta, extra_files={"curve.png": buffer.getvalue()}
        )
    result.verification = verification.to_dict() if verification else None
    return result.verification
