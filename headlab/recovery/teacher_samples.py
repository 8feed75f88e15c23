"""Windows sampled from the teacher for uptraining: text in the unedited model's own distribution, mixed into the
calibration windows (`UptrainConfig.generated`).

Distilling on calibration text alone teaches the student that text: the default recovery of the svd merge 3 -> 1 cut
perplexity on its calibration corpus to 0.34x and on two corpora it never saw to 0.53x and 0.56x (docs/recovery.md,
"What moves out-of-domain recovery").
Text the teacher writes itself, from its prefix token with nothing else to condition on, is a sample of everything
it was trained on, so a KL towards the teacher on it restores the model where the calibration corpus has no text.
This is LLM-QAT's data-free distillation (Liu et al. 2023, "LLM-QAT: Data-Free Quantization Aware Training for Large
Language Models"): next tokens sampled from the full-precision model, then distillation on the samples.

Sampling: ancestral, temperature 1 over the whole vocabulary (no top-k or top-p, which would train on a narrower
distribution than the teacher's), from the prefix token (BOS, else EOS, as in headlab's perplexity), seq_len tokens
a window, a batch of windows at a time with the KV cache, from a seeded generator of its own: the same seed gives the
same windows on any run. An end-of-text token mid-window is kept, and the teacher's continuation after it too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from headlab.core import distributed
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.measure.evaluate import _prefix_token
from headlab.measure.stats import special_token_ids
from headlab.recovery.choices import GENERATED_STARTS

SEED_OFFSET = 104729  # the samples' generator: the run's seed plus this (plus the rank under torchrun)
# Windows sampled together: one prefill and seq_len - 1 cached decode steps for all of them. A decode step's cost is
# mostly per-step overhead on a CPU: 6.1 ms a token at 32 windows, 4.2 at 64, 3.2 at 128 (the embedded model, 2 cores,
# bfloat16), so larger chunks sample faster; the run's limit keeps a short run from sampling a whole chunk it won't use.
CHUNK = 128


def prefix_token(tokenizer) -> int:
    """The token every sample starts from: BOS, else EOS (what headlab's perplexity puts before a text)."""
    token_id = _prefix_token(tokenizer)
    if token_id is None:
        raise HeadlabError(
            "sampling from the teacher needs a BOS or EOS token to start from; the tokenizer has neither"
        )
    return token_id


def ordinary_tokens(teacher: LoadedModel) -> torch.Tensor:
    """The ids a random start draws from: the model's vocabulary less its special ids (special_token_ids)."""
    vocab = int(teacher.model.config.get_text_config().vocab_size)
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[[i for i in special_token_ids(teacher) if 0 <= i < vocab]] = False
    return keep.nonzero().flatten()


@torch.no_grad()
def sample_windows(
    teacher: LoadedModel,
    count: int,
    seq_len: int,
    generator: torch.Generator,
    bf16: bool = False,
    start: str = "bos",
) -> torch.Tensor:
    """[count, seq_len] token ids: the prefix token, then (start "random") one token drawn uniformly from the
    ordinary vocabulary, then tokens each drawn from the teacher's next-token distribution softmax(logits) given the
    tokens before it (ancestral sampling, temperature 1)."""
    from transformers import DynamicCache  # start-up: transformers loads when sampling runs

    if start not in GENERATED_STARTS:
        raise HeadlabError(f"unknown start {start!r}; use one of {', '.join(GENERATED_STARTS)}")
    model, device = teacher.model, teacher.device
    ids = torch.full((count, 1), prefix_token(teacher.tokenizer), dtype=torch.long)
    if start == "random":  # LLM-QAT's first token: uniform over the vocabulary, so windows begin on every topic
        pool = ordinary_tokens(teacher)
        ids = torch.cat([ids, pool[torch.randint(len(pool), (count, 1), generator=generator)]], dim=1)
    step_ids, cache = ids, DynamicCache(config=model.config)
    for _ in range(seq_len - ids.shape[1]):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=step_ids.to(device), cache=cache, use_cache=True)  # writes `cache` in place
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1).cpu()  # float32: the sampled distribution itself
        step_ids = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, step_ids], dim=1)
    return ids


class TeacherSamples:
    """Endless windows sampled from the teacher, `chunk` at a time as they are asked for, but never more than `limit`
    in all unless more are asked for (the run's most: steps x accumulation x windows a batch); counts the windows
    taken and sampled and the seconds spent sampling (the record's)."""

    def __init__(self, teacher: LoadedModel, seq_len: int, seed: int, bf16: bool = False, chunk: int = CHUNK,
                 limit: int | None = None, start: str = "bos"):  # fmt: skip
        if teacher is None:
            raise HeadlabError("generated windows are sampled from the teacher; give one (or generated=0)")
        self.teacher, self.seq_len, self.bf16, self.chunk, self.limit = teacher, seq_len, bf16, chunk, limit
        self.start = start
        self.generator = torch.Generator().manual_seed(seed + SEED_OFFSET + distributed.rank())
        self.pending: list[torch.Tensor] = []
        self.windows, self.sampled, self.seconds = 0, 0, 0.0

    def take(self, count: int) -> torch.Tensor:
        """The next `count` windows, [count, seq_len]."""
        while len(self.pending) < count:
            missing = count - len(self.pending)
            size = max(missing, min(self.chunk, self.limit - self.sampled)) if self.limit is not None else self.chunk
            began = time.perf_counter()
            was_training = self.teacher.model.training
            self.teacher.model.eval()  # no dropout in the sampled distribution
            try:
                self.pending.extend(
                    sample_windows(self.teacher, size, self.seq_len, self.generator, self.bf16, self.start)
                )
            finally:
                self.teacher.model.train(was_training)
            self.seconds += time.perf_counter() - began
            self.sampled += size
        taken, self.pending = self.pending[:count], self.pending[count:]
        self.windows += count
        return torch.stack(taken)

    def record(self) -> dict:
        return {"windows": self.windows, "windows_sampled": self.sampled, "sampling_seconds": round(self.seconds, 3)}


def mixed_batches(calibration: Iterator, samples: TeacherSamples, generated: int, pad_id: int) -> Iterator:
    """Training batches (input_ids, attention_mask, epoch) of the calibration stream's windows (batches of batch_size
    - generated, or none when it is None) followed by `generated` windows sampled from the teacher; the calibration
    windows are right-padded to the samples' length (a chunk's last window can be shorter)."""
    while True:
        if calibration is None:
            ids = samples.take(generated)
            yield ids, torch.ones_like(ids), 0
            continue
        ids, mask, epoch = next(calibration)
        sampled = samples.take(generated)
        width = max(ids.shape[1], sampled.shape[1])
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad_id)
        mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=0)
        yield torch.cat([ids, sampled]), torch.cat([mask, torch.ones_like(sampled)]), epoch
