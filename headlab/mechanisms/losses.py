"""Per-sequence next-token NLL with the vocabulary projection and cross-entropy computed in chunks of scored positions,
so the [B, T, V] logits never exist whole (the fused linear-cross-entropy idea of Liger Kernel and Cut Cross-Entropy).

The model runs with its LM head swapped for a stand-in that returns the final hidden states; the loss then projects
chunks of those rows itself and computes d loss / d hidden in the same sweep (the head's weights are frozen).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from headlab.core import distributed

# Bytes of float32 logits per chunk. Every chunk reads the whole [V, C] head weight twice (the projection and the
# gradient projection), so small chunks are bound by that traffic: at 8 MiB (42 rows of SmolLM2's 49,152 logits) the
# loss ran 2-2.5x slower than whole logits on CPU, at 32 MiB (170 rows) as fast (scripts/bench_cases/importance.py).
CHUNK_BYTES = 32 * 2**20
IGNORE = -100  # label of an unscored position (padding, the last position of a window), as in transformers

# Models whose forward changes the head's output (soft-capping, scaling, casting): found on their first batch and
# from then on given the plain loss.
_TRANSFORMED_LOGITS: weakref.WeakSet = weakref.WeakSet()


class _HiddenStates(nn.Module):
    """Stands in for the LM head during one forward: returns its input (the final hidden states) untouched."""

    def __init__(self):
        super().__init__()
        self.returned: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.returned = hidden
        return hidden


def _head_slot(model: nn.Module) -> tuple[nn.Module, str, nn.Linear] | None:
    """(parent module, attribute, head) of the model's LM head when the chunked loss can use it: a plain Linear whose
    weights are materialised on a device, not managed by accelerate hooks (device maps, offloading) and frozen."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if type(head) is not nn.Linear or head.weight.device.type == "meta" or hasattr(head, "_hf_hook"):
        return None
    if distributed.lockstep(model):  # FSDP2: the head's weight is whole only inside the model's own forward
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters()):
        return None  # training the head needs its weight gradient, which the chunked loss does not compute
    for name, module in model.named_modules():
        if module is head and name:
            parent_name, _, attribute = name.rpartition(".")
            return model.get_submodule(parent_name), attribute, head
    return None


@contextlib.contextmanager
def _hidden_states_instead_of_logits(parent: nn.Module, attribute: str):
    stand_in = _HiddenStates()
    head = getattr(parent, attribute)
    setattr(parent, attribute, stand_in)
    try:
        yield stand_in
    finally:
        setattr(parent, attribute, head)


class _ChunkedNLL(torch.autograd.Function):
    """nll[b] = sum_t [lse(W h_bt + c) - (W h_bt + c)_{y_bt}] over scored t, with dnll[b]/dh_bt = (softmax - onehot) W
    computed chunk by chunk in the forward (one sweep) and scaled by the incoming gradient in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels):
        B, T, C = hidden.shape
        V = weight.shape[0]
        accumulate = torch.promote_types(hidden.dtype, torch.float32)  # float32, float64 for a float64 model
        flat = hidden.reshape(B * T, C)  # [B*T, C]
        flat_labels = labels.reshape(-1)
        scored = (flat_labels != IGNORE).nonzero()[:, 0]  # [N] rows that carry a label; the others cost nothing
        nll = torch.zeros(B, dtype=accumulate, device=hidden.device)  # [B]
        want_grad = ctx.needs_input_grad[0]
        grad = torch.zeros(B * T, C, dtype=hidden.dtype, device=hidden.device) if want_grad else None  # [B*T, C]
        rows = max(1, CHUNK_BYTES // (4 * V))
        buffer = torch.empty(min(rows, len(scored)), V, dtype=accumulate, device=hidden.device)  # [r, V], reused
        for start in range(0, len(scored), rows):
            index = scored[start : start + rows]  # [r]
            targets = flat_labels[index][:, None]  # [r, 1]
            logits = _project(flat[index], weight, bias, buffer[: len(index)])  # [r, V]
            picked = logits.gather(1, targets)  # [r, 1], before the buffer is turned into probabilities
            peak, total = _exp_in_place(logits)
            nll.index_add_(0, index // T, (peak + total.log() - picked)[:, 0])  # lse - z_y, as torch.logsumexp
            if want_grad:
                probs = logits.div_(total)  # softmax: [r, V]
                probs.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=probs.dtype))  # softmax - onehot
                grad[index] = (probs.to(weight.dtype) @ weight).to(grad.dtype)  # [r, C]
        if want_grad:
            ctx.save_for_backward(grad)
            ctx.shape = (B, T, C)
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        (grad,) = ctx.saved_tensors
        B, T, C = ctx.shape
        scale = grad_nll.to(grad.dtype).view(B, 1, 1)  # each row's gradient scales with its own sequence's loss
        return grad.view(B, T, C) * scale, None, None, None


def _project(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """W h + c for rows [r, C] written into `out` [r, V] (a buffer reused across chunks: a fresh [r, V] tensor per
    chunk costs its page faults every time); cast through a temporary where the head's dtype is not out's."""
    if weight.dtype != out.dtype:
        return out.copy_(F.linear(rows, weight, bias))
    if bias is None:
        return torch.mm(rows, weight.t(), out=out)
    return torch.addmm(bias, rows, weight.t(), out=out)


def _exp_in_place(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, total) [r, 1] with m = max_v z_v and total = sum_v exp(z_v - m), so log-sum-exp = m + log total, turning
    `logits` into exp(z - m) in place: one exp pass and no temporary of the logits' size (torch.logsumexp and
    log_softmax allocate one)."""
    peak = logits.amax(dim=-1, keepdim=True)
    return peak, logits.sub_(peak).exp_().sum(dim=-1, keepdim=True)


def chunked_nll(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """Summed NLL per sequence [B] from final hidden states [B, T, C], the LM head and labels [B, T] (IGNORE = not
    scored); differentiable in `hidden` only: the head must be frozen (its weight gradient is not computed)."""
    if torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in (head.weight, head.bias)):
        raise ValueError("chunked_nll needs a frozen head (requires_grad False); use plain_nll to train the head")
    return _ChunkedNLL.apply(hidden, head.weight, head.bias, labels.to(hidden.device))


def plain_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed NLL per sequence [B] from whole logits [B, T, V] (float32 at least), the reference for chunked_nll."""
    B, T, V = logits.shape
    labels = labels.to(logits.device)  # under a device map the logits may live off the input device
    logits = logits.reshape(B * T, V).to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE, reduction="none")
    return nll.view(B, T).sum(1)  # [B]


def sequence_nll(model: nn.Module, input_ids, attention_mask, labels, *, chunked: bool = True) -> torch.Tensor:
    """L(x) = sum_t -log p(label_t | x) per sequence, [B]. With chunked=True and autograd on, the vocabulary is
    projected in chunks of scored positions (see chunked_nll) wherever the model hands its head's output back
    unchanged. Without autograd the loss uses whole logits: a no-grad score (ablation) then equals
    the same model's under a device map and does not depend on how positions fall into chunks."""
    wanted = chunked and torch.is_grad_enabled() and model not in _TRANSFORMED_LOGITS
    slot = _head_slot(model) if wanted else None
    if slot is None:
        return plain_nll(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    states, head = _states_without_head(model, input_ids, attention_mask, slot)
    return plain_nll(states, labels) if head is None else chunked_nll(states, head, labels)


@torch.no_grad()
def final_states(model: nn.Module, input_ids, attention_mask) -> tuple[torch.Tensor, nn.Module | None]:
    """(states, head): the final hidden states [B, T, C] and the LM head to project slices of them with, so that the
    whole [B, T, V] logits never exist; or (logits, None) where the head cannot be split off (device maps, a trained
    head, a forward that transforms the head's output such as Gemma's soft-capping)."""
    slot = _head_slot(model) if model not in _TRANSFORMED_LOGITS else None
    if slot is None:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits, None
    return _states_without_head(model, input_ids, attention_mask, slot)


def _states_without_head(model: nn.Module, input_ids, attention_mask, slot) -> tuple[torch.Tensor, nn.Module | None]:
    """(final hidden states, head) from one forward with the head at `slot` swapped for a stand-in; (whole logits,
    None) when the forward transformed the head's output (soft-capping, a scale, a cast): that transform would have
    been applied to hidden states, so the model is remembered and run again with its head."""
    parent, attribute, head = slot
    with _hidden_states_instead_of_logits(parent, attribute) as stand_in:
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    if out.logits is not stand_in.returned:
        _TRANSFORMED_LOGITS.add(model)
        return model(input_ids=input_ids, attention_mask=attention_mask).logits, None
    return out.logits, head


@torch.no_grad()
def picked_log_probs(states: torch.Tensor, head: nn.Module | None, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[i] | row i) in float32 (float64 for a float64 model), [N], for rows `states` [N, C] of final
    hidden states projected by `head` chunk by chunk (or [N, V] logits when head is None): log_softmax(W h + c)[y]."""
    accumulate = torch.promote_types(states.dtype, torch.float32)
    targets = targets.to(states.device)[:, None]
    if head is None:
        return torch.log_softmax(states.to(accumulate), dim=-1).gather(1, targets)[:, 0]
    rows = max(1, CHUNK_BYTES // (4 * head.out_features))
    picked = []
    # log_softmax here, not the in-place exp of _ChunkedNLL: its rounding is lm-evaluation-harness's, which
    # tests/test_lm_eval.py matches to 1e-6 in word perplexity (exp of a sum of thousands of log-probabilities).
    for start in range(0, len(states), rows):
        logits = head(states[start : start + rows]).to(accumulate)  # [r, V]
        picked.append(torch.log_softmax(logits, dim=-1).gather(1, targets[start : start + rows])[:, 0])
    return torch.cat(picked) if picked else states.new_zeros(0, dtype=accumulate)


__all__ = [
    "CHUNK_BYTES",
    "IGNORE",
    "chunked_nll",
    "final_states",
    "picked_log_probs",
    "plain_nll",
    "sequence_nll",
]
