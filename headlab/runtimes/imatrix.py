"""Importance matrices for llama.cpp's quantizer: for each matrix of a GGUF file, the mean square of each input
feature over calibration tokens, E[x_j^2] (what llama.cpp's `llama-imatrix` collects and `llama-quantize --imatrix`
reads; its k- and i-quants weight the rounding error of weight column j by it, ggml-quants.c)."""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from headlab.core.loading import LoadedModel
from headlab.mechanisms.hooks import module_hooks


def input_mean_squares(loaded: LoadedModel, modules: dict[str, torch.nn.Module], batches, *, progress: bool = True):
    """{name: E[x_j^2] over the real (unpadded) tokens of `batches`, x the input of modules[name]} as float32
    arrays [in_features], accumulated in float64; and the number of tokens they average."""
    sums = {name: torch.zeros(module.in_features, dtype=torch.float64) for name, module in modules.items()}
    state = {"mask": None, "tokens": 0}

    def accumulate(name):
        def add(x):
            mask = state["mask"].to(x.device, torch.float64)  # [B, T]
            sums[name] += torch.einsum("btc,bt->c", x.detach().double() ** 2, mask).cpu()

        return add

    device = loaded.device  # where the inputs go, also under a device map
    with torch.no_grad(), module_hooks((module, accumulate(name)) for name, module in modules.items()):
        for input_ids, attention_mask, *_ in tqdm(
            batches, desc="importance matrix", unit="batch", disable=not progress
        ):
            state["mask"] = attention_mask
            state["tokens"] += int(attention_mask.sum())
            loaded.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    tokens = max(state["tokens"], 1)
    return {name: (total / tokens).float().numpy().astype(np.float32) for name, total in sums.items()}, state["tokens"]
