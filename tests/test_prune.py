"""Head pruning: selection by hand-checked rules, mask == gates, physical == mask, checkpoints that load back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from models import ALL_TYPES, ENCODER_TYPES, GQA_TYPES, MHA_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.arch import adapter_for
from headlab.core.checkpoint import _auto_class_for
from headlab.core.errors import HeadlabError
from headlab.core.layout import HEAD_LAYOUT_KEY
from headlab.core.loading import from_model, load_model
from headlab.mechanisms.gates import head_gates, read_mask
from headlab.pruning import prune as P
from headlab.pruning import scores as S


def _loaded(name, **overrides):
    model = tiny_model(name, **overrides)
    return from_model(model, tiny_tokenizer(encoder=name in ENCODER_TYPES), spec=name)


def _logits(model, name):
    with torch.no_grad():
        return model(**tiny_inputs(name)).logits


def _gated(loaded, pruned, name):
    with head_gates(loaded, P.gates_from_pruned(loaded.layers, pruned)):
        return _logits(loaded.model, name)


def _mixed(layers):
    """Layer 0 loses head 1 (GQA: groups of unequal size afterwards); later layers keep head 1 only."""
    return [{1} if layer.index == 0 else {0, 2, 3} for layer in layers]


# ---- selection ----------------------------------------------------------------------------------------------------


class _Layer:
    """A stand-in AttentionLayer for selection tests (selection needs only counts)."""

    def __init__(self, index, H, G):
        self.index, self.num_heads, self.num_kv_heads = index, H, G

    group_size = property(lambda self: self.num_heads // self.num_kv_heads)

    def kv_head_of(self, h):
        return h // self.group_size


def _scores(rows):
    return [torch.tensor(r, dtype=torch.float64) for r in rows]


def test_global_selection_takes_lowest_and_keeps_one_head():
    layers = [_Layer(0, 3, 3), _Layer(1, 3, 3)]
    scores = _scores([[0.1, 0.2, 0.3], [0.9, 0.05, 0.8]])
    assert P.select_heads(layers, scores, count=2) == [{0}, {1}]
    # The 4 lowest are 0.05, 0.1, 0.2, 0.3; taking 0.3 would empty layer 0, so 0.8 comes instead.
    assert P.select_heads(layers, scores, count=4) == [{0, 1}, {1, 2}]
    assert P.select_heads(layers, scores, count=4, allow_empty_layer=True) == [{0, 1, 2}, {1}]
    assert P.select_heads(layers, scores, fraction=0.5) == [{0, 1}, {1}]  # round(0.5 * 6) = 3
    with pytest.raises(HeadlabError, match="keeping one head"):
        P.select_heads(layers, scores, count=5)


def test_per_layer_and_ties():
    layers = [_Layer(0, 4, 4), _Layer(1, 4, 4)]
    scores = _scores([[1, 1, 0, 1], [0.4, 0.3, 0.2, 0.1]])
    # per layer: round(0.5 * 4) = 2 each; ties broken by the lower head index.
    assert P.select_heads(layers, scores, fraction=0.5, per_layer=True) == [{2, 0}, {3, 2}]


def test_kv_group_unit_scores_groups_by_sum():
    layers = [_Layer(0, 4, 2), _Layer(1, 4, 2)]
    # group sums: layer 0: 0.2+0.9=1.1, 0.5+0.5=1.0; layer 1: 0.3+0.3=0.6, 2.0
    scores = _scores([[0.2, 0.9, 0.5, 0.5], [0.3, 0.3, 1.0, 1.0]])
    assert P.select_heads(layers, scores, count=1, unit="kv-group") == [set(), {0, 1}]
    assert P.select_heads(layers, scores, count=2, unit="kv-group") == [{2, 3}, {0, 1}]
    with pytest.raises(HeadlabError, match="nothing different"):
        P.select_heads([_Layer(0, 4, 4)], _scores([[1, 2, 3, 4]]), count=1, unit="kv-group")


def test_uniform_selection():
    layers = [_Layer(0, 6, 2), _Layer(1, 6, 2)]  # groups of 3
    scores = _scores([[3, 1, 2, 0, 5, 4], [0, 1, 2, 9, 8, 7]])
    # fraction 0.6 of a group of 3 -> 1.8 -> 2 per group, the two lowest of each group; 0.5 -> 1.5 -> 1 (halves down)
    assert P.select_heads(layers, scores, fraction=0.5, uniform=True) == [{1, 3}, {0, 5}]
    assert P.select_heads(layers, scores, fraction=0.6, uniform=True) == [{1, 2, 3, 5}, {0, 1, 4, 5}]
    assert P.select_heads(layers, scores, count=4, uniform=True) == [{1, 3}, {0, 5}]
    with pytest.raises(HeadlabError, match="multiple of 4"):
        P.select_heads(layers, scores, count=3, uniform=True)
    with pytest.raises(HeadlabError, match="removes 0"):
        P.select_heads(layers, scores, fraction=0.1, uniform=True)
    with pytest.raises(HeadlabError, match="kv-group"):
        P.select_heads(layers, scores, fraction=0.9, uniform=True)
    # whole groups: 1 of 2 per layer, the lower sum (layer 0: 6 vs 9; layer 1: 3 vs 24)
    assert P.select_heads(layers, scores, fraction=0.5, unit="kv-group", uniform=True) == [{0, 1, 2}, {0, 1, 2}]


def test_parse_heads_and_bad_specs():
    layers = [_Layer(0, 4, 2), _Layer(1, 4, 2)]
    assert P.parse_heads("0:1,3; 1:0", layers) == [{1, 3}, {0}]
    for bad, message in (("2:0", "layer 2"), ("0:4", "no head 4"), ("0-1", "cannot read"), (";", "no head")):
        with pytest.raises(HeadlabError, match=message):
            P.parse_heads(bad, layers)


def test_read_scores_checks_the_model(tmp_path):
    loaded = _loaded("llama")
    table = pd.DataFrame(
        [(layer.index, h, float(layer.index * 10 + h)) for layer in loaded.layers for h in range(4)],
        columns=["layer", "head", "score"],
    )
    table.to_csv(tmp_path / "s.csv", index=False)
    scores = S.read_scores(tmp_path / "s.csv", loaded.layers)
    assert scores[1].tolist() == [10.0, 11.0, 12.0, 13.0]
    with pytest.raises(HeadlabError, match="does not match the model"):
        S.read_scores(table[table["head"] < 3], loaded.layers)
    with pytest.raises(HeadlabError, match="needs columns"):
        S.read_scores(table.rename(columns={"score": "x"}), loaded.layers)


# ---- applying: mask == gates, physical == mask ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_TYPES)
def test_mask_and_physical_equal_gated_model(name):
    loaded = _loaded(name)
    pruned = _mixed(loaded.layers)
    reference = _gated(loaded, pruned, name)
    original = _logits(loaded.model, name)
    with P.pruned_in_place(loaded, pruned, "mask"):
        masked = _logits(loaded.model, name)
        assert [layer.num_heads for layer in loaded.layers] == [4] * len(loaded.layers)
    torch.testing.assert_close(masked, reference, atol=1e-5, rtol=0)
    with P.pruned_in_place(loaded, pruned, "physical") as layout:
        physical = _logits(loaded.model, name)
        assert [layer.num_heads for layer in loaded.layers] == [lay.num_heads for lay in layout]
    torch.testing.assert_close(_logits(loaded.model, name), original, atol=0, rtol=0)  # restored exactly
    if loaded.adapter.norm_spans_heads:  # OLMo2: q/k norms span heads, physical pruning is approximate
        assert P.layout_record(loaded.model.config, layout, loaded.adapter.norm_spans_heads)["approximate"]
        assert (physical - reference).abs().max() > 1e-4
    else:
        torch.testing.assert_close(physical, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", GQA_TYPES)
def test_gqa_layouts(name):
    loaded = _loaded(name)
    layers = loaded.layers
    # Whole KV group 0 in every layer: the KV head goes with its queries.
    groups = [{0, 1} for _ in layers]
    layout = P.physical_layout(layers, groups)
    assert all(lay.heads == [2, 3] and lay.kv_heads == [1] for lay in layout)
    # One query of group 0: groups of 1 and 2 queries -> head 1 stays as zero-output padding, no KV head is added.
    layout = P.physical_layout(layers, [{1} for _ in layers])
    assert all(lay.heads == [0, 1, 2, 3] and lay.kv_heads == [0, 1] and lay.padding == [1] for lay in layout)
    # Groups of 1 and 2 left of groups of 3 would need padding too; here {0, 3}: sizes 1 and 1, no padding.
    layout = P.physical_layout(layers, [{0, 3} for _ in layers])
    assert all(lay.heads == [1, 2] and lay.kv_heads == [0, 1] and lay.padding == [] for lay in layout)
    if loaded.adapter.norm_spans_heads:
        return
    for pruned in (groups, [{1} for _ in layers], [{0, 3} for _ in layers]):
        reference = _gated(loaded, pruned, name)
        with P.pruned_in_place(loaded, pruned, "physical"):
            torch.testing.assert_close(_logits(loaded.model, name), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_emptied_layer_keeps_a_zero_head(name):
    loaded = _loaded(name)
    pruned = [set(range(4)) if layer.index == len(loaded.layers) - 1 else {2} for layer in loaded.layers]
    with pytest.raises(HeadlabError, match="allow_empty_layer=True"):
        P.check_not_empty(loaded.layers, pruned, False)
    reference = _gated(loaded, pruned, name)
    with P.pruned_in_place(loaded, pruned, "physical") as layout:
        assert layout[-1].zeroed and layout[-1].num_heads == 1
        torch.testing.assert_close(_logits(loaded.model, name), reference, atol=1e-5, rtol=0)


# ---- checkpoints ----------------------------------------------------------------------------------------------------


def _vanilla(path, like):
    return _auto_class_for(like).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_nonuniform_physical_checkpoint_reloads_with_headlab_and_fails_vanilla(name, tmp_path):
    loaded = _loaded(name)
    pruned = _mixed(loaded.layers)
    spec = ";".join(f"{i}:{','.join(map(str, sorted(p)))}" for i, p in enumerate(pruned))
    reference = _gated(loaded, pruned, name)
    result = P.prune(
        loaded, selection=P.Selection(heads=spec), mode="physical", out=tmp_path / "p", evaluate=False, progress=False
    )
    assert result.verification["max_abs_diff"] <= 1e-4
    reloaded = load_model(str(tmp_path / "p"), device="cpu", attn_implementation="eager")
    got = _logits(reloaded.model, name)
    torch.testing.assert_close(got, _logits(loaded.model, name), atol=1e-5, rtol=0)
    if not loaded.adapter.norm_spans_heads:
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    if len(loaded.layers) == 1:  # hybrids: one softmax layer, so any layout is uniform and vanilla-loadable
        assert result.loader == "vanilla"
        torch.testing.assert_close(_logits(_vanilla(tmp_path / "p", loaded.model), name), got, atol=1e-5, rtol=0)
    else:
        assert result.loader == "headlab" and type(reloaded.model) is type(loaded.model)
        record = json.loads((tmp_path / "p" / "config.json").read_text())[HEAD_LAYOUT_KEY]
        live = [sorted(set(entry["heads"]) - set(entry["padding_heads"])) for entry in record["layers"]]
        assert live == [sorted(set(range(4)) - p) for p in pruned]
        with pytest.raises(RuntimeError, match="mismatch"):  # vanilla transformers must refuse, never run wrong
            _vanilla(tmp_path / "p", loaded.model)
    # The record beside the weights: tidy table, mask in gates' format, meta.
    heads = pd.read_csv(tmp_path / "p" / P.RECORD_DIR / "heads.csv")
    assert list(heads.columns[:4]) == ["layer", "head", "kv_head", "pruned"]
    assert int(heads["pruned"].sum()) == sum(len(p) for p in pruned)
    mask = read_mask(tmp_path / "p" / P.RECORD_DIR / "mask.csv", tiny_model(name))
    assert [set(torch.nonzero(g == 0).flatten().tolist()) for g in mask] == pruned
    assert json.loads((tmp_path / "p" / P.RECORD_DIR / "meta.json").read_text())["mode"] == "physical"


@pytest.mark.parametrize("name", [n for n in ALL_TYPES if adapter_for(tiny_model(n)).free_head_dim])
def test_uniform_physical_checkpoint_loads_with_vanilla_transformers(name, tmp_path):
    loaded = _loaded(name)
    unit = "kv-group" if name in GQA_TYPES else "head"
    scores = pd.DataFrame(
        [(layer.index, h, float((h * 7 + layer.index) % 5)) for layer in loaded.layers for h in range(4)],
        columns=["layer", "head", "score"],
    )
    for pass_unit, tag in ((unit, "a"), ("head", "b")):
        fresh = _loaded(name)
        result = P.prune(
            fresh, P.PruneSpec(fraction=0.5, unit=pass_unit, uniform=True), P.Selection(scores=scores),
            mode="physical", out=tmp_path / tag, evaluate=False, progress=False,
        )  # fmt: skip
        assert result.loader == "vanilla"
        config = json.loads((tmp_path / tag / "config.json").read_text())
        assert HEAD_LAYOUT_KEY not in config and HEAD_LAYOUT_KEY not in config.get("text_config", {})
        reference = _gated(loaded, result.pruned, name)
        got = _logits(_vanilla(tmp_path / tag, loaded.model), name)
        if loaded.adapter.norm_spans_heads:
            torch.testing.assert_close(got, _logits(fresh.model, name), atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def test_mask_checkpoint_loads_with_vanilla_transformers(tmp_path):
    loaded = _loaded("qwen3")
    reference = _gated(loaded, [{0, 3}, {2}], "qwen3")
    result = P.prune(
        loaded, selection=P.Selection(heads="0:0,3;1:2"), out=tmp_path / "m", evaluate=False, progress=False
    )
    assert result.loader == "vanilla" and result.mode == "mask"
    torch.testing.assert_close(_logits(_vanilla(tmp_path / "m", loaded.model), "qwen3"), reference, atol=1e-5, rtol=0)


def test_repruning_a_nonuniform_checkpoint_composes_layouts(tmp_path):
    first = _loaded("llama")
    P.prune(first, selection=P.Selection(heads="0:1;1:0,2"), mode="physical", out=tmp_path / "a", evaluate=False,
            progress=False)  # fmt: skip
    second = load_model(str(tmp_path / "a"), device="cpu", attn_implementation="eager")
    # layer 1 now holds original heads [1, 3]; pruning its head 0 removes original head 1
    P.prune(second, selection=P.Selection(heads="1:0"), mode="physical", out=tmp_path / "b", evaluate=False,
            progress=False)  # fmt: skip
    record = json.loads((tmp_path / "b" / "config.json").read_text())[HEAD_LAYOUT_KEY]
    # layer 0 keeps its padding head 1 (zero output) from the first pruning
    assert record["layers"][0]["heads"] == [0, 1, 2, 3] and record["layers"][0]["kv_heads"] == [0, 1]
    assert record["layers"][0]["padding_heads"] == [1]
    assert record["layers"][1]["heads"] == [3] and record["layers"][1]["kv_heads"] == [1]
    reference = _gated(_loaded("llama"), [{1}, {0, 1, 2}], "llama")
    third = load_model(str(tmp_path / "b"), device="cpu", attn_implementation="eager")
    torch.testing.assert_close(_logits(third.model, "llama"), reference, atol=1e-5, rtol=0)


# ---- iterative ----------------------------------------------------------------------------------------------------


def test_iterative_rescoring_matches_manual_steps(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    kwargs = dict(data=str(corpus), seq_len=32, batch_size=2, max_tokens=256, progress=False)
    loaded = _loaded("llama")
    result = P.prune(loaded, P.PruneSpec(fraction=0.5), P.Selection(iterative=2, calibration_tokens=256),
                     data=str(corpus), seq_len=32, batch_size=2, evaluate=False, progress=False)  # fmt: skip
    # By hand: step 1 prunes 2 of 8 on plain importance; step 2 re-scores with those gated off and prunes 2 more.
    fresh = _loaded("llama")
    step1 = P.select_heads(fresh.layers, S.importance_scores(fresh, **kwargs), count=2)
    rescored = S.importance_scores(fresh, step1, **kwargs)
    step2 = P.select_heads(fresh.layers, rescored, count=4, already=step1)
    assert result.pruned == step2
    assert sum(len(p) for p in step2) == 4
    one_shot = P.select_heads(fresh.layers, S.importance_scores(fresh, **kwargs), count=4)
    assert result.meta["selection"]["iterative"] == 2
    del one_shot  # may or may not differ; the rescoring itself is what the manual steps pin down


# ---- safety and bad input (CLI) ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path):
    return save_tiny("llama", tmp_path / "src")


def _snapshot(path: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(path.rglob("*")) if p.is_file()}


def _base_args(src, corpus, out):
    return ["prune", "--model", src, "--device", "cpu", "--data", corpus, "--max-tokens", "64", "--seq-len", "32",
            "--calibration-tokens", "128", "--out", out]  # fmt: skip


def test_cli_prune_writes_verified_checkpoint_and_keeps_source(tiny_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    before = _snapshot(tiny_dir)
    code, out, err = run_cli([*_base_args(tiny_dir, corpus, tmp_path / "o"), "--fraction", "0.5",
                              "--mode", "physical", "--uniform"], capsys)  # fmt: skip
    assert code == 0, err
    assert "perplexity" in out and "vanilla" in out and "KV cache per token" in out
    assert _snapshot(tiny_dir) == before
    assert (tmp_path / "o" / "model.safetensors").is_file()
    # an existing output needs --overwrite, and is left untouched without it
    stamp = _snapshot(tmp_path / "o")
    code, _, err = run_cli([*_base_args(tiny_dir, corpus, tmp_path / "o"), "--heads", "0:1"], capsys)
    assert code == 2 and "--overwrite" in err and _snapshot(tmp_path / "o") == stamp
    code, _, err = run_cli([*_base_args(tiny_dir, corpus, tmp_path / "o"), "--heads", "0:1", "--overwrite"], capsys)
    assert code == 0, err
    assert _snapshot(tmp_path / "o") != stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fraction", "1.0"], "[0, 1)"),
        (["--fraction", "-0.1"], "[0, 1)"),
        (["--heads", "5:0"], "layer 5"),
        (["--heads", "0:9"], "no head 9"),
        (["--heads", "0:0,1,2,3"], "allow-empty-layer"),
        (["--fraction", "0.1", "--uniform"], "removes 0"),
        (["--count", "3", "--uniform"], "multiple of"),
        (["--scores", "SCORES"], "does not match the model"),
        (["--fraction", "0.5", "--count", "2"], "exactly one"),
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(tiny_dir, tmp_path, capsys, extra, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    other = pd.DataFrame([(0, h, 1.0) for h in range(8)], columns=["layer", "head", "score"])
    other.to_csv(tmp_path / "other.csv", index=False)
    extra = [str(tmp_path / "other.csv") if e == "SCORES" else e for e in extra]
    code, out, err = run_cli([*_base_args(tiny_dir, corpus, tmp_path / "o"), *extra], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_kv_group_on_mha_is_an_error(tmp_path, capsys):
    src = save_tiny("gpt2", tmp_path / "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    code, _, err = run_cli([*_base_args(src, corpus, tmp_path / "o"), "--unit", "kv-group"], capsys)
    assert code == 2 and "nothing different" in err and not (tmp_path / "o").exists()


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import headlab.core.checkpoint as checkpoint

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "save_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        P.prune(
            _loaded("llama"), selection=P.Selection(heads="0:1"), out=tmp_path / "x", evaluate=False, progress=False
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", MHA_TYPES[:1])
def test_costs_follow_the_layout(name):
    loaded = _loaded(name)
    before = P.costs(loaded, context=10)
    with P.pruned_in_place(loaded, [{0, 1}, {0, 1}], "physical"):
        after = P.costs(loaded, context=10)
    C, D, L = 64, 16, 2
    removed = L * 2 * (4 * D * C)  # per head: q, k, v rows and o columns (bias-free llama)
    assert before["parameters"] - after["parameters"] == removed
    assert before["kv_bytes_per_token"] - after["kv_bytes_per_token"] == 2 * L * 2 * D * 4
    assert before["attention_flops_per_token"] - after["attention_flops_per_token"] == 2 * removed + 4 * L * 2 * D * 10


# ---- the embedded model (slow) ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_physical_checkpoints(tmp_path):
    """SmolLM2-135M (9 query / 3 KV heads x 30 layers): a uniform prune reloads with vanilla transformers, a per-layer
    one with headlab, both equal to the model with the same heads gated off."""
    loaded = load_model(None, device="cpu")
    inputs = {"input_ids": torch.arange(100, 164).view(2, 32)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])

    def logits(model):
        with torch.no_grad():
            return model(**inputs).logits

    scores = pd.DataFrame(
        [(layer.index, h, float((13 * h + 7 * layer.index) % 11)) for layer in loaded.layers for h in range(9)],
        columns=["layer", "head", "score"],
    )
    for tag, kwargs, loader in (("u", dict(uniform=True), "vanilla"), ("n", dict(), "headlab")):
        fresh = load_model(None, device="cpu")
        result = P.prune(fresh, P.PruneSpec(fraction=0.3, **kwargs), P.Selection(scores=scores), mode="physical",
                         out=tmp_path / tag, evaluate=False, progress=False)  # fmt: skip
        assert result.loader == loader
        with head_gates(loaded, P.gates_from_pruned(loaded.layers, result.pruned)):
            reference = logits(loaded.model)
        reloaded = load_model(str(tmp_path / tag), device="cpu")
        # 30 float32 layers through sdpa with other head counts: kernel noise ~1e-4 x the logit scale, where a
        # mis-mapped head shifts logits by O(1).
        diff = float((logits(reloaded.model) - reference).abs().max())
        assert diff <= 1e-3 * max(1.0, float(reference.abs().max())), (tag, diff)


def test_the_cli_and_the_python_api_share_the_calibration_default():
    """One default for prune's calibration budget (headlab.pruning.prune.DEFAULT_CALIBRATION_TOKENS), in both faces."""
    import click

    from headlab.cli import cli
    from headlab.pruning.prune import DEFAULT_CALIBRATION_TOKENS, Selection

    assert Selection().calibration_tokens == DEFAULT_CALIBRATION_TOKENS
    command = cli.get_command(click.Context(cli), "prune")
    option = next(p for p in command.params if p.name == "calibration_tokens")
    assert option.default == DEFAULT_CALIBRATION_TOKENS
    assert Selection().low_memory is None  # chosen by the memory available in both faces
    assert next(p for p in command.params if p.name == "low_memory").default is None


@pytest.mark.parametrize("name", ["prune", "sweep"])
def test_help_says_what_each_token_budget_bounds_and_costs(name, capsys):
    """--max-tokens bounds the eval text, --calibration-tokens the calibration text, each with its cost."""
    code, out, _ = run_cli([name, "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "--max-tokens INTEGER RANGE eval-split tokens" in text
    assert "bounded by --calibration-tokens" in text
    assert "--calibration-tokens INTEGER RANGE calibration-split tokens" in text
    assert "s per 1,024 tokens" in text and "3x that with --low-memory" in text
    assert "bound on the tokens processed" not in text


@pytest.mark.parametrize("mode", ["mask", "physical"])
def test_the_record_counts_the_heads_the_model_had_before_pruning(mode, tmp_path):
    from tiny_text import SAMPLE_TEXT, tiny_tokenizer

    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    before = sum(layer.num_heads for layer in loaded.layers)
    # uniform: the physical prune rewrites the config, and the layers are described anew with fewer heads
    result = P.prune(loaded, P.PruneSpec(count=4, uniform=True), P.Selection(calibration_tokens=128),
                     data=str(corpus), seq_len=32, eval_tokens=64, mode=mode, progress=False)  # fmt: skip
    assert result.meta["total_heads"] == before and result.meta["pruned_heads"] == 4


def test_a_uniform_prune_the_config_class_refuses_keeps_the_layout_record(tmp_path):
    """Llama's config refuses hidden_size 64 over 3 heads on save (though its attention reads head_dim): one head
    pruned from every layer of the 4-head MHA llama is saved with the per-layer layout instead, and reloads exactly."""
    loaded = from_model(tiny_model("llama_mha"), tiny_tokenizer())
    selection = P.Selection(heads="0:3;1:0")
    result = P.prune(loaded, P.PruneSpec(), selection, mode="physical", evaluate=False, out=tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert result.loader == "headlab" and HEAD_LAYOUT_KEY in config and config["num_attention_heads"] == 4
    assert result.verification["max_abs_diff"] == 0.0
    assert [layer.num_heads for layer in load_model(str(tmp_path / "out"), device="cpu").layers] == [3, 3]
