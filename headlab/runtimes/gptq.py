"""GPTQ rounding for the GGUF block types headlab writes itself (q8_0, q5_0, q4_0).

Each matrix is rounded onto its type's grid one input column at a time, and the rounding error of each column is
pushed onto the columns not rounded yet, so that the layer's output on calibration inputs moves least: minimise
tr((W - Q) H (W - Q)^T), H = E[x x^T] (Frantar et al. 2023, "GPTQ", Algorithm 1: the optimal brain surgeon update of
Hassibi & Stork 1993, read off the upper Cholesky factor of H^-1, with lazy block updates). Round to nearest (RTN) is
what ggml's reference quantizers do; GPTQ keeps their block scales, so the result is still an ordinary q8_0 / q5_0 /
q4_0 tensor that any llama.cpp build reads.

Block scales follow ggml's reference rules (ggml-quants.c: q8_0 d = max|w| / 127; q5_0 / q4_0 d = w* / -16 or -8 for
w* the block's weight of largest magnitude), taken from the block's values when its first column is reached. The
weight that sets the scale is rounded to the grid's end it defines, so the rounded block has the same largest weight
and gguf's own quantizer (the same rules) writes the rounded matrix back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

DAMPING = 0.01  # GPTQ's default: H + 0.01 mean(diag H) I keeps the inverse stable when inputs are nearly collinear
COLUMNS_PER_UPDATE = 128  # GPTQ's lazy batch: columns rounded before the rest of the matrix is updated in one product


@dataclass(frozen=True)
class BlockGrid:
    """A symmetric ggml block type: `block` consecutive weights of a row share one float16 scale d = w* / divisor,
    w* the block's weight of largest magnitude (its magnitude when `magnitude_reference`), and hold q d for integer q
    in [low, high]."""

    block: int
    divisor: float
    low: int
    high: int
    magnitude_reference: bool


GRIDS = {
    "q8_0": BlockGrid(32, 127.0, -127, 127, True),
    "q5_0": BlockGrid(32, -16.0, -16, 15, False),
    "q4_0": BlockGrid(32, -8.0, -8, 7, False),
}


def block_scales(blocks: torch.Tensor, grid: BlockGrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For blocks [..., block]: (d rounded to float16, the index of the weight w* setting it, the integer that weight
    takes: w* / d, an end of the grid), ggml's reference rule."""
    index = blocks.abs().argmax(-1, keepdim=True)
    extreme = blocks.gather(-1, index)
    reference = extreme.abs() if grid.magnitude_reference else extreme
    scale = (reference / grid.divisor).to(torch.float16).to(blocks.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    end = torch.where(scale == 0, torch.zeros_like(scale), torch.round(extreme / safe))
    return scale.squeeze(-1), index.squeeze(-1), end.squeeze(-1)


def _to_grid(values: torch.Tensor, scale: torch.Tensor, grid: BlockGrid) -> torch.Tensor:
    """The integer level of each value at its scale (0 where the scale flushed to zero), nearest, ties up."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    levels = torch.floor(values / safe + 0.5).clamp(grid.low, grid.high)
    return torch.where(scale == 0, torch.zeros_like(levels), levels)


def round_to_nearest(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """What gguf's own quantizer (ggml's reference rules, round to nearest) writes for weight [out, in], read back
    as float64: the rounding GPTQ is measured against."""
    ggml_type = gguf.GGMLQuantizationType[qtype.upper()]
    values = weight.detach().to("cpu", torch.float32).numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, ggml_type), ggml_type)).double()


def output_error(weight: torch.Tensor, rounded: torch.Tensor, gram: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the mean squared change of the layer's output over the tokens H = E[x x^T] averages."""
    delta = weight.double() - rounded.double()
    return float(((delta @ gram.double()) * delta).sum())


def gptq_round(weight: torch.Tensor, gram: torch.Tensor, qtype: str, *, damping: float = DAMPING) -> torch.Tensor:
    """weight [out, in] rounded onto `qtype`'s grid by GPTQ against H = gram [in, in], as float64 (every value q d is
    exact in float32). Inputs that never fired (H_jj = 0) are rounded to nearest and pass no error on."""
    grid = GRIDS[qtype]
    rows, columns = weight.shape
    if columns % grid.block:
        raise ValueError(f"{columns} input columns do not split into {qtype}'s {grid.block}-weight blocks")
    W = weight.detach().to("cpu", torch.float64).clone()
    H = gram.detach().to("cpu", torch.float64).clone()
    dead = torch.diagonal(H) == 0
    H[dead, :] = 0
    H[:, dead] = 0
    H[dead, dead] = 1
    H += damping * torch.diagonal(H).mean() * torch.eye(columns, dtype=H.dtype)
    # the upper factor U of H^-1 = U^T U: row c of U, divided by U_cc, is the OBS update for column c once the
    # columns before it are fixed (GPTQ, section 3, "Cholesky reformulation")
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    rounded = torch.empty_like(W)
    width = max(grid.block, COLUMNS_PER_UPDATE // grid.block * grid.block)
    for start in range(0, columns, width):
        end = min(start + width, columns)
        part, errors = W[:, start:end].clone(), torch.empty(rows, end - start, dtype=W.dtype)
        for j in range(end - start):
            if j % grid.block == 0:  # a new block: its scale from its values now, after the earlier columns' errors
                scale, setter, end_level = block_scales(part[:, j : j + grid.block], grid)
            levels = _to_grid(part[:, j], scale, grid)
            levels = torch.where(setter == j % grid.block, end_level, levels)  # the scale's own weight: the grid end
            rounded[:, start + j] = levels * scale
            errors[:, j] = (part[:, j] - rounded[:, start + j]) / U[start + j, start + j]
            part[:, j + 1 :] -= errors[:, j : j + 1] * U[start + j, start + j + 1 : end]
        W[:, end:] -= errors @ U[start:end, end:]
    return rounded


class GptqRounding:
    """Rounds named matrices by GPTQ as they are written (`rounding(name, weight)`), each against its calibration
    second moments {name: E[x x^T]} onto its type's grid ({name: type}: those in GRIDS are rounded); frees each
    one's moments once used, and records its output error against round to nearest's."""

    def __init__(self, grams: dict[str, torch.Tensor], qtypes: dict[str, str], calibration: dict):
        self.grams = {name: gram for name, gram in grams.items() if qtypes.get(name) in GRIDS}
        self.qtypes, self.calibration = qtypes, calibration
        self.errors: dict[str, tuple[float, float]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.grams

    def __call__(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        gram, qtype = self.grams.pop(name), self.qtypes[name]
        rounded = gptq_round(weight, gram, qtype)
        nearest = round_to_nearest(weight, qtype)
        self.errors[name] = (output_error(weight, rounded, gram), output_error(weight, nearest, gram))
        return rounded.to(torch.float32)  # exact: q d has at most 8 + 11 significant bits

    def record(self) -> dict:
        """What the export records: the matrices rounded, the calibration, and the output error GPTQ reached as a
        fraction of round to nearest's (tr(dW H dW^T), summed over the matrices, and the worst single one)."""
        ratios = {name: gptq / nearest for name, (gptq, nearest) in self.errors.items() if nearest > 0}
        worst = max(ratios, key=ratios.get) if ratios else None
        total = sum(nearest for _, nearest in self.errors.values())
        types: dict[str, int] = {}
        for name in self.errors:
            types[self.qtypes[name]] = types.get(self.qtypes[name], 0) + 1
        return {
            "matrices": len(self.errors),
            "types": types,
            "damping": DAMPING,
            **self.calibration,
            "output_error_vs_nearest": sum(gptq for gptq, _ in self.errors.values()) / total if total else None,
            "worst_matrix": None if worst is None else {"name": worst, "output_error_vs_nearest": ratios[worst]},
        }
