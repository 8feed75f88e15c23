"""Direct logit attribution and activation patching (headlab.measure.attribution, `headlab attribute`): the sum check
on tiny models of several families, each head against a slow hand computation, patching's two fixed points, bad
input, and the command's run directory."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from models import tiny_model
from tiny_text import run_cli, save_tiny, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.attribution import (
    activation_patching,
    direct_logit_attribution,
    patched_metrics,
    patching_setup,
)
from headlab.mechanisms.hooks import hooks
from headlab.viz.plots import run_figures

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The quick brown fox jumps"
# Families with RMSNorm (llama, qwen3, olmo2, phi3, deepseek_v3's MLA heads), Gemma's 1 + weight RMSNorm (gemma3_text,
# the gemma3 wrapper, the qwen3_next hybrid whose linear-attention blocks fall in the rest) and LayerNorm with biases
# (gpt2, gpt_neox, opt). Encoders are refused (their MLM head transforms before it unembeds).
FAMILIES = [
    "llama",
    "qwen3",
    "gemma3_text",
    "gemma3",
    "qwen3_next",
    "olmo2",
    "phi3",
    "gpt2",
    "gpt_neox",
    "opt",
    "deepseek_v3",
]


def _loaded(name: str, **overrides):
    return from_model(tiny_model(name, **overrides), tiny_tokenizer())


def _check_sum(table) -> None:
    meta = table.attrs["meta"]
    heads = table.groupby("position")["contribution"].sum()
    for record in meta["per_position"]:
        total = heads[record["position"]] + record["rest"] + record["lm_head_bias"]
        assert abs(total - record["logit"]) < 1e-4, record
        if meta["final_logit_softcapping"] is None:  # the model's own output: the same logit
            assert abs(record["logit"] - record["model_logit"]) < 1e-4, record
    assert meta["sum_check"]["max_abs_error"] < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_heads_and_rest_add_up_to_the_logit(name):
    loaded = _loaded(name)
    last = direct_logit_attribution(loaded, TEXT)
    _check_sum(last)
    heads = sum(layer.num_heads for layer in loaded.layers)
    assert len(last) == heads and last["position"].unique().tolist() == [len(TEXT) - 2]
    assert list(last.columns) == ["layer", "head", "kv_head", "name", "position", "token", "target", "contribution"]
    assert last["name"].iloc[-1] == f"L{loaded.layers[-1].index}H{loaded.layers[-1].num_heads - 1}"
    assert (last["target"] == TEXT[-1]).all() and (last["token"] == TEXT[-2]).all()
    every = direct_logit_attribution(loaded, TEXT, positions="all")
    _check_sum(every)
    assert len(every) == heads * (len(TEXT) - 1)
    # the last position of "all" is the default's
    tail = every[every["position"] == len(TEXT) - 2].reset_index(drop=True)
    assert torch.allclose(torch.tensor(tail["contribution"]), torch.tensor(last["contribution"]), atol=1e-9)
    given = direct_logit_attribution(loaded, TEXT, target="x", positions="all")
    _check_sum(given)
    assert len(given) == heads * len(TEXT) and (given["target"] == "x").all()


def test_soft_capped_logits_are_attributed_before_the_cap():
    loaded = _loaded("gemma3_text", final_logit_softcapping=0.1)
    table = direct_logit_attribution(loaded, TEXT, positions="all")
    _check_sum(table)  # against the pre-cap logit
    for record in table.attrs["meta"]["per_position"]:
        assert abs(0.1 * math.tanh(record["logit"] / 0.1) - record["model_logit"]) < 1e-6


def test_opt_projection_after_the_norm_is_folded_into_the_unembedding():
    _check_sum(direct_logit_attribution(_loaded("opt", word_embed_proj_dim=32), TEXT))


def _by_hand(loaded, text: str, gain_offset: float) -> list[float]:
    """Each head at the second-to-last position, the obvious way: its output from the hook, through the output
    projection module with every other head's slice zeroed (minus the bias), through the final norm with the scale of
    the whole residual, dotted with the next token's unembedding row."""
    model, adapter, layers = loaded.model, loaded.adapter, loaded.layers
    ids = torch.tensor([loaded.tokenizer(text)["input_ids"]])
    outputs, resid = {}, []
    keep = [("heads_out", layer, lambda x, i=layer.index: outputs.__setitem__(i, x.detach())) for layer in layers]
    with torch.no_grad(), hooks(adapter, [*keep, ("resid_final", model, lambda x: resid.append(x.detach()))]):
        model(input_ids=ids)
    position, target = ids.shape[1] - 2, int(ids[0, -1])
    norm = adapter.final_norm(model).module
    x = resid[0][0, position].double()
    centred = isinstance(norm, torch.nn.LayerNorm)
    x_c = x - x.mean() if centred else x
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    scale = torch.sqrt(x_c.pow(2).mean() + eps)
    u = model.get_output_embeddings().weight[target].double()
    values = []
    for layer in layers:
        out_proj = adapter.out_proj(layer)
        z = outputs[layer.index][0, position]
        D = layer.head_dim
        for head in range(layer.num_heads):
            alone = torch.zeros_like(z)
            alone[head * D : (head + 1) * D] = z[head * D : (head + 1) * D]
            with torch.no_grad():
                vector = (out_proj(alone[None]) - out_proj(torch.zeros_like(alone)[None]))[0].double()
            vector = vector - vector.mean() if centred else vector
            values.append(float(((norm.weight.detach().double() + gain_offset) * vector / scale * u).sum()))
    return values


@pytest.mark.parametrize("name, gain_offset", [("llama", 0.0), ("gpt2", 0.0), ("gemma3_text", 1.0), ("qwen3", 0.0)])
def test_each_head_matches_a_hand_computation(name, gain_offset):
    loaded = _loaded(name)
    table = direct_logit_attribution(loaded, TEXT)
    expected = _by_hand(loaded, TEXT, gain_offset)
    assert max(abs(a - b) for a, b in zip(table["contribution"], expected)) < 1e-6


def test_patching_all_heads_of_a_single_layer_recovers_the_clean_run():
    """One layer: with every head patched, the last position (the same token in both prompts) sees exactly the clean
    attention output, and its MLP and the unembedding are position-wise: the clean logit difference comes back."""
    loaded = _loaded("llama", num_hidden_layers=1)
    setup = patching_setup(loaded, "abcdefgh", "xyzdefgh")
    everything = [[(0, head) for head in range(loaded.layers[0].num_heads)]]
    (patched,) = patched_metrics(loaded, setup, everything)
    span = setup.clean_metric - setup.corrupted_metric
    assert abs((patched - setup.corrupted_metric) / span - 1) < 1e-4
    table = activation_patching(loaded, "abcdefgh", "xyzdefgh")
    assert list(table.columns) == ["layer", "head", "kv_head", "name", "patched", "recovered"]
    assert table["recovered"].map(math.isfinite).all()


def test_a_head_whose_output_does_not_change_recovers_nothing():
    loaded = _loaded("llama_mha")
    layer = loaded.layers[0]
    D = layer.head_dim
    v_proj = layer.module.v_proj
    with torch.no_grad():  # head 1 reads KV head 1 alone (MHA): zero values, zero output in both runs
        v_proj.weight[D : 2 * D] = 0
    table = activation_patching(loaded, "abcdefgh", "xyzdefgh", batch_size=3)
    row = table[(table["layer"] == 0) & (table["head"] == 1)].iloc[0]
    assert abs(row["recovered"]) < 1e-5
    assert table.loc[table["recovered"].abs().idxmax(), "recovered"] != 0  # other heads do matter


def test_patch_batches_agree_with_single_patches():
    loaded = _loaded("gpt2")
    one = activation_patching(loaded, "abcdefgh", "xyzdefgh", batch_size=1)
    many = activation_patching(loaded, "abcdefgh", "xyzdefgh", batch_size=5)
    assert max(abs(a - b) for a, b in zip(one["patched"], many["patched"])) < 1e-5
    meta = many.attrs["meta"]
    assert meta["differing_positions"] == [0, 1, 2] and meta["heads"] == 8


def test_patching_answers():
    loaded = _loaded("llama")
    table = activation_patching(loaded, "abcdefgh", "xyzdefgh", answer_tokens=["a", "b"])
    answers = table.attrs["meta"]["answers"]
    assert (answers["correct"], answers["incorrect"], answers["given"]) == ("a", "b", True)
    meta = activation_patching(loaded, "abcdefgh", "xyzdefgh", target="q").attrs["meta"]
    assert meta["answers"]["correct"] == "q" and meta["answers"]["incorrect"] != "q"


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda m: activation_patching(m, "abc", "abcd"), "3 and 4 tokens"),
        (lambda m: direct_logit_attribution(m, ""), "text is empty"),
        (lambda m: direct_logit_attribution(m, "   "), "text is empty"),
        (lambda m: direct_logit_attribution(m, "a"), "one token"),
        (lambda m: direct_logit_attribution(m, "abc", target="\u00e9"), "does not know"),
        (lambda m: direct_logit_attribution(m, "abc", target="ab"), "2 tokens"),
        (lambda m: direct_logit_attribution(m, "abc", target=500), "not a token id"),
        (lambda m: direct_logit_attribution(m, "abc", positions="first"), "positions='first'"),
        (lambda m: direct_logit_attribution(m, "a" * 65), "64 positions"),
        (lambda m: activation_patching(m, "abc", "abc"), "nothing to recover"),
        (lambda m: activation_patching(m, "abc", "abd", answer_tokens=["a", "a"]), "same token"),
        (lambda m: activation_patching(m, "abc", "abd", answer_tokens=["a"]), "two tokens"),
        (lambda m: patched_metrics(m, patching_setup(m, "abc", "abd"), [[(5, 0)]]), "no head 0 in attention layer 5"),
    ],
)
def test_bad_input_is_one_line(call, fragment):
    loaded = _loaded("llama")
    with pytest.raises(HeadlabError) as error:
        call(loaded)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_encoders_are_refused():
    loaded = from_model(tiny_model("bert"), tiny_tokenizer(encoder=True))
    with pytest.raises(HeadlabError, match="encoder"):
        direct_logit_attribution(loaded, TEXT)
    with pytest.raises(HeadlabError, match="encoder"):
        activation_patching(loaded, "abc", "abd")


def test_post_ln_models_are_refused():
    with pytest.raises(HeadlabError, match="no final norm"):
        direct_logit_attribution(_loaded("opt", do_layer_norm_before=False), TEXT)


def test_command_writes_tables_figures_and_meta(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = save_tiny("llama", tmp_path / "tiny")
    args = ["attribute", "--model", model, "--device", "cpu", "--text", TEXT, "--positions", "all"]
    args += ["--clean", "abcdefgh", "--corrupted", "xyzdefgh", "--answers", "a,b", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["out"] == "runs/attribute" and record["patching"]["answers"]["correct"] == "a"
    run = tmp_path / "runs" / "attribute"
    assert {p.name for p in run.iterdir()} >= {"dla.csv", "dla.parquet", "patching.csv", "meta.json", "figures"}
    assert {p.name for p in (run / "figures").iterdir()} == {"dla.png", "patching.png"}
    dla = pd.read_csv(run / "dla.csv")
    assert len(dla) == 8 * (len(TEXT) - 1)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["dla"]["sum_check"]["max_abs_error"] < 1e-4 and meta["model_type"] == "llama"
    assert {"dla", "patching"} <= set(run_figures(run))  # `headlab plot` redraws both from the tables
    # patching alone, from a text file for DLA alone
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, err = run_cli(
        ["attribute", "--model", model, "--device", "cpu", "--text-file", "t.txt", "--out", "d"], capsys
    )
    assert code == 0, err
    assert "L1H" in out and not (tmp_path / "d" / "patching.csv").exists()


@pytest.mark.slow
def test_embedded_model_sum_holds():
    from headlab.core.loading import load_model

    loaded = load_model(device="cpu", dtype="float32")
    table = direct_logit_attribution(loaded, "The Eiffel Tower is in the city of Paris", positions="all")
    meta = table.attrs["meta"]
    assert meta["sum_check"]["max_abs_error"] < 1e-3, meta["sum_check"]
    assert all(abs(r["logit"] - r["model_logit"]) < 1e-3 for r in meta["per_position"])
