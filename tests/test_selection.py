"""Head selection (Fisher in headlab.measure.importance, headlab.pruning.obs, headlab.pruning.selection): the Fisher against a slow per-sequence loop, OBS
on a layer with a redundant head, OBS's predicted error against the actual ridge refit, and budgets' constraints."""

from __future__ import annotations

import itertools

import pytest
import torch
from models import tiny_inputs, tiny_model

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.importance import fisher_statistics, frozen, head_importance, scoring_batches
from headlab.mechanisms.gates import head_gates
from headlab.pruning import prune as P
from headlab.pruning import selection as S
from headlab.pruning.obs import obs_path, ridge_lambda
from headlab.recovery.compensate import _error, output_statistics, ridge_refit


class Batches:
    """Three batches of tiny inputs (6 windows: even ones fit, odd ones held out)."""

    def __init__(self, name, seq=24):
        self.batches = [tiny_inputs(name, batch=2, seq=seq, seed=s) for s in (1, 2, 3)]

    def __iter__(self):
        for b in self.batches:
            yield b["input_ids"], b["attention_mask"], None


def _prepared(loaded, name="llama", seq=24):
    batches = [(b["input_ids"], b["attention_mask"]) for b in Batches(name, seq).batches]
    prepared = scoring_batches(loaded, batches)
    prepared[1].attention_mask[0, -5:] = 0  # one padded row: fewer scored tokens, so l(x) = L(x) / n_x matters
    prepared[1].labels[0, -6:] = -100
    return prepared


# ---- Fisher ----------------------------------------------------------------------------------------------------


def _gate_gradients_one_by_one(loaded, prepared):
    """Slow and obvious: for each sequence alone, gates [H] per layer at 1 and the float64 gradients of its mean
    token NLL with respect to them."""
    with frozen(loaded.model):
        for batch in prepared:
            for row in range(batch.input_ids.shape[0]):
                ids, mask, labels = (t[row : row + 1] for t in (batch.input_ids, batch.attention_mask, batch.labels))
                gates = [torch.ones(layer.num_heads, requires_grad=True) for layer in loaded.layers]
                with head_gates(loaded, gates):
                    logits = loaded.model(input_ids=ids, attention_mask=mask).logits[0]
                    nll = torch.nn.functional.cross_entropy(logits, labels[0], ignore_index=-100)  # mean over n_x
                    yield [g.double() for g in torch.autograd.grad(nll, gates)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fisher_equals_a_slow_per_sequence_loop(name):
    loaded = from_model(tiny_model(name))
    prepared = _prepared(loaded, name)
    stats = fisher_statistics(loaded, prepared, progress=False)
    # Slow: one sequence at a time, gates [H] per layer, the gradient of its mean token NLL, outer products averaged.
    outer = [torch.zeros(layer.num_heads, layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    count = 0
    for grads in _gate_gradients_one_by_one(loaded, prepared):
        for l, g in enumerate(grads):
            outer[l] += torch.outer(g, g)
        count += 1
    for l in range(len(loaded.layers)):
        torch.testing.assert_close(stats.block[l], outer[l] / count, rtol=1e-4, atol=1e-10)
        torch.testing.assert_close(stats.diagonal[l], torch.diagonal(outer[l]) / count, rtol=1e-4, atol=1e-10)
    # the importance table's raw fisher column is the same diagonal
    raw_batches = [(b.input_ids, b.attention_mask) for b in prepared]  # the same padding, labels made again
    result = head_importance(loaded, raw_batches, method="fisher", progress=False)
    torch.testing.assert_close(torch.cat(result.raw).double(), torch.cat(stats.diagonal), rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_second_order_equals_the_taylor_terms_of_a_slow_loop(name):
    """second-order: I_h = -mean_x dl(x)/dxi_h + mean_x (dl(x)/dxi_h)^2 / 2, one sequence at a time by hand."""
    loaded = from_model(tiny_model(name))
    prepared = _prepared(loaded, name)
    first = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    square = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    count = 0
    for grads in _gate_gradients_one_by_one(loaded, prepared):
        for l, g in enumerate(grads):
            first[l] += g
            square[l] += g**2
        count += 1
    raw_batches = [(b.input_ids, b.attention_mask) for b in prepared]
    result = head_importance(loaded, raw_batches, method="second-order", progress=False)
    expected = torch.cat([-f / count + s / count / 2 for f, s in zip(first, square)])
    torch.testing.assert_close(torch.cat(result.raw).double(), expected, rtol=1e-4, atol=1e-9)
    assert result.meta["definition"].startswith("I_h = -(1/S) sum_x dl(x)/dxi_h + F_hh / 2")


def test_output_fisher_equals_a_slow_loop():
    """B_l = (1/N) sum_t d_t d_t^T with d_t = dL(x)/d(block output at t), over scored positions."""
    loaded = from_model(tiny_model("llama"))
    prepared = _prepared(loaded)
    stats = fisher_statistics(loaded, prepared, output_fisher=True, progress=False)
    outputs = {}
    hooks = [
        loaded.adapter.out_proj(layer).register_forward_hook(lambda m, a, r, i=layer.index: outputs.__setitem__(i, r))
        for layer in loaded.layers
    ]
    total = [0.0 for _ in loaded.layers]
    tokens = 0
    try:
        with frozen(loaded.model):
            for batch in prepared:
                gates = [torch.ones(layer.num_heads, requires_grad=True) for layer in loaded.layers]
                with head_gates(loaded, gates):
                    logits = loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
                    nll = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100, reduction="sum"
                    )
                    grads = torch.autograd.grad(nll, [outputs[i] for i in range(len(loaded.layers))])
                for l, d in enumerate(grads):
                    for b, t in zip(*torch.nonzero(batch.labels != -100, as_tuple=True)):
                        total[l] = total[l] + torch.outer(d[b, t].double(), d[b, t].double())
                tokens += batch.scored
    finally:
        for h in hooks:
            h.remove()
    for l in range(len(loaded.layers)):
        torch.testing.assert_close(stats.output[l], total[l] / tokens, rtol=1e-4, atol=1e-10)


# ---- OBS -------------------------------------------------------------------------------------------------------


def _redundant_llama():
    """Tiny MHA llama whose head 2 in layer 0 copies head 0's attention (same q, k rows) with twice its value rows,
    so z_2 = 2 z_0 on every token: head 2's output is a linear combination of the others."""
    loaded = from_model(tiny_model("llama_mha"))
    layer = loaded.layers[0]
    w = loaded.adapter.read(layer)
    with torch.no_grad():
        w.q[2], w.k[2], w.v[2] = w.q[0], w.k[0], 2 * w.v[0]
    loaded.adapter.write(layer, w)
    return loaded


def _layer_inputs(loaded, layer):
    w = loaded.adapter.read(layer)
    W = w.o.reshape(w.o.shape[0], -1).double()
    return W, None if w.o_bias is None else w.o_bias.double()


def test_obs_removes_a_linearly_dependent_head_first_at_zero_cost():
    loaded = _redundant_llama()
    grams = output_statistics(loaded, Batches("llama_mha"), progress=False)
    layer = loaded.layers[0]
    W, b = _layer_inputs(loaded, layer)
    units = [[h] for h in range(layer.num_heads)]
    gram = grams[0][0] + grams[0][1]
    path, _ = obs_path(gram, W, b, layer.head_dim, units, alpha=1e-9)
    assert path.units[0][0] in (0, 2)  # either copy can go: the other, refit, reproduces it
    assert path.error[0] < 1e-6
    others = [c for h, c in ((u[0], c) for u, c in zip(units, [path.single[(h,)] for h in range(4)])) if h in (1, 3)]
    assert min(others) > 1e3 * max(path.cost[0], 1e-12)
    # loss-weighted too (any positive-definite output weighting): still first, still free
    stats = fisher_statistics(loaded, _prepared(loaded, "llama_mha"), output_fisher=True, progress=False)
    weighted, _ = obs_path(gram, W, b, layer.head_dim, units, alpha=1e-9, output_fisher=stats.output[0])
    assert weighted.units[0][0] in (0, 2) and weighted.cost[0] < 1e-6 * weighted.single[(1,)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # gpt2: o_proj has a bias, refit freely
@pytest.mark.parametrize("weighted", [False, True])
def test_obs_predicted_error_equals_the_actual_ridge_refit(name, weighted):
    loaded = from_model(tiny_model(name))
    grams = output_statistics(loaded, Batches(name), progress=False)
    fisher = fisher_statistics(loaded, _prepared(loaded, name), output_fisher=True, progress=False).output
    for i, layer in enumerate(loaded.layers):
        W, b = _layer_inputs(loaded, layer)
        gram = grams[i][0] + grams[i][1]
        alpha = 0.1
        units = [[h] for h in range(layer.num_heads)]
        path, _ = obs_path(
            gram, W, b, layer.head_dim, units, alpha=alpha, output_fisher=fisher[i] if weighted else None
        )
        assert len(path.units) == layer.num_heads  # the path may empty the layer; budgets keep one head
        n = W.shape[1]
        lam = ridge_lambda(gram, n, alpha)
        target = torch.cat([W.T, (b if b is not None else torch.zeros(W.shape[0], dtype=W.dtype))[None]])
        norm = float((target * (gram @ target)).sum())
        removed = set()
        for step, unit in enumerate(path.units[:-1]):
            removed |= set(unit)
            D = layer.head_dim
            kept = [h * D + d for h in range(layer.num_heads) if h not in removed for d in range(D)]
            theta, K, target = ridge_refit(gram, W, b, kept, alpha, lam=lam)
            actual = _error(theta, gram, K, target) / norm
            assert path.error[step] == pytest.approx(actual, rel=1e-6, abs=1e-12)
        assert all(x <= y + 1e-12 for x, y in zip(path.error, path.error[1:]))  # removing more never helps


def test_obs_greedy_matches_exhaustive_search_for_one_removal():
    """The first OBS step is the exact best single removal: the Schur-complement cost equals a refit per head."""
    loaded = from_model(tiny_model("llama"))
    grams = output_statistics(loaded, Batches("llama"), progress=False)
    layer = loaded.layers[1]
    W, b = _layer_inputs(loaded, layer)
    gram = grams[1][0] + grams[1][1]
    path, _ = obs_path(gram, W, b, layer.head_dim, [[h] for h in range(4)], alpha=0.3, steps=1)
    lam = ridge_lambda(gram, W.shape[1], 0.3)
    D = layer.head_dim
    norm = float((W.T * (gram[:-1, :-1] @ W.T)).sum())
    errors = []
    for h in range(4):
        kept = [j * D + d for j in range(4) if j != h for d in range(D)]
        theta, K, target = ridge_refit(gram, W, b, kept, 0.3, lam=lam)
        errors.append(_error(theta, gram, K, target) / norm)
    assert path.units[0] == [min(range(4), key=lambda h: errors[h])]


# ---- budgets ---------------------------------------------------------------------------------------------------


def _joint(loaded, select, budget, **kw):
    prepared = _prepared(loaded)
    grams = output_statistics(loaded, Batches("llama"), progress=False)
    scores = [
        torch.rand(layer.num_heads, generator=torch.Generator().manual_seed(layer.index)) for layer in loaded.layers
    ]
    defaults = dict(unit="head", fraction=None, count=None, allow_empty_layer=False)
    return S.select_joint(
        loaded, select=select, budget=budget, scoring_batches=prepared, grams=grams, scores=scores,
        search=S.BudgetSearch(prepared), progress=False, **{**defaults, **kw},
    )  # fmt: skip


@pytest.mark.parametrize("select", S.SELECTS)
def test_uniform_budget_removes_the_same_number_from_every_kv_group(select):
    loaded = from_model(tiny_model("llama", num_hidden_layers=3))  # H=4, G=2: groups {0,1}, {2,3}
    result = _joint(loaded, select, "uniform", count=6)  # 6 = 1 per group x 2 groups x 3 layers
    for layer, heads in zip(loaded.layers, result.pruned):
        assert [sum(1 for h in heads if layer.kv_head_of(h) == g) for g in range(2)] == [1, 1]
    layout = P.physical_layout(loaded.layers, result.pruned)
    assert P.is_uniform(layout, loaded.adapter) and not any(lay.padding for lay in layout)
    with pytest.raises(HeadlabError, match="multiple of 6"):
        _joint(loaded, select, "uniform", count=4)


@pytest.mark.parametrize("select", S.SELECTS)
@pytest.mark.parametrize("budget", ["global", "search"])
def test_global_and_search_budgets_prune_exactly_the_count_and_keep_a_head(select, budget):
    loaded = from_model(tiny_model("llama", num_hidden_layers=3))
    result = _joint(loaded, select, budget, count=8)
    assert sum(len(p) for p in result.pruned) == 8
    assert all(len(p) < 4 for p in result.pruned)
    taken = result.table[result.table["taken"]]
    assert len(taken) == 8
    with pytest.raises(HeadlabError, match="keeping one head"):
        _joint(loaded, select, budget, count=10)  # 3 layers x 3 removable heads = 9


@pytest.mark.parametrize("select", ["fisher-block", "obs"])
def test_kv_group_unit_removes_whole_groups_and_per_layer_counts(select):
    loaded = from_model(tiny_model("llama", num_hidden_layers=3))
    result = _joint(loaded, select, "per-layer", unit="kv-group", count=1)
    for heads in result.pruned:
        assert heads in ({0, 1}, {2, 3})


def test_rank_with_global_budget_equals_the_existing_global_ranking():
    loaded = from_model(tiny_model("llama", num_hidden_layers=3))
    scores = [torch.rand(4, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64) for i in range(3)]
    units = [S.layer_units(layer, "head") for layer in loaded.layers]
    allowed = [S._allowed(layer, "head", "global", None, False) for layer in loaded.layers]
    paths = [S.score_path(layer, units[i], scores[i], allowed[i]) for i, layer in enumerate(loaded.layers)]
    for count in range(10):
        taken = S.take_global(paths, count)
        pruned = [set(h for u in p.units[:k] for h in u) for p, k in zip(paths, taken)]
        assert pruned == P.select_heads(loaded.layers, scores, count=count)


def test_budget_search_is_the_exact_optimum():
    generator = torch.Generator().manual_seed(3)
    curves = [torch.rand(3, generator=generator).cumsum(0).tolist() for _ in range(4)]
    curves[1] = [0.5, -0.2, 0.1]  # measured curves need not be monotone
    for target in range(0, 13):
        taken = S.take_search(curves, target)
        assert sum(taken) == target
        value = sum(c[k - 1] if k else 0.0 for c, k in zip(curves, taken))
        brute = min(
            sum(c[k - 1] if k else 0.0 for c, k in zip(curves, ks))
            for ks in itertools.product(range(4), repeat=4)
            if sum(ks) == target
        )
        assert value == pytest.approx(brute)
    with pytest.raises(HeadlabError, match="cannot place"):
        S.take_search(curves, 13)


def test_search_measures_each_layers_loss_curve():
    """The measured curve of layer l at step k is the calibration loss with exactly those heads gated off."""
    loaded = from_model(tiny_model("llama"))
    result = _joint(loaded, "rank", "search", count=3)
    prepared = _prepared(loaded)
    tokens = sum(b.scored for b in prepared)

    def loss(pruned):
        from headlab.measure.importance import sequence_nll

        with torch.no_grad(), head_gates(loaded, P.gates_from_pruned(loaded.layers, pruned)):
            return sum(float(sequence_nll(loaded.model, b, "cpu").double().sum()) for b in prepared) / tokens

    base = loss([set(), set()])
    row = result.table[(result.table["layer"] == 1) & (result.table["step"] == 2)].iloc[0]
    heads = set()
    for r in result.table[(result.table["layer"] == 1) & (result.table["step"] <= 2)].itertuples():
        heads |= {int(h) for h in r.heads.split(",")}
    assert row["measured_loss_increase"] == pytest.approx(loss([set(), heads]) - base, rel=1e-6, abs=1e-9)


# ---- through prune, sweep and the CLI --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("select", "budget", "compensate"),
    [("obs", "uniform", "ridge"), ("fisher-block", "global", None), ("rank", "search", "ridge")],
)
def test_prune_with_joint_selection_saves_a_consistent_record(select, budget, compensate, tmp_path):
    from tiny_text import SAMPLE_TEXT, tiny_tokenizer

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama", num_hidden_layers=3), tiny_tokenizer())
    chosen = P.Selection(method="fisher", select=select, budget=budget, calibration_tokens=256, search_tokens=64)
    result = P.prune(
        loaded, P.PruneSpec(count=6), chosen, compensate=compensate, data=str(corpus), seq_len=32, eval_tokens=128,
        mode="physical", out=tmp_path / "p", progress=False,
    )  # fmt: skip
    assert result.num_pruned == 6
    assert result.meta["selection"]["select"] == select and result.meta["selection"]["budget"] == budget
    removed = result.table[result.table["pruned"]]
    if select != "rank":
        assert removed["selection_step"].notna().all()
    if budget == "uniform":
        assert result.loader == "vanilla"
    assert result.verification["max_abs_diff"] <= 1e-3


def test_obs_selection_and_its_refit_share_one_gram_pass(tmp_path, monkeypatch):
    """--select obs --compensate computes the calibration Grams once: the refit reads the ones the selection read,
    and the pruned model equals the one a refit from freshly computed Grams gives."""
    from tiny_text import SAMPLE_TEXT, tiny_tokenizer

    from headlab.mechanisms.restore import restoring

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    calls = []
    for module in (S, P):  # both import it by name: the selection's Grams and the refit's
        monkeypatch.setattr(module, "output_statistics", lambda *a, **k: calls.append(1) or output_statistics(*a, **k))
    loaded = from_model(tiny_model("llama", num_hidden_layers=3), tiny_tokenizer())
    kw = dict(compensate="ridge", data=str(corpus), seq_len=32, eval_tokens=128, mode="mask", progress=False)
    with restoring(loaded):
        obs = P.Selection(select="obs", budget="uniform", calibration_tokens=256)
        shared = P.prune(loaded, P.PruneSpec(count=6), obs, **kw)
        weights = [loaded.adapter.read(layer).o.clone() for layer in loaded.layers]
    assert len(calls) == 1
    # the same heads, refit from Grams computed anew, give the same weights
    with restoring(loaded):
        heads = ";".join(f"{r.layer}:{r.head}" for r in shared.table[shared.table["pruned"]].itertuples())
        P.prune(loaded, selection=P.Selection(heads=heads, calibration_tokens=256), **kw)
        for layer, w in zip(loaded.layers, weights):
            assert torch.equal(loaded.adapter.read(layer).o, w)
    assert len(calls) == 2


def test_prune_method_sources_by_name(tmp_path):
    """Every score source prunes by name; random is seeded (same seed, same heads)."""
    from tiny_text import SAMPLE_TEXT, tiny_tokenizer

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    spec, common = P.PruneSpec(count=3), dict(data=str(corpus), seq_len=32, evaluate=False, progress=False)
    chosen = {}
    for method in ("obs", "random", "entropy", "fisher"):
        loaded = from_model(tiny_model("llama"), tiny_tokenizer())
        chosen[method] = P.prune(loaded, spec, P.Selection(method=method, calibration_tokens=128), **common).pruned
        assert sum(len(p) for p in chosen[method]) == 3
    seeded = P.Selection(method="random", calibration_tokens=128)
    again = P.prune(from_model(tiny_model("llama"), tiny_tokenizer()), spec, seeded, **common).pruned
    assert again == chosen["random"]


def test_sweep_compares_joint_and_ranked_orders(tmp_path):
    from tiny_text import SAMPLE_TEXT, tiny_tokenizer

    from headlab.pruning.sweep import SweepPlan, sweep

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    result = sweep(
        loaded, SweepPlan(fractions=(0.0, 0.25, 0.5), orders=("obs", "fisher", "fisher-block")), data=str(corpus),
        seq_len=32, calibration_tokens=128, eval_tokens=64, compensate="ridge", progress=False,
    )  # fmt: skip
    table = result.table
    assert set(table["order"]) == {"obs", "fisher", "fisher-block"}
    assert set(table["compensation"]) == {"none", "ridge"}
    assert sorted(table.loc[table["order"] == "obs", "pruned_heads"].unique().tolist()) == [0, 2, 4]


def test_cli_prune_select_obs_uniform_and_importance_fisher(tmp_path, capsys):
    import json

    import pandas as pd
    from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

    model = save_tiny("llama", tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text(SAMPLE_TEXT * 4)
    data = ["--model", model, "--device", "cpu", "--data", text, "--seq-len", "32"]
    code, out, err = run_cli(
        ["prune", *data, "--select", "obs", "--budget", "uniform", "--count", "4", "--compensate", "--mode",
         "physical", "--calibration-tokens", "128", "--max-tokens", "64", "--json", "--out", tmp_path / "p"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    record = json.loads(out)
    assert record["pruned_heads"] == 4 and record["loader"] == "vanilla"
    assert record["selection"]["select"] == "obs" and record["compensation"]["method"] == "ridge"
    heads = pd.read_csv(tmp_path / "p" / "pruning" / "heads.csv")
    assert heads["pruned"].sum() == 4 and heads.loc[heads["pruned"], "selection_cost"].notna().all()
    code, out, err = run_cli(["importance", *data, "--method", "fisher", "--out", tmp_path / "i"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "i" / "meta.json").read_text())
    assert meta["method"] == "fisher" and "Fisher" in meta["definition"]
