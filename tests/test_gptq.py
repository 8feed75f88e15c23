"""GPTQ rounding (headlab.runtimes.gptq) against the textbook optimal-brain-surgeon loop, its grids against gguf's own
quantizer, the input second moments by hand, and `export-gguf --gptq` end to end (llama.cpp's file types when
llama-cpp-python is installed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_gguf import (
    QUANT_SHAPES,
    _batch,
    _Batches,
    _windows,
    calibrated_export_args,
    needs_llamacpp,
    read,
    tensor_of,
    tiny,
)
from tiny_text import run_cli

from headlab.core.errors import HeadlabError
from headlab.mechanisms.hooks import input_grams
from headlab.runtimes import gguf_export
from headlab.runtimes.choices import GPTQ_TYPES
from headlab.runtimes.gguf_export import check_type, export_gguf
from headlab.runtimes.gptq import DAMPING, GRIDS, gptq_round, output_error, round_to_nearest

gguf = pytest.importorskip("gguf")


def textbook_gptq(weight: torch.Tensor, gram: torch.Tensor, qtype: str) -> torch.Tensor:
    """The slow, obvious form (Frantar et al. 2023, eq. 2-3): fix column c, move the remaining columns F by
    -(w_c - q_c) / [H_F^-1]_cc [H_F^-1]_c,F, then drop c from H_F^-1 by one Gauss-Jordan step; no Cholesky factor, no
    lazy batches. Block scales by ggml's rules written out here: q8_0 max|w| / 127, q5_0 / q4_0 the signed largest
    weight over -16 / -8, each rounded to float16, the weight that set it pinned to the grid's end."""
    grid = GRIDS[qtype]
    W, H = weight.double().clone(), gram.double().clone()
    n = W.shape[1]
    dead = torch.diagonal(H) == 0
    H[dead, :], H[:, dead] = 0, 0
    H[dead, dead] = 1
    H += DAMPING * torch.diagonal(H).mean() * torch.eye(n, dtype=H.dtype)
    inverse = torch.linalg.inv(H)
    rounded = torch.zeros_like(W)
    for c in range(n):
        if c % grid.block == 0:
            block = W[:, c : c + grid.block]
            setter = block.abs().argmax(1)
            largest = block[torch.arange(W.shape[0]), setter]
            reference = largest.abs() if qtype == "q8_0" else largest
            divisor = {"q8_0": 127.0, "q5_0": -16.0, "q4_0": -8.0}[qtype]
            scale = (reference / divisor).half().double()
        for row in range(W.shape[0]):
            d = float(scale[row])
            if d == 0:
                level = 0.0
            elif int(setter[row]) == c % grid.block:
                level = round(float(largest[row]) / d)
            else:
                level = min(max(np.floor(float(W[row, c]) / d + 0.5), grid.low), grid.high)
            rounded[row, c] = level * d
        error = W[:, c] - rounded[:, c]
        W[:, c:] -= (error / inverse[c, c])[:, None] * inverse[c, c:][None, :]
        inverse = inverse - torch.outer(inverse[:, c], inverse[c, :]) / inverse[c, c]
    return rounded


def correlated_gram(n: int, tokens: int = 4000, dead: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    """E[x x^T] of inputs with strongly correlated features (a random mixing) and a few always-zero ones."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=generator, dtype=torch.float64)
    x = x @ torch.randn(n, n, generator=generator, dtype=torch.float64) * 0.3
    x[:, list(dead)] = 0
    return x.T @ x / tokens


def random_weight(rows: int, columns: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, columns, generator=generator, dtype=torch.float64) * 0.05


@pytest.mark.parametrize("qtype", GPTQ_TYPES)
def test_gptq_is_the_textbook_obs_loop(qtype):
    """Blocked, Cholesky-factored GPTQ equals the column-by-column OBS loop with an explicit inverse, level for
    level, across three lazy-update batches of columns (320 > 2 x 128) and with two dead input features."""
    weight, gram = random_weight(5, 320), correlated_gram(320, dead=(7, 200))
    fast, slow = gptq_round(weight, gram, qtype), textbook_gptq(weight, gram, qtype)
    assert torch.equal(fast, slow), (fast - slow).abs().max()
    assert sorted(GRIDS) == sorted(GPTQ_TYPES)


@pytest.mark.parametrize("qtype", GPTQ_TYPES)
def test_gguf_writes_the_gptq_rounding_back_bit_for_bit(qtype):
    """gguf's own quantizer (ggml's reference rules) maps GPTQ's output onto itself exactly: same scales, same
    levels, also for an all-zero block and a row with one outlier."""
    weight, gram = random_weight(8, 128), correlated_gram(128)
    weight[2, :32] = 0  # a zero block
    weight[5, 70] = 3.0  # an outlier setting its block's scale
    rounded = gptq_round(weight, gram, qtype)
    ggml_type = gguf.GGMLQuantizationType[qtype.upper()]
    values = rounded.float().numpy()
    back = gguf.quants.dequantize(gguf.quants.quantize(values, ggml_type), ggml_type)
    assert np.array_equal(back, values)
    assert torch.equal(rounded[2, :32], torch.zeros(32, dtype=rounded.dtype))
    block = rounded[5, 64:96].abs()  # the scale's own weight stays the block's largest, near its value
    assert block.max() == block[70 - 64] and abs(float(rounded[5, 70]) - 3.0) < 0.1


@pytest.mark.parametrize("qtype", GPTQ_TYPES)
def test_gptq_moves_the_output_less_than_round_to_nearest(qtype):
    """The objective GPTQ minimises, tr(dW H dW^T) on correlated inputs, well below round to nearest's; on inputs
    with no correlation (H diagonal) no error has anywhere to go, and GPTQ is round to nearest up to ties."""
    weight, gram = random_weight(16, 256), correlated_gram(256)
    gptq, nearest = gptq_round(weight, gram, qtype), round_to_nearest(weight, qtype)
    assert output_error(weight, gptq, gram) < 0.7 * output_error(weight, nearest, gram)
    diagonal = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5)
    alone = gptq_round(weight, diagonal, qtype)
    step = (alone - nearest).abs().max()
    assert (alone != nearest).float().mean() < 0.01, step


def test_input_grams_are_the_second_moments_over_real_tokens():
    """By hand: E[x x^T] of layer 0's q-projection input (the normed embeddings) over the unpadded tokens only, held
    once for q, k and v (called on the same tensor), and the MLP's gate input on its own."""
    loaded = tiny()
    model = loaded.model
    rows = [list(range(5, 29)), list(range(40, 51))]
    ids, mask = _batch(loaded, rows)
    block = model.model.layers[0]
    modules = {"q": block.self_attn.q_proj, "k": block.self_attn.k_proj, "v": block.self_attn.v_proj,
               "gate": block.mlp.gate_proj}  # fmt: skip
    grams, tokens = input_grams(loaded, modules, _Batches([(ids, mask), (ids, mask)]))
    captured = []
    hook = block.mlp.gate_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    with torch.no_grad():
        normed = block.input_layernorm(model.model.embed_tokens(ids))[mask.bool()].double()
        model(input_ids=ids, attention_mask=mask)
    hook.remove()
    gate_input = captured[0][mask.bool()].double()
    assert tokens == 70
    torch.testing.assert_close(grams["q"], normed.T @ normed / 35, rtol=1e-6, atol=1e-10)
    assert grams["k"] is grams["q"] and grams["v"] is grams["q"]
    torch.testing.assert_close(grams["gate"], gate_input.T @ gate_input / 35, rtol=1e-6, atol=1e-10)


def _calibration(loaded):
    from headlab.core.data import calibration_batches

    return calibration_batches(loaded.tokenizer, None, seq_len=64, batch_size=2, max_tokens=512)


def test_q8_0_export_writes_gptqs_rounding_of_each_calibrated_matrix(tmp_path):
    """`export_gguf(..., gptq=batches)`: every q/k/v/o/gate/up/down matrix in the file is GPTQ's rounding against
    its own input moments (recomputed here), not round to nearest; the tied embedding, also the input lookup table,
    stays round to nearest; the record gives the output error reached against round to nearest's."""
    loaded = tiny(tie_word_embeddings=True, **QUANT_SHAPES)
    batches = _calibration(loaded)
    record = export_gguf(loaded, tmp_path / "g.gguf", outtype="q8_0", progress=False, gptq=batches)
    export_gguf(loaded, tmp_path / "n.gguf", outtype="q8_0", progress=False)
    gptq = record["quantization"]["gptq"]
    layers = loaded.model.config.num_hidden_layers
    assert gptq["matrices"] == 7 * layers and gptq["types"] == {"q8_0": 7 * layers}, gptq
    assert 0 < gptq["output_error_vs_nearest"] < 1 and gptq["tokens"] == batches.num_tokens, gptq
    fields, tensors = read(tmp_path / "g.gguf")
    _, nearest = read(tmp_path / "n.gguf")
    assert "GPTQ-rounded on" in fields["headlab.quantized_by"]
    down = loaded.model.model.layers[1].mlp.down_proj
    grams, _ = input_grams(loaded, {"down": down}, batches)
    expected = gptq_round(down.weight.detach(), grams["down"], "q8_0").float().numpy()
    assert np.array_equal(tensor_of(tensors["blk.1.ffn_down.weight"]), expected)
    assert not np.array_equal(tensor_of(nearest["blk.1.ffn_down.weight"]), expected)
    assert np.array_equal(tensor_of(tensors["token_embd.weight"]), tensor_of(nearest["token_embd.weight"]))


def test_gptq_refusals_come_before_any_work(tmp_path, capsys):
    """--gptq with a float type or an asymmetric legacy type (q4_1: its minimum moves with the block) is one line,
    from the type check before the model loads; on the command line exit 2 and nothing written."""
    for outtype in ("f16", "f32", "q4_1", "q5_1"):
        with pytest.raises(HeadlabError, match="drop --gptq") as refusal:
            check_type(outtype, gptq=True)
        assert "\n" not in str(refusal.value)
    code, out, err = run_cli(["export-gguf", "--outtype", "f16", "--gptq", "--out", tmp_path / "m.gguf"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--gptq" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "outtype",
    ["q8_0", pytest.param("Q4_K_M", marks=needs_llamacpp)],
)
def test_gptq_moments_too_large_for_memory_are_refused_and_leave_nothing(tmp_path, monkeypatch, outtype):
    """The float64 second moments are held for every GPTQ matrix at once: more than half the available memory is
    one line naming the bytes, and nothing is written. q8_0: before any writing; a llama.cpp file type: once its
    recipe has chosen the matrices (after the first quantization), its scratch files gone too."""
    monkeypatch.setattr(gguf_export, "available_memory", lambda device: 1000)
    loaded = tiny(**{**QUANT_SHAPES, "num_attention_heads": 2, "num_key_value_heads": 1})
    with pytest.raises(HeadlabError, match="GPTQ's input second moments need") as refusal:
        export_gguf(loaded, tmp_path / "m.gguf", outtype=outtype, progress=False, gptq=_calibration(loaded))
    assert "\n" not in str(refusal.value)
    assert list(tmp_path.iterdir()) == []


@needs_llamacpp
def test_llamacpp_q4_k_m_keeps_gptqs_legacy_blocks(tmp_path, monkeypatch):
    """Q4_K_M with --gptq: llama.cpp's recipe picks the types (q4_k / q6_k where rows split into 256, its q5_0
    fallback where they do not: attn_output's 128-wide rows here); the q5_0 matrices are GPTQ-rounded, survive
    llama.cpp's quantizer exactly, and the file runs in llama.cpp within Q4_K_M's usual distance of transformers.
    The input moments are measured for those matrices alone, not for the k-quant ones."""
    from headlab.runtimes.llamacpp import compare_logprobs

    measured = []

    def recording_grams(loaded, modules, *args, **kwargs):
        measured.extend(modules)
        return input_grams(loaded, modules, *args, **kwargs)

    monkeypatch.setattr(gguf_export, "input_grams", recording_grams)
    loaded = tiny(**{**QUANT_SHAPES, "num_attention_heads": 2, "num_key_value_heads": 1})
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="Q4_K_M", progress=False, gptq=_calibration(loaded))
    gptq = record["quantization"]["gptq"]
    _, tensors = read(tmp_path / "m.gguf")
    legacy = sorted(n for n, t in tensors.items() if len(t.shape) > 1 and t.tensor_type.name.lower() in GPTQ_TYPES)
    calibrated = [n for n in legacy if n != "token_embd.weight"]
    assert calibrated and gptq["matrices"] == len(calibrated) == gptq["written_as_rounded"], (gptq, legacy)
    assert sorted(measured) == calibrated, (measured, calibrated)
    assert any(t.tensor_type.name.lower() not in GPTQ_TYPES for t in tensors.values() if len(t.shape) > 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # the f32 scratch file is gone
    result = compare_logprobs(loaded, tmp_path / "m.gguf", _windows(loaded))
    assert result["relative_difference"] < 0.05, result


def test_export_gguf_gptq_on_the_command_line(tmp_path, capsys):
    """`export-gguf --outtype q8_0 --gptq`: calibration windows from the corpus's calibration part, and the table's
    GPTQ row gives the matrices, the tokens and the output error against round to nearest's."""
    args = calibrated_export_args(tmp_path, capsys, "--outtype", "q8_0", "--gptq")
    code, out, err = run_cli([*args, "--out", tmp_path / "m.gguf", "--json"], capsys)
    assert code == 0, err
    gptq = json.loads(out)["quantization"]["gptq"]
    assert 0 < gptq["tokens"] <= 256 and gptq["text"]["split"] == "calibration", gptq
    code, out, err = run_cli([*args, "--out", tmp_path / "n.gguf"], capsys)
    assert code == 0 and f"{gptq['matrices']} matrices from {gptq['tokens']} calibration tokens" in out, (out, err)
