"""16-bit matrix products on a CPU without native bfloat16 kernels, computed in float32.

torch's CPU kernels for bfloat16/float16 products need AVX512-BF16 or AMX; without them they fall back to a generic
loop. On a 2-core AVX2 EPYC (this project's machine until December 2026; the current one has AVX512-BF16),
[256, 2048] @ [2048, 4096] in bfloat16 (the input gradient of a linear layer) runs at 0.3 GFLOP/s against 79 in
float32, and the forward product at 10 against 76, so a bfloat16 checkpoint
offloaded with `--device-map auto` (which keeps the stored dtype) took hours for one `importance` batch at the 8B
shape. A model loaded on such a CPU in a 16-bit dtype therefore runs its linear layers and matmuls with float32
arithmetic on the 16-bit values: the weights stay 16-bit in memory, each product upcasts its operands (in row
blocks, so the largest weight never needs a whole float32 copy), accumulates in float32 and rounds the result back,
which is what the native kernel computes too, up to the order of the float32 sums. Autograd keeps the 16-bit
operands, not float32 copies. `HEADLAB_CPU_MATMUL=native|float32` forces either path (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Row block of a weight upcast at a time: 2**24 float32 elements (64 MiB); the 8B shape's lm_head is 128,256 x 4,096
# (2 GiB in float32), so whole upcasts would dominate a reader's peak memory.
BLOCK_ELEMENTS = 2**24
ENV = "HEADLAB_CPU_MATMUL"


def native_half_matmul() -> bool:
    """Whether this CPU has native 16-bit product kernels (AVX512-BF16 or AMX tiles), or HEADLAB_CPU_MATMUL says."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("native", "float32"):
        return forced == "native"
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def needs_float32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """A 16-bit model computing on a CPU without native 16-bit kernels."""
    return device.type == "cpu" and dtype in HALF_DTYPES and not native_half_matmul()


def _row_blocks(rows: int, columns: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(columns, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _Float32Linear(torch.autograd.Function):
    """y = x W^T + b with float32 arithmetic on 16-bit operands; the backward recomputes the upcasts block by block
    (dx = dy W, dW = dy^T x, db = sum dy) and returns each gradient in its operand's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        x32 = x.float()
        parts = [F.linear(x32, weight[rows].float()) for rows in _row_blocks(*weight.shape)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        g32 = grad.float()
        grad_x = grad_w = grad_b = None
        blocks = _row_blocks(*weight.shape)
        if ctx.needs_input_grad[0]:
            grad_x = sum(g32[..., rows] @ weight[rows].float() for rows in blocks).to(x.dtype)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1]).float()
            g2 = g32.reshape(-1, g32.shape[-1])
            grad_w = torch.cat([g2[:, rows].T @ x2 for rows in blocks]).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = g32.reshape(-1, g32.shape[-1]).sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b


def _is_half_cpu(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.dtype in HALF_DTYPES


_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}


class Float32Products(TorchFunctionMode):
    """While active, F.linear and matmul/bmm of 16-bit CPU tensors run with float32 arithmetic (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or func is torch._C._nn.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _is_half_cpu(x) and _is_half_cpu(weight) and x.dtype == weight.dtype:
                return _Float32Linear.apply(x, weight, bias)
        elif func in _PRODUCTS and len(args) == 2 and not kwargs and all(_is_half_cpu(a) for a in args):
            a, b = args
            if a.dtype == b.dtype:  # autograd keeps the float32 copies here: activations, not weights
                return func(a.float(), b.float()).to(a.dtype)
        return func(*args, **kwargs)


_active = threading.local()


def _enter(module=None, args=None):
    depth = getattr(_active, "depth", 0)
    if depth == 0:
        _active.mode = Float32Products()
        _active.mode.__enter__()
    _active.depth = depth + 1


def _leave(module=None, args=None, output=None):
    _active.depth -= 1
    if _active.depth == 0:
        _active.mode.__exit__(None, None, None)
        _active.mode = None


FLAG = "_headlab_float32_products"


@contextlib.contextmanager
def products_of(module: torch.nn.Module):
    """Float32 products while `module` runs outside its own __call__, if install() hooked it: transformers'
    checkpointed blocks recompute their raw forward in backward, which no module hook sees."""
    if not getattr(module, FLAG, False):
        yield
        return
    _enter()
    try:
        yield
    finally:
        _leave()


def install(model: torch.nn.Module) -> int:
    """Make `model`'s forward passes, and each block's called on its own, compute 16-bit products in float32 (a
    recomputing backward enters products_of(block) itself); returns how many modules were hooked. Idempotent."""
    if getattr(model, FLAG, False):
        return 0
    targets = [model] + [m for m in model.modules() if m is not model and hasattr(m, "gradient_checkpointing")]
    for module in targets:
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        setattr(module, FLAG, True)
    return len(targets)
