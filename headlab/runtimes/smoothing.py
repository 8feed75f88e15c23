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
"""

from __future__ import annotations

import torch

from headlab.core.errors import HeadlabError
from headlab.mechanisms.hooks import input_abs_max

DEFAULT_ALPHA = 0.5
SCALE_FLOOR = 1e-5  # a channel that never fires (max |x| = 0) or a zero weight column: no division by zero
# The tensors a block's rescaling changes (GGUF names less "blk.N."); ffn_gate's and ffn_down's biases add to outputs
# the rescaling leaves alone
RESCALED = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_up.bias", "ffn_down.weight")


def smoothing_scale(activation_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^a / max_i |W_ij|^(1 - a) over every matrix reading x (float64 [in_features])."""
    weight_max = torch.stack([w.detach().abs().double().amax(0) for w in weights]).amax(0)
    return activation_max.double().clamp_min(SCALE_FLOOR) ** alpha / weight_max.clamp_min(SCALE_FLOOR) ** (1 - alpha)


class Smoothing:
    """The per-block scales {block: (s_in [hidden], s_mid [intermediate])}; `smoothing(name, tensor)` is the tensor
    as the file stores it, `moments(name, value)` a calibrated matrix's input statistics after the rescaling."""

    def __init__(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], alpha: float, calibration: dict):
        self.scales, self.alpha, self.calibration = scales, alpha, calibration

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
        return {"method": "SmoothQuant (Xiao et al. 2023), feed-forward inputs", "alpha": self.alpha,
                "blocks": len(self.scales), "scale_range": [float(every.min()), float(every.max())],
                **self.calibration}  # fmt: skip


def _split(name: str) -> tuple[int | None, str]:
    """("blk.3.ffn_up.weight") -> (3, "ffn_up.weight"); a tensor outside the blocks -> (None, name)."""
    parts = name.split(".", 2)
    return (int(parts[1]), parts[2]) if parts[0] == "blk" and len(parts) == 3 else (None, name)


def activation_smoothing(loaded, modules: dict, items: list, weight, batches, alpha: float,
                         progress: bool = True) -> Smoothing:  # fmt: skip
    """A Smoothing for every block whose feed-forward the file holds whole (ffn_norm, ffn_gate, ffn_up, ffn_down),
    its activation maxima over the calibration `batches` read at the gate's and the down projection's inputs
    (`modules`: {GGUF name: transformers linear layer}, headlab.runtimes.gguf_export.calibrated_modules; `weight`:
    GGUF name -> the resident tensor)."""
    if not 0 <= alpha <= 1:
        raise HeadlabError(f"smoothing alpha={alpha} must be in [0, 1]")
    names = {name for name, _, _ in items}
    feed_forward = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    blocks = sorted({block for name in names if (block := _split(name)[0]) is not None})
    whole = [b for b in blocks if f"blk.{b}.ffn_norm.weight" in names
             and all(f"blk.{b}.{short}" in names and f"blk.{b}.{short}" in modules for short in feed_forward)]  # fmt: skip
    hooked = {
        f"blk.{b}.{short}": modules[f"blk.{b}.{short}"] for b in whole for short in (feed_forward[0], feed_forward[2])
    }
    maxima, tokens = input_abs_max(loaded, hooked, batches, progress=progress, desc="smoothing")
    scales = {}
    for b in whole:
        gate, up, down = (weight(f"blk.{b}.{short}") for short in feed_forward)
        s_in = smoothing_scale(maxima[f"blk.{b}.ffn_gate.weight"], [gate, up], alpha)
        s_mid = smoothing_scale(maxima[f"blk.{b}.ffn_down.weight"], [down], alpha)
        scales[b] = (s_in, s_mid)
    return Smoothing(scales, alpha, {"tokens": tokens, "text": batches.meta})
