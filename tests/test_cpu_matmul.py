"""16-bit products in float32 on CPUs without native 16-bit kernels (headlab.core.cpu_matmul): the same values and
gradients as a float64 product of the same 16-bit operands, row blocks that change nothing, every forward of a
loaded 16-bit CPU model routed through them (a recomputed block in backward included), and float32 models left
alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import tiny_inputs, tiny_model
from tiny_text import save_tiny, tiny_tokenizer

from headlab.core import cpu_matmul
from headlab.core.loading import from_model, load_model
from headlab.measure.importance import head_importance


def _operands(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 48, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(40, 48, generator=g) / 7).to(dtype).requires_grad_(True)
    b = torch.randn(40, generator=g).to(dtype).requires_grad_(True) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_a_float64_product_of_the_same_values(dtype, bias):
    x, w, b = _operands(dtype, bias)
    with cpu_matmul.Float32Products():
        y = F.linear(x, w, b)
    assert y.dtype == dtype
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(grad)
    x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
    expected = x64 @ w64.T + (b.detach().double() if bias else 0)
    # the result is the float64 value rounded once to the 16-bit dtype (up to float32 summation order)
    step = torch.finfo(dtype).eps * expected.abs().max()
    assert (y.double() - expected).abs().max() <= step
    for got, want in (
        (x.grad, g64 @ w64),
        (w.grad, g64.reshape(-1, 40).T @ x64.reshape(-1, 48)),
        *([(b.grad, g64.sum((0, 1)))] if bias else []),
    ):
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() <= torch.finfo(dtype).eps * want.abs().max()


def test_row_blocks_change_nothing(monkeypatch):
    x, w, b = _operands(torch.bfloat16)
    with cpu_matmul.Float32Products():
        whole = F.linear(x, w, b)
        (gx_whole, gw_whole) = torch.autograd.grad(whole.float().square().sum(), (x, w))
    monkeypatch.setattr(cpu_matmul, "BLOCK_ELEMENTS", 48 * 7)  # 7 rows of w at a time: 6 blocks, the last short
    assert len(cpu_matmul._row_blocks(40, 48)) == 6
    with cpu_matmul.Float32Products():
        blocked = F.linear(x, w, b)
        (gx, gw) = torch.autograd.grad(blocked.float().square().sum(), (x, w))
    assert torch.equal(blocked, whole) and torch.equal(gw, gw_whole)
    assert torch.allclose(gx.float(), gx_whole.float(), rtol=1e-2, atol=1e-2)  # float32 sums in another order


def test_matmul_of_16bit_cpu_tensors_runs_in_float32():
    a = torch.randn(2, 4, 8).bfloat16()
    b = torch.randn(2, 8, 3).bfloat16()
    with cpu_matmul.Float32Products():
        got = torch.matmul(a, b)
        float32_untouched = torch.matmul(a.float(), b.float())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (a.float() @ b.float()).bfloat16())
    assert float32_untouched.dtype == torch.float32


def _counting(monkeypatch):
    calls = {"forward": 0}
    original = cpu_matmul._Float32Linear.forward

    def counted(ctx, *args):
        calls["forward"] += 1
        return original(ctx, *args)

    monkeypatch.setattr(cpu_matmul._Float32Linear, "forward", staticmethod(counted))
    return calls


def test_a_loaded_bf16_cpu_model_routes_every_linear_and_its_recomputation(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_matmul.ENV, "float32")
    model_dir = save_tiny("llama", tmp_path / "model")
    loaded = load_model(str(model_dir), device="cpu", dtype="bfloat16")
    assert loaded.describe()["cpu_products"] == "float32"
    reference = tiny_model("llama").to(torch.bfloat16)  # the same weights, no hooks: torch's own kernels
    inputs = tiny_inputs("llama", batch=2, seq=10, seed=2)
    calls = _counting(monkeypatch)
    with torch.no_grad():
        got = loaded.model(**inputs).logits.float()
        want = reference(**inputs).logits.float()
    linears = sum(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    assert calls["forward"] == linears  # q, k, v, o and the MLP of each block, and the LM head
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    # importance's recomputing pass re-runs each block in backward, outside the model's own forward
    calls["forward"] = 0
    ids = inputs["input_ids"]
    head_importance(loaded, [(ids, torch.ones_like(ids))], progress=False, gradient_checkpointing=True)
    # torch stops a recomputation once the tensors the backward needs are back, so not every block linear reruns;
    # one routed in the forward and not in the recomputation fails checkpoint's saved-tensor check instead
    assert calls["forward"] > linears


def test_float32_models_and_native_cpus_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_matmul.ENV, "float32")
    assert "cpu_products" not in from_model(tiny_model("llama"), tiny_tokenizer()).describe()
    monkeypatch.setenv(cpu_matmul.ENV, "native")
    model = tiny_model("llama").to(torch.bfloat16)
    assert "cpu_products" not in from_model(model, tiny_tokenizer()).describe()
    assert not model._forward_pre_hooks
    monkeypatch.setenv(cpu_matmul.ENV, "float32")
    loaded = from_model(model, tiny_tokenizer())
    assert loaded.describe()["cpu_products"] == "float32"
    assert cpu_matmul.install(model) == 0  # installed once
