"""Empirical Fisher information of the head gates (Kwon et al. 2022) and of each attention block's output (the
loss weighting of reconstruction-aware selection), from one forward + backward pass per calibration batch.

Per sequence x with S sequences, l(x) = L(x) / n_x is the mean next-token NLL of x (L summed, n_x scored tokens):
- gate gradient g_x = dl(x)/dxi at xi = 1 (the per-sequence gate gradients of `grad`, divided by n_x);
- diagonal Fisher F_hh = (1/S) sum_x g_xh^2; block-diagonal (per layer) F_l = (1/S) sum_x g_x,l g_x,l^T;
  the Fisher estimate of the mean-loss increase from removing a set R of a layer's heads is 1/2 1_R^T F_l 1_R
  (Kwon et al. 2022, "A Fast Post-Training Pruning Framework for Transformers", eq. 6 and the block-diagonal form).
- output Fisher of layer l: B_l = (1/N) sum_t d_t d_t^T over the N scored-token positions, d_t = dL(x)/do_t the
  gradient of the sequence's summed NLL with respect to the attention block's output at position t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from headlab import distributed
from headlab.errors import HeadlabError
from headlab.gates import head_gates
from headlab.importance import frozen, sequence_nll
from headlab.uptrain import activation_checkpointing


@dataclass
class FisherStatistics:
    """Per attention layer: `diagonal` [H_l], `block` [H_l, H_l], `mean_gradient` [H_l] (mean over sequences of
    dl(x)/dxi), and, when asked for, `output` [C, C] (the block-output Fisher B_l); `sequences`, `tokens` counted."""

    diagonal: list[torch.Tensor]
    block: list[torch.Tensor]
    mean_gradient: list[torch.Tensor]
    output: list[torch.Tensor] | None
    sequences: int
    tokens: int


def fisher_statistics(
    loaded, batches, *, mask=None, output_fisher: bool = False, progress: bool = True, gradient_checkpointing=False
) -> FisherStatistics:
    """One forward + backward per ScoringBatch with per-sequence gates [B, H_l] (parameters frozen); see the module
    docstring for the formulas. `mask`: gates [H_l] the statistics are taken at (heads already removed = 0)."""
    from headlab.importance import _base_gates

    model, device = loaded.model, loaded.device
    base = _base_gates(loaded, mask)
    dtype = torch.float64
    block = [torch.zeros(g.shape[0], g.shape[0], dtype=dtype) for g in base]
    first = [torch.zeros(g.shape[0], dtype=dtype) for g in base]
    output = None
    sequences = torch.zeros((), dtype=dtype)
    tokens = torch.zeros((), dtype=dtype)
    out_projs = [loaded.adapter.out_proj(layer) for layer in loaded.layers]
    captured: list = [None] * len(out_projs)
    hooks = []
    if output_fisher:
        output = [None] * len(out_projs)  # [C, C] each, sized at the first batch (Linear or GPT-2's Conv1D)

        def keep(index):
            def hook(module, args, result):
                captured[index] = result  # [B, T, C]: the block output whose gradient d_t we take

            return hook

        hooks = [p.register_forward_hook(keep(i)) for i, p in enumerate(out_projs)]
    try:
        with frozen(model), activation_checkpointing(model, gradient_checkpointing):
            for batch in tqdm(batches, desc="fisher", disable=not progress, unit="batch"):
                B = batch.input_ids.shape[0]
                gates = [g.expand(B, -1).clone().requires_grad_(True) for g in base]  # [B, H_l]
                with head_gates(loaded, gates):
                    nll = sequence_nll(model, batch, device)  # [B] summed NLL L(x)
                    wanted = gates + (list(captured) if output_fisher else [])
                    grads = torch.autograd.grad(nll.sum(), wanted)
                counts = (batch.labels != -100).sum(1).to(dtype)  # [B] scored tokens n_x
                live = counts > 0
                for l in range(len(base)):
                    g = grads[l].detach().to(dtype).cpu()[live] / counts[live, None]  # [B', H] dl(x)/dxi
                    block[l] += g.T @ g
                    first[l] += g.sum(0)
                sequences += float(live.sum())
                if output_fisher:
                    valid = (batch.labels != -100).to(device)  # positions whose prediction is scored
                    for l, d in enumerate(grads[len(base) :]):
                        rows = d.detach()[valid.to(d.device)].to(dtype)  # [N_b, C]
                        gram = (rows.T @ rows).cpu()
                        output[l] = gram if output[l] is None else output[l] + gram
                tokens += float(valid.sum()) if output_fisher else float((batch.labels != -100).sum())
    finally:
        for hook in hooks:
            hook.remove()
    for t in block + first + (output or []) + [sequences, tokens]:
        distributed.all_reduce_sum(t)
    S, N = float(sequences), float(tokens)
    if S == 0:
        raise HeadlabError("the calibration batches hold no scored tokens")
    block = [b / S for b in block]
    return FisherStatistics(
        diagonal=[torch.diagonal(b).clone() for b in block],
        block=block,
        mean_gradient=[f / S for f in first],
        output=None if output is None else [o / N for o in output],
        sequences=int(S),
        tokens=int(N),
    )


def fisher_scores(loaded, batches, *, mask=None, progress=True, gradient_checkpointing=False) -> list[torch.Tensor]:
    """I_h = F_hh = (1/S) sum_x (dl(x)/dxi_h)^2, the diagonal empirical Fisher of the gates (Kwon et al. 2022)."""
    stats = fisher_statistics(
        loaded, batches, mask=mask, progress=progress, gradient_checkpointing=gradient_checkpointing
    )
    return stats.diagonal
