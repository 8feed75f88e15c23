"""KV-head conversion: pooling, expansion, similarity grouping and the head permutation, on tiny models of every
GQA-capable architecture, checked against hand-built cases and slow, obvious implementations."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from models import GQA_TYPES, HYBRID_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, parity_generate, run_cli, save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM

from headlab.core.arch import HeadWeights
from headlab.core.checkpoint import save_checkpoint
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import gqa
from headlab.kv import grouping as kv_grouping
from headlab.measure import costs, longctx
from headlab.measure.costs import model_info

NO_GQA = ["gpt2", "gpt_neox", "opt", "bert", "roberta"]


def logits(model, name, **kw):
    with torch.no_grad():
        return model(**tiny_inputs(name, **kw)).logits


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- pooling and expansion -------------------------------------------------------------------------------------


def test_pool_weights_by_hand():
    # 4 KV heads of D=1, C=1 holding 1, 2, 3, 10: mean pooling to 2 gives 1.5 and 6.5; first gives 1 and 3.
    k = torch.tensor([1.0, 2.0, 3.0, 10.0]).view(4, 1, 1)
    w = HeadWeights(q=torch.zeros(8, 1, 1), k=k, v=-k, o=torch.zeros(1, 8, 1), k_bias=k.view(4, 1))
    mean = kv_grouping.pool_weights(w, 2, "mean")
    assert mean.k.flatten().tolist() == [1.5, 6.5] and mean.v.flatten().tolist() == [-1.5, -6.5]
    assert mean.k_bias.flatten().tolist() == [1.5, 6.5]
    assert kv_grouping.pool_weights(w, 2, "first").k.flatten().tolist() == [1.0, 3.0]
    assert torch.equal(mean.q, w.q) and torch.equal(mean.o, w.o)  # query and output untouched


def test_random_pool_is_seeded_and_scaled():
    torch.manual_seed(0)
    k = torch.cat([torch.randn(2, 16, 64) * 0.1, torch.randn(2, 16, 64) * 2.0])  # group stds 0.1 and 2
    w = HeadWeights(q=torch.zeros(4, 16, 64), k=k, v=k.clone(), o=torch.zeros(64, 4, 16))
    a, b = kv_grouping.pool_weights(w, 2, "random", seed=3), kv_grouping.pool_weights(w, 2, "random", seed=3)
    assert torch.equal(a.k, b.k) and not torch.equal(a.k, kv_grouping.pool_weights(w, 2, "random", seed=4).k)
    assert a.k[0].std() == pytest.approx(0.1, rel=0.1) and a.k[1].std() == pytest.approx(2.0, rel=0.1)
    assert not torch.allclose(a.k[0], k[0])


@pytest.mark.parametrize("name", GQA_TYPES)
@pytest.mark.parametrize("pool", kv_grouping.POOLS)
def test_current_kv_heads_reproduce_the_logits(name, pool):
    model = tiny_model(name)
    before = logits(model, name)
    conversion = gqa.convert(from_model(model), 2, pool=pool)
    assert conversion.action == "keep"
    assert torch.equal(logits(model, name), before)


@pytest.mark.parametrize("name", GQA_TYPES)
def test_expand_is_lossless_and_pooling_back_is_exact(name):
    model = tiny_model(name)
    original, before = state(model), logits(model, name)
    loaded = from_model(model)
    gqa.convert(loaded, 4)  # H = 4: MHA
    assert [layer.num_kv_heads for layer in loaded.layers] == [4] * len(loaded.layers)
    assert model.config.get_text_config().num_key_value_heads == 4
    torch.testing.assert_close(logits(model, name), before, rtol=0, atol=1e-5)
    gqa.convert(loaded, 2, pool="mean", grouping="contiguous")
    after = state(model)
    assert after.keys() == original.keys()
    assert all(torch.equal(after[k], original[k]) for k in original)
    assert torch.equal(logits(model, name), before)


def test_mean_pooling_matches_an_obvious_loop():
    """MHA llama, 4 -> 2: KV head g of the result is the average of heads 2g and 2g+1, read straight from k_proj."""
    model = tiny_model("llama_mha")
    old_k = [blk.self_attn.k_proj.weight.detach().clone().view(4, 16, 64) for blk in model.model.layers]
    old_v = [blk.self_attn.v_proj.weight.detach().clone().view(4, 16, 64) for blk in model.model.layers]
    gqa.convert(from_model(model), 2)
    for blk, k, v in zip(model.model.layers, old_k, old_v):
        new_k, new_v = blk.self_attn.k_proj.weight.view(2, 16, 64), blk.self_attn.v_proj.weight.view(2, 16, 64)
        for g in range(2):
            torch.testing.assert_close(new_k[g], (k[2 * g] + k[2 * g + 1]) / 2, rtol=0, atol=1e-7)
            torch.testing.assert_close(new_v[g], (v[2 * g] + v[2 * g + 1]) / 2, rtol=0, atol=1e-7)
        assert blk.self_attn.num_key_value_groups == 2


@pytest.mark.parametrize("name", HYBRID_TYPES)
def test_hybrids_convert_softmax_layers_only(name):
    model = tiny_model(name)
    linear = {k: v for k, v in state(model).items() if "linear_attn" in k}
    assert linear
    gqa.convert(from_model(model), 1)
    after = state(model)
    assert all(torch.equal(after[k], v) for k, v in linear.items())
    assert torch.isfinite(logits(model, name)).all()


# ---- permutation and grouping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GQA_TYPES + ["llama_mha", "qwen3_mha", "phi3_mha"])
def test_query_permutation_leaves_the_function_unchanged(name):
    model = tiny_model(name)
    before = logits(model, name)
    loaded = from_model(model)
    G = loaded.layers[0].num_kv_heads
    generator = torch.Generator().manual_seed(5)
    orders = [torch.randperm(G, generator=generator).tolist() for _ in loaded.layers]
    if all(order == list(range(G)) for order in orders):
        orders[0] = list(reversed(range(G)))
    heads_before = [loaded.adapter.read(layer) for layer in loaded.layers]
    kv_grouping.permute_heads(loaded, orders)
    moved = loaded.adapter.read(loaded.layers[0])
    assert not torch.equal(moved.k, heads_before[0].k) or orders[0] == list(range(G))
    torch.testing.assert_close(logits(model, name), before, rtol=1e-5, atol=1e-5)


def brute_best_score(similarity, m):
    """Slow and obvious: every ordering of the heads, cut into consecutive groups of m."""
    n = similarity.shape[0]
    return max(
        kv_grouping.partition_score(similarity, [order[i : i + m] for i in range(0, n, m)])
        for order in itertools.permutations(range(n))
    )


@pytest.mark.parametrize("n, m, seed", [(6, 2, 0), (6, 3, 1), (4, 2, 2), (6, 2, 3)])
def test_exact_search_finds_the_best_partition(n, m, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=generator)
    similarity = (a + a.T) / 2
    groups, method = kv_grouping.best_groups(similarity, n // m)
    assert method == "exact"
    assert sorted(i for g in groups for i in g) == list(range(n)) and {len(g) for g in groups} == {m}
    assert kv_grouping.partition_score(similarity, groups) == pytest.approx(brute_best_score(similarity, m))
    assert kv_grouping.partition_count(n, m) == len(list(kv_grouping._partitions(tuple(range(n)), m)))


def planted_similarity(groups, n, seed=0):
    """High similarity inside the planted groups, low and noisy elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    s = 0.1 * torch.rand(n, n, generator=generator)
    for g in groups:
        for i, j in itertools.product(g, g):
            s[i, j] = 0.9
    return (s + s.T) / 2


def test_greedy_search_recovers_a_planted_grouping_beyond_the_exact_limit():
    n, m = 16, 4
    assert kv_grouping.partition_count(n, m) > kv_grouping.EXACT_SEARCH_LIMIT
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    planted = kv_grouping.canonical([order[i : i + m] for i in range(0, n, m)])
    groups, method = kv_grouping.best_groups(planted_similarity(planted, n), n // m)
    assert method == "greedy" and groups == planted


def plant_kv_copies(model, planted, noise=0.05, seed=0):
    """Make each planted group's KV heads copies of one random head plus noise of `noise` x its std (tiny llama)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in model.model.layers:
            attn = blk.self_attn
            D = attn.head_dim
            for proj in (attn.k_proj, attn.v_proj):
                w = proj.weight.view(-1, D, proj.in_features)  # [G, D, C]
                for g in planted:
                    base = w[g[0]].clone()
                    for head in g:
                        w[head] = base + noise * base.std() * torch.randn(base.shape, generator=generator)


def test_similarity_grouping_recovers_a_planted_grouping_and_pools_it():
    H = 8
    model = tiny_model("llama", num_attention_heads=H, num_key_value_heads=H, head_dim=8)
    planted = [[0, 5], [1, 3], [2, 7], [4, 6]]
    plant_kv_copies(model, planted)
    batches = [(x["input_ids"], x["attention_mask"]) for x in (tiny_inputs("llama", 4, 16, seed=s) for s in range(3))]
    loaded = from_model(model)
    similarity = kv_grouping.kv_similarity(loaded, batches, progress=False)
    assert similarity["tokens"] == 3 * 4 * 16
    assert similarity["similarity"].shape == (2, H, H)
    torch.testing.assert_close(
        similarity["key"].diagonal(dim1=1, dim2=2), torch.ones(2, H, dtype=torch.float64), atol=1e-5, rtol=0
    )
    groups, _ = gqa.plan_groups(loaded, 4, "similarity", similarity)
    assert groups == [planted, planted]

    before = logits(model, "llama")
    contiguous = tiny_model("llama", num_attention_heads=H, num_key_value_heads=H, head_dim=8)
    plant_kv_copies(contiguous, planted)
    gqa.convert(from_model(contiguous), 4, grouping="contiguous")
    conversion = gqa.convert(loaded, 4, grouping="similarity", similarity=similarity)
    assert conversion.permuted_layers == 2 and conversion.groups == [planted, planted]
    near = (logits(model, "llama") - before).abs().max()
    far = (logits(contiguous, "llama") - before).abs().max()
    assert near < far / 5  # pooling near-copies barely changes the model; pooling unrelated heads does


def test_kv_similarity_matches_a_direct_computation():
    """Cosines from hooked inputs equal cosines of k_proj / v_proj outputs computed by hand, padding excluded."""
    model = tiny_model("qwen2")  # biases on k and v
    x = tiny_inputs("qwen2", 2, 8)
    x["attention_mask"][1, 5:] = 0
    result = kv_grouping.kv_similarity(from_model(model), [(x["input_ids"], x["attention_mask"])], progress=False)
    captured = {}
    handles = [
        blk.self_attn.register_forward_pre_hook(
            lambda mod, args, kw, i=i: captured.__setitem__(i, kw["hidden_states"]), with_kwargs=True
        )
        for i, blk in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(**x)
    for h in handles:
        h.remove()
    valid = x["attention_mask"].bool()
    for i, blk in enumerate(model.model.layers):
        h = captured[i][valid]  # [N, C]
        for kind, proj in (("key", blk.self_attn.k_proj), ("value", blk.self_attn.v_proj)):
            out = proj(h).view(len(h), 2, 16)
            expect = torch.zeros(2, 2, dtype=torch.float64)
            for a, b in itertools.product(range(2), range(2)):
                expect[a, b] = torch.nn.functional.cosine_similarity(out[:, a], out[:, b], dim=-1).double().mean()
            torch.testing.assert_close(result[kind][i], expect, rtol=1e-5, atol=1e-6)


# ---- checkpoints and the KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GQA_TYPES)
def test_vanilla_reload_of_a_converted_model(name, tmp_path):
    model = tiny_model(name)
    loaded = from_model(model)
    gqa.convert(loaded, 1, pool="mean")
    expected = logits(model, name)
    check = save_checkpoint(model, None, tmp_path / "mqa", meta={"kv": 1})
    assert check.max_abs_diff <= 1e-4
    config = json.loads((tmp_path / "mqa" / "config.json").read_text())
    assert (config.get("text_config") or config)["num_key_value_heads"] == 1
    if "text_config" not in config:  # plain causal LMs: exactly what a user would type
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa", attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded, name), expected, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "mqa" / "headlab.json").read_text())["kv"] == 1


@pytest.mark.parametrize("name", GQA_TYPES)
def test_measured_kv_cache_shrinks_by_the_expected_factor(name):
    loaded = from_model(tiny_model(name))
    before = gqa.measured_kv_bytes_per_token(loaded)
    gqa.convert(loaded, 1)
    after = gqa.measured_kv_bytes_per_token(loaded)
    assert before == 2 * after
    assert after == costs.kv_bytes_per_token(loaded)


def real_cache_bytes_per_token(model, tokens):
    """Bytes of every key and value tensor in the cache a forward with use_cache=True returns, per token."""
    ids = torch.randint(10, 100, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if torch.is_tensor(tensor):  # linear-attention layers of hybrids hold none
                total += tensor.numel() * tensor.element_size()
    return total / tokens


# 3 tokens: below every tiny sliding window (4), so sliding layers still hold every token.
@pytest.mark.parametrize("name", ["llama", "llama_mha", "mistral", "gemma3_text", "phi3", "qwen3_next", "qwen3_5_text"])
def test_info_kv_bytes_match_a_real_cache(name):
    model = tiny_model(name)
    info = model_info(from_model(model))
    assert info["kv_bytes_per_token"] == real_cache_bytes_per_token(model, 3)
    assert gqa.measured_kv_bytes_per_token(from_model(model), tokens=12) == info["kv_bytes_per_token"]


# ---- errors --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NO_GQA)
def test_architectures_without_kv_heads_get_a_clear_error(name):
    with pytest.raises(HeadlabError, match="supports_gqa=False"):
        gqa.convert(from_model(tiny_model(name)), 1)


@pytest.mark.parametrize(
    "H, G, target, message",
    [
        (12, 6, 4, "does not divide"),
        (4, 2, 3, "not reachable"),
        (4, 2, 0, "at least 1"),
        (4, 2, 8, "not reachable"),
        (6, 2, 4, "not reachable"),
    ],
)
def test_bad_targets(H, G, target, message):
    with pytest.raises(HeadlabError, match=message):
        kv_grouping.check_kv_heads(H, G, target)


def test_check_kv_heads_actions():
    assert [kv_grouping.check_kv_heads(12, 3, g) for g in (1, 3, 6, 12)] == ["pool", "keep", "expand", "expand"]


@pytest.fixture
def tiny_checkpoint(tmp_path):
    return save_tiny("llama", tmp_path / "src")


def _digest(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-heads", "3"], "not reachable"),
        (["--kv-heads", "4"], "use `headlab expand-kv`"),
        (["--kv-heads", "0"], "at least 1"),
    ],
)
def test_cli_bad_kv_heads(args, message, tiny_checkpoint, tmp_path, capsys):
    source = _digest(tiny_checkpoint)
    code, out, err = run_cli(["convert-gqa", "--model", tiny_checkpoint, "--out", tmp_path / "out", *args], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert _digest(tiny_checkpoint) == source
    assert message in err


def test_cli_refuses_existing_output_and_the_source(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, _, err = run_cli(
        ["convert-gqa", "--model", tiny_checkpoint, "--kv-heads", "1", "--out", tmp_path / "out"], capsys
    )
    assert code == 2 and "--overwrite" in err and not any((tmp_path / "out").iterdir())
    source = _digest(tiny_checkpoint)
    args = ["convert-gqa", "--model", tiny_checkpoint, "--kv-heads", "1", "--out", tiny_checkpoint, "--overwrite"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "source" in err and _digest(tiny_checkpoint) == source


def test_cli_without_kv_head_support(tmp_path, capsys):
    source = save_tiny("gpt2", tmp_path / "gpt2")
    code, _, err = run_cli(["convert-gqa", "--model", source, "--kv-heads", "1", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "supports_gqa=False" in err and not (tmp_path / "o").exists()


def test_cli_expand_then_convert_round_trip(tiny_checkpoint, tmp_path, capsys):
    """expand-kv then convert-gqa through the CLI on a tiny checkpoint: the weights come back bit for bit."""
    from safetensors.torch import load_file

    common = ["--no-eval", "--json"]
    code, out, err = run_cli(["expand-kv", "--model", tiny_checkpoint, "--out", tmp_path / "mha", *common], capsys)
    assert code == 0, err
    assert (
        json.loads(out)["measured_kv_bytes_per_token_after"]
        == 2 * json.loads(out)["measured_kv_bytes_per_token_before"]
    )
    code, out, err = run_cli(
        ["convert-gqa", "--model", tmp_path / "mha", "--kv-heads", "2", "--out", tmp_path / "back", *common], capsys
    )
    assert code == 0, err
    original = load_file(tiny_checkpoint / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_cli_sweep_writes_table_and_plot(tiny_checkpoint, tmp_path, capsys):
    """A sweep on a tiny checkpoint with a tiny text corpus: every variant has a row, numbers are consistent."""
    from tiny_text import SAMPLE_TEXT

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    args = ["gqa-sweep", "--model", tiny_checkpoint, "--data", corpus, "--seq-len", "32", "--max-tokens", "128"]
    code, out, err = run_cli([*args, "--calibration-tokens", "128", "--out", tmp_path / "sweep"], capsys)
    assert code == 0, err
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "sweep" / "sweep.parquet")
    assert sorted(frame["kv_heads"].unique().tolist()) == [1, 2, 4]
    assert (frame["kv_bytes_per_token"] == frame["kv_bytes_per_token_formula"]).all()
    by_g = frame.groupby("kv_heads")["kv_bytes_per_token"].first()
    assert by_g[4] == 2 * by_g[2] == 4 * by_g[1]
    # Expanding is lossless: the MHA row's perplexity equals the unchanged model's.
    ppl = frame.set_index("variant")["perplexity"]
    assert ppl["4/expand/-"] == pytest.approx(ppl["2/keep/-"], rel=1e-5)
    # One group: every grouping gives the same partition, so similarity rows reuse the contiguous ones.
    assert set(frame.loc[frame["grouping"] == "similarity", "same_as"]) == {
        "1/contiguous/mean",
        "1/contiguous/first",
        "1/contiguous/random",
    }
    assert (tmp_path / "sweep" / "gqa_sweep.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "sweep" / "meta.json").read_text())["kv_heads"] == 2


def test_cli_sweep_resumes_after_a_failed_variant(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A variant that fails keeps the variants before it in OUT.partial; the same command again converts and measures
    only the rest (the MLA rung too) and writes the table of an uninterrupted run (timings aside)."""
    import pandas as pd
    from tiny_text import SAMPLE_TEXT

    from headlab.kv import gqa as gqa_module

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    args = ["gqa-sweep", "--model", tiny_checkpoint, "--data", corpus, "--seq-len", "32", "--max-tokens", "128"]
    args += ["--calibration-tokens", "128", "--pool", "mean,first", "--mla", "gqa"]
    measured, fail = [], False
    real = gqa_module._variant_numbers

    def numbers(loaded, text, conversion):
        measured.append(conversion.action)
        if fail and len(measured) == 3:
            raise HeadlabError("out of luck")
        return real(loaded, text, conversion)

    monkeypatch.setattr(gqa_module, "_variant_numbers", numbers)
    code, _, err = run_cli([*args, "--out", tmp_path / "whole"], capsys)
    assert code == 0, err
    variants, fail, measured[:] = len(measured), True, []
    out = tmp_path / "resumed"
    code, _, err = run_cli([*args, "--out", out], capsys)
    assert code == 2 and "out of luck" in err and f"are kept in {out}.partial" in err and not out.exists()
    fail, measured[:] = False, []
    code, _, err = run_cli([*args, "--out", out], capsys)
    assert code == 0, err
    assert variants > 3 and len(measured) == variants - 2  # the two variants measured before the failure are kept
    whole, resumed = pd.read_csv(tmp_path / "whole" / "sweep.csv"), pd.read_csv(out / "sweep.csv")
    pd.testing.assert_frame_equal(whole, resumed)
    assert not (tmp_path / "resumed.partial").exists()


def test_sweep_long_context_columns_measure_each_variant(tmp_path, monkeypatch):
    """gqa_sweep's long_context columns: the unchanged (keep) row is passkey retrieval of the model itself, a pooled
    row that of the pooled model, a reused row copies them (decoding stood in for by a model-dependent answer)."""
    from headlab.measure.long_tasks import TRADE_DEPTHS, TRADE_SAMPLES
    from headlab.mechanisms.restore import restoring

    monkeypatch.setattr(longctx, "transformers_generate", parity_generate)
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama", max_position_embeddings=512), tiny_tokenizer(), spec="llama")
    common = dict(data=corpus, seq_len=32, max_tokens=64, calibration_tokens=128, progress=False)
    frame, meta = gqa.gqa_sweep(loaded, [2, 1], pools=("mean",), long_context=(300,), **common)
    rows = frame.set_index("variant")
    assert rows["passkey_300"].between(0, 1).all() and set(rows["passkey_prompts"]) == {6}
    assert meta["long_context"]["lengths"] == [300] and meta["long_context"]["task"] == "passkey"

    def direct():
        return longctx.long_context(loaded, data=corpus, split="eval", tasks=("passkey",), lengths=[300],
                                    depths=TRADE_DEPTHS, samples=TRADE_SAMPLES, position_sequences_count=0,
                                    progress=False).accuracy("passkey", 300)  # fmt: skip

    assert rows.loc["2/keep/-", "passkey_300"] == direct()
    with restoring(loaded):
        gqa.convert(loaded, 1, pool="mean")
        assert rows.loc["1/contiguous/mean", "passkey_300"] == direct()
    assert rows.loc["1/contiguous/mean", "passkey_300"] != rows.loc["2/keep/-", "passkey_300"]  # told apart
    assert rows.loc["1/similarity/mean", "same_as"] == "1/contiguous/mean"
    assert rows.loc["1/similarity/mean", "passkey_300"] == rows.loc["1/contiguous/mean", "passkey_300"]
    with pytest.raises(HeadlabError, match="exceeds the model's maximum positions"):
        gqa.gqa_sweep(loaded, [1], long_context=(600,), **common)


def test_cli_sweep_long_context_writes_passkey_columns(tmp_path, capsys):
    """gqa-sweep --long-context decodes for real on every variant and prints and writes its passkey columns."""
    import pandas as pd

    source = save_tiny("llama", tmp_path / "src", max_position_embeddings=512)
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    args = ["gqa-sweep", "--model", source, "--data", corpus, "--seq-len", "32", "--max-tokens", "64", "--kv-heads",
            "2,1", "--pool", "mean", "--grouping", "contiguous", "--calibration-tokens", "128", "--long-context", "300"]  # fmt: skip
    code, out, err = run_cli([*args, "--out", tmp_path / "sweep"], capsys)
    assert code == 0, err
    frame = pd.read_csv(tmp_path / "sweep" / "sweep.csv")
    assert frame["variant"].tolist() == ["2/keep/-", "1/contiguous/mean"]
    assert frame["passkey_300"].between(0, 1).all() and set(frame["passkey_prompts"]) == {6}
    assert frame["copy_300"].between(0, 1).all()
    assert "passkey@300" in out
    assert json.loads((tmp_path / "sweep" / "meta.json").read_text())["long_context"]["lengths"] == [300]


# ---- the embedded model ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_mqa_checkpoint_evaluates_to_the_printed_perplexity(tmp_path):
    from transformers import AutoTokenizer

    from headlab.core.loading import load_model
    from headlab.measure.evaluate import perplexity

    loaded = load_model(None, device="cpu")
    record = gqa.convert_checkpoint(loaded, 1, tmp_path / "mqa", max_tokens=256, seq_len=128, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa", dtype=torch.float32)
    assert model.config.num_key_value_heads == 1
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "mqa")
    again = perplexity(from_model(model, tokenizer), max_tokens=256, seq_len=128, progress=False)
    assert again.perplexity == pytest.approx(record["perplexity_after"]["perplexity"], rel=1e-5)
    assert record["measured_kv_bytes_per_token_after"] * 3 == record["measured_kv_bytes_per_token_before"]
