"""Activation smoothing for GGUF exports (SmoothQuant, headlab.runtimes.smoothing): the scales by the paper's formula,
the activation maxima over real tokens, the rescaling exact in transformers and in llama.cpp's f32 graph, and the
importance matrix of the rescaled inputs."""

from __future__ import annotations

import json

import pytest
import torch
from test_gguf import (
    QUANT_SHAPES,
    _batch,
    _Batches,
    _windows,
    calibrated_export_args,
    needs_llamacpp,
    quant_model,
    tiny,
)
from test_gptq import _calibration
from tiny_text import run_cli

from headlab.core.loading import from_model
from headlab.mechanisms.hooks import input_abs_max, input_mean_squares
from headlab.runtimes.gguf_export import _export_items, _gguf_names, calibrated_modules, importance_matrix, plan_export
from headlab.runtimes.smoothing import activation_smoothing, smoothing_scale

gguf = pytest.importorskip("gguf")


def test_smoothing_scale_is_the_papers_formula():
    """s_j = max|x_j|^a / max_i |W_ij|^(1 - a) over both matrices reading x (Xiao et al. 2023, eq. 4), by hand."""
    activation = torch.tensor([4.0, 0.25, 9.0])
    gate = torch.tensor([[1.0, -2.0, 0.5], [-3.0, 0.5, 0.25]])
    up = torch.tensor([[0.5, 8.0, -1.0]])
    weight_max = torch.tensor([3.0, 8.0, 1.0])
    for alpha in (0.0, 0.5, 0.8, 1.0):
        expected = activation.double() ** alpha / weight_max.double() ** (1 - alpha)
        torch.testing.assert_close(smoothing_scale(activation, [gate, up], alpha), expected)


def test_input_abs_max_is_the_maximum_over_real_tokens():
    """max_t |x_tj| at a module's input, padding positions excluded (a right-padded batch), against the inputs
    captured by hand."""
    loaded = tiny(**QUANT_SHAPES)
    module = loaded.model.model.layers[1].mlp.down_proj
    batches = _Batches([_batch(loaded, [[5, 9, 14, 3, 7], [8, 2]]), _batch(loaded, [[11, 4, 6]])])
    captured = []
    handle = module.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
    maxima, tokens = input_abs_max(loaded, {"down": module}, batches)
    handle.remove()
    real = [x[mask.bool()] for x, (_, mask) in zip(captured, batches)]
    expected = torch.cat(real).abs().amax(0).double()
    assert tokens == 10
    torch.testing.assert_close(maxima["down"], expected)


def _smoothed_model(loaded, smoothing):
    """The transformers model with every tensor rescaled as the file stores it (llama names): what the file computes."""
    copy = from_model(type(loaded.model)(loaded.model.config), loaded.tokenizer)
    state = loaded.model.state_dict()
    names = _gguf_names(loaded.model)
    copy.model.load_state_dict({key: smoothing(names[key][0], value) if key in names else value
                                for key, value in state.items()})  # fmt: skip
    copy.model.eval()
    return copy


def _smoothing(loaded, batches, alpha=0.5):
    items = _export_items(loaded, plan_export(loaded), loaded.model.config.get_text_config())
    tensors = {name: tensor for name, _, tensor in items}
    return items, activation_smoothing(loaded, calibrated_modules(loaded, items)[0], items, tensors.__getitem__,
                                       batches, alpha, progress=False)  # fmt: skip


def test_smoothing_is_exact_in_transformers_and_its_moments_are_the_rescaled_inputs():
    """The rescaled model gives the same logits (up to float32 rounding), its feed-forward inputs' maxima are
    max|x|^(1-a) max|W|^(1-a) (the paper's balance: activation and weight ranges meet), and the importance matrix
    with smoothing is the mean square of the rescaled model's inputs."""
    loaded = tiny(**QUANT_SHAPES)
    batches = _calibration(loaded)
    items, smoothing = _smoothing(loaded, batches)
    assert sorted(smoothing.scales) == [0, 1] and smoothing.record()["blocks"] == 2
    smoothed = _smoothed_model(loaded, smoothing)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 31]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed.model(ids).logits, loaded.model(ids).logits, rtol=1e-4, atol=1e-4)
    s_in, _ = smoothing.scales[0]
    assert not torch.allclose(s_in, torch.ones_like(s_in))  # the rescaling did something
    modules = {"gate": smoothed.model.model.layers[0].mlp.gate_proj}
    after, _ = input_abs_max(smoothed, modules, batches)
    before, _ = input_abs_max(loaded, {"gate": loaded.model.model.layers[0].mlp.gate_proj}, batches)
    torch.testing.assert_close(after["gate"], before["gate"] / s_in, rtol=1e-4, atol=1e-6)
    weights, _ = importance_matrix(loaded, items, batches, progress=False, smoothing=smoothing)
    down = {"blk.1.ffn_down.weight": smoothed.model.model.layers[1].mlp.down_proj}
    squares, _ = input_mean_squares(smoothed, down, batches)
    torch.testing.assert_close(torch.from_numpy(weights["blk.1.ffn_down.weight"]).double(),
                               squares["blk.1.ffn_down.weight"], rtol=1e-4, atol=1e-9)  # fmt: skip


@needs_llamacpp
@pytest.mark.parametrize("layout", ["uniform", "deci", "mla"])
def test_a_smoothed_f32_file_runs_in_llamacpp_as_the_model_does(tmp_path, layout):
    """Every layout export-gguf writes (llama, deci with an attention-free layer, deepseek2): smoothed and f32, the
    file's logits are transformers' (the rescaling is exact in llama.cpp's graph too), and its ffn tensors differ
    from the model's."""
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs

    loaded = quant_model(layout)
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False, smooth=_calibration(loaded))
    assert record["smoothing"]["blocks"] == loaded.model.config.num_hidden_layers
    result = compare_logprobs(loaded, tmp_path / "m.gguf", _windows(loaded))
    assert abs(result["relative_difference"]) < 1e-4 and result["max_abs_logit_diff"] < 1e-3, result


def test_export_gguf_smooth_on_the_command_line(tmp_path, capsys):
    """`export-gguf --outtype q8_0 --smooth`: the record's smoothing (alpha, blocks, tokens) and the table's row."""
    args = calibrated_export_args(tmp_path, capsys, "--outtype", "q8_0", "--smooth", "--smooth-alpha", "0.6")
    code, out, err = run_cli([*args, "--out", tmp_path / "m.gguf", "--json"], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["smoothing"]["alpha"] == 0.6 and record["smoothing"]["blocks"] == 2, record["smoothing"]
    assert record["quantization"]["smoothing"] == record["smoothing"]
    assert 0 < record["smoothing"]["tokens"] <= 256
    code, out, err = run_cli([*args, "--out", tmp_path / "n.gguf"], capsys)
    assert code == 0 and "SmoothQuant alpha 0.6 on 2 feed-forwards" in out, (out, err)
