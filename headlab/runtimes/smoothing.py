"""Activation smoothing for quantized GGUF files (SmoothQuant, Xiao et al. 2023, eq. 4).

llama.cpp's quantized products round each activation vector too (to 8-bit blocks of 32, q8_0 / q8_K), so one
outlier channel costs the other channels of its block their precision. An exact rescaling moves that range into
the weights: the matrices W reading an input x get W' = W diag(s) and x' = x / s, with

    s_j = max_t |x_tj|^a / max_i |W_ij|^(1 - a)     (a = 0.5 by default, the paper's)

over calibration tokens t, the division folded into what produces x. Here the feed-forward of every llama-family
block (the only layout llama.cpp's llama / deci / deepseek2 graphs give it): ffn_norm's weight / s_in with
ffn_gate and ffn_up times s_in (their columns); ffn_up's rows (and bias) / s_mid with ffn_down's columns times
s_mid, exact because the gate's activation multiplies up's output elementwise. In full precision the file computes
what the model does (tests/test_smoothing.py: llama.cpp against transformers in f32); what changes is how it
rounds. Importance matrices and GPTQ's second moments are taken of the rescaled inputs (`moments`).

With alpha "auto" each block's two inputs get their own alpha, or no rescaling, whichever gives the smallest
simulated error of llama.cpp's product on calibration tokens: sum over the matrices W reading x of
||Q8(x / s) Q(W diag(s))^T - x W^T||^2 / ||x W^T||^2, Q8 the activation rounding ggml applies before a q8_0, q5_0 or
q4_0 dot product (quantize_row_q8_0: blocks of 32, d = max|x| / 127) and Q the file's own weight rounding. A per-layer
search of alpha is SmoothQuant's own suggestion for models whose outliers differ by layer (Xiao et al. 2023, sec. 5;
Intel Neural Compressor's "auto" alpha); here it is scored against the rounding the file will actually see.
"""

from __future__ import annotations

import torch

from headlab.core.errors import HeadlabError
from headlab.mechanisms.hooks import input_abs_max, input_rows
from headlab.runtimes.gptq import GRIDS, round_to_nearest

DEFAULT_ALPHA = 0.5
AUTO = "auto"
ALPHA_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)  # with no rescaling (None), the choices of alpha "auto"
SAMPLED_TOKENS = 2048  # calibration tokens whose inputs "auto" keeps to score each choice (every 4th real token)
ACTIVATION_BLOCK = 32  # ggml's q8_0 block: what the CPU rounds activations to for q8_0, q5_0 and q4_0 weights
SCALE_FLOOR = 1e-5  # a channel that never fires (max |x| = 0) or a zero weight column: no division by zero
# The tensors a block's rescaling changes (GGUF names less "blk.N."); ffn_gate's and ffn_down's biases add to outputs
# the rescaling leaves alone
RESCALED = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_up.bias", "ffn_down.weight")
FEED_FORWARD = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def smoothing_scale(activation_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^a / max_i |W_ij|^(1 - a) over every matrix reading x (float64 [in_features])."""
    weight_max = torch.stack([w.detach().abs().double().amax(0) for w in weights]).amax(0)
    return activation_max.double().clamp_min(SCALE_FLOOR) ** alpha / weight_max.clamp_min(SCALE_FLOOR) ** (1 - alpha)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero (ggml's reference quantizers)."""
    return torch.sign(values) * torch.floor(values.abs() + 0.5)


def q8_0_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., features] as llama.cpp's CPU rounds it before a q8_0 / q5_0 / q4_0 dot product, read back: each block
    of 32 features gets d = max|x| / 127 (stored in float16) and the integers roundf(x / d) (ggml-quants.c,
    quantize_row_q8_0_ref)."""
    blocks = x.reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    levels = torch.where(scale == 0, torch.zeros_like(blocks), _round_half_away(blocks / safe))
    return (levels * scale.half().to(x.dtype)).reshape(x.shape)


def exact_products(rows: torch.Tensor, weights: list[tuple[torch.Tensor, str]]) -> list[torch.Tensor]:
    """x W^T in float64 for each (W, type): what every candidate scale's rounded product is compared with."""
    return [rows.double() @ weight.double().T for weight, _ in weights]


def quantized_product_error(rows: torch.Tensor, weights: list[tuple[torch.Tensor, str]], scale: torch.Tensor | None,
                            exact: list[torch.Tensor] | None = None) -> float:  # fmt: skip
    """sum over (W, type) of ||Q8(x / s) Q(W diag(s))^T - x W^T||^2 / ||x W^T||^2 over the sampled inputs `rows`
    [tokens, in]: how far llama.cpp's product with the rescaled tensors lands from the exact one (scale None: no
    rescaling; `exact`: exact_products of the same rows and weights, computed once for many scales)."""
    x = rows.double()
    inputs = q8_0_activations(x if scale is None else x / scale)
    exact = exact_products(rows, weights) if exact is None else exact
    total = 0.0
    for (weight, qtype), product in zip(weights, exact):
        stored = weight if scale is None else weight.double() * scale
        error = inputs @ round_to_nearest(stored, qtype).T - product
        total += float(error.square().sum() / product.square().sum().clamp_min(1e-30))
    return total


def chosen_scale(maxima: torch.Tensor, rows: torch.Tensor, weights: list[tuple[torch.Tensor, str]]):
    """(s, alpha) for one input under "auto": the ALPHA_GRID scale or no rescaling (s = 1, alpha None), whichever has
    the smallest quantized_product_error on `rows`."""
    matrices = [weight for weight, _ in weights]
    candidates = {None: None, **{alpha: smoothing_scale(maxima, matrices, alpha) for alpha in ALPHA_GRID}}
    exact = exact_products(rows, weights)
    errors = {alpha: quantized_product_error(rows, weights, scale, exact) for alpha, scale in candidates.items()}
    best = min(errors, key=errors.get)
    scale = candidates[best]
    return (torch.ones_like(maxima, dtype=torch.float64) if scale is None else scale), best


class Smoothing:
    """The per-block scales {block: (s_in [hidden], s_mid [intermediate])}; `smoothing(name, tensor)` is the tensor
    as the file stores it, `moments(name, value)` a calibrated matrix's input statistics after the rescaling."""

    def __init__(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], alpha, calibration: dict,
                 chosen: dict[int, tuple] | None = None):  # fmt: skip
        self.scales, self.alpha, self.calibration = scales, alpha, calibration
        self.chosen = chosen or {}  # alpha "auto": {block: (alpha of s_in, alpha of s_mid)}, None for no rescaling

    def _input_scale(self, name: str) -> torch.Tensor | None:
        """s of the input the matrix `name` reads (None: not rescaled)."""
        block, short = _split(name)
        if block not in self.scales:
            return None
        s_in, s_mid = self.scales[block]
        return {"ffn_gate.weight": s_in, "ffn_up.weight": s_in, "ffn_down.weight": s_mid}.get(short)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        block, short = _split(name)
        if block not in self.scales or short not in RESCALED:  # attention and the rest pass through untouched
            return tensor
        s_in, s_mid = self.scales[block]
        value = tensor.double()
        if short == "ffn_norm.weight":
            value = value / s_in
        elif short != "ffn_up.bias":  # the three matrices: columns times the scale of the input they read
            value = value * self._input_scale(name)
        if short == "ffn_up.weight":
            value = value / s_mid[:, None]
        elif short == "ffn_up.bias":
            value = value / s_mid
        return value.to(tensor.dtype)

    def moments(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """E[x'^2] = E[x^2] / s^2 ([in]) or E[x' x'^T] = E[x x^T] / (s s^T) ([in, in]) of the rescaled input."""
        s = self._input_scale(name)
        if s is None:
            return value
        scale = s**2 if value.dim() == 1 else torch.outer(s, s)
        return (value.double() / scale).to(value.dtype)

    def record(self) -> dict:
        every = torch.cat([torch.cat(pair) for pair in self.scales.values()]) if self.scales else torch.ones(1)
        record = {"method": "SmoothQuant (Xiao et al. 2023), feed-forward inputs", "alpha": self.alpha,
                  "blocks": len(self.scales), "scale_range": [float(every.min()), float(every.max())],
                  **self.calibration}  # fmt: skip
        if self.chosen:
            record["chosen_alpha"] = {str(block): list(pair) for block, pair in self.chosen.items()}
        return record


def _split(name: str) -> tuple[int | None, str]:
    """("blk.3.ffn_up.weight") -> (3, "ffn_up.weight"); a tensor outside the blocks -> (None, name)."""
    parts = name.split(".", 2)
    return (int(parts[1]), parts[2]) if parts[0] == "blk" and len(parts) == 3 else (None, name)


def check_alpha(alpha, outtype: str | None = None) -> None:
    """One line, before any work, for an alpha outside [0, 1], or "auto" for a file type whose rounding (and the q8_0
    activation rounding llama.cpp pairs with it) headlab does not simulate: its own q8_0, q5_0 and q4_0 only."""
    if alpha == AUTO:
        if outtype is not None and outtype not in GRIDS:
            raise HeadlabError(f"smoothing alpha 'auto' scores the rounding of {', '.join(GRIDS)} files only, not "
                               f"{outtype}; give alpha as a number in [0, 1]")  # fmt: skip
        return
    if isinstance(alpha, str) or not 0 <= alpha <= 1:
        raise HeadlabError(f"smoothing alpha={alpha} must be in [0, 1] or 'auto'")


def activation_smoothing(loaded, modules: dict, items: list, weight, batches, alpha, progress: bool = True,
                         qtypes: dict[str, str] | None = None) -> Smoothing:  # fmt: skip
    """A Smoothing for every block whose feed-forward the file holds whole (ffn_norm, ffn_gate, ffn_up, ffn_down),
    its activation maxima over the calibration `batches` read at the gate's and the down projection's inputs
    (`modules`: {GGUF name: transformers linear layer}, headlab.runtimes.gguf_export.calibrated_modules; `weight`:
    GGUF name -> the resident tensor). `alpha` "auto" (needs `qtypes`, {GGUF name: the type it is written in}) chooses
    each input's alpha, or none, by `chosen_scale` on inputs sampled in a second pass."""
    check_alpha(alpha)
    if alpha == AUTO and qtypes is None:
        raise ValueError("smoothing alpha 'auto' scores the file's rounding: pass the types it is written in (qtypes)")
    names = {name for name, _, _ in items}
    feed_forward = FEED_FORWARD  # gate, up, down
    blocks = sorted({block for name in names if (block := _split(name)[0]) is not None})
    whole = [b for b in blocks if f"blk.{b}.ffn_norm.weight" in names
             and all(f"blk.{b}.{short}" in names and f"blk.{b}.{short}" in modules for short in feed_forward)]  # fmt: skip
    hooked = {
        f"blk.{b}.{short}": modules[f"blk.{b}.{short}"] for b in whole for short in (feed_forward[0], feed_forward[2])
    }
    maxima, tokens = input_abs_max(loaded, hooked, batches, progress=progress, desc="smoothing")
    rows = None
    if alpha == AUTO:
        rows, _ = input_rows(loaded, hooked, batches, limit=SAMPLED_TOKENS, progress=progress, desc="smoothing search")
    scales, chosen = {}, {}
    for b in whole:
        gate, up, down = (weight(f"blk.{b}.{short}") for short in feed_forward)
        gate_input, down_input = f"blk.{b}.ffn_gate.weight", f"blk.{b}.ffn_down.weight"
        if rows is None:
            s_in = smoothing_scale(maxima[gate_input], [gate, up], alpha)
            s_mid = smoothing_scale(maxima[down_input], [down], alpha)
        else:
            if any(qtypes.get(f"blk.{b}.{short}") not in GRIDS for short in feed_forward):
                continue  # a matrix that fell back to another type (a width no block divides): left unscaled
            gate_type, up_type, down_type = (qtypes[f"blk.{b}.{short}"] for short in feed_forward)
            s_in, a_in = chosen_scale(maxima[gate_input], rows[gate_input], [(gate, gate_type), (up, up_type)])
            s_mid, a_mid = chosen_scale(maxima[down_input], rows[down_input], [(down, down_type)])
            chosen[b] = (a_in, a_mid)
        scales[b] = (s_in, s_mid)
    calibration = {"tokens": tokens, "text": batches.meta}
    if rows is not None:
        calibration["search_tokens"] = min(len(held) for held in rows.values())
    return Smoothing(scales, alpha, calibration, chosen)
