"""Pruning compensation (`prune --compensate`): after heads are removed, refit the kept heads' output-projection
columns (and its bias) in closed form so each attention block's output matches the unpruned one on calibration text.

ridge: per layer, with z the output projection's input (concatenated head outputs, [H*D]) of the unpruned model and
K the kept heads' columns,
    W_K' = argmin_W ||z_K W^T + b' - (z W_o^T + b)||^2 + lam ||W - W_K||^2        (b' refit where o_proj has a bias)
solved from the calibration Gram of [z, 1]. The ridge pulls towards the original columns (so lam -> inf is "no
compensation"), which makes the refit never worse than no compensation on the data it is fitted on. lam = alpha x
tr(z_K^T z_K) / |K|: alpha is chosen per layer from ALPHAS by the reconstruction error on held-out calibration
windows (odd windows; the fit uses the even ones), and "no compensation" is a candidate; the chosen alpha is then
refitted on all calibration windows. The kept heads of one KV group produce strongly correlated outputs, so the
unregularised least squares (alpha = 0) over-fits badly.
bias: FLAP-style (An et al. 2024): b' = b + mean_t z_R(t) W_R^T, the mean output of the removed heads R folded into
the bias; n/a where the output projection has no bias (Llama, Qwen, ...): headlab refuses it there rather than add a
parameter the architecture's config cannot express.
"""

from __future__ import annotations

import contextlib
import math

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.data import TextSpec, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.mechanisms.hooks import hooks
from headlab.mechanisms.restore import restoring
from headlab.recovery.choices import COMPENSATIONS

ALPHAS = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0)


def check_compensation(loaded: LoadedModel, method: str | None) -> None:
    """Bad --compensate values fail before any work: unknown names, bias compensation without an o_proj bias."""
    if method is None:
        return
    check_resident(loaded, "compensation")
    if method not in COMPENSATIONS:
        raise HeadlabError(f"unknown compensate={method!r}; use one of {', '.join(COMPENSATIONS)}")
    if method == "bias" and loaded.adapter.read(loaded.layers[0]).o_bias is None:
        raise HeadlabError(
            f"{loaded.model.config.model_type}'s output projection has no bias, so bias-only (FLAP) compensation "
            "is n/a; use compensate='ridge'"
        )


@torch.no_grad()
def output_statistics(loaded: LoadedModel, batches, *, progress: bool = True) -> list[torch.Tensor]:
    """Per layer, Grams [2, H*D+1, H*D+1] (float64) of [z, 1] over the unpadded tokens of the even windows (index
    0: fit) and of the odd windows (index 1: held out), z = the output projection's input."""
    layers = loaded.layers
    grams = [
        torch.zeros(2, layer.num_heads * layer.head_dim + 1, layer.num_heads * layer.head_dim + 1, dtype=torch.float64)
        for layer in layers
    ]
    state = {}

    def hook_for(index):
        def hook(z):
            z = z.float()  # [B, T, H*D]
            z = torch.cat([z, torch.ones_like(z[..., :1])], -1)  # [B, T, H*D+1]
            for part in (0, 1):
                rows = (state["valid"] & (state["parity"] == part)[:, None]).to(z.device)  # [B, T]
                if bool(rows.any()):
                    zp = z[rows].double()  # [N, H*D+1]
                    grams[index][part] += (zp.T @ zp).cpu()

        return hook

    window = 0
    with hooks(loaded.adapter, [("heads_out", layer, hook_for(layer.index)) for layer in layers]):
        for input_ids, attention_mask, *_ in tqdm(batches, desc="compensation statistics", disable=not progress):
            B = input_ids.shape[0]
            state["valid"] = attention_mask.bool().to(loaded.device)
            state["parity"] = (torch.arange(window, window + B) % 2).to(loaded.device)
            window += B
            loaded.model(
                input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device), use_cache=False
            )
    if window == 0:
        raise HeadlabError("no calibration windows to compensate on")
    if window == 1:  # one window: nothing held out; alpha is then chosen on the fitted window itself
        for gram in grams:
            gram[1] = gram[0]
    return grams


def _error(theta, gram, K, target) -> float:
    """||[z_K, 1] theta - [z, 1] target||^2 from the Gram of [z, 1] (theta [k+1, C], target [H*D+1, C])."""
    Skk, Ska, Saa = gram[K][:, K], gram[K], gram
    return float((theta * (Skk @ theta)).sum() - 2 * (theta * (Ska @ target)).sum() + (target * (Saa @ target)).sum())


def ridge_refit(
    gram: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, kept: list[int], alpha: float, lam: float | None = None
):
    """Closed-form ridge refit of o_proj columns `kept` (and b) towards the original; returns theta [k(+1), C].

    gram: [H*D+1, H*D+1] Gram of [z, 1]; W: [C, H*D]; b: [C] or None; kept: column indices; `lam` replaces
    alpha x tr(z_K^T z_K) / |K| (headlab.pruning.obs fixes it for a whole greedy path)."""
    n = W.shape[1]
    K = kept + ([n] if b is not None else [])
    target = torch.cat([W.T, (b if b is not None else torch.zeros(W.shape[0], dtype=W.dtype))[None]])  # [n+1, C]
    theta0 = target[K]
    Skk = gram[K][:, K]
    penalty = torch.ones(len(K), dtype=gram.dtype)
    if b is not None:
        penalty[-1] = 0.0  # the bias is not shrunk
    theta = ridge_solve(Skk, gram[K] @ target, theta0, penalty, alpha, len(kept), lam=lam)
    return theta, K, target


def ridge_solve(Skk, Sky, theta0, penalty, alpha: float, scaled: int, lam: float | None = None) -> torch.Tensor:
    """argmin_theta tr(theta^T Skk theta) - 2 tr(theta^T Sky) + lam ||diag(penalty)^(1/2) (theta - theta0)||^2, the
    ridge least squares pulled towards theta0, with lam = alpha x (mean of the first `scaled` diagonal entries of Skk).

    Skk: [k, k] Gram of the inputs; Sky: [k, C] inputs x targets; theta0: [k, C]; penalty: [k] (0: not shrunk);
    a given `lam` is used as is (headlab.pruning.obs fixes it for a whole greedy path)."""
    if lam is None:
        lam = alpha * float(torch.diagonal(Skk)[:scaled].sum()) / max(scaled, 1)
    A = Skk + lam * torch.diag(penalty)
    rhs = Sky + lam * penalty[:, None] * theta0
    return torch.linalg.lstsq(A, rhs).solution if lam == 0 else torch.linalg.solve(A, rhs)


def compensation_weights(
    W: torch.Tensor,
    b: torch.Tensor | None,
    grams: torch.Tensor,
    kept: list[int],
    method: str = "ridge",
    alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """New (W [C, H*D], b [C]) for one layer with only columns `kept` live (the others are zeroed), and a record:
    chosen alpha, and the relative reconstruction error on all calibration tokens before and after. A given `alpha`
    is used as is (no held-out selection; alpha=0 is plain least squares)."""
    W, b = W.double().cpu(), None if b is None else b.double().cpu()
    n = W.shape[1]
    pruned_cols = [i for i in range(n) if i not in set(kept)]
    total = grams[0] + grams[1]
    target = torch.cat([W.T, (b if b is not None else torch.zeros(W.shape[0], dtype=W.dtype))[None]])  # [n+1, C]
    K0 = kept + ([n] if b is not None else [])
    norm = max(float((target * (total @ target)).sum()), 1e-300)
    before = _error(target[K0], total, K0, target) / norm
    record = {"alpha": None, "error_before": before, "error_after": before}
    if not pruned_cols:
        return W, b, record
    if method == "bias":
        if b is None:
            raise HeadlabError("bias compensation needs an output-projection bias")
        mean_z = total[n, :n] / total[n, n]  # [n] mean of z over the calibration tokens
        b_new = b + W[:, pruned_cols] @ mean_z[pruned_cols]
        W_new = W.clone()
        W_new[:, pruned_cols] = 0
        theta = torch.cat([W.T[kept], b_new[None]])
        record["error_after"] = _error(theta, total, K0, target) / norm
        return W_new, b_new, record
    # alpha by held-out windows; "no compensation" (alpha = inf) competes too
    best_alpha, best = math.inf, _error(target[K0], grams[1], K0, target)
    for candidate in ALPHAS if alpha is None else ():
        theta, K, _ = ridge_refit(grams[0], W, b, kept, candidate)
        error = _error(theta, grams[1], K, target)
        if error < best:
            best_alpha, best = candidate, error
    if alpha is not None:
        best_alpha = alpha
    W_new = W.clone()
    W_new[:, pruned_cols] = 0
    b_new = b
    if math.isfinite(best_alpha):
        theta, K, _ = ridge_refit(total, W, b, kept, best_alpha)
        W_new[:, kept] = theta[: len(kept)].T
        if b is not None:
            b_new = theta[-1]
        record["error_after"] = _error(theta, total, K, target) / norm
    record["alpha"] = best_alpha if math.isfinite(best_alpha) else None  # None: no alpha beat leaving W as is
    return W_new, b_new, record


@torch.no_grad()
def apply_compensation(
    loaded: LoadedModel,
    pruned: list[set[int]],
    grams: list[torch.Tensor],
    method: str = "ridge",
    alpha: float | None = None,
) -> pd.DataFrame:
    """Rewrite each layer's output projection in place for the heads `pruned` (original indices) will remove; the
    pruned heads' columns are zeroed (pruning removes them anyway). One row per layer: layer, pruned_heads,
    alpha, error_before, error_after (relative squared error of the block output on the calibration tokens)."""
    check_compensation(loaded, method)
    adapter, rows = loaded.adapter, []
    for layer, heads, gram in zip(loaded.layers, pruned, grams):
        D = layer.head_dim
        kept = [h * D + d for h in range(layer.num_heads) if h not in heads for d in range(D)]
        w = adapter.read(layer)
        C = w.o.shape[0]
        W = w.o.reshape(C, -1)
        W_new, b_new, record = compensation_weights(W, w.o_bias, gram, kept, method, alpha)
        if heads:
            w.o = W_new.to(w.o.dtype).reshape(w.o.shape)
            w.o_bias = None if b_new is None else b_new.to(w.o_bias.dtype)
            adapter.write(layer, w)
        rows.append({"layer": layer.index, "pruned_heads": len(heads), "method": method, **record})
    return pd.DataFrame(rows)


@takes_text(split="calibration", seq_len=256, batch_size=4, max_tokens=2048)
def compensation_batches(loaded: LoadedModel, data=None, *, text: TextSpec):
    """Calibration-split windows of `text` for the statistics (never the eval split); `data`, when given, is its
    corpus."""
    if data is not None:
        text = text.but(data=data)
    return text.but(split="calibration").batches(loaded.tokenizer, max_positions=loaded.max_positions)


@contextlib.contextmanager
def compensated(loaded: LoadedModel, pruned: list[set[int]], grams: list[torch.Tensor], method: str = "ridge"):
    """apply_compensation for the duration of a block (yields its table), then the original weights come back."""
    with restoring(loaded):
        yield apply_compensation(loaded, pruned, grams, method)
