"""Activation smoothing for GGUF exports (SmoothQuant, headlab.runtimes.smoothing): the scales by the paper's formula,
the activation maxima over real tokens, the rescaling exact in transformers and in llama.cpp's f32 graph, and the
importance matrix of the rescaled inputs."""

from __future__ import annotations

import json

import click
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

from headlab.cli.export_gguf import SmoothingAlpha
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


def test_q8_0_activations_are_ggml_q8_0_rounding():
    """The activation rounding "auto" simulates is q8_0's: the gguf package's reference quantizer (ggml-quants.c's rule)
    read back gives the same values (random inputs have no exact halves, where the two round differently)."""
    from headlab.runtimes.smoothing import q8_0_activations

    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 30, 96)
    x[2, :32] = 0  # an all-zero block: d = 0 and zeros back
    reference = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                       gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    torch.testing.assert_close(q8_0_activations(x), torch.from_numpy(reference), rtol=0, atol=1e-6)


def test_quantized_product_error_by_hand_and_the_auto_choice_is_the_smallest():
    """The error of one candidate against a computation by hand (rescaled, both roundings, relative squared error);
    `chosen_scale` returns the candidate of smallest error among no rescaling and every ALPHA_GRID alpha, and with one
    outlier channel in the inputs it rescales and beats no rescaling by a wide margin."""
    from headlab.runtimes.gptq import round_to_nearest
    from headlab.runtimes.smoothing import ALPHA_GRID, chosen_scale, q8_0_activations, quantized_product_error

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 64, generator=generator)
    rows[:, 5] *= 400  # an outlier channel: its block's other 31 activations lose their precision
    weight = torch.randn(48, 64, generator=generator)
    maxima = rows.abs().amax(0).double()
    scale = smoothing_scale(maxima, [weight], 0.5)
    x = rows.double()
    exact = x @ weight.double().T
    by_hand = q8_0_activations(x / scale) @ round_to_nearest(weight.double() * scale, "q8_0").T
    expected = float((by_hand - exact).square().sum() / exact.square().sum())
    assert quantized_product_error(rows, [(weight, "q8_0")], scale) == pytest.approx(expected, rel=1e-12)

    chosen, alpha = chosen_scale(maxima, rows, [(weight, "q8_0")])
    candidates = {None: None, **{a: smoothing_scale(maxima, [weight], a) for a in ALPHA_GRID}}
    errors = {a: quantized_product_error(rows, [(weight, "q8_0")], s) for a, s in candidates.items()}
    assert alpha == min(errors, key=errors.get) and alpha is not None
    torch.testing.assert_close(chosen, candidates[alpha])
    assert errors[alpha] < 0.2 * errors[None], errors


def test_input_rows_are_every_kth_real_token_up_to_the_limit():
    """The sampled inputs: every 2nd real token of each batch (padding skipped), at most `limit` rows, against the
    inputs captured by hand."""
    from headlab.mechanisms.hooks import input_rows

    loaded = tiny(**QUANT_SHAPES)
    module = loaded.model.model.layers[0].mlp.gate_proj
    batches = _Batches([_batch(loaded, [[5, 9, 14, 3, 7], [8, 2]]), _batch(loaded, [[11, 4, 6, 12, 13]])])
    captured = []
    handle = module.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
    rows, tokens = input_rows(loaded, {"gate": module}, batches, limit=5, every=2)
    handle.remove()
    expected = torch.cat([x[mask.bool()][::2] for x, (_, mask) in zip(captured, batches)])[:5]
    assert tokens == 12 and rows["gate"].shape == (5, module.in_features)
    torch.testing.assert_close(rows["gate"], expected.float())


def test_auto_smoothing_records_its_choices_and_stays_exact():
    """alpha "auto" on a q8_0 export's types: a choice per block and input (an alpha of the grid, or None with unit
    scales), the record lists them, and the rescaling stays exact in transformers."""
    from headlab.runtimes.smoothing import ALPHA_GRID

    loaded = tiny(**QUANT_SHAPES)
    batches = _calibration(loaded)
    items = _export_items(loaded, plan_export(loaded), loaded.model.config.get_text_config())
    tensors = {name: tensor for name, _, tensor in items}
    qtypes = {name: "q8_0" for name in tensors}
    smoothing = activation_smoothing(loaded, calibrated_modules(loaded, items)[0], items, tensors.__getitem__,
                                     batches, "auto", progress=False, qtypes=qtypes)  # fmt: skip
    assert sorted(smoothing.chosen) == [0, 1]
    for block, pair in smoothing.chosen.items():
        for alpha, scale in zip(pair, smoothing.scales[block]):
            assert alpha is None or alpha in ALPHA_GRID
            if alpha is None:
                assert torch.equal(scale, torch.ones_like(scale))
    record = smoothing.record()
    assert record["alpha"] == "auto" and record["chosen_alpha"]["0"] == list(smoothing.chosen[0])
    assert 0 < record["search_tokens"] <= record["tokens"]
    smoothed = _smoothed_model(loaded, smoothing)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 31]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed.model(ids).logits, loaded.model(ids).logits, rtol=1e-4, atol=1e-4)


def test_export_gguf_smooth_alpha_auto_on_the_command_line(tmp_path, capsys):
    """`--smooth-alpha auto` on a q8_0 export: the record's choices and the table's row; on a type whose rounding is
    not simulated (f16): one line, exit 2, nothing written."""
    args = calibrated_export_args(tmp_path, capsys, "--outtype", "q8_0", "--smooth", "--smooth-alpha", "auto")
    code, out, err = run_cli([*args, "--out", tmp_path / "m.gguf", "--json"], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["smoothing"]["alpha"] == "auto" and len(record["smoothing"]["chosen_alpha"]) == 2
    code, out, err = run_cli([*args, "--out", tmp_path / "n.gguf"], capsys)
    assert code == 0 and "alphas chosen (inputs)" in out, (out, err)
    f16 = [arg if arg != "q8_0" else "f16" for arg in args]
    code, out, err = run_cli([*f16, "--out", tmp_path / "f.gguf"], capsys)
    assert code == 2 and "'auto' scores the rounding of q8_0, q5_0, q4_0 files only, not f16" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "f.gguf").exists()


@pytest.mark.parametrize(("given", "parsed"), [("auto", "auto"), ("AUTO", "auto"), (" Auto ", "auto"), ("0.25", 0.25)])
def test_smooth_alpha_option_reads_auto_in_any_case_and_shows_it_as_written(given, parsed):
    """--help shows the metavar `[0..1|auto]` as the option takes it (click would upper-case a type's name), and the
    word is read in any case, like --outtype's llama.cpp types; numbers outside [0, 1] stay refused."""
    alpha = SmoothingAlpha()
    assert alpha.get_metavar(None) == "[0..1|auto]"
    assert alpha.convert(given, None, None) == parsed
    with pytest.raises(click.BadParameter):
        alpha.convert("1.5", None, None)
