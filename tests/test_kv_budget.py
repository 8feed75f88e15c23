"""Per-layer KV budgets (headlab.kv.budget, `convert-gqa --kv-budget`): the allocation against enumeration, the
budget arithmetic, exact per-layer conversions, the measured costs against a slow recomputation, the checkpoint
that reloads with the same logits, and the command's refusals."""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
from dataclasses import replace

import pandas as pd
import pytest
import torch
from models import tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core.checkpoint import save_checkpoint
from headlab.core.data import TextSpec, split_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model, load_model
from headlab.kv import budget as B
from headlab.kv import gqa
from headlab.kv.grouping import expand_weights, pool_weights
from headlab.measure.costs import kv_bytes_per_token
from headlab.measure.importance import scoring_batches, sequence_nll
from headlab.recovery.retrieval_windows import retrieval_batches


def _wide(**overrides):
    """A tiny Llama with 8 query and 4 KV heads in 3 layers: per-layer options 4, 2, 1."""
    kwargs = dict(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3) | overrides
    return from_model(tiny_model("llama", **kwargs), None)


def _logits(loaded, name="llama"):
    with torch.no_grad():
        return loaded.model(**tiny_inputs(name)).logits


# ---- the allocation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_optimal_against_enumeration(seed):
    rng = random.Random(seed)
    widths = [rng.choice([16, 32]) for _ in range(4)]
    costs = [{4: 0.0, 2: rng.random(), 1: rng.random() * 3} for _ in widths]
    for layer in costs:
        layer[1] = max(layer[1], layer[2])  # fewer heads cost at least as much, as a measured curve usually does
    budget = rng.randint(sum(widths), 4 * sum(widths))
    chosen = B.allocate_kv(costs, widths, budget)
    assert sum(g * w for g, w in zip(chosen, widths)) <= budget
    feasible = [
        combo
        for combo in itertools.product(*(list(c) for c in costs))
        if sum(g * w for g, w in zip(combo, widths)) <= budget
    ]
    best = min(sum(c[g] for c, g in zip(costs, combo)) for combo in feasible)
    assert sum(c[g] for c, g in zip(costs, chosen)) == pytest.approx(best, abs=1e-12)


def test_allocation_by_hand():
    # Two layers of width 1, budget 5 heads of 8: layer 0 cheap to cut, layer 1 expensive -> (1, 4).
    costs = [{4: 0.0, 2: 0.1, 1: 0.2}, {4: 0.0, 2: 1.0, 1: 5.0}]
    assert B.allocate_kv(costs, [1, 1], 5) == [1, 4]
    assert B.allocate_kv(costs, [1, 1], 4) == [2, 2]  # 0.1 + 1.0 beats (1, 2) at 0.2 + 1.0; 3 is no option
    with pytest.raises(HeadlabError, match="no per-layer layout fits"):
        B.allocate_kv(costs, [1, 1], 1)


def test_kv_choices_are_the_divisors():
    assert B.kv_choices(4) == [4, 2, 1] and B.kv_choices(3) == [3, 1] and B.kv_choices(6) == [6, 3, 2, 1]


def test_budget_units_and_refusals():
    layers = _wide().layers  # 3 layers x 4 KV heads x head_dim
    D = layers[0].head_dim
    assert B.budget_units(layers, 1.0) == 12 * D
    assert B.budget_units(layers, 0.5) == 6 * D
    assert B.budget_units(layers, 0.25) == 3 * D  # one head per layer: the floor
    assert B.budget_units(layers, 0.1, allow_empty_layer=True) == int(0.1 * 12 * D)  # layers may go without heads
    with pytest.raises(HeadlabError, match="below one KV head in the first layer"):
        B.budget_units(layers, 0.05, allow_empty_layer=True)  # below the first layer's one head
    for bad, match in ((0.2, "below one KV head per layer"), (1.5, r"in \(0, 1\]"), (0.0, r"in \(0, 1\]"),
                       (float("nan"), r"in \(0, 1\]")):  # fmt: skip
        with pytest.raises(HeadlabError, match=match):
            B.budget_units(layers, bad)


# ---- conversions -------------------------------------------------------------------------------------------------


def test_counts_equal_to_the_original_change_nothing():
    loaded = _wide()
    before = _logits(loaded)
    record = B.apply_counts(loaded, [4, 4, 4], B.BudgetSpec(1.0), None)
    assert record["loader"] == "vanilla" and torch.equal(_logits(loaded), before)


def test_per_layer_pooling_of_copied_heads_is_exact():
    # Expand a 2-KV-head model to 4 by copying each head; pooling pairs back per layer restores its function exactly.
    loaded = _wide(num_key_value_heads=2)
    before = _logits(loaded)
    for layer in loaded.layers:
        loaded.adapter.write(layer, expand_weights(loaded.adapter.read(layer), 4))
    loaded.adapter.set_config_heads(loaded.model.config, 8, 4, loaded.layers[0].head_dim)
    record = B.apply_counts(loaded, [2, 4, 2], B.BudgetSpec(0.7), None)
    assert [layer.num_kv_heads for layer in loaded.layers] == [2, 4, 2] and record["loader"] == "headlab"
    torch.testing.assert_close(_logits(loaded), before, atol=1e-5, rtol=0)


def test_apply_counts_pools_each_layer_as_pool_weights_does():
    loaded = _wide()
    reference = copy.deepcopy(loaded.model)
    B.apply_counts(loaded, [1, 4, 2], B.BudgetSpec(0.6), None)
    expected = from_model(reference, None)
    for layer, g in zip(expected.layers, [1, 4, 2]):
        if g < 4:
            expected.adapter.write(layer, pool_weights(expected.adapter.read(layer), g, "mean", seed=layer.index))
    torch.testing.assert_close(_logits(loaded), _logits(expected), atol=0, rtol=0)
    assert kv_bytes_per_token(loaded) == kv_bytes_per_token(expected)


def test_layer_costs_match_a_slow_recomputation(tmp_path):
    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    loaded = load_model(str(src), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=128, seq_len=32).resolved()
    batches = text.batches(loaded.tokenizer)
    costs = B.layer_costs(loaded, B.BudgetSpec(0.5), None, batches, progress=False)
    assert sorted(zip(costs.layer, costs.kv_heads)) == sorted((i, g) for i in range(3) for g in (4, 2, 1))

    @torch.no_grad()
    def nll(model) -> float:
        scored = scoring_batches(loaded, batches)
        total = sum(float(sequence_nll(model, b, "cpu").double().sum()) for b in scored)
        return total / sum(b.scored for b in scored)

    original = nll(loaded.model)
    for layer_index, g in ((0, 1), (2, 2)):
        model = copy.deepcopy(loaded.model)
        by_hand = from_model(model, loaded.tokenizer)
        layer = by_hand.layers[layer_index]
        by_hand.adapter.write(layer, pool_weights(by_hand.adapter.read(layer), g, "mean", seed=layer_index))
        row = costs[(costs.layer == layer_index) & (costs.kv_heads == g)].iloc[0]
        assert row.loss_increase == pytest.approx(nll(model) - original, abs=1e-6)
        assert row.kv_numbers_per_token == 2 * g * layer.head_dim
    assert (costs[costs.kv_heads == 4].loss_increase == 0).all()
    torch.testing.assert_close(nll(loaded.model), original, atol=0, rtol=0)  # every layer restored


@pytest.mark.parametrize("method", ["mean", "svd"])
def test_budget_checkpoint_reloads_with_the_same_logits(tmp_path, method):
    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    loaded = load_model(str(src), device="cpu")
    spec = B.BudgetSpec(0.5, method=method, search_tokens=128)
    record = gqa.convert_budget_checkpoint(loaded, spec, tmp_path / "out", data=str(tmp_path / "t.txt"),
                                           max_tokens=128, seq_len=32, calibration_tokens=128,
                                           progress=False)  # fmt: skip
    counts = record["conversion"]["kv_heads_per_layer"]
    assert sum(counts) <= 6 and all(g in (1, 2, 4) for g in counts)
    assert record["measured_kv_bytes_per_token_after"] == record["kv_bytes_per_token_after"]
    assert record["kv_bytes_per_token_after"] <= record["kv_bytes_per_token_before"] // 2
    assert record["verification"]["max_abs_diff"] <= 1e-4
    back = load_model(str(tmp_path / "out"), device="cpu")
    assert [layer.num_kv_heads for layer in back.layers] == counts
    torch.testing.assert_close(_logits(back), _logits(loaded), atol=1e-5, rtol=0)
    table = (tmp_path / "out" / "kv_budget" / "costs.csv").read_text().splitlines()
    assert table[0].startswith("layer,kv_heads,loss_increase") and len(table) == 1 + 3 * 3
    meta = json.loads((tmp_path / "out" / "kv_budget" / "meta.json").read_text())
    assert meta["kv_heads_per_layer"] == counts and meta["fraction"] == 0.5


# ---- the command -------------------------------------------------------------------------------------------------


def _command(tmp_path, *extra):
    src = tmp_path / "src"
    if not src.exists():
        save_tiny("llama", src, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
        (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    return ["convert-gqa", "--model", src, "--data", tmp_path / "t.txt", "--max-tokens", "128", "--seq-len", "32",
            "--calibration-tokens", "128", "--search-tokens", "128", "--out", tmp_path / "out", *extra]  # fmt: skip


def test_cli_kv_budget_writes_a_per_layer_checkpoint(tmp_path, capsys):
    code, out, err = run_cli(_command(tmp_path, "--kv-budget", "0.5", "--json"), capsys)
    assert code == 0, err
    record = json.loads(out)
    counts = record["conversion"]["kv_heads_per_layer"]
    assert [layer.num_kv_heads for layer in load_model(str(tmp_path / "out"), device="cpu").layers] == counts


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--kv-budget", "1.5"], r"in \(0, 1\]"),
        (["--kv-budget", "0.1"], "below one KV head per layer"),
        (["--kv-budget", "0.5", "--kv-heads", "2"], "one of them"),
        ([], "one of them"),
        (["--kv-budget", "0.5", "--streaming"], "drop --streaming"),
        (["--kv-budget", "0.5", "--grouping", "similarity"], "--grouping similarity"),
    ],
)
def test_cli_kv_budget_refusals(tmp_path, capsys, extra, message):
    code, out, err = run_cli(_command(tmp_path, *extra), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_info_prices_a_per_layer_budget(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    code, out, err = run_cli(["info", "--model", src, "--kv-budget", "0.5", "--json"], capsys)
    assert code == 0, err
    budget = json.loads(out)["kv_budget"]
    D = 16  # the tiny Llama's head_dim (tests/models.py)
    assert budget["kv_heads"] == 6 and budget["total_kv_heads"] == 12 and budget["choices_per_layer"] == [[4, 2, 1]]
    assert budget["kv_bytes_per_token"] == 2 * 6 * D * 4  # keys and values, float32
    code, out, err = run_cli(["info", "--model", src, "--kv-budget", "2"], capsys)
    assert code == 2 and "(0, 1]" in err and len(err.strip().splitlines()) == 1


def test_ladder_budget_rows_match_a_direct_conversion_and_restore_the_model(tmp_path):
    from headlab.kv.ladder import budget_rows
    from headlab.measure.evaluate import perplexity

    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    loaded = load_model(str(src), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="eval", max_tokens=128, seq_len=32).resolved()
    before = _logits(loaded)
    rows = budget_rows(loaded, (0.5, 0.75), text, 128, "mean", progress=False, search_tokens=128)
    assert torch.equal(_logits(loaded), before) and not hasattr(loaded.model.config, "headlab_head_layout")
    search = text.but(split="calibration", max_tokens=128, batch_size=4).batches(loaded.tokenizer)
    costs = B.layer_costs(loaded, B.BudgetSpec(1.0, search_tokens=128), None, search, progress=False)
    for row in rows.itertuples():
        counts = B.allocation(loaded, costs, row.budget)
        assert row.kv_heads_per_layer == ",".join(map(str, counts)) and row.action == "kv-budget"
        fresh = load_model(str(src), device="cpu")
        B.apply_counts(fresh, counts, B.BudgetSpec(row.budget), None)
        assert row.perplexity == pytest.approx(perplexity(fresh, text=text, progress=False).perplexity, rel=1e-6)
        assert row.kv_bytes_per_token == kv_bytes_per_token(fresh)


def test_budget_rows_convert_each_kv_head_count_once(tmp_path, monkeypatch):
    """The costs, every row's refinement and every row's conversion share one conversion per count (LayerOptions):
    an svd merge is a calibration pass, which a sweep of several budgets used to repeat for each row and stage."""
    from headlab.kv.ladder import budget_rows

    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    loaded = load_model(str(src), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="eval", max_tokens=128, seq_len=32).resolved()
    converted = []
    real = B._layer_options
    monkeypatch.setattr(B, "_layer_options", lambda *args: converted.append(args[4]) or real(*args))
    rows = budget_rows(loaded, (0.5, 0.75), text, 128, "svd", progress=False, search_tokens=128, refine_rounds=1)
    assert len(rows) == 2 and sorted(converted) == [1, 2]  # the counts below 4 that divide it, each once


def test_layer_options_cache_per_count_and_spec(tmp_path):
    loaded = load_model(str(save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4)))
    options = B.LayerOptions(loaded, None)
    spec = B.BudgetSpec(0.5)
    first = options(spec, 2)
    assert options(spec, 2) is first and options(B.BudgetSpec(0.25), 2) is first  # the fraction does not convert
    seeded = options(B.BudgetSpec(0.5, pool="random", seed=3), 2)
    assert seeded is not first and set(seeded) == set(first)
    for index, weights in first.items():  # what the uncached conversion gives
        expected = B._layer_options(loaded, "mean", spec.pool, spec.seed, 2, None, False)[index]
        assert torch.equal(weights.k, expected.k) and torch.equal(weights.v, expected.v)


def test_cli_gqa_sweep_kv_budgets(tmp_path, capsys):
    _command(tmp_path)  # writes the tiny model and text
    args = ["gqa-sweep", "--model", tmp_path / "src", "--data", tmp_path / "t.txt", "--max-tokens", "128",
            "--seq-len", "32", "--calibration-tokens", "128", "--kv-heads", "4,1", "--pool", "mean",
            "--grouping", "contiguous", "--kv-budgets", "0.5", "--out", tmp_path / "sweep"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "budget 0.5" in out and (tmp_path / "sweep" / "gqa_sweep.png").exists()
    code, out, err = run_cli([*args[:-2], "--kv-budgets", "0.1", "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "below one KV head per layer" in err and not (tmp_path / "bad").exists()


# ---- layers left without attention (--allow-empty-layer) --------------------------------------------------------


def test_empty_layer_costs_and_conversion_equal_gating_the_layer_off(tmp_path):
    from headlab.mechanisms.gates import head_gates

    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 10)
    loaded = load_model(str(src), device="cpu")
    spec = B.BudgetSpec(0.2, allow_empty_layer=True, search_tokens=128)
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=128, seq_len=32).resolved()
    costs = B.layer_costs(loaded, spec, None, text.batches(loaded.tokenizer), progress=False)
    assert sorted(costs[costs.kv_heads == 0].layer) == [1, 2]  # never layer 0
    assert (costs[costs.kv_heads == 0].kv_numbers_per_token == 0).all()
    off = [torch.ones(8), torch.ones(8), torch.zeros(8)]  # layer 2's heads gated to zero: what losing it does
    with head_gates(loaded, off):
        gated = _logits(loaded)
    counts = B.allocation(loaded, costs, 0.2)  # 2 of 12 KV heads: only possible with layers left out
    assert counts[0] >= 1 and sum(counts) <= 2 and 0 in counts
    record = B.apply_counts(loaded, [4, 4, 0], spec, None)
    assert record["attention_free_layers"] == [2] and record["kv_numbers_per_token_without_padding"] == 2 * 8 * 16
    torch.testing.assert_close(_logits(loaded), gated, atol=1e-5, rtol=0)
    with pytest.raises(HeadlabError, match="never in layer 0"):
        B.apply_counts(load_model(str(src), device="cpu"), [0, 4, 4], spec, None)


def test_empty_layer_checkpoint_reloads_and_is_attention_free_in_gguf(tmp_path):
    pytest.importorskip("gguf")
    from headlab.runtimes.gguf_export import plan_export

    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    loaded = load_model(str(src), device="cpu")
    B.apply_counts(loaded, [2, 0, 1], B.BudgetSpec(0.3, allow_empty_layer=True), None)
    expected = _logits(loaded)
    save_checkpoint(loaded.model, loaded.tokenizer, tmp_path / "out")
    back = load_model(str(tmp_path / "out"), device="cpu")
    assert [layer.num_kv_heads for layer in back.layers] == [2, 1, 1]  # layer 1: the padding head
    torch.testing.assert_close(_logits(back), expected, atol=1e-5, rtol=0)
    plan = plan_export(back)
    assert plan.target.arch == "deci" and plan.kv_heads == [2, 0, 1] and plan.attention_free == [1]


def test_cli_allow_empty_layer_needs_a_budget(tmp_path, capsys):
    code, out, err = run_cli(_command(tmp_path, "--kv-heads", "2", "--allow-empty-layer"), capsys)
    assert code == 2 and "--allow-empty-layer applies to --kv-budget" in err and not (tmp_path / "out").exists()


# ---- the retrieval cost (--retrieval-weight) ---------------------------------------------------------------------


def _long_tiny(tmp_path):
    """A tiny 3-layer Llama (8 query, 4 KV heads) with room for 768-token retrieval prompts, and its text file."""
    src = save_tiny("llama", tmp_path / "src", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3,
                    max_position_embeddings=1024)  # fmt: skip
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 80)
    return src


def test_retrieval_costs_match_a_slow_recomputation(tmp_path):
    loaded = load_model(str(_long_tiny(tmp_path)), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=128, seq_len=32).resolved()
    haystack = split_text(text.corpus, "calibration").text
    spec = B.BudgetSpec(0.5, retrieval_weight=0.5, retrieval_len=768, retrieval_prompts=2)
    costs = B.layer_costs(loaded, spec, None, text.batches(loaded.tokenizer), progress=False, retrieval_text=haystack)
    stream = retrieval_batches(loaded.tokenizer, haystack, 768, seed=0)
    prompts = [next(stream) for _ in range(2)]

    @torch.no_grad()
    def answer_nll(model) -> float:
        """-log p of every answer token, from the full log-softmax, averaged over the answer tokens of both prompts."""
        total, count = 0.0, 0
        for ids, _, _, answer in prompts:
            logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)[0]
            for t in range(ids.shape[1] - 1):
                if answer[0, t]:
                    total -= float(logp[t, ids[0, t + 1]])
                    count += 1
        return total / count

    original = answer_nll(loaded.model)
    for layer_index, g in ((0, 1), (1, 2)):
        by_hand = from_model(copy.deepcopy(loaded.model), loaded.tokenizer)
        layer = by_hand.layers[layer_index]
        by_hand.adapter.write(layer, pool_weights(by_hand.adapter.read(layer), g, "mean", seed=layer_index))
        row = costs[(costs.layer == layer_index) & (costs.kv_heads == g)].iloc[0]
        assert row.retrieval_increase == pytest.approx(answer_nll(by_hand.model) - original, abs=1e-5)
        assert row.cost == pytest.approx(row.loss_increase + 0.5 * row.retrieval_increase, abs=1e-12)
    assert (costs[costs.kv_heads == 4][["loss_increase", "retrieval_increase", "cost"]] == 0).all().all()


def test_copy_retrieval_costs_match_copy_outcome_by_hand(tmp_path):
    """retrieval_kind="copy": r_l(g) is the increase of the mean NLL of the copied tokens copy_outcome scores, over
    the cost's own copy sequences (seeded apart from longeval's)."""
    from headlab.measure.copying import copy_outcome, copy_sequence
    from headlab.measure.stats import random_token_ids

    loaded = load_model(str(_long_tiny(tmp_path)), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=128, seq_len=32).resolved()
    spec = B.BudgetSpec(0.5, retrieval_weight=2.0, retrieval_len=101, retrieval_prompts=2, retrieval_kind="copy")
    costs = B.layer_costs(loaded, spec, None, text.batches(loaded.tokenizer), progress=False)
    vocabulary = random_token_ids(loaded)
    sequences = [copy_sequence(vocabulary, 101, B.COPY_COST_SEED, index) for index in range(2)]
    assert sequences[0] != copy_sequence(vocabulary, 101, 0, 0)  # not the sequences longeval reports

    def copy_nll(model) -> float:
        outcomes = [copy_outcome(model, ids) for ids in sequences]
        return sum(o[2] for o in outcomes) / sum(o[0] for o in outcomes)

    original = copy_nll(loaded)
    by_hand = from_model(copy.deepcopy(loaded.model), loaded.tokenizer)
    layer = by_hand.layers[1]
    by_hand.adapter.write(layer, pool_weights(by_hand.adapter.read(layer), 2, "mean", seed=1))
    row = costs[(costs.layer == 1) & (costs.kv_heads == 2)].iloc[0]
    assert row.retrieval_increase == pytest.approx(copy_nll(by_hand) - original, abs=1e-5)
    assert row.cost == pytest.approx(row.loss_increase + 2.0 * row.retrieval_increase, abs=1e-12)
    with pytest.raises(HeadlabError, match="unknown retrieval kind"):
        B.layer_costs(loaded, replace(spec, retrieval_kind="echo"), None, text.batches(loaded.tokenizer))


def test_allocation_minimises_the_cost_column_when_there_is_one():
    loaded = _wide()
    # Text alone would merge layer 0 (cheapest loss); the retrieval cost makes layer 2 the cheap one.
    rows = []
    for layer, loss, cost in ((0, 0.1, 5.0), (1, 0.2, 0.3), (2, 0.3, 0.2)):
        rows += [dict(layer=layer, kv_heads=4, loss_increase=0.0, cost=0.0),
                 dict(layer=layer, kv_heads=1, loss_increase=loss, cost=cost)]  # fmt: skip
    frame = pd.DataFrame(rows)
    budget = 9 / 12  # one layer at 1 KV head, two at 4
    assert B.allocation(loaded, frame.drop(columns="cost"), budget) == [1, 4, 4]
    assert B.allocation(loaded, frame, budget) == [4, 4, 1]


def test_cli_retrieval_weight_records_its_costs(tmp_path, capsys):
    _long_tiny(tmp_path)
    extra = ("--kv-budget", "0.5", "--retrieval-weight", "1", "--retrieval-len", "768", "--json")
    code, out, err = run_cli(_command(tmp_path, *extra), capsys)
    assert code == 0, err
    record = json.loads(out)
    retrieval = record["conversion"]["retrieval_cost"]
    assert retrieval["weight"] == 1 and retrieval["prompt_tokens"] == 768 and retrieval["prompts"] == 6
    assert retrieval["kind"] == "needles"
    costs = pd.read_csv(tmp_path / "out" / "kv_budget" / "costs.csv")
    assert {"retrieval_increase", "cost", "chosen"} <= set(costs.columns)
    chosen = costs[costs.chosen].sort_values("layer")
    assert list(chosen.kv_heads) == record["conversion"]["kv_heads_per_layer"]
    assert retrieval["predicted_retrieval_increase"] == pytest.approx(chosen.retrieval_increase.sum())


def test_cli_copy_retrieval_cost(tmp_path, capsys):
    _long_tiny(tmp_path)
    extra = ("--kv-budget", "0.5", "--retrieval-weight", "1", "--retrieval-kind", "copy", "--retrieval-len", "64",
             "--json")  # fmt: skip
    code, out, err = run_cli(_command(tmp_path, *extra), capsys)
    assert code == 0, err
    retrieval = json.loads(out)["conversion"]["retrieval_cost"]
    assert retrieval["kind"] == "copy" and retrieval["prompt_tokens"] == 64
    costs = pd.read_csv(tmp_path / "out" / "kv_budget" / "costs.csv")
    assert (costs[costs.kv_heads < 4].retrieval_increase != 0).any()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--kv-heads", "2", "--retrieval-weight", "1"), "--retrieval-weight weighs per-layer costs"),
        (("--kv-budget", "0.5", "--retrieval-weight", "-1"), "--retrieval-weight"),
        (
            ("--kv-budget", "0.5", "--retrieval-weight", "1", "--retrieval-len", "100000"),
            "--retrieval-len 100000 must be in",
        ),
        (("--kv-budget", "0.5", "--retrieval-kind", "copy"), "add --retrieval-weight W"),
        (("--kv-budget", "0.5", "--retrieval-weight", "1", "--retrieval-kind", "echo"), "--retrieval-kind"),
    ],
)
def test_cli_retrieval_weight_refusals(tmp_path, capsys, extra, message):
    code, out, err = run_cli(_command(tmp_path, *extra), capsys)
    assert code == 2 and message in err and not (tmp_path / "out").exists()
    assert "Traceback" not in err


def test_weighted_costs_add_the_weighted_retrieval_increase_or_drop_the_cost():
    frame = pd.DataFrame({"layer": [0, 0], "kv_heads": [4, 1], "loss_increase": [0.0, 0.25],
                          "retrieval_increase": [0.0, 0.5], "cost": [0.0, 99.0]})  # fmt: skip
    assert list(B.weighted_costs(frame, 3.0).cost) == [0.0, 0.25 + 3.0 * 0.5]
    assert "cost" not in B.weighted_costs(frame, 0.0)
    assert list(frame.cost) == [0.0, 99.0]  # the measured table is not edited


def test_ladder_budget_rows_place_each_weight_from_one_measurement(tmp_path):
    from headlab.kv.ladder import budget_rows

    loaded = load_model(str(_long_tiny(tmp_path)), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="eval", max_tokens=128, seq_len=32).resolved()
    before = _logits(loaded)
    rows = budget_rows(loaded, (0.5,), text, 128, "mean", progress=False, search_tokens=128,
                       retrieval_weights=(0.0, 50.0), retrieval_len=768)  # fmt: skip
    assert torch.equal(_logits(loaded), before)
    assert list(rows.variant) == ["budget 0.5", "budget 0.5 retrieval x50"] and list(rows.retrieval_weight) == [0, 50]
    search = text.but(split="calibration", max_tokens=128, batch_size=4).batches(loaded.tokenizer)
    haystack = split_text(text.corpus, "calibration").text
    spec = B.BudgetSpec(1.0, search_tokens=128, retrieval_weight=50.0, retrieval_len=768)
    costs = B.layer_costs(loaded, spec, None, search, progress=False, retrieval_text=haystack)
    for row in rows.itertuples():
        counts = B.allocation(loaded, B.weighted_costs(costs, row.retrieval_weight), row.budget)
        assert row.kv_heads_per_layer == ",".join(map(str, counts))
        fresh = load_model(str(tmp_path / "src"), device="cpu")
        B.apply_counts(fresh, counts, B.BudgetSpec(row.budget), None)
        assert row.perplexity == pytest.approx(perplexity_of(fresh, text), rel=1e-6)


def perplexity_of(loaded, text) -> float:
    from headlab.measure.evaluate import perplexity

    return perplexity(loaded, text=text, progress=False).perplexity


def _sweep_command(tmp_path, *extra):
    return ["gqa-sweep", "--model", tmp_path / "src", "--data", tmp_path / "t.txt", "--max-tokens", "128",
            "--seq-len", "32", "--calibration-tokens", "128", "--kv-heads", "4,1", "--pool", "mean",
            "--grouping", "contiguous", "--out", tmp_path / "sweep", *extra]  # fmt: skip


def test_cli_gqa_sweep_retrieval_weights(tmp_path, capsys):
    _long_tiny(tmp_path)
    extra = ("--kv-budgets", "0.5", "--retrieval-weights", "0,1", "--retrieval-len", "768")
    code, out, err = run_cli(_sweep_command(tmp_path, *extra), capsys)
    assert code == 0, err
    assert "budget 0.5 retrieval x1" in out
    frame = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    budget = frame[frame.action == "kv-budget"]
    assert list(budget.retrieval_weight) == [0, 1]
    meta = json.loads((tmp_path / "sweep" / "meta.json").read_text())
    assert meta["kv_budgets"]["retrieval_weights"] == [0, 1]
    assert meta["kv_budgets"]["retrieval_prompts"]["tokens"] == 768


def test_cli_gqa_sweep_copy_retrieval_kind(tmp_path, capsys):
    """--retrieval-kind copy places the budget row by the copy cost: its layout is the allocation from layer costs
    measured with copy prompts (the same costs convert-gqa --retrieval-kind copy measures)."""
    _long_tiny(tmp_path)
    extra = ("--kv-budgets", "0.5", "--retrieval-weights", "1", "--retrieval-kind", "copy", "--retrieval-len", "64")
    code, out, err = run_cli(_sweep_command(tmp_path, *extra), capsys)
    assert code == 0, err
    assert "budget 0.5 copy x1" in out
    frame = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    row = frame[frame.action == "kv-budget"].iloc[0]
    assert row.retrieval_kind == "copy" and row.retrieval_weight == 1
    meta = json.loads((tmp_path / "sweep" / "meta.json").read_text())
    assert meta["kv_budgets"]["retrieval_prompts"] == {"kind": "copy", "tokens": 64, "prompts": 6,
                                                       "haystack": "random tokens"}  # fmt: skip
    loaded = load_model(str(tmp_path / "src"), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=1024, seq_len=32, batch_size=4)
    search = text.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    spec = B.BudgetSpec(1.0, retrieval_weight=1.0, retrieval_len=64, retrieval_kind="copy")
    costs = B.layer_costs(loaded, spec, None, search, progress=False)
    assert row.kv_heads_per_layer == ",".join(map(str, B.allocation(loaded, B.weighted_costs(costs, 1.0), 0.5)))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--retrieval-weights", "1"), "--retrieval-weights weighs the per-layer costs of --kv-budgets"),
        (("--kv-budgets", "0.5", "--retrieval-kind", "copy"), "--retrieval-kind picks what --retrieval-weights"),
        (("--kv-budgets", "0.5", "--retrieval-weights", "1", "--retrieval-kind", "echo"), "Invalid value"),
        (
            ("--kv-budgets", "0.5", "--retrieval-weights", "1", "--retrieval-kind", "copy", "--retrieval-len", "2"),
            "--retrieval-len 2",
        ),
        (("--kv-budgets", "0.5", "--retrieval-weights", "1,-2"), "--retrieval-weights -2.0 must be"),
        (("--kv-budgets", "0.5", "--retrieval-weights", "x"), "--retrieval-weights: cannot read"),
        (("--kv-budgets", "0.5", "--retrieval-len", "768"), "add --retrieval-weights"),
        (
            ("--kv-budgets", "0.5", "--retrieval-weights", "1", "--retrieval-len", "100000"),
            "--retrieval-len 100000 must be in",
        ),
    ],
)
def test_cli_gqa_sweep_retrieval_weight_refusals(tmp_path, capsys, extra, message):
    _command(tmp_path)  # writes the tiny model and text
    code, out, err = run_cli(_sweep_command(tmp_path, *extra), capsys)
    assert code == 2 and message in err and not (tmp_path / "sweep").exists()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- refinement of the layout on the measured objective (refine_rounds) -----------------------------------------


def _layout_objective(src, layout, spec, search, haystack=None) -> float:
    """J of `layout` measured the slow way: a fresh model converted by apply_counts, its mean calibration NLL plus
    w x its mean retrieval-answer NLL."""
    fresh = load_model(str(src), device="cpu")
    B.apply_counts(fresh, layout, spec, None, progress=False)
    text_nll = B._mean_nll(fresh, scoring_batches(fresh, search))
    if not spec.retrieval_weight:
        return text_nll
    return text_nll + spec.retrieval_weight * B._mean_nll(fresh, B.retrieval_scoring(fresh, spec, haystack))


@pytest.mark.parametrize("weight", [0.0, 2.0])
def test_refinement_never_raises_the_measured_objective(tmp_path, weight):
    src = _long_tiny(tmp_path)
    loaded = load_model(str(src), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), split="calibration", max_tokens=128, seq_len=32).resolved()
    search = text.batches(loaded.tokenizer)
    haystack = split_text(text.corpus, "calibration").text
    spec = B.BudgetSpec(0.5, search_tokens=128, refine_rounds=3, retrieval_weight=weight, retrieval_len=768,
                        retrieval_prompts=2)  # fmt: skip
    costs = B.layer_costs(loaded, spec, None, search, progress=False, retrieval_text=haystack)
    start = B.allocation(loaded, costs, 0.5)
    before = _logits(loaded)
    counts, rounds = B.refine_counts(loaded, spec, start, None, search, progress=False, retrieval_text=haystack)
    assert torch.equal(_logits(loaded), before)  # the model is left as it came
    assert sum(counts) * 16 <= 0.5 * 3 * 4 * 16 and 1 <= len(rounds) <= 3
    assert rounds[0]["objective_before"] == pytest.approx(_layout_objective(src, start, spec, search, haystack))
    for record in rounds:
        assert record["objective_proposed"] == pytest.approx(
            _layout_objective(src, record["proposed"], spec, search, haystack), abs=1e-5
        )
        assert record["kept"] == (record["objective_proposed"] < record["objective_before"])
    assert _layout_objective(src, counts, spec, search, haystack) <= rounds[0]["objective_before"] + 1e-6
    assert all(record["kept"] for record in rounds[:-1])  # the search stops at the first proposal it does not keep


def test_cli_refine_rounds_records_the_rounds_and_saves_the_refined_layout(tmp_path, capsys):
    code, out, err = run_cli(_command(tmp_path, "--kv-budget", "0.5", "--refine-rounds", "2", "--json"), capsys)
    assert code == 0, err
    conversion = json.loads(out)["conversion"]
    refinement = conversion["refinement"]
    assert 1 <= len(refinement["rounds"]) <= 2
    kept = [r["proposed"] for r in refinement["rounds"] if r["kept"]]
    assert conversion["kv_heads_per_layer"] == (kept[-1] if kept else refinement["additive_allocation"])
    saved = load_model(str(tmp_path / "out"), device="cpu")
    assert [layer.num_kv_heads for layer in saved.layers] == conversion["kv_heads_per_layer"]
    costs = pd.read_csv(tmp_path / "out" / "kv_budget" / "costs.csv")
    assert list(costs[costs.chosen].sort_values("layer").kv_heads) == conversion["kv_heads_per_layer"]


def test_cli_refine_rounds_needs_a_budget(tmp_path, capsys):
    code, out, err = run_cli(_command(tmp_path, "--kv-heads", "2", "--refine-rounds", "1"), capsys)
    assert code == 2 and "--refine-rounds refines a per-layer layout" in err and not (tmp_path / "out").exists()


def test_describe_rounds_reads_each_round():
    rounds = [{"round": 1, "objective_before": 3.99288, "proposed": [1], "objective_proposed": 3.86206, "kept": True},
              {"round": 2, "objective_before": 3.86206, "proposed": [1], "objective_proposed": 3.9, "kept": False}]  # fmt: skip
    assert B.describe_rounds(rounds) == "round 1: 3.9929 -> 3.8621 kept; round 2: 3.8621 -> 3.9000 not kept"


def test_cli_gqa_sweep_refine_rounds(tmp_path, capsys):
    """Each budget row is refined on the whole layout's measured cost, exactly as refine_counts refines it, and says
    how the rounds went; without --kv-budgets the option is refused before loading."""
    _command(tmp_path)  # writes the tiny model and text
    code, out, err = run_cli(_sweep_command(tmp_path, "--kv-budgets", "0.5", "--refine-rounds", "2"), capsys)
    assert code == 0, err
    frame = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    row = frame[frame.action == "kv-budget"].iloc[0]
    assert row.refinement.startswith("round 1: ") and 0 <= row.rounds_kept <= 2
    loaded = load_model(str(tmp_path / "src"), device="cpu")
    text = TextSpec(data=str(tmp_path / "t.txt"), max_tokens=128, seq_len=32, batch_size=4)
    calibration = text.but(split="calibration", batch_size=4)
    merge = None  # mean pooling: no calibrated merge
    search = calibration.but(max_tokens=1024).batches(loaded.tokenizer, max_positions=loaded.max_positions)
    spec = B.BudgetSpec(0.5, refine_rounds=2)
    counts = B.allocation(loaded, B.layer_costs(loaded, spec, merge, search, progress=False), 0.5)
    refined, rounds = B.refine_counts(loaded, spec, counts, merge, search, progress=False)
    assert row.kv_heads_per_layer == ",".join(map(str, refined))
    assert row.refinement == B.describe_rounds(rounds)
    meta = json.loads((tmp_path / "sweep" / "meta.json").read_text())
    assert meta["kv_budgets"]["refine_rounds"] == 2
    code, out, err = run_cli(_sweep_command(tmp_path, "--refine-rounds", "1", "--out", tmp_path / "bad"), capsys)
    assert code == 2 and "add --kv-budgets" in err and not (tmp_path / "bad").exists()
