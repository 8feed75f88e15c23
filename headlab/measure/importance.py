"""Head importance: gradient (Michel, Levy & Neubig 2019), Taylor and exact-ablation scorers over calibration text,
with the paper's normalisations, as a tidy per-head table (plus KV-group sums for GQA models).

Definitions (N = scored tokens of all sequences; L(x) = summed next-token NLL of sequence x, padding excluded; for
masked-LM encoders the NLL of the fixed-seed 15% masked tokens, as in headlab.measure.evaluate):
- grad:     I_h = (1/N) sum_x |dL(x)/dxi_h| at xi = 1, i.e. E_x |d meanNLL(x)/dxi_h| weighted by each sequence's
            scored tokens (Michel et al. 2019, the absolute value taken per sequence).
- taylor:   I_h = (1/N) sum_x sum_t |ctx_{t,h}^T dL(x)/dctx_{t,h}| (per token, Michel et al.'s code).
- ablation: I_h = (sum_x L(x) with head h gated to 0 - sum_x L(x)) / N, the exact loss increase (signed).
- fisher:   I_h = (1/S) sum_x (dl(x)/dxi_h)^2 over the S sequences, l(x) = L(x) / n_x: the diagonal empirical
            Fisher of the gates (Kwon et al. 2022), with its block-diagonal (per-layer) form.
- second-order: I_h = -(1/S) sum_x dl(x)/dxi_h + F_hh / 2, the second-order Taylor expansion of the mean-loss change
            when xi_h goes from 1 to 0 (LeCun et al. 1990's OBD with the empirical Fisher as the Hessian diagonal):
            a signed estimate of ablation from one gradient pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core import distributed
from headlab.core.data import MLM_SEED, TextSpec, masked_lm_batch, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, available_memory, offloaded_modules
from headlab.core.tables import head_table
from headlab.measure.costs import peak_memory
from headlab.measure.importance_methods import BERTOLOGY_DEFINITION, IMPORTANCE_METHODS
from headlab.mechanisms import losses
from headlab.mechanisms.gates import head_gates, read_mask
from headlab.mechanisms.recompute import activation_checkpointing, checkpointing_supported

ACCUMULATE = ("per-sequence", "bertology")


@dataclass
class ScoringBatch:
    """Model inputs and labels aligned with the logits: labels[b, t] is the token position t predicts, or -100."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]

    @property
    def scored(self) -> int:
        return int((self.labels != -100).sum())


@dataclass
class ImportanceResult:
    """Per-head importance: `table` (layer, head, kv_head, importance_raw, importance, rank; rank 1 = most
    important), `kv_groups` (raw scores summed over the query heads of each KV head, normalised alike), per-layer tensors `scores`
    (normalised) and `raw`, and `meta` (method, options, tokens, data)."""

    table: pd.DataFrame
    kv_groups: pd.DataFrame
    scores: list[torch.Tensor]
    raw: list[torch.Tensor]
    meta: dict = field(default_factory=dict)


# ---- batches and the loss ----------------------------------------------------------------------------------------


def scoring_batches(loaded: LoadedModel, batches: Iterable) -> list[ScoringBatch]:
    """Turn (input_ids, attention_mask, ...) batches into ScoringBatches: next-token labels for causal models, the
    fixed-seed 15% masking of headlab.measure.evaluate (rows wrapped in [CLS] ... [SEP]) for masked-LM encoders. Masks are
    drawn row by row from one generator, so they do not depend on the batch size."""
    generator = torch.Generator().manual_seed(MLM_SEED)
    out = []
    for batch in batches:
        input_ids, attention_mask = batch[0], batch[1]
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise HeadlabError(f"batches must hold input_ids and attention_mask [B, T], got {tuple(input_ids.shape)}")
        if loaded.adapter.is_encoder:
            rows = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
            ids, mask, labels = masked_lm_batch(loaded.tokenizer, rows, generator)
            if loaded.max_positions is not None and ids.shape[1] > loaded.max_positions:
                raise HeadlabError(
                    f"windows of {ids.shape[1]} tokens exceed the model's {loaded.max_positions} positions"
                )
            out.append(ScoringBatch(ids, mask, labels))
            continue
        valid = attention_mask.bool()
        labels = torch.full_like(input_ids, -100)  # [B, T]
        # Position t predicts token t+1; only pairs of real tokens count (right padding excluded).
        labels[:, :-1] = torch.where(valid[:, 1:] & valid[:, :-1], input_ids[:, 1:], -100)
        out.append(ScoringBatch(input_ids, attention_mask, labels))
    if not out or sum(b.scored for b in out) == 0:
        raise HeadlabError("the calibration batches hold no scored tokens")
    return out


def split_rows(batches: list[ScoringBatch], max_rows: int) -> list[ScoringBatch]:
    """Each batch cut into batches of at most `max_rows` sequences (same rows, same order)."""
    if max_rows < 1:
        raise HeadlabError(f"max_rows must be at least 1, got {max_rows}")
    return [
        ScoringBatch(b.input_ids[i : i + max_rows], b.attention_mask[i : i + max_rows], b.labels[i : i + max_rows])
        for b in batches
        for i in range(0, b.input_ids.shape[0], max_rows)
    ]


# The chunked loss by default: the [B, T, V] logits never exist whole (at batch 1 x 256 tokens they were 48 MB, and
# three tensors of that size, most of `importance`'s peak memory above the model). With 32 MiB chunks it costs about
# the time of whole logits (BENCHMARKS.md "Head importance"); at 8 MiB it had cost 2.60x against 2.21x a forward.
CHUNKED_LOSS = True


def sequence_nll(model, batch: ScoringBatch, device, *, chunked: bool = CHUNKED_LOSS) -> torch.Tensor:
    """Summed NLL per sequence, L(x) = sum_t -log p(label_t), [B] in float32 (float64 for a float64 model); the
    vocabulary is projected in chunks of scored positions (headlab.mechanisms.losses) unless chunked=False."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    return losses.sequence_nll(model, ids, mask, batch.labels, chunked=chunked)


@contextlib.contextmanager
def frozen(model):
    """requires_grad False on every parameter (no weight gradient is computed or stored); restored on exit."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad():
            yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# ---- low-memory mode, chosen by the memory available ------------------------------------------------------------

# Activations a gradient pass keeps per token and block, in elements of the model's dtype: so many hidden-size and
# MLP-width vectors, and 2 attention rows per head (eager or sdpa's math path keep the weights; flash kernels keep
# less). On the embedded model (30 blocks, width 576, MLP 1536, 4 x 256 tokens, parameters frozen) whole batches
# peak at over 5x the model's bytes against 2.5x in the low-memory mode (headlab.pruning.scores.ScoreRequest), about
# 1.3 GiB of activations; this formula says 1.9 GiB, so it errs high.
ACTIVATION_HIDDEN_VECTORS = 8
ACTIVATION_MLP_VECTORS = 4
# Whole-batch passes are chosen when the estimate is at most this share of the memory available, leaving the rest
# for the logit chunks, the allocator's slack and other processes.
BATCH_MEMORY_SHARE = 0.5


def gradient_pass_bytes(loaded: LoadedModel, rows: int, seq_len: int) -> int:
    """Estimated activation bytes of one whole-batch gradient pass without recomputation: `rows` windows of `seq_len`
    tokens through every block (ACTIVATION_HIDDEN_VECTORS and friends above; deliberately high)."""
    config = loaded.model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = loaded.layers
    hidden = getattr(config, "hidden_size", None) or max(la.num_heads * la.head_dim for la in layers)
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = max(la.num_heads for la in layers)
    per_token = ACTIVATION_HIDDEN_VECTORS * hidden + ACTIVATION_MLP_VECTORS * mlp + 2 * heads * seq_len
    element = torch.finfo(loaded.dtype).bits // 8
    return rows * seq_len * len(layers) * per_token * element


def choose_low_memory(loaded: LoadedModel, rows: int, seq_len: int, *, available: int | None = None) -> bool:
    """Whether a gradient pass should run one sequence at a time with recomputed blocks (the low-memory mode).

    That mode gives the same scores in a fraction of the memory but about 3x the time on a CPU (BENCHMARKS.md,
    "Calibration budget"), so it is chosen only when the whole-batch estimate (gradient_pass_bytes) exceeds
    BATCH_MEMORY_SHARE of the memory available (available_memory), when that memory cannot be read, and for
    models spread over several devices or offloaded by a device map. `available`: bytes, instead of asking the device."""
    if len(set(getattr(loaded.model, "hf_device_map", {}).values())) > 1:
        return True  # a model that needs several devices has no memory to spare for whole batches
    if offloaded_modules(loaded.model):
        return True  # autograd would keep every offloaded block's weights, read in for the forward, until backward
    if available is None:
        available = available_memory(loaded.device)
    if available is None:
        return True
    return gradient_pass_bytes(loaded, rows, seq_len) > BATCH_MEMORY_SHARE * available


def _accumulator_dtype(loaded: LoadedModel) -> torch.dtype:
    return torch.promote_types(torch.float32, loaded.dtype)  # float32, float64 for a float64 model


def _base_gates(loaded: LoadedModel, mask) -> list[torch.Tensor]:
    """Gate values the scores are taken at: 1 everywhere, times an optional mask (heads already removed)."""
    dtype = _accumulator_dtype(loaded)
    if mask is None:
        return [torch.ones(layer.num_heads, dtype=dtype) for layer in loaded.layers]
    return [g.detach().to(dtype) for g in mask]


# ---- scorers: scorer(loaded, batches, **options) -> list of per-layer raw scores ---------------------------------


def _gradient_pass(
    loaded, batches, *, mask=None, accumulate="per-sequence", want="grad", progress=True, gradient_checkpointing=False
):
    """One forward + backward per batch with per-sequence gates; returns raw grad or taylor scores per layer.
    gradient_checkpointing: recompute each block in the backward pass instead of keeping its activations."""
    model, device = loaded.model, loaded.device
    base = _base_gates(loaded, mask)
    dtype = base[0].dtype
    total = torch.zeros((), dtype=torch.float64)
    scores = [torch.zeros_like(g) for g in base]  # float32 accumulators [H_l]
    running = [torch.zeros_like(g) for g in base]  # bertology: the never-reset head_mask.grad
    with frozen(model), activation_checkpointing(model, gradient_checkpointing):
        for batch in tqdm(batches, desc=f"importance ({want})", disable=not progress, unit="batch"):
            B = batch.input_ids.shape[0]
            if accumulate == "bertology":
                gates = [g.clone().requires_grad_(True) for g in base]  # [H] shared by the batch
            else:
                gates = [g.expand(B, -1).clone().requires_grad_(True) for g in base]  # [B, H]
            # The backward pass stays inside the gates: a checkpointed block recomputes its forward, gates included.
            with head_gates(loaded, gates, keep_outputs=want == "taylor") as handle:
                nll = sequence_nll(model, batch, device)  # [B]
                outputs = list(handle.outputs)  # a recomputation in backward overwrites handle.outputs
                if accumulate == "bertology":
                    grads = torch.autograd.grad(nll.sum() / batch.scored, gates)
                else:
                    grads = torch.autograd.grad(nll.sum(), gates if want == "grad" else outputs)
            if accumulate == "bertology":
                # The example's loss is the batch mean over its tokens; it then adds |cumulative gradient| (its
                # head_mask.grad is never reset) and divides by all input tokens.
                for l, g in enumerate(grads):
                    running[l] += g.detach().to(dtype)
                    scores[l] += running[l].abs()
                total += int(batch.attention_mask.sum())
                continue
            if want == "grad":
                for l, g in enumerate(grads):  # row b of layer l's grad: dL(x_b)/dxi
                    scores[l] += g.detach().to(dtype).abs().sum(0)
            else:
                # d sum_b L(x_b) / dy with y = xi * ctx the gated o_proj input: ctx_h^T dL/dctx_h = y_h^T dL/dy_h.
                valid = batch.attention_mask.bool()  # [B, T]
                for l, (y, gy) in enumerate(zip(outputs, grads)):
                    H = base[l].shape[0]
                    per_token = (y.detach().to(dtype) * gy.to(dtype)).unflatten(-1, (H, -1)).sum(-1)  # [B, T, H]
                    # y lives on its layer's device (device maps spread layers); the accumulator on the gates'.
                    scores[l] += per_token.abs()[valid.to(y.device)].sum(0).to(scores[l].device)
            total += batch.scored
    # torchrun: each process scored its share of the batches; the sums add up to one process's.
    for s in scores:
        distributed.all_reduce_sum(s)
    distributed.all_reduce_sum(total)
    return [s / float(total) for s in scores]


def grad_scores(
    loaded, batches, *, mask=None, accumulate="per-sequence", progress=True, gradient_checkpointing=False
) -> list[torch.Tensor]:
    """I_h = (1/N) sum_x |dL(x)/dxi_h| at xi = 1 (Michel et al. 2019); accumulate="bertology" reproduces the old
    transformers example instead: sum over batches k of |sum_{j<=k} dmeanNLL_j/dxi_h|, divided by input tokens."""
    if accumulate not in ACCUMULATE:
        raise HeadlabError(f"unknown accumulate {accumulate!r}; use one of {', '.join(ACCUMULATE)}")
    return _gradient_pass(
        loaded,
        batches,
        mask=mask,
        accumulate=accumulate,
        want="grad",
        progress=progress,
        gradient_checkpointing=gradient_checkpointing,
    )


def taylor_scores(
    loaded, batches, *, mask=None, accumulate="per-sequence", progress=True, gradient_checkpointing=False
) -> list[torch.Tensor]:
    """I_h = (1/N) sum_x sum_t |ctx_{t,h}^T dL(x)/dctx_{t,h}| (Michel et al.'s code: absolute value per token)."""
    if accumulate != "per-sequence":
        raise HeadlabError("accumulate='bertology' (the compatibility mode) applies to method='grad' only")
    return _gradient_pass(
        loaded, batches, mask=mask, want="taylor", progress=progress, gradient_checkpointing=gradient_checkpointing
    )


@torch.no_grad()
def _total_nll(loaded, batches, gates) -> float:
    total = torch.zeros((), dtype=torch.float64)
    with head_gates(loaded, gates):
        for batch in batches:
            total += sequence_nll(loaded.model, batch, loaded.device).double().sum().cpu()
    return float(distributed.all_reduce_sum(total))


def ablation_scores(loaded, batches, *, mask=None, accumulate="per-sequence", progress=True) -> list[torch.Tensor]:
    """I_h = (sum_x L(x) | xi_h = 0) - sum_x L(x)) / N: the exact loss increase from masking one head (signed)."""
    if accumulate != "per-sequence":
        raise HeadlabError("accumulate='bertology' (the compatibility mode) applies to method='grad' only")
    base = _base_gates(loaded, mask)
    N = float(distributed.all_reduce_sum(torch.tensor(float(sum(b.scored for b in batches)), dtype=torch.float64)))
    reference = _total_nll(loaded, batches, base)
    scores = [torch.zeros_like(g) for g in base]
    heads = [(l, h) for l, g in enumerate(base) for h in range(g.shape[0])]
    for l, h in tqdm(heads, desc="importance (ablation)", disable=not progress, unit="head"):
        gates = [g.clone() for g in base]
        gates[l][h] = 0.0
        scores[l][h] = (_total_nll(loaded, batches, gates) - reference) / N
    return scores


# ---- Fisher information (Kwon et al. 2022) -----------------------------------------------------------------------
# Per sequence x (S sequences), l(x) = L(x) / n_x the mean next-token NLL, g_x = dl(x)/dxi at xi = 1 (the
# per-sequence gate gradients of `grad`, divided by n_x): diagonal Fisher F_hh = (1/S) sum_x g_xh^2, block-diagonal
# F_l = (1/S) sum_x g_x,l g_x,l^T; 1/2 1_R^T F_l 1_R estimates the mean-loss increase from removing the heads R of
# layer l (Kwon et al. 2022, "A Fast Post-Training Pruning Framework for Transformers"). The block-output Fisher
# B_l = (1/N) sum_t d_t d_t^T, d_t = dL(x)/do_t the gradient of the summed NLL with respect to the attention
# block's output at scored position t, weights headlab.pruning.obs's reconstruction errors.


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


def fisher_scores(
    loaded, batches, *, mask=None, accumulate="per-sequence", progress=True, gradient_checkpointing=False
) -> list[torch.Tensor]:
    """I_h = F_hh = (1/S) sum_x (dl(x)/dxi_h)^2, l(x) the mean NLL of sequence x (Kwon et al. 2022)."""
    if accumulate != "per-sequence":
        raise HeadlabError("accumulate='bertology' (the compatibility mode) applies to method='grad' only")
    stats = fisher_statistics(
        loaded, batches, mask=mask, progress=progress, gradient_checkpointing=gradient_checkpointing
    )
    return stats.diagonal


def second_order_scores(
    loaded, batches, *, mask=None, accumulate="per-sequence", progress=True, gradient_checkpointing=False
) -> list[torch.Tensor]:
    """I_h = -mean_x dl(x)/dxi_h + F_hh / 2: the second-order Taylor estimate of the mean-loss increase when head h
    is removed (xi_h: 1 -> 0), with the diagonal empirical Fisher F as the Hessian (LeCun et al. 1990; Kwon et al.
    2022). Signed like ablation; lowest is pruned first."""
    if accumulate != "per-sequence":
        raise HeadlabError("accumulate='bertology' (the compatibility mode) applies to method='grad' only")
    stats = fisher_statistics(
        loaded, batches, mask=mask, progress=progress, gradient_checkpointing=gradient_checkpointing
    )
    return [f / 2 - g for g, f in zip(stats.mean_gradient, stats.diagonal)]


# ---- normalisation and the table ---------------------------------------------------------------------------------


def normalise(raw: list[torch.Tensor], *, layer_norm: bool = True, global_norm: bool = True) -> list[torch.Tensor]:
    """Per layer I_h / (sum_h' I_h'^2)^(1/2), then global min-max to [0, 1] (Michel et al. 2019; bertology).

    A layer whose scores are all 0 stays 0; if every score is equal, global min-max gives 0 everywhere.
    """
    scores = [r.clone() for r in raw]
    if layer_norm:
        scores = [s / s.pow(2).sum().sqrt() if bool(s.pow(2).sum() > 0) else s for s in scores]
    if global_norm:
        flat = torch.cat(scores)
        low, high = flat.min(), flat.max()
        span = high - low
        scores = [(s - low) / span if bool(span > 0) else torch.zeros_like(s) for s in scores]
    return scores


def importance_tables(
    layers, raw: list[torch.Tensor], *, layer_norm: bool = True, global_norm: bool = True
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-head table (rank 1 = highest normalised importance, ties by layer then head) and the KV-group table:
    raw scores summed over the query heads of each KV head, then normalised like the heads."""
    scores = normalise(raw, layer_norm=layer_norm, global_norm=global_norm)
    table = head_table(
        layers,
        {
            "importance_raw": torch.cat(raw).double().tolist(),
            "importance": torch.cat(scores).double().tolist(),
        },
    )
    table["rank"] = table["importance"].rank(method="first", ascending=False).astype(int)
    groups = (
        table.groupby(["layer", "kv_head"], sort=True)
        .agg(query_heads=("head", "size"), importance_raw=("importance_raw", "sum"))
        .reset_index()
    )
    kv_raw = [torch.tensor(part["importance_raw"].to_numpy()) for _, part in groups.groupby("layer", sort=True)]
    groups["importance"] = torch.cat(normalise(kv_raw, layer_norm=layer_norm, global_norm=global_norm)).tolist()
    groups["rank"] = groups["importance"].rank(method="first", ascending=False).astype(int)
    return table, groups


@takes_text(split="calibration", seq_len=256, max_tokens=None)
def head_importance(
    loaded: LoadedModel,
    batches: Iterable | None = None,
    *,
    method: str = "grad",
    text: TextSpec,
    layer_norm: bool = True,
    global_norm: bool = True,
    accumulate: str = "per-sequence",
    mask=None,
    gradient_checkpointing: bool = False,
    max_rows: int | None = None,
    progress: bool = True,
) -> ImportanceResult:
    """Score every attention head with `method` (grad | taylor | fisher | ablation) on calibration text (or `batches` of
    (input_ids, attention_mask, ...)); see the module docstring for the formulas.

    `text`: a TextSpec (the loose keywords data, seq_len, batch_size, max_tokens, text_column also work); its
    max_tokens defaults to 2048 for grad/taylor/fisher and 256 for ablation (one forward pass set per head). `mask`:
    gates ([H_l] per layer) or a mask-file path; scores are taken with those heads already gated. For encoders the
    windows are seq_len - 2 tokens, wrapped in [CLS] ... [SEP]. gradient_checkpointing (grad, taylor): recompute each
    block in the backward pass instead of keeping its activations (long windows; same scores, one more forward).
    max_rows: sequences per forward/backward pass (per-sequence scores are sums over sequences, so splitting a
    batch gives the same scores with the logits and activations of fewer rows held at once).
    """
    _check_importance_options(method, accumulate, gradient_checkpointing)
    layers = loaded.layers
    mask_path = None
    if mask is not None and not isinstance(mask, (list, tuple)):
        mask_path, mask = str(mask), read_mask(mask, layers)
    if mask is not None:
        if len(mask) != len(layers) or any(m.shape != (layer.num_heads,) for m, layer in zip(mask, layers)):
            raise HeadlabError("mask must hold one [H_l] gate tensor per attention layer")
    data_meta: dict = {}
    if batches is None:
        batches = _importance_windows(loaded, text, method)
        data_meta = dict(batches.meta, seq_len=text.seq_len)
    prepared = scoring_batches(loaded, batches)
    if max_rows is not None and accumulate == "per-sequence":  # bertology's batch mean depends on the batch
        prepared = split_rows(prepared, max_rows)
    if distributed.active():
        if accumulate == "bertology":
            raise HeadlabError("the bertology compatibility mode depends on batch order; run it in one process")
        prepared = distributed.shard(prepared)  # masks were drawn before sharding: same as one process
    device = loaded.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    options = {"gradient_checkpointing": gradient_checkpointing} if IMPORTANCE_METHODS[method].backward else {}
    raw = IMPORTANCE_METHODS[method].scorer.resolve()(
        loaded, prepared, mask=mask, accumulate=accumulate, progress=progress, **options
    )
    seconds = time.perf_counter() - start
    raw = [r.cpu() for r in raw]
    if not all(bool(torch.isfinite(r).all()) for r in raw):
        advice = (
            "check the weights and the calibration text"
            if loaded.dtype == torch.float32
            else f"with {str(loaded.dtype)}, load the model with dtype='float32'"
        )
        raise HeadlabError(f"importance scores are not finite; {advice}")
    scores = normalise(raw, layer_norm=layer_norm, global_norm=global_norm)
    table, groups = importance_tables(layers, raw, layer_norm=layer_norm, global_norm=global_norm)
    meta = {
        **loaded.describe(),
        **data_meta,
        "method": method,
        "accumulate": accumulate,
        "gradient_checkpointing": bool(gradient_checkpointing and checkpointing_supported(loaded.model)),
        "max_rows": max_rows,
        "layer_norm": layer_norm,
        "global_norm": global_norm,
        "objective": "masked-lm (15% fixed-seed masking)" if loaded.adapter.is_encoder else "causal",
        "scored_tokens": _global_count(sum(b.scored for b in prepared)),
        "sequences": _global_count(sum(b.input_ids.shape[0] for b in prepared)),
        "batches": _global_count(len(prepared)),
        "processes": distributed.world_size(),
        "mask": mask_path if mask_path is not None else (None if mask is None else "in-memory"),
        "masked_heads": 0 if mask is None else int(sum(int((m == 0).sum()) for m in mask)),
        "definition": IMPORTANCE_METHODS[method].definition if accumulate == "per-sequence" else BERTOLOGY_DEFINITION,
        "seconds": seconds,
        "peak_memory_bytes": peak_memory(device),
    }
    return ImportanceResult(table, groups, scores, raw, meta)


def _check_importance_options(method: str, accumulate: str, gradient_checkpointing: bool) -> None:
    IMPORTANCE_METHODS[method]  # an unknown name is an error listing the registry
    if accumulate not in ACCUMULATE:
        raise HeadlabError(f"unknown accumulate {accumulate!r}; use one of {', '.join(ACCUMULATE)}")
    if accumulate == "bertology" and method != "grad":
        raise HeadlabError("accumulate='bertology' (the compatibility mode) applies to method='grad' only")
    if gradient_checkpointing and not IMPORTANCE_METHODS[method].backward:
        raise HeadlabError(
            f"gradient_checkpointing=True applies to the methods with a backward pass, not method={method!r}"
        )


def _importance_windows(loaded: LoadedModel, text: TextSpec, method: str):
    """The calibration windows importance scores on: the method's default token budget unless the text sets one,
    windows 2 tokens shorter for an encoder's [CLS]/[SEP]."""
    if loaded.tokenizer is None:
        raise HeadlabError("scoring calibration text needs the model's tokenizer; pass batches instead")
    if text.split != "calibration":
        raise HeadlabError(
            f"split {text.split!r}: importance is scored on calibration text only (eval is for perplexity)"
        )
    if text.max_tokens is None:
        text = text.but(max_tokens=IMPORTANCE_METHODS[method].default_max_tokens)
    window = text.seq_len - 2 if loaded.adapter.is_encoder else text.seq_len
    if window < 2:
        raise HeadlabError(f"seq_len={text.seq_len} is too short")
    return text.batches(loaded.tokenizer, seq_len=window, max_positions=loaded.max_positions)


def _global_count(local: int) -> int:
    return int(distributed.all_reduce_sum(torch.tensor(float(local), dtype=torch.float64)))
