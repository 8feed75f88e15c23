"""Reconstruction-aware head selection: structured Optimal Brain Surgeon at head granularity (Hassibi & Stork 1993;
ZipLM, Kurtic et al. 2023), on the calibration Gram that `prune --compensate` refits from (headlab.recovery.compensate).

One attention layer, z the output projection's input ([H*D], plus a constant 1 where o_proj has a bias), G its Gram
over N calibration tokens, T0 = [W_o^T; b] the projection as rows per input dimension, lam the ridge of the refit:
- removing a set R of head blocks and refitting the kept rows K optimally,
      T' = argmin_{T_R = 0} tr( B (T - T0)^T (G + lam P) (T - T0) )          (P: 1 on head dims, 0 on the bias)
  is the ridge refit of headlab.recovery.compensate for every positive-definite B (B weights output channels, and the
  optimum of a Kronecker-weighted least squares does not depend on the output weighting);
- greedily, one unit at a time (OBS): with Hinv = (G + lam P)^{-1} over the live rows, removing block R raises the
  objective by tr( B T_R^T (Hinv_RR)^{-1} T_R ); then T <- T - Hinv[:, R] (Hinv_RR)^{-1} T_R and
  Hinv <- Hinv - Hinv[:, R] (Hinv_RR)^{-1} Hinv[R, :] (the inverse-Hessian row and column removal);
- B is the block-output Fisher of headlab.measure.importance.fisher_statistics (K-FAC: E[d d^T], d = dL/d(block output)), so the data part
  cost = 1/2 tr( B (T' - T0)^T G (T' - T0) ) / N estimates the increase of the mean next-token NLL (nats/token);
  that puts every layer's costs on one scale (Kronecker-factored curvature, Martens & Grosse 2015). With B = I the
  cost is the plain reconstruction error.
lam = alpha x mean diagonal of G over the head dims, alpha chosen per layer on held-out calibration windows (the fit /
held-out Grams of headlab.recovery.compensate.output_statistics) by the B-weighted error summed along the greedy path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from headlab.core.errors import HeadlabError
from headlab.recovery.compensate import ALPHAS


@dataclass
class ObsPath:
    """One layer's greedy removal order `units` (lists of query heads), after each removal the cumulative `cost`
    (nats/token estimate; plain error with B = I) and relative reconstruction `error` (||z_K T'_K - z T0||^2 /
    ||z T0||^2 on the Gram the path was built on), the chosen `alpha` and `lam`, and `single` (the cost of removing
    each unit alone, from the full model: a per-head score)."""

    layer: int
    units: list[list[int]]
    cost: list[float]
    error: list[float]
    alpha: float
    lam: float
    single: dict[tuple[int, ...], float] = field(default_factory=dict)


def _target(W: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """T0 [n(+1), C] (rows: input dims, plus the bias row) and the live dims (the bias row only where it exists)."""
    n = W.shape[1]
    T0 = torch.cat([W.T, (b if b is not None else torch.zeros(W.shape[0], dtype=W.dtype))[None]])
    return T0, list(range(n)) + ([n] if b is not None else [])


def ridge_lambda(gram: torch.Tensor, n: int, alpha: float) -> float:
    """lam = alpha x tr(G_zz) / n, the mean diagonal of the head dims' Gram (fixed for the whole path)."""
    return alpha * float(torch.diagonal(gram)[:n].sum()) / max(n, 1)


def _chol_factor(output_fisher: torch.Tensor | None, C: int) -> torch.Tensor | None:
    """L with L L^T = B + eps I (eps: 1e-9 of the mean diagonal keeps a rank-deficient Fisher positive definite)."""
    if output_fisher is None:
        return None
    B = output_fisher.double()
    eps = 1e-9 * float(torch.diagonal(B).mean()) + 1e-300
    return torch.linalg.cholesky(B + eps * torch.eye(C, dtype=B.dtype))


class _GreedyState:
    """What one greedy OBS path updates together at every removal (module docstring): Hinv = (G + lam P)^{-1} over
    the live rows, the refit T in plain and Tw in B-weighted coordinates (the same tensor when B = I), the two
    accumulated ridge objectives, and, with a held-out Gram G1, the product G1 (Tw - Tw0) and the error summed."""

    def __init__(self, gram, W, b, alpha: float, output_fisher, held_out):
        gram, W = gram.double(), W.double()
        b = None if b is None else b.double()
        n, C = W.shape[1], W.shape[0]
        T0, live = _target(W, b)
        self.T0 = T0[live]  # [m, C]
        G = gram[live][:, live]  # [m, m]
        self.lam = ridge_lambda(gram, n, alpha)
        self.penalty = torch.ones(len(live), dtype=G.dtype)
        if b is not None:
            self.penalty[-1] = 0.0  # the bias is refit freely, as in compensate.ridge_refit
        self.Hinv = torch.linalg.inv(G + self.lam * torch.diag(self.penalty))
        L = _chol_factor(output_fisher, C)
        self.T = self.T0.clone()  # current refit, original coordinates
        self.Tw = self.T0 @ L if L is not None else self.T  # the same rows in B-weighted coordinates
        self.weighted = L is not None
        self.norm = max(float((self.T0 * (G @ self.T0)).sum()), 1e-300)
        tokens = max(float(gram[n, n]), 1.0)
        self.scale = 0.5 / tokens if self.weighted else 1.0
        self.G1 = None if held_out is None else held_out.double()[live][:, live]
        # G1 @ (Tw - Tw0)
        self.G1_delta = None if self.G1 is None else torch.zeros_like(self.T0 if not self.weighted else self.Tw)
        self.Tw0 = self.Tw.clone()
        self.objective_w = self.objective_u = 0.0
        self.held_total = 0.0

    def increment(self, R: list[int], X_rows: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        """tr( X_R^T (Hinv_RR)^{-1} X_R ): the objective's rise on removing rows R; with the solve and the block."""
        block = self.Hinv[R][:, R]
        solved = torch.linalg.solve(block, X_rows[R])  # (Hinv_RR)^{-1} T_R
        return float((X_rows[R] * solved).sum()), solved, block

    def remove(self, R: list[int], cost: float) -> tuple[float, float]:
        """Remove rows R (B-weighted objective rise `cost`): OBS update of the refit and of Hinv, the held-out error
        added; returns the data part (ridge objective - lam ||P (T' - T0)||^2), B-weighted and plain."""
        _, solved_w, block = self.increment(R, self.Tw)
        solved_u = torch.linalg.solve(block, self.T[R])
        column = self.Hinv[:, R]  # [m, |R|]
        self.objective_w += cost
        self.objective_u += float((self.T[R] * solved_u).sum())
        step_w = column @ solved_w
        self.T = self.T - column @ solved_u
        self.Tw = self.Tw - step_w if self.weighted else self.T
        if self.G1_delta is not None:
            self.G1_delta = self.G1_delta - (self.G1 @ column) @ (solved_w if self.weighted else solved_u)
        self.Hinv = self.Hinv - column @ torch.linalg.solve(block, self.Hinv[R])
        self.T[R], self.Hinv[R], self.Hinv[:, R] = 0.0, 0.0, 0.0
        if self.weighted:
            self.Tw[R] = 0.0
        pen_u = self.lam * float((self.penalty[:, None] * (self.T - self.T0) ** 2).sum())
        data_u = self.objective_u - pen_u
        if self.weighted:
            data_w = self.objective_w - self.lam * float((self.penalty[:, None] * (self.Tw - self.Tw0) ** 2).sum())
        else:
            data_w = data_u
        if self.G1_delta is not None:
            delta = (self.Tw - self.Tw0) if self.weighted else (self.T - self.T0)
            self.held_total += float((delta * self.G1_delta).sum())
        return data_w, data_u


def obs_path(
    gram: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    head_dim: int,
    units: list[list[int]],
    *,
    alpha: float,
    output_fisher: torch.Tensor | None = None,
    allowed: Callable[[set[int], list[int]], bool] | None = None,
    steps: int | None = None,
    held_out: torch.Tensor | None = None,
    layer: int = 0,
) -> tuple[ObsPath, float]:
    """Greedy OBS removal path of one layer (module docstring). Returns the path and, with `held_out` (a Gram of
    other windows), the B-weighted held-out error of the path's refits summed over its steps (for choosing alpha).

    gram [n+1, n+1] of [z, 1]; W [C, n]; b [C] or None; units: candidate removals as lists of query heads;
    allowed(removed_heads, unit): constraint (GQA / uniform caps); steps: stop after this many removals."""
    state = _GreedyState(gram, W, b, alpha, output_fisher, held_out)
    removed: set[int] = set()
    path = ObsPath(layer, [], [], [], alpha, state.lam)

    def dims(unit):
        return [h * head_dim + d for h in unit for d in range(head_dim)]

    limit = len(units) if steps is None else steps
    while len(path.units) < limit:
        candidates = [u for u in units if not set(u) & removed and (allowed is None or allowed(removed, u))]
        if not candidates:
            break
        scored = []
        for u in candidates:
            cost, _, _ = state.increment(dims(u), state.Tw)
            scored.append((cost, u))
            if not path.units:
                path.single[tuple(u)] = cost
        cost, unit = min(scored, key=lambda c: (c[0], c[1]))
        data_w, data_u = state.remove(dims(unit), cost)
        removed |= set(unit)
        path.units.append(list(unit))
        path.cost.append(state.scale * data_w)
        path.error.append(data_u / state.norm)
    return path, state.held_total


def choose_alpha_path(
    grams: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None,
    head_dim: int,
    units: list[list[int]],
    *,
    output_fisher=None,
    allowed=None,
    steps=None,
    layer: int = 0,
    alphas=ALPHAS,
) -> ObsPath:
    """The OBS path on all calibration windows with the alpha whose path (built on the even windows) has the
    smallest held-out (odd windows) B-weighted error summed over its steps. grams: [2, n+1, n+1] as from
    headlab.recovery.compensate.output_statistics."""
    if not alphas:
        raise HeadlabError("OBS selection needs at least one ridge alpha")
    best = (math.inf, alphas[0])
    if len(alphas) > 1:
        for alpha in alphas:
            _, held = obs_path(
                grams[0], W, b, head_dim, units, alpha=alpha, output_fisher=output_fisher, allowed=allowed,
                steps=steps, held_out=grams[1], layer=layer,
            )  # fmt: skip
            if held < best[0]:
                best = (held, alpha)
    path, _ = obs_path(
        grams[0] + grams[1], W, b, head_dim, units, alpha=best[1], output_fisher=output_fisher, allowed=allowed,
        steps=steps, layer=layer,
    )  # fmt: skip
    return path
