"""Importance matrices for llama.cpp's quantizer: for each matrix of a GGUF file, the mean square of each input
feature over calibration tokens, E[x_j^2] (what llama.cpp's `llama-imatrix` collects and `llama-quantize --imatrix`
reads; its k- and i-quants weight the rounding error of weight column j by it, ggml-quants.c)."""

from __future__ import annotations

import numpy as np
import torch

from headlab.core.loading import LoadedModel
from headlab.mechanisms.hooks import input_mean_squares as hooked_mean_squares


def input_mean_squares(loaded: LoadedModel, modules: dict[str, torch.nn.Module], batches, *, progress: bool = True):
    """{name: E[x_j^2] over the real (unpadded) tokens of `batches`, x the input of modules[name]} as float32
    arrays [in_features], accumulated in float64 (headlab.mechanisms.hooks.input_mean_squares); and the number of
    tokens they average."""
    squares, tokens = hooked_mean_squares(loaded, modules, batches, progress=progress, desc="importance matrix")
    return {name: total.float().numpy().astype(np.float32) for name, total in squares.items()}, tokens
