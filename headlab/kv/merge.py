"""Calibrated, training-free KV-head merging (`convert-gqa --method svd`): each group of KV heads becomes one head
chosen by a weighted SVD on calibration activations, and each member's residual map is folded into its query heads.

Values: member j's value v_j = W_v[j] x + b_j reaches the output as A_h v_j W_o[h]^T for the query heads h reading
it. With a shared value v = c^T [v_1; ...; v_m] (c: [m*D, D]) and v_j ~ v M_j, the fold W_o[h] <- W_o[h] M_j^T keeps
the layer's form. c maximises tr(c^T S B S c) subject to c^T S c = I, the closed form of
    min_{c, M} sum_j tr( G_j (E_j - c M_j)^T S (E_j - c M_j) ),
S: second moment of the stacked member values as the output sees them (attention-mixed: y_h = sum_t A_h[., t] v(t),
or uniform over tokens), G_j = sum_h W_o[h]^T W_o[h] over j's query heads, B = blockdiag(G_j); then per member the
least-squares map M_j = (c^T S_j c)^+ c^T S_j E_j on its own heads' statistics S_j.

Keys: rotary embeddings rotate each pair (i, i + rd/2) (transformers' rotate_half) by a position angle, so only a
complex scale per frequency pair can be folded into the queries. Per frequency, the complex keys k_j of the members
(weighted by sqrt of the query energy E|q_f|^2 of j's heads) get their best rank-1 approximation k_j ~ c z_j
(Hermitian eigendecomposition of the calibration Gram); c is the pooled key, and q <- q conj(z_j) folds z_j into the
queries, since q . k = Re(conj(q) k). Non-rotary dimensions (partial rotary) are merged like values, with the
query second moment as weight, and folded as W_q <- M_j W_q.

Exact where it can be: members that are copies (values), or complex rotations/scalings of one another per
frequency pair (keys), merge losslessly. Approximations, by design: the attention pattern of the original model
weights the value fit; keys passing a per-head norm before rotary (Qwen3, OLMo2, Gemma3, Qwen3-Next) are nonlinear
in the weights, so their keys are mean-pooled (values still merged); gated attention (Qwen3-Next, Qwen3.5) gates
each output dimension after attention, which a dense M_j does not commute with, so their values are mean-pooled.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from headlab.core.arch import HeadWeights
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.kv.grouping import gqa_layers, pool_weights
from headlab.mechanisms.capture import capture_attention
from headlab.mechanisms.hooks import hooks

VALUE_WEIGHTINGS = ("attention", "uniform")
# Eigenvalues of a token Gram below this fraction of the largest are treated as zero (directions the calibration
# tokens never excite): the merge is then exact on what was seen and leaves the rest to the pooled projection.
RANK_TOL = 1e-10


@dataclass
class LayerStats:
    """Calibration statistics of one attention layer, summed over the unpadded calibration tokens (float64)."""

    key_gram: torch.Tensor | None  # [G*D, G*D]  sum_t k(t) k(t)^T, keys before norm and rotary
    query_gram: torch.Tensor | None  # [H, D, D]  sum_t q_h(t) q_h(t)^T, queries before rotary
    value_gram: (
        torch.Tensor
    )  # [H, m*D, m*D]  sum_t y_h(t) y_h(t)^T, y_h = stacked values of h's new group as h sees them
    tokens: int


def merge_plan(loaded: LoadedModel) -> dict[str, str]:
    """What `svd` does for keys and values on this architecture ("svd" or "mean"), with the reason."""
    adapter = loaded.adapter
    w = adapter.read(loaded.layers[0])
    keys = "mean" if w.k_norm is not None else "svd"
    values = "mean" if adapter.gated else "svd"
    return {
        "keys": keys,
        "values": values,
        "keys_reason": "per-head key norm before rotary (nonlinear): mean-pooled" if keys == "mean" else "linear",
        "values_reason": "output gate after attention: mean-pooled" if values == "mean" else "linear",
    }


# ---- statistics -----------------------------------------------------------------------------------------------


def _augmented(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, C: int) -> torch.Tensor:
    """[rows, C + 1] float32: the bias as the weight of a constant-1 input column."""
    b = bias.reshape(rows) if bias is not None else torch.zeros(rows)
    return torch.cat([weight.reshape(rows, C), b.reshape(rows, 1).to(weight)], 1).float()


def _projections(loaded: LoadedModel, layers) -> tuple[dict, dict]:
    """Per layer index the augmented (key [G*D, C+1], query [H*D, C+1] on each head's first D rows, value
    [G*D, C+1]) projections, and the device the layer's weights (and so its statistics) live on."""
    projections, layer_device = {}, {}
    for layer in layers:
        H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        w = loaded.adapter.read(layer)
        C = w.k.shape[2]
        layer_device[layer.index] = w.k.device  # under a device map each layer's statistics stay on its device
        q_bias = None if w.q_bias is None else w.q_bias[:, :D]
        projections[layer.index] = (
            _augmented(w.k, w.k_bias, G * D, C),
            _augmented(w.q[:, :D], q_bias, H * D, C),
            _augmented(w.v, w.v_bias, G * D, C),
        )
    return projections, layer_device


class _Calibration:
    """The running sums of one calibration pass: a pre-hook per attention module adds the key and query Grams of its
    input (and, uniformly weighted, the value Grams); `on_chunk` adds the attention-mixed value Grams."""

    def __init__(self, layers, projections, layer_device, kv_heads: int, keys: bool, value_weighting: str | None):
        H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
        self.H, self.D, self.m = H, D, G // kv_heads
        self.projections, self.kv_heads, self.keys, self.value_weighting = projections, kv_heads, keys, value_weighting
        self.stats: dict[int, LayerStats] = {}
        for layer in layers:
            f64 = dict(dtype=torch.float64, device=layer_device[layer.index])
            self.stats[layer.index] = LayerStats(
                torch.zeros(G * D, G * D, **f64) if keys else None,
                torch.zeros(H, D, D, **f64) if keys else None,
                torch.zeros(H, self.m * D, self.m * D, **f64),
                0,
            )
        self.valid: torch.Tensor | None = None  # [B, T] bool, the current batch's real tokens
        self.values: dict[int, torch.Tensor] = {}  # layer index -> [B, T, G', m*D], for on_chunk of this batch

    def pre_hook_for(self, layer):
        """The attention-input hook of `layer`: x [B, T, C] after the input norm."""
        H, D, m, kv_heads = self.H, self.D, self.m, self.kv_heads

        def hook(x):
            x = x.float()  # [B, T, C]
            B, T, _ = x.shape
            x = torch.cat([x, torch.ones(B, T, 1, dtype=x.dtype, device=x.device)], -1)  # [B, T, C+1]
            k_w, q_w, v_w = self.projections[layer.index]
            valid = self.valid.to(x.device)  # [B, T]
            s = self.stats[layer.index]
            s.tokens += int(valid.sum())
            xv = x[valid]  # [N, C+1]
            if self.keys:
                k = xv @ k_w.T  # [N, G*D]
                s.key_gram += (k.T @ k).double()
                q = (xv @ q_w.T).reshape(-1, H, D)  # [N, H, D]
                s.query_gram += torch.einsum("nhd,nhe->hde", q, q).double()
            if self.value_weighting is None:
                return
            values = (x @ v_w.T).reshape(B, T, kv_heads, m * D)  # [B, T, G', m*D] members of each new group
            if self.value_weighting == "uniform":
                per_group = torch.einsum("ngd,nge->gde", values[valid], values[valid]).double()  # [G', mD, mD]
                s.value_gram += per_group.repeat_interleave(H // kv_heads, 0)
            else:
                self.values[layer.index] = values

        return hook

    def on_chunk(self, chunk) -> None:
        """y_h = sum_t A_h[., t] v(t) for every query head of the chunk, into its value Gram."""
        H, m, D, kv_heads = self.H, self.m, self.D, self.kv_heads
        values = self.values[chunk.layer.index]  # [B, T, G', mD]
        B, _, c, Tk = chunk.probs.shape
        probs = chunk.probs.reshape(B, kv_heads, H // kv_heads, c, Tk)  # [B, G', H/G', c, Tk]
        y = torch.einsum("bgrct,btgn->bgrcn", probs, values[:, :Tk]).reshape(B, H, c, m * D)  # [B, H, c, mD]
        y = y * chunk.query_valid[:, None, :, None]
        self.stats[chunk.layer.index].value_gram += torch.einsum("bhcn,bhck->hnk", y, y).double()


@torch.no_grad()
def merge_statistics(
    loaded: LoadedModel,
    kv_heads: int,
    batches,
    *,
    value_weighting: str | None = "attention",
    keys: bool = True,
    progress: bool = True,
) -> list[LayerStats]:
    """One calibration pass: per layer the key Gram, per-head query Grams, and each query head's Gram of the stacked
    values of its new group (mixed by its attention weights with value_weighting="attention", else per token).

    The layer input x (after the input norm) comes from a forward pre-hook on the attention module; attention
    weights from headlab.mechanisms.capture (the model keeps its sdpa output)."""
    if value_weighting is not None and value_weighting not in VALUE_WEIGHTINGS:
        raise HeadlabError(f"unknown value weighting {value_weighting!r}; use one of {', '.join(VALUE_WEIGHTINGS)}")
    layers = gqa_layers(loaded)
    device = loaded.device
    check_resident(loaded, "the svd merge")
    projections, layer_device = _projections(loaded, layers)
    calibration = _Calibration(layers, projections, layer_device, kv_heads, keys, value_weighting)
    model = loaded.model
    attending = value_weighting == "attention"
    capturing = capture_attention(model, layers, calibration.on_chunk) if attending else nullcontext()
    with hooks(loaded.adapter, [("attn_in", layer, calibration.pre_hook_for(layer)) for layer in layers]), capturing:
        for input_ids, attention_mask, *_ in tqdm(batches, desc="merge calibration", disable=not progress):
            calibration.valid = attention_mask.bool().to(device)
            model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
            calibration.values.clear()
    # The closed forms run in float64 on the CPU, whichever device each layer's statistics were summed on.
    out = [
        LayerStats(*(t.cpu() if torch.is_tensor(t) else t for t in vars(calibration.stats[layer.index]).values()))
        for layer in layers
    ]
    if not out or out[0].tokens == 0:
        raise HeadlabError("no calibration tokens to merge KV heads on")
    return out


# ---- the closed forms ------------------------------------------------------------------------------------------


def _subspace(S: torch.Tensor, B: torch.Tensor, d: int) -> torch.Tensor:
    """c [n, d] maximising tr(c^T S B S c) subject to c^T S c = I (zero columns beyond S's rank).

    With S = Q diag(lam) Q^T and c = Q lam^{-1/2} u: the top-d eigenvectors u of lam^{1/2} Q^T B Q lam^{1/2}."""
    lam, Q = torch.linalg.eigh(S)
    keep = lam > RANK_TOL * max(float(lam.max()), 0.0)
    if not bool(keep.any()):
        return torch.zeros(S.shape[0], d, dtype=S.dtype)
    lam, Q = lam[keep], Q[:, keep]
    root = lam.sqrt()
    K = root[:, None] * (Q.T @ B @ Q) * root[None, :]
    K = (K + K.T) / 2
    _, U = torch.linalg.eigh(K)
    U = U.flip(-1)[:, :d]  # descending
    c = Q @ (U / root[:, None])  # [n, min(r, d)]
    if c.shape[1] < d:
        c = torch.cat([c, torch.zeros(c.shape[0], d - c.shape[1], dtype=c.dtype)], 1)
    return c


def _member_maps(c: torch.Tensor, S_members: list[torch.Tensor], d: int) -> list[torch.Tensor]:
    """Least-squares M_j [d, d] of member j's outputs on the shared ones: (c^T S_j c)^+ c^T S_j E_j."""
    maps = []
    for j, S in enumerate(S_members):
        E = S[:, j * d : (j + 1) * d]  # S_j E_j
        maps.append(torch.linalg.pinv(c.T @ S @ c, hermitian=True, rtol=1e-10) @ (c.T @ E))
    return maps


def merge_values(weights: HeadWeights, kv_heads: int, stats: LayerStats) -> HeadWeights:
    """Values merged per group (weighted SVD) and each member's map folded into its query heads' o_proj columns."""
    H, G, D = weights.num_heads, weights.num_kv_heads, weights.head_dim
    m, r = G // kv_heads, H // G
    C = weights.v.shape[2]
    v = torch.empty(kv_heads, D, C, dtype=torch.float64)
    v_bias = None if weights.v_bias is None else torch.empty(kv_heads, D, dtype=torch.float64)
    o = weights.o.double().clone()  # [C, H, D]
    for g in range(kv_heads):
        members = list(range(g * m, (g + 1) * m))
        heads_of = [list(range(j * r, (j + 1) * r)) for j in members]
        S_members = [stats.value_gram[heads].sum(0).cpu() for heads in heads_of]  # each [mD, mD]
        S = sum(S_members)
        B = torch.block_diag(*[torch.einsum("chd,che->de", o[:, heads], o[:, heads]) for heads in heads_of])
        c = _subspace(S, B, D)  # [mD, D]
        maps = _member_maps(c, S_members, D)
        v[g] = c.T @ weights.v[members].double().reshape(m * D, C)
        if v_bias is not None:
            v_bias[g] = c.T @ weights.v_bias[members].double().reshape(m * D)
        for M, heads in zip(maps, heads_of):
            o[:, heads] = o[:, heads] @ M.T  # W_o[h] M_j^T
    return replace(
        weights,
        v=v.to(weights.v.dtype),
        v_bias=None if v_bias is None else v_bias.to(weights.v_bias.dtype),
        o=o.to(weights.o.dtype),
    )


def _complex_mul_rows(rows: torch.Tensor, z: torch.Tensor, half: int) -> torch.Tensor:
    """Rows [..., 2*half, *] of a projection read as complex pairs (f, f + half), multiplied by z [half]."""
    re, im = rows[..., :half, :], rows[..., half : 2 * half, :]
    a, b = z.real[:, None], z.imag[:, None]
    return torch.cat([a * re - b * im, b * re + a * im], -2)


def merge_keys(weights: HeadWeights, kv_heads: int, stats: LayerStats, rotary_dim: int) -> HeadWeights:
    """Keys merged per group: complex rank-1 per rotary frequency pair, weighted SVD on non-rotary dims; the member
    factors folded into the query rows (and biases) of the heads that read them."""
    H, G, D = weights.num_heads, weights.num_kv_heads, weights.head_dim
    m, r = G // kv_heads, H // G
    half = rotary_dim // 2
    C = weights.k.shape[2]
    # Augmented rows [.., D, C+1]: the bias rides along as the weight of a constant input.
    k_aug = torch.cat([weights.k.double(), _bias_col(weights.k_bias, (G, D))], -1)  # [G, D, C+1]
    q_aug = torch.cat([weights.q.double(), _bias_col(weights.q_bias, weights.q.shape[:2])], -1)  # [H, Dq, C+1]
    KG = stats.key_gram.cpu().reshape(G, D, G, D)
    QG = stats.query_gram.cpu()  # [H, D, D]
    new_k = torch.empty(kv_heads, D, C + 1, dtype=torch.float64)
    for g in range(kv_heads):
        members = list(range(g * m, (g + 1) * m))
        heads_of = [list(range(j * r, (j + 1) * r)) for j in members]
        if half:
            f = torch.arange(half)
            energy = torch.stack([(QG[h][:, f, f] + QG[h][:, f + half, f + half]).sum(0) for h in heads_of])  # [m, F]
            scale = energy.clamp_min(1e-30 * float(energy.max().clamp_min(1e-300))).sqrt()  # [m, F]
            sub = KG[members][:, :, members]  # [m, D, m, D]
            # Hermitian Gram per frequency: sum_t conj(k_i) k_j = (x_i x_j + y_i y_j) + i (x_i y_j - y_i x_j),
            # x = dim f, y = dim f + half of a key head.
            xx, yy = sub[:, f, :, f], sub[:, f + half, :, f + half]  # [F, m, m]
            xy, yx = sub[:, f, :, f + half], sub[:, f + half, :, f]
            gram = torch.complex(xx + yy, xy - yx)  # [F, m, m]
            s = scale.T  # [F, m]
            weighted = s[:, :, None] * gram * s[:, None, :]
            weighted = (weighted + weighted.conj().transpose(1, 2)) / 2
            _, vecs = torch.linalg.eigh(weighted)
            u = vecs[..., -1]  # [F, m] top eigenvector
            alpha = s * u  # new key c = sum_j alpha_j k_j
            zeta = u / s  # member j ~ c conj(zeta_j): queries get multiplied by zeta_j
            rot = torch.zeros(rotary_dim, C + 1, dtype=torch.float64)
            for j, member in enumerate(members):
                rot = rot + _complex_mul_rows(k_aug[member, :rotary_dim], alpha[:, j], half)
            new_k[g, :rotary_dim] = rot
            for j, heads in enumerate(heads_of):
                q_aug[heads, :rotary_dim] = _complex_mul_rows(q_aug[heads, :rotary_dim], zeta[:, j], half)
        if rotary_dim < D:
            R = list(range(rotary_dim, D))
            dr = len(R)
            S = KG[members][:, R][:, :, members][:, :, :, R].reshape(m * dr, m * dr)
            B = torch.block_diag(*[QG[h][:, R][:, :, R].sum(0) for h in heads_of])
            c = _subspace(S, B, dr)  # [m*dr, dr]
            maps = _member_maps(c, [S] * m, dr)
            new_k[g, rotary_dim:] = c.T @ k_aug[members][:, R].reshape(m * dr, C + 1)
            for M, heads in zip(maps, heads_of):
                q_aug[heads, rotary_dim:D] = M @ q_aug[heads, rotary_dim:D]
    return replace(
        weights,
        k=new_k[..., :C].to(weights.k.dtype),
        k_bias=None if weights.k_bias is None else new_k[..., C].to(weights.k_bias.dtype),
        q=q_aug[..., :C].to(weights.q.dtype),
        q_bias=None if weights.q_bias is None else q_aug[..., C].to(weights.q_bias.dtype),
    )


def _cpu(weights: HeadWeights) -> HeadWeights:
    return replace(weights, **{f: None if t is None else t.cpu() for f, t in weights.tensors().items()})


def _bias_col(bias: torch.Tensor | None, shape) -> torch.Tensor:
    if bias is None:
        return torch.zeros(*shape, 1, dtype=torch.float64)
    return bias.double().reshape(*shape, 1)


def merge_weights(
    weights: HeadWeights, kv_heads: int, stats: LayerStats, rotary_dim: int, *, keys: str = "svd", values: str = "svd"
) -> HeadWeights:
    """One layer's contiguous groups of G / kv_heads KV heads merged: mean-pooled first (norms, and the parts left
    to mean), then keys and/or values replaced by the calibrated merge."""
    merged = pool_weights(weights, kv_heads, "mean")
    if keys == "svd":
        k = merge_keys(weights, kv_heads, stats, rotary_dim)
        merged = replace(merged, k=k.k, k_bias=k.k_bias, q=k.q, q_bias=k.q_bias)
    if values == "svd":
        v = merge_values(weights, kv_heads, stats)
        merged = replace(merged, v=v.v, v_bias=v.v_bias, o=v.o)
    return merged


@torch.no_grad()
def merge_kv_heads(
    loaded: LoadedModel,
    kv_heads: int,
    batches,
    *,
    value_weighting: str = "attention",
    passes: int = 1,
    progress: bool = True,
) -> dict:
    """Merge contiguous groups of KV heads of every layer in place (calibrated on `batches`) and write the new count
    into the config. Returns what was done per part (keys/values: svd or mean) and the calibration token count.

    passes=2: keys are merged first and the value statistics are taken on the model with merged keys (the
    attention pattern the merged values will really be mixed by); passes=1 (default) takes both on the original model.
    """
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    if kv_heads >= G or G % kv_heads:
        raise HeadlabError(f"merging needs a divisor of the {G} KV heads below {G}, got {kv_heads}")
    if passes not in (1, 2):
        raise HeadlabError(f"passes must be 1 or 2, got {passes}")
    plan = merge_plan(loaded)
    adapter, config = loaded.adapter, loaded.model.config
    keys = plan["keys"]
    if passes == 2 and keys == "svd":
        stats = merge_statistics(loaded, kv_heads, batches, value_weighting=None, progress=progress)
        m = G // kv_heads
        for layer, layer_stats in zip(layers, stats):
            weights = _cpu(adapter.read(layer))
            merged = merge_keys(weights, kv_heads, layer_stats, adapter.rotary_dim(layer, config))
            # Still G KV heads, each member holding its group's merged key: the function of the merged-keys model
            # with the original values, ready for the value statistics.
            expand = dict(k=merged.k.repeat_interleave(m, 0), q=merged.q, q_bias=merged.q_bias)
            expand["k_bias"] = None if merged.k_bias is None else merged.k_bias.repeat_interleave(m, 0)
            adapter.write(layer, replace(weights, **expand))
        keys = "mean"  # the members' keys are now equal: mean pooling is exact
    stats = merge_statistics(
        loaded, kv_heads, batches, value_weighting=value_weighting, keys=keys == "svd", progress=progress
    )
    for layer, layer_stats in zip(layers, stats):
        adapter.write(layer, _merged(loaded, layer, kv_heads, layer_stats, keys, plan["values"]))
    adapter.set_config_heads(config, H, kv_heads, D)
    return {**plan, "value_weighting": value_weighting, "passes": passes, "calibration_tokens": stats[0].tokens}


def _merged(loaded: LoadedModel, layer, kv_heads: int, stats: LayerStats, keys: str, values: str) -> HeadWeights:
    """One layer's weights merged to `kv_heads` KV heads from its statistics (nothing written)."""
    weights = _cpu(loaded.adapter.read(layer))  # the algebra runs in float64 on the CPU; write puts it back in place
    rotary = loaded.adapter.rotary_dim(layer, loaded.model.config)
    return merge_weights(weights, kv_heads, stats, rotary, keys=keys, values=values)


@torch.no_grad()
def layer_merges(loaded: LoadedModel, targets: dict[int, int], batches, *, progress: bool = True) -> dict:
    """Per-layer merges for per-layer KV budgets (headlab.kv.budget): {layer index: merged HeadWeights} for each
    layer of `targets` ({layer index: KV heads}, each a divisor of its G below G), all calibrated on the original
    model (one statistics pass per distinct target count, before anything is written). Nothing is written."""
    plan = merge_plan(loaded)
    layers = {layer.index: layer for layer in gqa_layers(loaded)}
    merged = {}
    for kv_heads in sorted(set(targets.values())):
        stats = merge_statistics(loaded, kv_heads, batches, keys=plan["keys"] == "svd", progress=progress)
        for layer, layer_stats in zip(layers.values(), stats):
            if targets.get(layer.index) == kv_heads:
                merged[layer.index] = _merged(loaded, layer, kv_heads, layer_stats, plan["keys"], plan["values"])
    return merged
