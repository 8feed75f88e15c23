"""Head importance: gate gradients against finite differences, taylor and ablation against slow obvious
implementations, batch-size independence, the bertology compatibility mode by hand, normalisation, every
architecture in float32 and bfloat16, and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import ALL_TYPES, ENCODER_TYPES, GQA_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.arch import adapter_for, attention_layers
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.importance import head_importance, normalise, scoring_batches, sequence_nll
from headlab.mechanisms.gates import head_gates, ones_gates, write_mask


def _loaded(name, dtype=torch.float32, **overrides):
    model = tiny_model(name, **overrides).to(dtype)
    return from_model(model, tiny_tokenizer(encoder=name in ENCODER_TYPES))


def _padded(name, rows=3, seq=10, seed=1):
    """Rows of different lengths (right padding), as calibration batches would give them."""
    inputs = tiny_inputs(name, batch=rows, seq=seq, seed=seed)
    mask = inputs["attention_mask"].clone()
    for r in range(rows):
        mask[r, seq - 2 * r :] = 0
    return inputs["input_ids"], mask


def _split(ids, mask, size):
    return [(ids[i : i + size], mask[i : i + size]) for i in range(0, len(ids), size)]


def _zeroed(loaded, layer_index, head):
    """A copy of the model whose output projection ignores one head (adapter read/write), wrapped like `loaded`."""
    model = copy.deepcopy(loaded.model)
    adapter = adapter_for(model)
    layer = attention_layers(model)[layer_index]
    weights = adapter.read(layer)
    weights.o[:, head, :] = 0
    adapter.write(layer, weights)
    return from_model(model, loaded.tokenizer)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen3_5_text", "bert"])
def test_gate_gradient_matches_finite_differences(name):
    loaded = _loaded(name, torch.float64)
    ids, mask = _padded(name, rows=2)
    batch = scoring_batches(loaded, [(ids, mask)])[0]
    gates = ones_gates(loaded, 2, dtype=torch.float64)
    with head_gates(loaded, gates):
        nll = sequence_nll(loaded.model, batch, loaded.device)  # [B]
    grads = torch.autograd.grad(nll.sum(), gates)

    def central(layer, head, row, eps):
        values = []
        for sign in (1, -1):
            shifted = [g.detach().clone() for g in gates]
            shifted[layer][row, head] += sign * eps
            with torch.no_grad(), head_gates(loaded, shifted):
                values.append(sequence_nll(loaded.model, batch, loaded.device)[row])
        return (values[0] - values[1]) / (2 * eps)

    # Some families normalise in float32 even in a float64 model (Llama's RMSNorm), so a tiny step drowns in
    # rounding: use a large step with Richardson extrapolation (truncation error O(eps^4)).
    eps = 1e-2
    for layer, head in [(0, 1), (len(gates) - 1, 3)]:
        for row in range(2):
            estimate = (4 * central(layer, head, row, eps / 2) - central(layer, head, row, eps)) / 3
            torch.testing.assert_close(grads[layer][row, head], estimate, rtol=1e-4, atol=1e-5)
    # And the scorer: I_h = (1/N) sum_x |dL(x)/dxi_h|.
    raw = head_importance(loaded, [(ids, mask)], method="grad", progress=False).raw
    for layer in range(len(gates)):
        torch.testing.assert_close(raw[layer], grads[layer].abs().sum(0) / batch.scored)


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt_neox", "roberta"])
@pytest.mark.parametrize("method", ["grad", "taylor", "ablation"])
def test_scores_do_not_depend_on_batch_size(name, method):
    loaded = _loaded(name)
    ids, mask = _padded(name)
    one = head_importance(loaded, _split(ids, mask, 1), method=method, progress=False)
    three = head_importance(loaded, _split(ids, mask, 3), method=method, progress=False)
    # Ablation scores are differences of two float32 mean losses of order 1, so a rounding step of either (1.2e-7
    # at 1.0; the CPU's GEMM kernels differ by batch shape) shows in full: one ulp of the loss is the tolerance.
    atol = 2.5e-7 if method == "ablation" else 1e-7
    for a, b in zip(one.raw, three.raw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
    assert one.meta["scored_tokens"] == three.meta["scored_tokens"]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_zero_output_columns_give_zero_importance(name):
    loaded = _zeroed(_loaded(name), 1, 2)
    ids, mask = _padded(name)
    for method in ("grad", "taylor"):
        raw = head_importance(loaded, [(ids, mask)], method=method, progress=False).raw
        assert raw[1][2] == 0
        assert (raw[1][[0, 1, 3]] > 0).all() and (raw[0] > 0).all()


@pytest.mark.parametrize("name", ["llama", "phi3", "bert"])
def test_taylor_matches_per_token_gates(name):
    """Slow and obvious: a gate per token and head, one sequence at a time; I_h = sum |dL/dgate_{t,h}| / N."""
    loaded = _loaded(name, torch.float64)
    ids, mask = _padded(name)
    batches = scoring_batches(loaded, _split(ids, mask, 1))
    layers = loaded.layers
    expected = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in layers]
    for batch in batches:
        T = batch.input_ids.shape[1]
        gates = [torch.ones(T, layer.num_heads, dtype=torch.float64, requires_grad=True) for layer in layers]
        hooks = []
        for layer, gate in zip(layers, gates):
            D = layer.head_dim

            def hook(module, args, gate=gate, D=D):
                x = args[0]  # [1, T, H*D]
                return ((x.unflatten(-1, (-1, D)) * gate[None, :, :, None]).flatten(-2),)

            hooks.append(loaded.adapter.out_proj(layer).register_forward_pre_hook(hook))
        try:
            loss = sequence_nll(loaded.model, batch, loaded.device).sum()
        finally:
            for h in hooks:
                h.remove()
        for l, g in enumerate(torch.autograd.grad(loss, gates)):
            expected[l] += g.abs().sum(0)
    N = sum(b.scored for b in batches)
    raw = head_importance(loaded, _split(ids, mask, 3), method="taylor", progress=False).raw
    for got, want in zip(raw, expected):
        torch.testing.assert_close(got, want / N)


@pytest.mark.parametrize("name", ["qwen2", "opt", "bert"])
def test_ablation_matches_zeroed_models(name):
    loaded = _loaded(name)
    ids, mask = _padded(name)
    batches = scoring_batches(loaded, [(ids, mask)])
    N = batches[0].scored

    def mean_nll(model_loaded):
        with torch.no_grad():
            return float(sequence_nll(model_loaded.model, batches[0], model_loaded.device).double().sum()) / N

    reference = mean_nll(loaded)
    raw = head_importance(loaded, [(ids, mask)], method="ablation", progress=False).raw
    for layer, head in [(0, 0), (1, 3)]:
        assert raw[layer][head].item() == pytest.approx(mean_nll(_zeroed(loaded, layer, head)) - reference, abs=1e-5)


def test_bertology_compat_adds_cumulative_gradients():
    loaded = _loaded("llama")
    ids, mask = _padded("llama", rows=4)
    batches = _split(ids, mask, 2)
    # By hand: g_j = d meanNLL_j / dxi with one gate per batch; I = sum_k |g_1 + ... + g_k| / input tokens.
    per_batch = []
    for batch in scoring_batches(loaded, batches):
        gates = ones_gates(loaded)
        with head_gates(loaded, gates):
            loss = sequence_nll(loaded.model, batch, loaded.device).sum() / batch.scored
        per_batch.append(torch.autograd.grad(loss, gates))
    inputs = int(mask.sum())
    expected = [sum((per_batch[0][l] + per_batch[1][l] * k).abs() for k in (0, 1)) / inputs for l in range(2)]
    compat = head_importance(loaded, batches, accumulate="bertology", progress=False)
    default = head_importance(loaded, batches, progress=False)
    for got, want, other in zip(compat.raw, expected, default.raw):
        torch.testing.assert_close(got, want)
        assert not torch.allclose(got, other)
    assert "run_bertology" in compat.meta["definition"]
    with pytest.raises(HeadlabError, match="method=.grad. only"):
        head_importance(loaded, batches, method="taylor", accumulate="bertology", progress=False)


def test_normalisation_properties():
    raw = [torch.tensor([3.0, 4.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]), torch.zeros(3)]
    per_layer = normalise(raw, global_norm=False)
    torch.testing.assert_close(per_layer[0], torch.tensor([0.6, 0.8, 0.0]))
    torch.testing.assert_close(per_layer[1].pow(2).sum(), torch.tensor(1.0))
    assert torch.equal(per_layer[2], torch.zeros(3))  # an all-zero layer stays zero
    both = torch.cat(normalise(raw))
    assert both.min() == 0 and both.max() == 1
    torch.testing.assert_close(torch.cat(normalise(raw, layer_norm=False)), torch.cat(raw) / 4)
    assert all(torch.equal(a, b) for a, b in zip(normalise(raw, layer_norm=False, global_norm=False), raw))
    assert torch.equal(normalise([torch.ones(2), torch.ones(2)], layer_norm=False)[0], torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ALL_TYPES)
def test_every_architecture(name, dtype):
    loaded = _loaded(name, dtype)
    ids, mask = _padded(name)
    for method in ("grad", "taylor"):
        result = head_importance(loaded, _split(ids, mask, 2), method=method, progress=False)
        table = result.table
        assert list(table.columns) == ["layer", "head", "kv_head", "importance_raw", "importance", "rank"]
        assert len(table) == sum(layer.num_heads for layer in loaded.layers)
        assert all(r.dtype == torch.float32 for r in result.raw)
        assert table["importance_raw"].notna().all() and (table["importance_raw"] > 0).all()
        assert sorted(table["rank"]) == list(range(1, len(table) + 1))
        assert table.loc[table["rank"] == 1, "importance"].item() == table["importance"].max() == 1.0
    assert all(p.requires_grad for p in loaded.model.parameters())  # restored after the frozen pass
    assert all(p.grad is None for p in loaded.model.parameters())  # and no weight gradient was stored


@pytest.mark.parametrize("name", GQA_TYPES[:2])
def test_kv_groups_sum_query_heads(name):
    loaded = _loaded(name)
    result = head_importance(loaded, [_padded(name)], progress=False)
    sums = result.table.groupby(["layer", "kv_head"])["importance_raw"].sum().to_numpy()
    assert result.kv_groups["importance_raw"].to_numpy() == pytest.approx(sums)
    assert (result.kv_groups["query_heads"] == 2).all() and result.kv_groups["importance"].max() == 1.0


def test_mask_scores_with_heads_already_gated(tmp_path):
    loaded = _loaded("llama")
    gates = ones_gates(loaded, requires_grad=False)
    gates[0][1] = 0
    path = write_mask(tmp_path / "mask.csv", gates, loaded.layers)
    batches = [_padded("llama")]
    for method in ("taylor", "ablation"):
        result = head_importance(loaded, batches, method=method, mask=path, progress=False)
        assert result.raw[0][1] == 0 and result.meta["masked_heads"] == 1
    # A zero gate runs the same forward as zeroed output columns, so every other head's gradient agrees; the gated
    # head keeps its gradient at xi = 0, where the zeroed model's head has none.
    masked = head_importance(loaded, batches, mask=gates, progress=False).raw
    zeroed = head_importance(_zeroed(loaded, 0, 1), batches, progress=False).raw
    torch.testing.assert_close(masked[1], zeroed[1])
    torch.testing.assert_close(masked[0][[0, 2, 3]], zeroed[0][[0, 2, 3]])
    assert zeroed[0][1] == 0 and masked[0][1] > 0


def test_bad_arguments():
    loaded = _loaded("llama")
    # the error lists every method of the registry
    with pytest.raises(HeadlabError, match="grad, taylor, fisher, second-order, ablation"):
        head_importance(loaded, [_padded("llama")], method="fishy", progress=False)
    with pytest.raises(HeadlabError, match="one \\[H_l\\] gate"):
        head_importance(loaded, [_padded("llama")], mask=[torch.ones(4)], progress=False)


def test_cli_writes_tables_and_refuses_bad_input(tmp_path, capsys):
    model_dir = save_tiny("llama", tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    out = tmp_path / "out"
    base = ["importance", "--model", model_dir, "--data", corpus, "--device", "cpu", "--seq-len", "32"]
    code, stdout, stderr = run_cli([*base, "--max-tokens", "96", "--out", out], capsys)
    assert code == 0, stderr
    for name in ("importance.csv", "importance.parquet", "kv_groups.csv", "kv_groups.parquet", "meta.json"):
        assert (out / name).is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["method"] == "grad" and meta["split"] == "calibration" and meta["tokens"] == 96
    assert "most important" in stdout
    code, _, stderr = run_cli([*base, "--out", out], capsys)
    assert code == 2 and "already exists" in stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("layer,head,gate\n0,9,0\n")
    code, _, stderr = run_cli([*base, "--mask", bad, "--out", tmp_path / "o2"], capsys)
    assert code == 2 and "head 9 out of range" in stderr and not (tmp_path / "o2").exists()
    code, _, stderr = run_cli([*base, "--split", "eval", "--out", tmp_path / "o3"], capsys)
    assert code == 2 and "calibration text only" in stderr
    code, _, stderr = run_cli([*base, "--method", "taylor", "--bertology-compat", "--out", tmp_path / "o4"], capsys)
    assert code == 2 and "grad only" in stderr


@pytest.mark.slow
def test_embedded_model_grad_importance():
    from headlab.core.loading import load_model

    loaded = load_model(None, device="cpu")
    result = head_importance(loaded, max_tokens=256, seq_len=128, batch_size=2, progress=False)
    table = result.table
    assert len(table) == 30 * 9 and len(result.kv_groups) == 30 * 3
    assert (table["importance_raw"] > 0).all() and table["importance"].between(0, 1).all()
    assert result.meta["split"] == "calibration" and result.meta["scored_tokens"] == 2 * 127
