"""Uptraining (`headlab uptrain`, `--recover uptrain`): train a converted or pruned student towards its original (the
teacher) on streamed calibration text, keeping the state that is best on held-out calibration text.

Objective (per unpadded token, averaged): kl = KL(p_teacher || p_student) = sum_v p_t(v) (ln p_t(v) - ln p_s(v)) (logit
distillation, Hinton et al. 2015, temperature 1), ce = next-token cross-entropy (the LM loss Ainslie et al. 2023
uptrain with), mixed = (1 - w) kl + w ce, or kl_layers = kl + w_h x layer-output matching (the relative squared error of
every block's output, per token, as in the hidden-state distillation of Sun et al. 2019 and Jiao et al. 2020).
Recipe: AdamW, linear warmup over 10% of the steps, cosine decay to 0, global-norm clipping 1.0, gradient
accumulation; trained groups attention (default: every attention module and its output projection), norms (plus every
norm) or all. The default lr was chosen by held-out calibration perplexity
(docs/recovery.md); lr 1e-4 without warmup made a merged model worse before it got better.
Held-out: per domain of the calibration corpus (one for most corpora; four for the built-in `broad`), the last tokens
of its calibration text, never trained on; the state returned has the lowest held-out perplexity (exp of the mean
over domains of ln perplexity) among the states no worse than the start on any domain, the start included. The eval split only reports the curve.
Budget: `steps` (tokens = steps x accumulation x batch_size x seq_len), so one command trains the same model on any
machine (up to rounding: bfloat16 autocast where the device has fast bfloat16 products, `default_bf16`); `minutes`
is only a cap, which ends the run cleanly with the best state so far and says so in the record.
Under torchrun, `parallel` data: every rank holds the student, teacher and AdamW state and takes batch_size windows
per micro-batch, gradients all-reduced here; fsdp: FSDP2 shards them (headlab.recovery.fsdp) and batch_size is the
whole world's, each rank taking batch_size / N windows, so one command line trains the same model on 1 or N ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core import cpu_matmul, distributed
from headlab.core.data import (
    DOCUMENT_SEPARATOR,
    Corpus,
    batch_windows,
    chunk_windows,
    load_corpus,
    require_tokens,
    split_text,
    tokenize,
)
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.core.streaming import LayerEditor
from headlab.measure.evaluate import perplexity
from headlab.mechanisms.recompute import activation_checkpointing
from headlab.recovery import fsdp
from headlab.recovery.choices import (
    DEFAULT_LR,
    DEFAULT_STEPS,
    GENERATED_STARTS,
    LONG_KINDS,
    OBJECTIVES,
    PARALLEL,
    TRAINED,
    WHOLE_AFTER,
)
from headlab.recovery.reconstruct import check_pair, dead_heads, dead_heads_kept
from headlab.recovery.retrieval_windows import RETRIEVAL_TASKS, retrieval_batches
from headlab.recovery.teacher_samples import TeacherSamples, mixed_batches


@dataclass
class UptrainResult:
    curve: pd.DataFrame  # step, lr, loss, kl, ce, tokens, heldout_perplexity, perplexity (eval split), seconds
    meta: dict = field(default_factory=dict)
    verification: dict | None = None


def attention_parameters(loaded: LoadedModel) -> list[torch.nn.Parameter]:
    """Parameters of every softmax-attention module and its output projection (through the adapter), deduplicated."""
    modules = [m for layer in loaded.layers for m in (layer.module, loaded.adapter.out_proj(layer))]
    return _unique(p for module in modules for p in module.parameters())


def _unique(params) -> list[torch.nn.Parameter]:
    """`params` without repeats (tied or shared parameters), first occurrence kept, in order."""
    seen, unique = set(), []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def distillation_loss(student_logits, teacher_logits, valid) -> torch.Tensor:
    """Mean over valid positions of KL(p_teacher || p_student) (nats); logits [B, T, V], valid [B, T] bool."""
    log_s = torch.log_softmax(student_logits.float(), -1)
    log_t = torch.log_softmax(teacher_logits.to(student_logits.device).float(), -1)  # device maps: the LM heads'
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, T]
    return kl[valid.to(kl.device)].mean()


@dataclass
class UptrainConfig:
    """The uptraining recipe: AdamW, linear warmup then cosine decay to zero, gradient clipping, accumulation."""

    steps: int = DEFAULT_STEPS  # the budget: steps of accumulation x batch_size x seq_len tokens (same model anywhere)
    minutes: float | None = None  # optional wall-clock cap: training stops there cleanly, keeping the best state
    lr: float = DEFAULT_LR
    warmup: float = 0.1  # fraction of the steps with a linear warmup
    clip: float = 1.0  # max global gradient norm (0: no clipping)
    accumulation: int = 1  # micro-batches per optimiser step
    seq_len: int = 256
    batch_size: int = 4
    # Long windows in the mix (0: none): every long_every-th step trains on micro-batches of long_batch_size windows of
    # long_seq_len tokens, so what recovery restores includes attention over long distances (retrieval), not only 256.
    long_seq_len: int = 0
    long_every: int = 4
    long_batch_size: int = 1  # long windows per micro-batch (and rank)
    # What the long windows hold: text (calibration windows) or retrieval (synthetic key-value needle prompts over the
    # calibration text, distilled on the answer alone: headlab.recovery.retrieval_windows).
    long_kind: str = "text"
    # Share of each batch's short windows sampled from the teacher itself (0: none), from its prefix token at
    # temperature 1: text in the unedited model's own distribution, so that recovery also restores it where the
    # calibration corpus has no text (LLM-QAT's data-free distillation; headlab.recovery.teacher_samples).
    generated: float = 0.0
    generated_start: str = "bos"  # bos | random: how each sample begins (choices.GENERATED_STARTS)
    trained: str = "attention"  # attention | norms (attention + every norm) | all
    objective: str = "kl"  # kl (to the teacher) | ce (next-token cross-entropy) | mixed | kl_layers
    ce_weight: float = 0.5  # mixed: (1 - w) KL + w CE
    layers_weight: float = 1.0  # kl_layers: KL + w_h x the mean over blocks of the block outputs' relative error
    heldout_tokens: int = 2048  # held-out calibration tokens (the calibration part's tail) that choose the state kept
    heldout_every: int | None = None  # steps between held-out checks [default: about 8 checks per run]
    eval_every: int | None = None  # steps between eval-split perplexities of the curve [default: start and end]
    eval_tokens: int | None = 1024  # 0: no eval-split perplexity at all (choices made on calibration text only)
    eval_seq_len: int = 256
    gradient_checkpointing: bool = True
    bf16: bool | None = None  # bfloat16 autocast of student and teacher [default: default_bf16(device)]
    seed: int = 0
    # Under torchrun: data (whole copies, batch_size windows per rank) or fsdp (FSDP2 shards, batch_size windows over
    # all ranks together). Without torchrun only data: fsdp there is refused rather than silently ignored.
    parallel: str = "data"
    # fsdp only: the device the shards go to (default: the student's; the CLI loads the whole model on rank 0's host
    # and shards onto each rank's own device), and where the trained values are gathered whole at the end: every rank
    # or rank 0 alone, on its host (headlab.recovery.fsdp.sharded)
    shards_on: str | None = None
    whole_after: str = "every rank"

    def check(self) -> None:
        """Bad settings fail before any work, each as one line."""
        if self.steps is None or not (0 <= self.steps <= 10_000_000):
            raise HeadlabError(f"steps={self.steps} must be in 0..10000000")
        if self.minutes is not None and not (0 < self.minutes <= 10_000):
            raise HeadlabError(f"minutes={self.minutes} must be in (0, 10000]")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise HeadlabError(f"lr={self.lr} must be a positive number")
        if not (0 <= self.warmup < 1):
            raise HeadlabError(f"warmup={self.warmup} must be a fraction in [0, 1)")
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise HeadlabError(f"clip={self.clip} must be >= 0")
        if self.long_seq_len and self.long_seq_len < 2:
            raise HeadlabError(f"long_seq_len={self.long_seq_len} must be 0 (no long windows) or >= 2")
        if self.long_kind not in LONG_KINDS:
            raise HeadlabError(f"unknown long_kind={self.long_kind!r}; use one of {', '.join(LONG_KINDS)}")
        if self.long_kind == "retrieval" and not self.long_seq_len:
            raise HeadlabError("long_kind='retrieval' needs long_seq_len (the retrieval windows' length)")
        for name in ("accumulation", "batch_size", "heldout_tokens", "eval_seq_len", "long_every", "long_batch_size"):
            if getattr(self, name) < 1:
                raise HeadlabError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("heldout_every", "eval_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise HeadlabError(f"{name}={getattr(self, name)} must be >= 1")
        if self.eval_tokens is not None and self.eval_tokens < 0:
            raise HeadlabError(f"eval_tokens={self.eval_tokens} must be >= 0")
        if self.seq_len < 2:
            raise HeadlabError(f"seq_len={self.seq_len} must be >= 2")
        if self.trained not in TRAINED:
            raise HeadlabError(f"unknown trained={self.trained!r}; use one of {', '.join(TRAINED)}")
        if self.objective not in OBJECTIVES:
            raise HeadlabError(f"unknown objective={self.objective!r}; use one of {', '.join(OBJECTIVES)}")
        if not (0 <= self.ce_weight <= 1):
            raise HeadlabError(f"ce_weight={self.ce_weight} must be in [0, 1]")
        if not (0 <= self.generated <= 1):
            raise HeadlabError(f"generated={self.generated} must be a share of the batch in [0, 1]")
        if self.generated and not self.generated_windows:
            raise HeadlabError(
                f"generated={self.generated} of a batch of {self.batch_size} windows rounds to none; give at least "
                f"{1 / (2 * self.batch_size):.3g}, or 0"
            )
        if self.generated_start not in GENERATED_STARTS:
            raise HeadlabError(
                f"unknown generated_start={self.generated_start!r}; use one of {', '.join(GENERATED_STARTS)}"
            )
        if not (self.layers_weight >= 0 and math.isfinite(self.layers_weight)):
            raise HeadlabError(f"layers_weight={self.layers_weight} must be >= 0")
        self.check_parallel()

    @property
    def generated_windows(self) -> int:
        """Windows of each batch sampled from the teacher: round(generated x batch_size)."""
        return round(self.generated * self.batch_size)

    def check_parallel(self) -> None:
        """fsdp needs torchrun (its processes are what it shards over) and a batch the world divides (each rank takes
        batch_size / N windows); read from the launcher's environment, before any process group exists."""
        if self.parallel not in PARALLEL:
            raise HeadlabError(f"unknown parallel={self.parallel!r}; use one of {', '.join(PARALLEL)}")
        if self.whole_after not in WHOLE_AFTER:
            raise HeadlabError(f"unknown whole_after={self.whole_after!r}; use one of {', '.join(WHOLE_AFTER)}")
        if self.parallel != "fsdp":
            return
        if self.generated:  # sampling runs the sharded teacher's forward per token; not built or tested under FSDP
            raise HeadlabError(
                "generated windows are not available with parallel=fsdp; use parallel=data, or generated=0"
            )
        if not distributed.torchrun():
            raise HeadlabError(
                "parallel=fsdp shards over torchrun processes; start the command with torchrun --nproc-per-node N "
                "(N >= 1), or leave parallel=data"
            )
        world = distributed.launched_world()
        if self.batch_size % world:
            raise HeadlabError(
                f"batch_size={self.batch_size} is not divisible by the {world} torchrun processes: under parallel=fsdp "
                f"it is the batch of all of them together, batch_size / {world} windows each"
            )


def check_uptrain(steps: int, lr: float, eval_every: int | None = None, **more) -> UptrainConfig:
    """The config for these settings, checked (the CLI calls it before loading anything)."""
    config = UptrainConfig(steps=steps, lr=lr, eval_every=eval_every, **more)
    config.check()
    return config


def trained_parameters(loaded: LoadedModel, trained: str = "attention") -> list[torch.nn.Parameter]:
    """attention: attention modules and their output projections; norms: those plus every normalisation layer's
    parameters (found by class name: *Norm*); all: every parameter. Deduplicated, in model order."""
    if trained == "all":
        return list(loaded.model.parameters())
    params = attention_parameters(loaded)
    if trained == "norms":
        norms = [m for m in loaded.model.modules() if "norm" in type(m).__name__.lower()]
        params = _unique([*params, *(p for module in norms for p in module.parameters(recurse=False))])
    return params


def token_losses(student_logits, teacher_logits, input_ids, valid) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean KL(p_teacher || p_student) over valid positions, or NaN without a teacher; mean next-token
    cross-entropy -ln p_student(x_{t+1} | x_<=t) over valid pairs). logits [B, T, V], input_ids/valid [B, T]."""
    valid = valid.to(student_logits.device)
    kl = torch.tensor(math.nan)
    if teacher_logits is not None:
        kl = distillation_loss(student_logits, teacher_logits, valid)
    log_s = torch.log_softmax(student_logits[:, :-1].float(), -1)  # [B, T-1, V]
    labels = input_ids[:, 1:].to(log_s.device)
    pairs = valid[:, 1:] & valid[:, :-1]
    nll = -log_s.gather(-1, labels[..., None])[..., 0]  # [B, T-1]
    return kl, nll[pairs].mean()


def layer_matching_loss(student_hidden, teacher_hidden, valid) -> torch.Tensor:
    """Mean over blocks l and valid positions t of ||h_s[l, t] - h_t[l, t]||^2 / ||h_t[l, t]||^2: each block's output
    matched to the teacher's (hidden-state distillation, Sun et al. 2019; Jiao et al. 2020). Per token, so the
    few positions with massive activations (the attention sink) weigh no more than any other. Entry 0 of transformers'
    hidden_states (the embeddings, never edited) is skipped; tensors [B, T, C], valid [B, T] bool."""
    errors = []
    for student, teacher in zip(student_hidden[1:], teacher_hidden[1:], strict=True):
        teacher = teacher.to(student.device).float()
        error = (student.float() - teacher).pow(2).sum(-1) / teacher.pow(2).sum(-1).clamp_min(1e-12)  # [B, T]
        errors.append(error[valid.to(error.device)].mean())
    return torch.stack(errors).mean()


def objective_value(kl, ce, config: UptrainConfig, layers=None) -> torch.Tensor:
    if config.objective == "kl":
        return kl
    if config.objective == "ce":
        return ce
    if config.objective == "kl_layers":
        return kl + config.layers_weight * layers
    return (1 - config.ce_weight) * kl + config.ce_weight * ce


def learning_rate(step: int, total: int, config: UptrainConfig) -> float:
    """Step s (1-based) of `total`: linear warmup over ceil(warmup x total) steps, then cosine decay to zero."""
    warm = math.ceil(config.warmup * total)
    if step <= warm:
        return config.lr * step / warm
    progress = (step - warm) / max(total - warm, 1)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def heldout_split(tokenizer, text: str, tokens: int) -> tuple[str, torch.Tensor]:
    """(training text, held-out ids): the last `tokens` tokens of the calibration text (at most a quarter of a short
    text) are held out; training streams from the text before them, so the two never overlap."""
    tail = text[-max(4096, 16 * tokens) :]
    offset = len(text) - len(tail)
    if offset == 0:  # the whole text was tokenized: keep three quarters of it for training
        tokens = min(tokens, len(tokenizer(text, add_special_tokens=False)["input_ids"]) // 4)
    if getattr(tokenizer, "is_fast", False) and tokens > 0:
        encoded = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        if len(ids) > tokens:
            ids = ids[-tokens:]
            return text[: offset + offsets[-tokens][0]], torch.tensor(ids, dtype=torch.long)
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return text[:offset], torch.tensor(ids[-tokens:] if tokens > 0 else [], dtype=torch.long)


def stream_batches(tokenizer, text: str, config: UptrainConfig, pad_id: int, chunk_chars: int = 200_000):
    """Endless training batches (input_ids, attention_mask, epoch) streamed from `text`: tokenized a chunk of
    characters at a time, cut into seq_len windows, shuffled within the chunk (seeded), cycling over the whole text
    (no cap: a long run sees every window before any repeats). Under torchrun each rank takes every N-th window."""
    generator = torch.Generator().manual_seed(config.seed)
    epoch = 0
    while True:
        produced = 0
        for begin in range(0, len(text), chunk_chars):
            ids, _ = tokenize(tokenizer, text[begin : begin + chunk_chars])
            windows = chunk_windows(len(ids), config.seq_len, min_len=max(2, config.seq_len // 4))
            order = torch.randperm(len(windows), generator=generator).tolist()
            windows = distributed.shard([windows[i] for i in order])
            for input_ids, attention_mask, _ in batch_windows(ids, windows, config.batch_size, pad_id):
                produced += 1
                yield input_ids, attention_mask, epoch
        if not produced:
            raise HeadlabError(f"the calibration text is too short for seq_len={config.seq_len}")
        epoch += 1


@torch.no_grad()
def heldout_perplexity(student: LoadedModel, batches: list, bf16: bool = False) -> float:
    """exp(mean next-token cross-entropy) of the student on the held-out calibration batches (token-weighted)."""
    total, count = 0.0, 0
    device = student.device
    for input_ids, attention_mask, *_ in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = student.model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
            ).logits
        _, ce = token_losses(logits, None, input_ids, attention_mask.bool())
        pairs = int((attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()).sum())
        total, count = total + float(ce) * pairs, count + pairs
    return math.exp(total / max(count, 1))


def default_bf16(device: torch.device) -> bool:
    """bfloat16 autocast by default where products are fast in it: CUDA, and CPUs with native bfloat16 kernels
    (AVX512-BF16 or AMX; uptraining measured 1.4x faster on such a 2-core CPU at the same perplexity on four
    domains, docs/recovery.md). Elsewhere float32: without those kernels torch's bfloat16 products are far slower."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_matmul.native_half_matmul())


def _train_step(student, teacher, stream, optimizer, params, step, lr, config, bf16) -> dict:
    """One optimiser step over `accumulation` micro-batches; returns the step's record (losses, tokens, grad norm)."""
    model, device = student.model, student.device
    optimizer.zero_grad(set_to_none=True)
    sums, tokens, epoch = {"loss": 0.0, "kl": 0.0, "ce": 0.0}, 0, 0
    matching = config.objective == "kl_layers"
    for _ in range(config.accumulation):
        input_ids, attention_mask, epoch, *scored = next(stream)  # retrieval windows add a mask of scored positions
        teacher_out = None
        if config.objective != "ce":
            # the teacher under the student's autocast too: its forward is a third of a step's products
            with torch.no_grad(), torch.autocast(teacher.device.type, dtype=torch.bfloat16, enabled=bf16):
                teacher_out = teacher.model(
                    input_ids=input_ids.to(teacher.device),
                    attention_mask=attention_mask.to(teacher.device),
                    use_cache=False,
                    output_hidden_states=matching,
                )
        model.eval()  # no dropout; activation_checkpointing still recomputes the blocks
        ids, mask = input_ids.to(device), attention_mask.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=matching)
        valid = scored[0] if scored else mask.bool()
        kl, ce = token_losses(out.logits, teacher_out.logits if teacher_out is not None else None, ids, valid)
        layers = layer_matching_loss(out.hidden_states, teacher_out.hidden_states, valid) if matching else None
        loss = objective_value(kl, ce, config, layers)
        if not torch.isfinite(loss):
            raise HeadlabError(
                f"the {config.objective} loss is not finite at step {step} (lr {lr:.3g}); lower the learning rate (lr=)"
            )
        # KL exactly 0: the student reproduces the teacher on this batch, and the gradient is rounding noise that
        # Adam's per-parameter normalisation would blow up into a real step. Nothing to learn from it.
        if not (config.objective in ("kl", "kl_layers") and float(loss.detach()) == 0.0):
            (loss / config.accumulation).backward()
        sums = {k: v + float(x.detach()) / config.accumulation for (k, v), x in zip(sums.items(), (loss, kl, ce))}
        tokens += int(attention_mask.sum())
    if distributed.active():
        if not distributed.lockstep(model):  # data parallel: every rank applies the mean gradient
            for p in params:  # (FSDP2 has reduce-scattered the mean gradient's shards in backward already)
                if p.grad is not None:
                    distributed.all_reduce_sum(p.grad).div_(distributed.world_size())
        tokens = int(distributed.all_reduce_sum(torch.tensor(float(tokens), dtype=torch.float64)))
        # the curve records the step's loss over every rank's windows, not rank 0's share
        reduced = distributed.all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64))
        sums = dict(zip(sums, (reduced / distributed.world_size()).tolist()))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.clip if config.clip > 0 else math.inf)
    grad_norm = fsdp.full_value(grad_norm)  # FSDP: the norm over every rank's shards (a collective on each rank)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return {**sums, "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens, "epoch": epoch}


def heldout_sets(tokenizer, corpus: Corpus, tokens: int) -> tuple[str, dict[str, torch.Tensor]]:
    """(training text, held-out ids per domain) of the calibration part. A corpus of one domain holds out its last
    `tokens` tokens (heldout_split). A multi-domain corpus (built-in `broad`) holds out, per domain, the last
    tokens // domains tokens of that domain's last calibration chunks; training streams from the other chunks, so
    the held-out text mixes every domain in equal shares and is never trained on."""
    part = split_text(corpus, "calibration")
    if corpus.document_domains is None:
        train_text, ids = heldout_split(tokenizer, part.text, tokens)
        return train_text, {corpus.spec: ids}
    calibration = _calibration_documents(corpus)
    order = list(corpus.meta.get("domains", {}))  # the corpus's own domain order, then any other by name
    names = sorted({d for d, _ in calibration}, key=lambda d: (order.index(d) if d in order else len(order), d))
    share = max(1, tokens // len(names))
    held, sets = set(), {}
    for name in names:
        chosen = []
        for index in reversed([i for i, (domain, _) in enumerate(calibration) if domain == name]):
            chosen.insert(0, index)
            ids, _ = tokenize(tokenizer, DOCUMENT_SEPARATOR.join(calibration[i][1] for i in chosen))
            if len(ids) >= share or len(chosen) * 4 >= sum(d == name for d, _ in calibration):
                break  # enough tokens, or a quarter of the domain's chunks already (a short corpus keeps most)
        held.update(chosen)
        sets[name] = ids[-share:]
    train = [piece for i, (_, piece) in enumerate(calibration) if i not in held]
    return DOCUMENT_SEPARATOR.join(train), sets


def _calibration_documents(corpus: Corpus) -> list[tuple[str, str]]:
    """(domain, document) of the documents before the corpus's cut (its calibration part)."""
    documents, end = [], 0
    for domain, document in zip(corpus.document_domains, corpus.documents):
        end += len(document)
        if end > corpus.cut:
            break
        documents.append((domain, document))
        end += len(DOCUMENT_SEPARATOR)
    return documents


def heldout_batches(student: LoadedModel, sets: dict[str, torch.Tensor], seq_len: int, batch_size: int) -> dict:
    """Per domain, its held-out ids as padded seq_len windows."""
    tokenizer = student.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {
        name: list(batch_windows(ids, chunk_windows(len(ids), seq_len), batch_size, pad_id))
        for name, ids in sets.items()
    }


def _data(student: LoadedModel, corpus: Corpus, config: UptrainConfig, teacher: LoadedModel | None = None,
          bf16: bool = False):  # fmt: skip
    """(training streams, held-out batches per domain, record, teacher samples or None): training windows stream
    from the calibration part without its held-out text (heldout_sets), with config.generated of each short batch
    sampled from the teacher (headlab.recovery.teacher_samples); the eval part is never touched here."""
    tokenizer = student.tokenizer
    for name in ("seq_len", "long_seq_len"):
        if student.max_positions is not None and getattr(config, name) > student.max_positions:
            raise HeadlabError(
                f"{name}={getattr(config, name)} exceeds the model's maximum positions ({student.max_positions})"
            )
    part = split_text(corpus, "calibration")
    train_text, sets = heldout_sets(tokenizer, corpus, config.heldout_tokens)
    for name, ids in sets.items():
        require_tokens(ids, f"the held-out calibration text of {corpus.spec!r} ({name})")
    if not train_text.strip():
        raise HeadlabError(
            f"the calibration part of {corpus.spec!r} is too short to hold out {config.heldout_tokens} tokens"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Every rank runs every held-out batch (the same forwards on each: FSDP's collectives stay in step), whole.
    heldout = heldout_batches(student, sets, config.seq_len, config.batch_size)
    record = {
        **part.describe(),
        "training_characters": len(train_text),
        "heldout_tokens": int(sum(len(ids) for ids in sets.values())),
        "heldout_domains": {name: int(len(ids)) for name, ids in sets.items()},
        "heldout": "per domain, the last tokens of its calibration text; training streams from the rest",
    }
    if config.parallel == "fsdp":  # batch_size is the world's: this rank streams its share of each batch
        config = replace(config, batch_size=config.batch_size // distributed.world_size())
    samples = None
    if config.generated:
        most = config.steps * config.accumulation * config.generated_windows  # never sample more than a run can use
        samples = TeacherSamples(teacher, config.seq_len, config.seed, bf16, limit=most, start=config.generated_start)
        record["generated"] = {
            "windows_per_batch": config.generated_windows,
            "start": config.generated_start,
            "sampling": "the teacher's next-token distribution at temperature 1 (whole vocabulary), from the prefix "
            "token, seq_len tokens a window",
            "method": "LLM-QAT's data-free distillation (Liu et al. 2023)",
        }
    if config.long_seq_len:  # long_batch_size whole windows per micro-batch and rank (under fsdp, none is split)
        long = replace(config, seq_len=config.long_seq_len, batch_size=config.long_batch_size, seed=config.seed + 1)
        record["long_windows"] = {"seq_len": config.long_seq_len, "every": config.long_every, "kind": config.long_kind,
                                  "batch_size": config.long_batch_size}  # fmt: skip
        if config.long_kind == "retrieval":
            long_stream = retrieval_batches(tokenizer, train_text, config.long_seq_len, config.seed,
                                            batch_size=config.long_batch_size, pad_id=pad_id)  # fmt: skip
            record["long_windows"] |= {"tasks": list(RETRIEVAL_TASKS), "loss": "the answer tokens and the newline"}
        else:
            long_stream = stream_batches(tokenizer, train_text, long, pad_id)
        streams = (_short_stream(tokenizer, train_text, config, pad_id, samples), long_stream)
    else:
        streams = (_short_stream(tokenizer, train_text, config, pad_id, samples), None)
    return streams, heldout, record, samples


def _short_stream(tokenizer, train_text: str, config: UptrainConfig, pad_id: int, samples: TeacherSamples | None):
    """The short-window batches: calibration windows, or batch_size - n of them and n sampled from the teacher."""
    if samples is None:
        return stream_batches(tokenizer, train_text, config, pad_id)
    own = config.batch_size - config.generated_windows
    calibration = stream_batches(tokenizer, train_text, replace(config, batch_size=own), pad_id) if own else None
    return mixed_batches(calibration, samples, config.generated_windows, pad_id)


def domain_perplexities(student: LoadedModel, heldout: dict, bf16: bool = False) -> dict[str, float]:
    """Held-out perplexity of each domain (heldout_perplexity on its batches)."""
    return {name: heldout_perplexity(student, batches, bf16) for name, batches in heldout.items()}


def combined(perplexities: dict[str, float]) -> float:
    """The held-out perplexity that ranks states: exp(mean over domains of ln perplexity), each domain weighted
    equally (one domain: its perplexity)."""
    return math.exp(sum(math.log(p) for p in perplexities.values()) / len(perplexities))


@dataclass
class _Best:
    """The trained parameters' state with the lowest combined held-out perplexity so far among the states no worse
    than the start on any held-out domain (the start included): what uptrain hands back."""

    perplexity: float  # combined() of `domains`
    step: int
    state: list[torch.Tensor]
    domains: dict[str, float] = field(default_factory=dict)
    start: dict[str, float] = field(default_factory=dict)
    refused: list[dict] = field(default_factory=list)  # better overall but worse on a domain: not kept

    @classmethod
    def of(cls, params: list[torch.nn.Parameter], domains: dict[str, float], step: int = 0) -> _Best:
        return cls(combined(domains), step, [p.detach().clone() for p in params], dict(domains), dict(domains))

    def offer(self, params: list[torch.nn.Parameter], domains: dict[str, float], step: int) -> None:
        """Keep the current state when it is better (strictly lower combined held-out perplexity) and no domain's
        held-out perplexity is above the start's."""
        value = combined(domains)
        if not value < self.perplexity:
            return
        worse = [name for name, p in domains.items() if not p <= self.start[name]]
        if worse:
            self.refused.append({"step": step, "worse_domains": worse})
            return
        self.perplexity, self.step, self.domains = value, step, dict(domains)
        self.state = [p.detach().clone() for p in params]

    @torch.no_grad()
    def restore(self, params: list[torch.nn.Parameter]) -> None:
        for p, kept in zip(params, self.state):
            p.copy_(kept)


@dataclass
class _Run:
    """One uptraining run's fixed parts, built from the spec (UptrainConfig) before the first step."""

    student: LoadedModel
    teacher: LoadedModel | None
    config: UptrainConfig
    corpus: Corpus
    streams: tuple[Iterator, Iterator | None]  # training batches (stream_batches): short windows, long windows
    heldout: dict  # held-out calibration batches per domain
    data_record: dict
    bf16: bool
    params: list[torch.nn.Parameter]  # the trained ones
    optimizer: torch.optim.Optimizer
    eval_args: dict = field(default_factory=dict)
    dead: list[list[int]] | None = None  # dead heads per layer, read before any sharding
    samples: TeacherSamples | None = None  # the teacher's sampled windows (config.generated), for the record

    def stream(self, step: int) -> Iterator:
        """The batches of this step: long windows every long_every-th step when configured, else short ones."""
        short, long = self.streams
        return long if long is not None and step % self.config.long_every == 0 else short

    def evaluate(self) -> float:
        """Eval-split perplexity for the curve (NaN with --eval-tokens 0)."""
        if self.config.eval_tokens == 0:
            return math.nan
        self.student.model.eval()
        return perplexity(self.student, self.corpus, progress=False, **self.eval_args).perplexity

    def heldout_perplexities(self) -> dict[str, float]:
        return domain_perplexities(self.student, self.heldout, self.bf16)


def uptrain(
    student: LoadedModel,
    teacher: LoadedModel | None,
    *,
    data: Corpus | str | None = None,
    text_column: str | None = None,
    config: UptrainConfig | None = None,
    progress: bool = True,
    **settings,
) -> UptrainResult:
    """Train the student towards the teacher (config.objective) on streamed calibration windows, in place, and keep
    the state with the lowest held-out calibration perplexity (the start included), so the returned student is never
    worse on held-out calibration text than the one given. `settings` override fields of `config`.

    Curve: one row per step (lr, loss, kl, ce, tokens, grad_norm, seconds), held-out perplexity at the checks, and
    eval-split perplexity at step 0, every eval_every steps and at the end (the eval split only reports).
    Steps: check and prepare the data (`_prepare`), the optimiser (`_optimiser`), the loop with held-out checks that
    keep the best state (`_train`), the record (`_record`)."""
    config = replace(config or UptrainConfig(), **settings)
    corpus = _check(student, teacher, data, text_column, config)
    trains_on = torch.device(config.shards_on) if config.parallel == "fsdp" and config.shards_on else student.device
    bf16 = default_bf16(trains_on) if config.bf16 is None else config.bf16
    streams, heldout, data_record, samples = _data(student, corpus, config, teacher, bf16)
    # under fsdp only rank 0 may hold the weights before sharding (the others pass a skeleton): its finding is sent
    dead = distributed.from_rank0(lambda: _dead_per_layer(student))
    held = _held_before_sharding(student, teacher) if config.parallel == "fsdp" else None
    training = _parallel(student, teacher, config, trains_on)  # fsdp: sharded copies, values back on exit
    with training as (student, teacher):
        params, optimizer = _optimiser(student, config)
        torch.manual_seed(config.seed)
        eval_args = dict(
            split="eval", seq_len=config.eval_seq_len, max_tokens=config.eval_tokens, batch_size=config.batch_size
        )
        run = _Run(
            student, teacher, config, corpus, streams, heldout, data_record, bf16, params, optimizer, eval_args, dead
        )
        run.samples = samples
        start = time.perf_counter()
        best = _Best.of(params, run.heldout_perplexities())
        rows = [_first_row(best.perplexity, run.evaluate())]
        if len(best.start) > 1:
            rows[0].update({f"heldout_{name}": value for name, value in best.start.items()})
        loop = _train(run, best, rows, start, progress)
        curve = pd.DataFrame(rows)
        final = curve["perplexity"].iloc[-1] if best.step == loop["steps_run"] else run.evaluate()
        record = _record(run, best, rows, loop, float(final), start)
    if held is not None:
        record["weights_held_before_sharding"] = held
    return UptrainResult(curve, record)


def _dead_per_layer(student: LoadedModel) -> list[list[int]]:
    """Each layer's dead heads (zero output-projection blocks); for a skeleton, whose ranks read their own shards
    under fsdp, from its checkpoint, one attention module at a time (streaming's LayerEditor materialises it)."""
    if not fsdp.is_skeleton(student.model):
        return [dead_heads(student, layer) for layer in student.layers]
    reader = fsdp.checkpoint_reader(student)
    if reader is None:
        raise HeadlabError(f"{student.spec}: its weights are not loaded and its checkpoint cannot be read in shards")
    found: list[list[int]] = []
    editor = LayerEditor(student.model, student.layers, reader, lambda layer: found.append(dead_heads(student, layer)))
    for layer in student.layers:
        editor.convert(layer)
    return found


def _held_before_sharding(student: LoadedModel, teacher: LoadedModel | None) -> dict[str, int]:
    """Bytes of student and teacher weights each process held before FSDP sharded them: rank 0's, and the most any
    other rank held (0 when they passed skeletons, as the CLI's do)."""
    held = fsdp.bytes_held(student.model) + (fsdp.bytes_held(teacher.model) if teacher is not None else 0)
    others = distributed.all_reduce_max(float(held if distributed.rank() > 0 else 0))
    return {"rank 0": distributed.from_rank0(lambda: held), "other ranks, at most": int(others)}


@contextlib.contextmanager
def _parallel(student: LoadedModel, teacher: LoadedModel | None, config: UptrainConfig, trains_on: torch.device):
    """(student, teacher) to train with: the models themselves (data), or FSDP2-sharded copies on `trains_on` (fsdp;
    the trained parameters chosen before sharding, so FSDP reduces gradients for those alone) whose values the models
    get back on exit (headlab.recovery.fsdp.sharded)."""
    if config.parallel != "fsdp":
        yield student, teacher
        return
    names = {id(p): name for name, p in student.model.named_parameters()}
    trained = {names[id(p)] for p in trained_parameters(student, config.trained)}
    options = dict(device=trains_on, whole_after=config.whole_after)
    with contextlib.ExitStack() as stack:
        sharded_student = stack.enter_context(fsdp.sharded(student, trained, **options))
        teacher_options = dict(options, frozen=True)  # read from its files: not gathered back (nothing changed)
        sharded_teacher = stack.enter_context(fsdp.sharded(teacher, **teacher_options)) if teacher is not None else None
        yield sharded_student, sharded_teacher


def _check(student, teacher, corpus, text_column, config: UptrainConfig) -> Corpus:
    """Bad settings, a missing teacher or a mismatched pair fail before any work; returns the resolved corpus."""
    config.check()
    if config.objective != "ce" and teacher is None:
        raise HeadlabError(f"the {config.objective} objective needs a teacher")
    if teacher is not None:
        check_pair(student, teacher)
    check_resident(student, "uptraining")
    dispatched = [m.spec for m in (student, teacher) if m is not None and getattr(m.model, "hf_device_map", None)]
    if config.parallel == "fsdp" and dispatched:  # accelerate's hooks move activations; FSDP would shard under them
        raise HeadlabError(f"parallel=fsdp cannot shard {dispatched[0]}: it is spread over devices by a device map")
    return corpus if isinstance(corpus, Corpus) else load_corpus(corpus, text_column)


def _optimiser(student: LoadedModel, config: UptrainConfig) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The trained parameters (config.trained) and their AdamW (weight decay 0; the lr is set at every step)."""
    params = trained_parameters(student, config.trained)
    return params, torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)


def _first_row(heldout: float, perplexity_now: float) -> dict:
    """The curve's step 0: the start, before any training."""
    return {
        "step": 0,
        "lr": 0.0,
        "loss": math.nan,
        "kl": math.nan,
        "ce": math.nan,
        "tokens": 0,
        "seconds": 0.0,
        "heldout_perplexity": heldout,
        "perplexity": perplexity_now,
    }


def _train(run: _Run, best: _Best, rows: list[dict], start: float, progress: bool) -> dict:
    """The loop: optimiser steps until config.steps or the minutes cap, held-out checks offering each state to
    `best`, eval-split points for the curve (appended to `rows`). Afterwards, also after an error, the model is in
    eval mode with the best state and its own requires_grad flags. Returns the loop's counts."""
    config, model = run.config, run.student.model
    total = config.steps  # the budget; the schedule never depends on the machine's speed
    deadline = start + (config.minutes * 60 if config.minutes is not None else math.inf)
    trained = {id(p) for p in run.params}
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    restore = contextlib.ExitStack()
    checkpointing = restore.enter_context(activation_checkpointing(model, config.gradient_checkpointing))
    kept_dead = restore.enter_context(dead_heads_kept(run.student, run.dead))  # pruned heads stay pruned
    tokens_seen, step = 0, 0
    bar = tqdm(total=total, desc="uptrain", disable=not progress, unit="step")
    try:
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
        while step < total and not _late(deadline):
            step += 1
            lr = learning_rate(step, total, config)
            row = _train_step(
                run.student, run.teacher, run.stream(step), run.optimizer, run.params, step, lr, config, run.bf16
            )
            tokens_seen += row["tokens"]
            row.update(step=step, tokens=tokens_seen, heldout_perplexity=math.nan, perplexity=math.nan)
            _checkpoints(run, best, row, total, last=step >= total or _late(deadline))
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2g}")
    finally:
        bar.close()
        restore.close()
        model.eval()
        run.optimizer.zero_grad(set_to_none=True)
        best.restore(run.params)  # the best state is what the caller gets, also after an error
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
    return {
        "steps_run": step,
        "steps_planned": total,
        # the cap, not the budget, ended the run: the schedule was cut short (the best state is still what is kept)
        "stopped_on_time": step < total,
        "tokens_seen": tokens_seen,
        "gradient_checkpointing": checkpointing,
        "dead_heads_kept": kept_dead,
    }


def _late(deadline: float) -> bool:
    """Past the --minutes deadline, as every rank agrees (the latest clock decides): under torchrun all ranks stop on
    the same step, or the collectives of the next one (gradients, FSDP's all-gathers) would wait for a rank gone."""
    if deadline == math.inf:
        return False
    return bool(distributed.all_reduce_max(float(time.perf_counter() >= deadline)))


def _checkpoints(run: _Run, best: _Best, row: dict, total: int, last: bool) -> None:
    """At a held-out check (every heldout_every steps [default: about 8 per run] and the last step) offer the state
    to `best`; at an eval point (every eval_every steps and the last) add the eval-split perplexity to `row`."""
    config, step = run.config, row["step"]
    every = config.heldout_every or max(1, total // 8)
    if step % every == 0 or last:
        domains = run.heldout_perplexities()
        row["heldout_perplexity"] = combined(domains)
        if len(domains) > 1:
            row.update({f"heldout_{name}": value for name, value in domains.items()})
        best.offer(run.params, domains, step)
    if (config.eval_every and step % config.eval_every == 0) or last:
        row["perplexity"] = run.evaluate()


def _record(run: _Run, best: _Best, rows: list[dict], loop: dict, final: float, start: float) -> dict:
    """The run's metadata: who trained what with which recipe, the counts, held-out and eval perplexities."""
    config = run.config
    student_bytes = fsdp.local_bytes(run.student.model, optimizer=run.optimizer)
    teacher_bytes = fsdp.local_bytes(run.teacher.model if run.teacher is not None else None)["parameters"]
    memory = {
        "student_parameters": student_bytes["parameters"],
        "teacher_parameters": teacher_bytes,
        "optimiser_state": student_bytes["optimiser_state"],
        "total": student_bytes["total"] + teacher_bytes,
    }
    calibration = dict(run.data_record)
    if run.samples is not None:  # how many windows were sampled, and the seconds that took
        calibration["generated"] = calibration["generated"] | run.samples.record()
    return {
        "student": run.student.describe(),
        "teacher": run.teacher.describe() if run.teacher is not None else None,
        "config": asdict(config),
        "objective": {
            "kl": "mean KL(p_teacher || p_student) per token, temperature 1",
            "ce": "mean next-token cross-entropy",
            "mixed": f"(1 - {config.ce_weight}) KL + {config.ce_weight} CE",
            "kl_layers": f"KL + {config.layers_weight} x mean block-output relative squared error",
        }[config.objective],
        "schedule": "AdamW (weight decay 0), linear warmup, cosine decay to 0, global-norm clipping",
        "trained_parameters": sum(p.numel() for p in run.params),
        "steps_run": loop["steps_run"],
        "steps_planned": loop["steps_planned"],
        "stopped_on_time": loop["stopped_on_time"],
        "stopped_by": "the --minutes cap" if loop["stopped_on_time"] else "the step budget",
        "tokens_seen": loop["tokens_seen"],
        "epochs_started": int(max(r.get("epoch", 0) for r in rows)) + 1,
        "kept_step": best.step,
        "heldout_perplexity_before": rows[0]["heldout_perplexity"],
        "heldout_perplexity_after": best.perplexity,
        "heldout_domains_before": best.start,
        "heldout_domains_after": best.domains,
        "refused_worse_on_a_domain": best.refused,
        "perplexity_before": rows[0]["perplexity"],
        "perplexity_after": final,
        "gradient_checkpointing": loop["gradient_checkpointing"],
        "dead_heads_kept": loop["dead_heads_kept"],
        "bf16_autocast": run.bf16,
        "processes": distributed.world_size(),
        "parallel": config.parallel if distributed.torchrun() else "none (one process)",
        # what this process held at the end (local shards under fsdp): the student's and teacher's parameters and
        # the AdamW state; rank 0's numbers (FSDP's dim-0 shards differ between ranks by padding at most)
        "bytes_per_process": memory,
        "sharded_bytes_per_process": memory["total"],
        "calibration": calibration,
        "eval": {"data": run.corpus.spec, **run.eval_args},
        "seconds": time.perf_counter() - start,
    }
