"""DuoAttention's gate optimisation (Xiao et al. 2024, section 3.2) as a KV-cache policy score: per KV head a gate
alpha in [0, 1] mixes full attention with attention over sinks + a recent window (alpha x full + (1 - alpha) x
streaming), the model's weights frozen; the gates are trained on synthetic passkey prompts to keep the unedited
model's next-token distribution where it emits the pass key, against an L1 pull towards streaming:

    L = mean over answer rows of KL(p_original || p_gated) + l1 x mean_h alpha_h,    alpha clipped to [0, 1]

A head whose gate stays high is one the answer needs whole. DuoAttention distils the final hidden states over the
answer span; headlab distils the next-token distribution there (the same rows; a KL needs no per-architecture access
to the hidden states, and it is what recovery distils). The prompts are the retrieval statistic's passkey prompts
(headlab.measure.stats.retrieval_sequences), so `gates` and `retrieval` read the same text."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.errors import HeadlabError
from headlab.kv.methods import GATE_STEPS
from headlab.measure.importance import frozen
from headlab.measure.stats import retrieval_sequences
from headlab.mechanisms.head_cache import LayerStreaming, head_gates
from headlab.recovery.uptrain import distillation_loss


@dataclass(frozen=True)
class GateSpec:
    """The gate optimisation: `steps` Adam steps at `lr` (each over all `prompts` passkey prompts of `length` tokens,
    None: the retrieval pass's 1,024 capped by the model's positions), L1 weight `l1` on the mean gate."""

    steps: int = GATE_STEPS
    lr: float = 0.05  # gates move at most about lr per Adam step: 24 steps can take a gate from 1 to near 0
    l1: float = 0.05  # DuoAttention's lambda
    prompts: int = 4
    length: int | None = None
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1 or self.prompts < 1:
            raise HeadlabError(f"gate optimisation needs steps >= 1 and prompts >= 1, got {self.steps}, {self.prompts}")
        if not (self.lr > 0 and self.l1 >= 0):
            raise HeadlabError(f"gate optimisation needs lr > 0 and l1 >= 0, got {self.lr}, {self.l1}")


def answer_batches(loaded, sequences) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per passkey sequence (ids, target) of retrieval_sequences: (input_ids [1, T], answer rows [1, T] bool, the
    unedited model's logits on those rows [R, V] in float32), one forward each."""
    batches = []
    with torch.no_grad():
        for ids, target in sequences:
            input_ids = torch.tensor([ids], device=loaded.device)
            rows = torch.tensor([[t >= 0 for t in target]], device=loaded.device)
            batches.append((input_ids, rows, answer_logits(loaded.model, input_ids, rows).float()))
    return batches


def answer_logits(model, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits of the answer rows only [R, V]: the answer sits at the prompt's end, so where the model's forward
    takes `logits_to_keep` only the positions from the first answer row on meet the vocabulary projection (the
    other rows' [T, V] logits, and their gradient, are never made)."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return model(input_ids=input_ids).logits[rows]
    keep = rows.shape[-1] - int(rows.any(0).nonzero()[0])
    return model(input_ids=input_ids, logits_to_keep=keep).logits[rows[:, -keep:]]


def gated_distillation(model, batches, backward: bool) -> float:
    """Mean over `batches` (answer_batches) of the mean KL(p_original || p_gated) over the answer rows, for the
    gates in force (head_gates); with `backward`, its gradient accumulates into the gates, one prompt at a time."""
    total = 0.0
    for input_ids, rows, teacher in batches:
        logits = answer_logits(model, input_ids, rows)
        loss = distillation_loss(logits[None], teacher[None], torch.ones(1, len(teacher), dtype=torch.bool))
        if backward:
            (loss / len(batches)).backward()
        total += float(loss.detach()) / len(batches)
    return total


def gate_bands(loaded, sinks: int, window: int) -> dict[int, LayerStreaming]:
    """Per attention layer, the sinks + window band every KV head's streaming path reads."""
    return {layer.index: LayerStreaming(tuple(range(layer.num_kv_heads)), layer.num_kv_heads, layer.group_size,
                                        sinks, window)
            for layer in loaded.layers}  # fmt: skip


def optimized_gates(
    loaded, text, *, sinks: int, window: int, spec: GateSpec = GateSpec(), progress: bool = True
) -> tuple[pd.DataFrame, dict]:
    """(`layer, kv_head, head_dim, score`, meta): each KV head's trained gate alpha as its score (DuoAttention's
    optimisation, module docstring), on passkey prompts over `text`'s corpus part; meta records the recipe and, per
    step, the distillation loss and the mean gate before the step."""
    spec.check()
    sequences, prompts = retrieval_sequences(loaded, text, length=spec.length, count=spec.prompts, seed=spec.seed)
    if not sequences:
        raise HeadlabError(f"gate optimisation needs passkey prompts: {prompts['skipped']}")
    model, batches, bands = loaded.model, answer_batches(loaded, sequences), gate_bands(loaded, sinks, window)
    alpha = {i: torch.ones(band.num_kv_heads, device=loaded.device, requires_grad=True) for i, band in bands.items()}
    optimizer = torch.optim.Adam(alpha.values(), lr=spec.lr)
    history = []
    with frozen(model), head_gates(model, loaded.layers, {i: (bands[i], alpha[i]) for i in bands}):
        for _ in tqdm(range(spec.steps), desc="gates", unit="step", disable=not progress):
            optimizer.zero_grad(set_to_none=True)
            distill = gated_distillation(model, batches, backward=True)
            gates = torch.cat(list(alpha.values()))
            (spec.l1 * gates.mean()).backward()
            optimizer.step()
            with torch.no_grad():
                for gate in alpha.values():
                    gate.clamp_(0.0, 1.0)
            history.append({"kl": distill, "mean_gate": float(gates.detach().mean())})
    head_dims = {layer.index: layer.head_dim for layer in loaded.layers}
    frame = pd.DataFrame(
        [
            {"layer": index, "kv_head": head, "head_dim": head_dims[index], "score": float(value)}
            for index, gate in alpha.items()
            for head, value in enumerate(gate.detach().cpu())
        ]  # fmt: skip
    )
    meta = {"method": "DuoAttention gate optimisation (Xiao et al. 2024), KL on the answer rows + l1 x mean gate",
            **asdict(spec), "sinks": sinks, "window": window, "prompts_record": prompts,
            "steps_record": history}  # fmt: skip
    return frame, meta


__all__ = ["GateSpec", "answer_batches", "gate_bands", "gated_distillation", "optimized_gates"]
