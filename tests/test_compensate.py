"""Pruning compensation (headlab.recovery.compensate): the ridge refit against a slow stacked least-squares solution, nothing
pruned changes nothing, the calibration reconstruction error never rises, FLAP bias keeps the mean output."""

from __future__ import annotations

import pytest
import torch
from models import tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core.data import Corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.pruning import prune as P
from headlab.pruning import scores as S
from headlab.recovery.compensate import apply_compensation, output_statistics, ridge_refit


class Batches:
    """Two batches of tiny inputs (4 windows: even ones fit, odd ones held out)."""

    def __init__(self, name):
        self.batches = [tiny_inputs(name, batch=2, seq=24, seed=s) for s in (1, 2)]

    def __iter__(self):
        for b in self.batches:
            yield b["input_ids"], b["attention_mask"], None


def _o_inputs(loaded, batches):
    """Slow path: the output projection's inputs z [N, H*D] per layer, and its weight/bias."""
    store = {i: [] for i in range(len(loaded.layers))}
    handles = [
        loaded.adapter.out_proj(layer).register_forward_pre_hook(
            lambda m, a, i=layer.index: store[i].append(a[0].reshape(-1, a[0].shape[-1]).double())
        )
        for layer in loaded.layers
    ]
    with torch.no_grad():
        for ids, mask, _ in batches:
            loaded.model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return {i: torch.cat(v) for i, v in store.items()}


def test_ridge_refit_matches_stacked_least_squares():
    generator = torch.Generator().manual_seed(0)
    N, n, C = 200, 12, 5
    Z = torch.randn(N, n, generator=generator, dtype=torch.float64)
    W = torch.randn(C, n, generator=generator, dtype=torch.float64)
    b = torch.randn(C, generator=generator, dtype=torch.float64)
    kept = [0, 1, 2, 3, 6, 7, 8]
    Za = torch.cat([Z, torch.ones(N, 1, dtype=torch.float64)], 1)
    gram = Za.T @ Za
    alpha = 0.1
    theta, K, _ = ridge_refit(gram, W, b, kept, alpha)
    lam = alpha * float((Z[:, kept] ** 2).sum()) / len(kept)
    # Slow: minimise ||[Z_K 1] theta - (Z W^T + b)||^2 + lam ||theta_W - W_K^T||^2 as one stacked least squares.
    design = torch.cat([Za[:, K], torch.cat([lam**0.5 * torch.eye(len(kept)), torch.zeros(len(kept), 1)], 1)])
    target = torch.cat([Z @ W.T + b, lam**0.5 * W[:, kept].T])
    slow = torch.linalg.lstsq(design, target).solution
    torch.testing.assert_close(theta, slow, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "phi3", "qwen3_next"])
def test_nothing_pruned_changes_nothing(name):
    loaded = from_model(tiny_model(name))
    before = [loaded.adapter.read(layer) for layer in loaded.layers]
    grams = output_statistics(loaded, Batches(name), progress=False)
    table = apply_compensation(loaded, [set() for _ in loaded.layers], grams)
    for layer, w in zip(loaded.layers, before):
        after = loaded.adapter.read(layer)
        assert torch.equal(after.o, w.o)
    assert (table["error_after"] == table["error_before"]).all()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "phi3", "opt", "qwen3_next"])
def test_compensation_never_increases_the_calibration_error(name):
    """error_after <= error_before per layer, and the recorded error equals a direct computation on captured z."""
    loaded = from_model(tiny_model(name))
    batches = Batches(name)
    z = _o_inputs(loaded, batches)
    weights = {layer.index: loaded.adapter.read(layer) for layer in loaded.layers}
    pruned = [{0, 3}, {1}] if len(loaded.layers) == 2 else [{0, 3}]
    grams = output_statistics(loaded, batches, progress=False)
    table = apply_compensation(loaded, pruned, grams)
    assert (table["error_after"] <= table["error_before"] + 1e-12).all()
    for layer, heads in zip(loaded.layers, pruned):
        w0, w1 = weights[layer.index], loaded.adapter.read(layer)
        C = w0.o.shape[0]
        W0, W1 = w0.o.reshape(C, -1).double(), w1.o.reshape(C, -1).double()
        b0 = w0.o_bias.double() if w0.o_bias is not None else 0
        b1 = w1.o_bias.double() if w1.o_bias is not None else 0
        target = z[layer.index] @ W0.T + b0
        kept_z = z[layer.index].clone()
        D = layer.head_dim
        for h in heads:
            kept_z[:, h * D : (h + 1) * D] = 0
        error = float(((kept_z @ W1.T + b1 - target) ** 2).sum() / (target**2).sum())
        row = table[table["layer"] == layer.index].iloc[0]
        assert error == pytest.approx(row["error_after"], rel=1e-6, abs=1e-12)
        for h in heads:  # removed heads' columns are zero
            assert torch.all(w1.o[:, h] == 0)


def test_bias_compensation_keeps_the_mean_output():
    """FLAP: b' = b + mean of the removed heads' contribution, so the mean block output over calibration is kept."""
    loaded = from_model(tiny_model("gpt2"))
    batches = Batches("gpt2")
    z = _o_inputs(loaded, batches)
    w0 = loaded.adapter.read(loaded.layers[0])
    grams = output_statistics(loaded, batches, progress=False)
    apply_compensation(loaded, [{1, 2}, set()], grams, "bias")
    w1 = loaded.adapter.read(loaded.layers[0])
    C = w0.o.shape[0]
    before = (z[0] @ w0.o.reshape(C, -1).double().T + w0.o_bias.double()).mean(0)
    after = (z[0] @ w1.o.reshape(C, -1).double().T + w1.o_bias.double()).mean(0)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_bias_compensation_is_refused_without_an_o_bias():
    loaded = from_model(tiny_model("llama"))
    with pytest.raises(HeadlabError, match="n/a"):
        P.prune(loaded, selection=P.Selection(heads="0:1"), compensate="bias", evaluate=False, progress=False)
    with pytest.raises(HeadlabError, match="unknown compensate="):
        P.prune(loaded, selection=P.Selection(heads="0:1"), compensate="magic", evaluate=False, progress=False)


@pytest.mark.parametrize("mode", ["mask", "physical"])
def test_prune_with_compensation_saves_a_verified_checkpoint(mode, tmp_path):
    model = tiny_model("llama")
    loaded = from_model(model, tiny_tokenizer())
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    chosen = P.Selection(heads="0:0,1;1:2,3", calibration_tokens=256)
    common = dict(data=str(corpus), seq_len=32, eval_tokens=256, progress=False)
    plain = P.prune(from_model(tiny_model("llama"), tiny_tokenizer()), selection=chosen, mode=mode, **common)
    result = P.prune(loaded, selection=chosen, mode=mode, out=tmp_path / "p", compensate="ridge", **common)
    assert result.verification["max_abs_diff"] <= 1e-3
    record = result.meta["compensation"]
    assert record["method"] == "ridge" and record["error_after"] <= record["error_before"]
    # Random tiny models: compensation should not hurt the held-out perplexity much, and usually helps.
    assert result.ppl_after <= plain.ppl_after * 1.05


def test_corpus_object_is_accepted():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    result = P.prune(
        loaded,
        selection=P.Selection(heads="0:1", calibration_tokens=128),
        compensate="ridge",
        data=Corpus("sample", [SAMPLE_TEXT * 4]),
        seq_len=32,
        evaluate=False,
        progress=False,
    )
    assert result.meta["compensation"]["calibration"]["tokens"] > 0


def test_sweep_with_compensation_adds_compensated_rows(tmp_path):
    from headlab.pruning.sweep import SweepPlan, sweep, write_sweep

    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    result = sweep(
        loaded,
        SweepPlan(fractions=(0.0, 0.25), orders=("random",), seeds=(0,)),
        data=str(corpus),
        seq_len=32,
        calibration_tokens=256,
        eval_tokens=256,
        compensate="ridge",
        progress=False,
    )
    table = result.table
    assert sorted(table["compensation"].unique()) == ["none", "ridge"]
    unpruned = table[table["fraction"] == 0.0].set_index("compensation")["perplexity"]
    assert unpruned["ridge"] == pytest.approx(unpruned["none"], rel=1e-6)  # nothing pruned: nothing refitted
    write_sweep(result, tmp_path / "run")
    assert (tmp_path / "run" / "sweep.png").exists()


# ---- the embedded model ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_compensation_lowers_perplexity_and_reloads(tmp_path):
    """One query head per KV group (90 heads) by importance: the compensated checkpoint reloads with vanilla
    transformers to the perplexity prune printed, which is below the uncompensated one."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headlab.core.loading import load_model
    from headlab.measure.evaluate import perplexity

    loaded = load_model(None, device="cpu")
    scores = S.importance_scores(loaded, seq_len=128, batch_size=4, max_tokens=512, progress=False)
    table = pd.DataFrame(
        [(i, h, float(s[h])) for i, s in enumerate(scores) for h in range(len(s))], columns=["layer", "head", "score"]
    )
    spec, common = P.PruneSpec(count=90, uniform=True), dict(seq_len=128, eval_tokens=256, progress=False)
    plain = P.prune(loaded, spec, P.Selection(scores=table), **common)
    loaded = load_model(None, device="cpu")
    chosen = P.Selection(scores=table, calibration_tokens=1024)
    result = P.prune(loaded, spec, chosen, **common, mode="physical", compensate="ridge", out=tmp_path / "p")
    assert result.ppl_after < plain.ppl_after
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "p", dtype=torch.float32)
    again = perplexity(
        from_model(model, AutoTokenizer.from_pretrained(tmp_path / "p")), max_tokens=256, seq_len=128, progress=False
    )
    assert again.perplexity == pytest.approx(result.ppl_after, rel=1e-4)
