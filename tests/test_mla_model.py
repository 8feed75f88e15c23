"""Multi-head latent attention (deepseek_v3 with dense MLPs, as headlab's MLA conversion writes it) as a first-class
model: the adapter's layout and weight round trip, head gates against masking by hand, physical pruning equal to
masking (and vanilla reload), statistics against eager attention maps (query/key width != value width),
importance against finite differences, perplexity against a slow loop, local reconstruction and uptraining, the
KV-cache formula against a hand count, a real transformers cache and llama.cpp's state, costs, compensation and
speed (KV-head conversion's refusals are rows of tests/test_bad_input.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import MLA_TYPES, tiny_inputs, tiny_model
from test_evaluate import slow_perplexity
from test_stats import _reference
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.arch import LatentHeadWeights, LatentQKV, adapter_for
from headlab.core.data import Corpus, calibration_batches, split_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model, load_model
from headlab.kv.gqa import measured_kv_bytes_per_token
from headlab.measure.costs import kv_bytes_per_token, mla_budget, model_info
from headlab.measure.evaluate import perplexity
from headlab.measure.importance import head_importance, scoring_batches, sequence_nll
from headlab.measure.stats import StatisticsCollector
from headlab.mechanisms.capture import capture_attention
from headlab.mechanisms.gates import head_gates, ones_gates
from headlab.pruning import prune as P
from headlab.recovery.reconstruct import LocalSpec, dead_heads, reconstruct
from headlab.recovery.uptrain import uptrain

pytestmark = pytest.mark.usefixtures("one_thread")
CORPUS = Corpus("sample", [SAMPLE_TEXT * 6])


def _loaded(name, dtype=torch.float32):
    return from_model(tiny_model(name).to(dtype), tiny_tokenizer(), spec=name)


def _logits(model, name):
    with torch.no_grad():
        return model(**tiny_inputs(name)).logits


def _zero_output_columns(loaded, pruned, scale=0.0):
    """A copy whose output projection scales the pruned heads' [C, Dv] blocks by `scale`, edited by hand on o_proj."""
    model = copy.deepcopy(loaded.model)
    for block, heads in zip(model.model.layers, pruned):
        Dv = block.self_attn.v_head_dim
        with torch.no_grad():
            for h in heads:
                block.self_attn.o_proj.weight[:, h * Dv : (h + 1) * Dv] *= scale
    return model


# ---- layout and weights ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MLA_TYPES)
def test_layout_and_bit_identical_round_trip(name):
    model = tiny_model(name)
    adapter = adapter_for(model)
    assert isinstance(adapter, LatentQKV) and adapter.latent_kv and not adapter.supports_gqa
    layers = adapter.attention_layers(model)
    config = model.config
    assert [(la.num_heads, la.num_kv_heads, la.head_dim) for la in layers] == [(4, 4, config.v_head_dim)] * 2
    w = adapter.read(layers[0])
    Dqk = config.qk_nope_head_dim + config.qk_rope_head_dim
    C_q = config.q_lora_rank or config.hidden_size
    assert isinstance(w, LatentHeadWeights) and tuple(w.q.shape) == (4, Dqk, C_q)
    assert tuple(w.k.shape) == (4, config.qk_nope_head_dim, config.kv_lora_rank)
    assert tuple(w.v.shape) == (4, config.v_head_dim, config.kv_lora_rank)
    assert tuple(w.o.shape) == (config.hidden_size, 4, config.v_head_dim)
    assert (w.latent_norm is None) == (name == "deepseek_v3_nonorm")
    # kv_b rows of head h are [k_nope_h; v_h], in that order (the modeling code's view + split).
    kv_b = layers[0].module.kv_b_proj.weight.view(4, -1, config.kv_lora_rank)
    assert torch.equal(kv_b[2, : config.qk_nope_head_dim], w.k[2]) and torch.equal(
        kv_b[2, config.qk_nope_head_dim :], w.v[2]
    )
    before = _logits(model, name)
    for layer in layers:
        adapter.write(layer, adapter.read(layer))
    assert torch.equal(_logits(model, name), before)


def test_restoring_a_read_undoes_training_of_the_shared_latent_projection():
    model = tiny_model("deepseek_v3_qlora")
    adapter = adapter_for(model)
    layer = adapter.attention_layers(model)[0]
    saved, before = adapter.read(layer), _logits(model, "deepseek_v3_qlora")
    with torch.no_grad():
        for p in layer.module.parameters():
            p.add_(0.1)
    assert not torch.equal(_logits(model, "deepseek_v3_qlora"), before)
    adapter.write(layer, saved)
    assert torch.equal(_logits(model, "deepseek_v3_qlora"), before)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_qlora"])
def test_write_keeps_dtype_grad_flags_no_aliasing_and_eager_equals_sdpa(name):
    model = tiny_model(name).to(torch.bfloat16)
    model.requires_grad_(False)
    adapter = adapter_for(model)
    layers = adapter.attention_layers(model)
    w = adapter.read(layers[0]).take([0, 2])
    adapter.write(layers[0], w)
    for param in layers[0].block_module.parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad
    w.q.zero_(), w.k.zero_(), w.kv_a.zero_()  # the model holds copies, not the caller's tensors
    again = adapter.read(layers[0])
    assert again.q.abs().sum() > 0 and again.k.abs().sum() > 0 and again.kv_a.abs().sum() > 0
    model = model.float()
    model.set_attn_implementation("eager")
    eager = _logits(model, name)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(_logits(model, name), eager, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_logits(copy.deepcopy(model), name), eager, atol=1e-5, rtol=1e-4)


def test_config_layout_rebuilds_a_pruned_model_strictly():
    model = tiny_model("deepseek_v3_vdim")
    adapter = adapter_for(model)
    for layer in adapter.attention_layers(model):
        adapter.write(layer, adapter.read(layer).take([1, 3]))
    config = copy.deepcopy(model.config)
    adapter.set_config_heads(config, 2, 2, 12)
    assert adapter.layout_fields(config) == {"num_heads": 2, "num_kv_heads": 2, "head_dim": 12}
    assert config.head_dim == 8  # DeepSeek configs keep the rope dim there: untouched
    rebuilt = type(model)(config).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(_logits(rebuilt, "deepseek_v3_vdim"), _logits(model, "deepseek_v3_vdim"))
    with pytest.raises(HeadlabError, match="as many KV heads"):
        adapter.set_config_heads(config, 2, 1, 12)
    with pytest.raises(HeadlabError, match="own keys and values"):
        adapter.read(adapter.attention_layers(model)[0]).take([0, 1], [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_importance_in_float32_and_bfloat16(dtype):
    from test_importance import test_every_architecture as check

    check("deepseek_v3_qlora", dtype)


# ---- gates, masking, physical pruning ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_vdim"])
def test_gates_equal_scaling_output_columns_by_hand(name):
    loaded = _loaded(name)
    pruned = [{1, 3}, {0}]
    for value in (0.0, 0.5):
        gates = ones_gates(loaded, requires_grad=False)
        for gate, heads in zip(gates, pruned):
            gate[sorted(heads)] = value
        with head_gates(loaded, gates):
            gated = _logits(loaded.model, name)
        torch.testing.assert_close(gated, _logits(_zero_output_columns(loaded, pruned, value), name), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MLA_TYPES)
def test_mask_and_physical_pruning_equal_gating(name):
    loaded = _loaded(name)
    pruned = [{1}, {0, 2, 3}]
    reference = _logits(_zero_output_columns(loaded, pruned), name)
    original = _logits(loaded.model, name)
    with P.pruned_in_place(loaded, pruned, "mask"):
        torch.testing.assert_close(_logits(loaded.model, name), reference, atol=1e-5, rtol=0)
        layer = loaded.layers[1]
        assert dead_heads(loaded, layer) == [0, 2, 3]
        kv_b = layer.module.kv_b_proj.weight.view(4, -1, loaded.model.config.kv_lora_rank)
        assert not kv_b[[0, 2, 3]].any() and kv_b[1].any()  # each pruned head's own key and value rows zeroed
    with P.pruned_in_place(loaded, pruned, "physical"):
        assert [la.num_heads for la in loaded.layers] == [3, 1]
        assert [la.module.kv_b_proj.out_features for la in loaded.layers] == [
            n * (loaded.model.config.qk_nope_head_dim + loaded.model.config.v_head_dim) for n in (3, 1)
        ]
        torch.testing.assert_close(_logits(loaded.model, name), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(loaded.model, name), original, atol=0, rtol=0)


def test_uniform_physical_checkpoint_loads_with_vanilla_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    loaded = _loaded("deepseek_v3")
    pruned = [{0, 2}, {1, 2}]
    reference = _logits(_zero_output_columns(loaded, pruned), "deepseek_v3")
    spec = ";".join(f"{i}:{','.join(map(str, sorted(p)))}" for i, p in enumerate(pruned))
    chosen = P.Selection(heads=spec)
    result = P.prune(loaded, selection=chosen, mode="physical", out=tmp_path / "p", evaluate=False, progress=False)
    assert result.loader == "vanilla" and result.verification["max_abs_diff"] <= 1e-4
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 2, 8)
    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path / "p", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(vanilla, "deepseek_v3"), reference, atol=1e-5, rtol=0)
    # A layout that differs per layer is reloaded by headlab (and recorded), like any other family.
    loaded = _loaded("deepseek_v3")
    reference = _logits(_zero_output_columns(loaded, [{1}, {0, 2, 3}]), "deepseek_v3")
    chosen = P.Selection(heads="0:1;1:0,2,3")
    result = P.prune(loaded, selection=chosen, mode="physical", out=tmp_path / "q", evaluate=False, progress=False)
    assert result.loader == "headlab"
    again = load_model(str(tmp_path / "q"), device="cpu", attn_implementation="eager")
    assert [la.num_heads for la in again.layers] == [3, 1]
    torch.testing.assert_close(_logits(again.model, "deepseek_v3"), reference, atol=1e-5, rtol=0)


# ---- statistics, importance, perplexity ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-7)], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_vdim", "deepseek_v3_nonorm"])
def test_statistics_match_eager_attention_maps(name, dtype, tolerance):
    """Query/key heads are qk_nope + qk_rope wide, values v_head_dim: the capture's chunked output must be Dv wide."""
    model = tiny_model(name, attn_implementation="eager").to(dtype)
    loaded = from_model(model)
    inputs = tiny_inputs(name, batch=3, seq=12)
    inputs["attention_mask"][1, 9:] = 0
    inputs["attention_mask"][2, 5:] = 0
    sep_keys = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    target = torch.full_like(inputs["input_ids"], -1)
    target[:, 6:] = torch.arange(6, 12) - 5
    heads_out = {}  # eager head outputs [B, T, H, Dv], read at the output projection's input
    hooks = [
        loaded.adapter.out_proj(layer).register_forward_pre_hook(
            lambda module, args, i=layer.index, D=layer.head_dim: heads_out.__setitem__(
                i, args[0].unflatten(-1, (-1, D))
            )
        )
        for layer in loaded.layers
    ]
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True).attentions
        plain = model(**inputs).logits
    for hook in hooks:
        hook.remove()
    values = [heads_out[layer.index].transpose(1, 2).double() for layer in loaded.layers]  # [B, H, T, Dv]
    reference = _reference(eager, values, inputs["attention_mask"], sep_keys, target)
    collector = StatisticsCollector(loaded.layers, is_encoder=False)
    collector.set_batch(sep_keys=sep_keys, target=target)
    for output in ("chunks", "sdpa"):
        with (
            torch.no_grad(),
            capture_attention(model, loaded.layers, collector.on_chunk, collector.on_output, 5, output),
        ):
            captured = model(**inputs).logits
        real = inputs["attention_mask"].bool()
        torch.testing.assert_close(captured[real], plain[real], atol=10 * tolerance, rtol=0)
    means = collector.means()
    for layer in loaded.layers:
        for statistic, expected in reference[layer.index].items():
            if statistic == "sep_share":
                continue
            got = means[layer.index][statistic][0].tolist()
            assert got == pytest.approx(expected, abs=tolerance, nan_ok=True), (layer.index, statistic)


def test_gate_gradient_matches_finite_differences():
    loaded = _loaded("deepseek_v3", torch.float64)
    ids = tiny_inputs("deepseek_v3", batch=2, seq=10)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    batch = scoring_batches(loaded, [(ids, mask)])[0]
    gates = ones_gates(loaded, 2, dtype=torch.float64)
    with head_gates(loaded, gates):
        nll = sequence_nll(loaded.model, batch, loaded.device)
    grads = torch.autograd.grad(nll.sum(), gates)

    def central(layer, head, row, eps):
        values = []
        for sign in (1, -1):
            shifted = [g.detach().clone() for g in gates]
            shifted[layer][row, head] += sign * eps
            with torch.no_grad(), head_gates(loaded, shifted):
                values.append(sequence_nll(loaded.model, batch, loaded.device)[row])
        return (values[0] - values[1]) / (2 * eps)

    eps = 1e-2  # RMSNorms run in float32 inside a float64 model: a large step with Richardson extrapolation
    for layer, head in [(0, 1), (1, 3)]:
        for row in range(2):
            estimate = (4 * central(layer, head, row, eps / 2) - central(layer, head, row, eps)) / 3
            torch.testing.assert_close(grads[layer][row, head], estimate, rtol=1e-4, atol=1e-5)
    raw = head_importance(loaded, [(ids, mask)], method="grad", progress=False).raw
    for layer in range(2):
        torch.testing.assert_close(raw[layer], grads[layer].abs().sum(0) / batch.scored)


def test_perplexity_matches_slow_loop():
    model, tokenizer = tiny_model("deepseek_v3"), tiny_tokenizer()
    corpus = Corpus("sample", [SAMPLE_TEXT])
    result = perplexity(from_model(model, tokenizer), corpus, seq_len=32, stride=8, batch_size=3, max_tokens=120,
                        progress=False)  # fmt: skip
    text = split_text(corpus, "eval").text[:120]
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    expected, count = slow_perplexity(model, ids, 32, 8)
    assert result.scored_tokens == count
    assert result.perplexity == pytest.approx(expected, rel=1e-5)


# ---- recovery ---------------------------------------------------------------------------------------------------------


def _pair(name):
    teacher = from_model(tiny_model(name), tiny_tokenizer())
    return teacher, from_model(copy.deepcopy(teacher.model), tiny_tokenizer())


@pytest.mark.parametrize("name", ["deepseek_v3_nonorm", "deepseek_v3_vdim"])
def test_local_reconstruction_lowers_the_error_and_keeps_pruned_heads_dead(name):
    teacher, student = _pair(name)
    with torch.no_grad():  # a known corruption of layer 0: every head's key (nope part) and value rows scaled
        student.layers[0].module.kv_b_proj.weight.mul_(1.5)
    P.apply_mask(student, [{2}, {1}])
    batches = calibration_batches(student.tokenizer, CORPUS, seq_len=32, batch_size=4, max_tokens=512)
    table = reconstruct(student, teacher, batches, LocalSpec(steps=4, lr=1e-3), progress=False)
    assert (table["error_after"] <= table["error_before"]).all()
    assert table.set_index("layer").loc[0, "changed"]
    assert table.set_index("layer").loc[0, "error_after"] < table.set_index("layer").loc[0, "error_before"]
    assert [dead_heads(student, layer) for layer in student.layers] == [[2], [1]]


def test_uptraining_lowers_held_out_loss_without_the_latent_norm():
    teacher, student = _pair("deepseek_v3_nonorm")
    P.apply_mask(student, [{0}, {3}])
    small = dict(seq_len=32, batch_size=4, heldout_tokens=128, eval_tokens=128, eval_seq_len=32, progress=False)
    result = uptrain(student, teacher, data=CORPUS, steps=12, lr=1e-2, objective="ce", heldout_every=3, **small)
    assert result.meta["heldout_perplexity_after"] < result.meta["heldout_perplexity_before"]
    assert [dead_heads(student, layer) for layer in student.layers] == [[0], [3]]
    assert all(type(la.module.kv_a_layernorm) is torch.nn.Identity for la in student.layers)


# ---- KV cache ----------------------------------------------------------------------------------------------------------


def test_latent_cache_formula_by_hand_and_a_real_cache():
    loaded = _loaded("deepseek_v3")  # kv_lora_rank 12 + qk_rope 8 per layer, 2 layers, float32
    assert kv_bytes_per_token(loaded) == (12 + 8) * 2 * 4
    # transformers 5 caches the compressed latent and the rotary key (not per-head keys and values).
    assert measured_kv_bytes_per_token(loaded) == (12 + 8) * 2 * 4
    info = model_info(loaded, context=10, batch=2, cache_dtype="bfloat16")
    assert (info["kv_lora_rank"], info["rope_dim"]) == (12, 8)
    assert info["kv_bytes"] == (12 + 8) * 2 * 2 * 10 * 2 and info["mla_rungs"] == []
    ladder = {step["variant"]: step for step in info["ladder"]}
    assert ladder["MLA"]["current"] and ladder["MLA"]["kv_bytes_per_token"] == 20 * 2 * 2
    # What per-head keys (16 + 8) and values (16) of 4 heads would take: 4 x 40 numbers per layer.
    assert ladder["expanded"]["kv_bytes_per_token"] == 4 * (24 + 16) * 2 * 2


def test_mla_rung_of_a_gqa_model_by_hand():
    # SmolLM2-135M (MLA.md): GQA-3 with head_dim 64 holds 384 numbers per layer = 320 latent + 64 rope; MQA 64 + 64.
    assert mla_budget(3, 64, 64) == (320, 64) and mla_budget(1, 64, 64) == (64, 64)
    info = model_info(from_model(tiny_model("llama")), context=4, batch=1, cache_dtype="float16")  # H 4, G 2, D 16
    rungs = {step["variant"]: step for step in info["mla_rungs"]}
    assert (rungs["MLA@GQA-2"]["kv_lora_rank"], rungs["MLA@GQA-2"]["rope_dim"]) == (48, 16)
    assert (rungs["MLA@MQA"]["kv_lora_rank"], rungs["MLA@MQA"]["rope_dim"]) == (16, 16)
    ladder = {step["variant"]: step for step in info["ladder"]}
    assert rungs["MLA@GQA-2"]["kv_bytes_per_token"] == ladder["GQA-2"]["kv_bytes_per_token"] == 64 * 2 * 2
    assert rungs["MLA@MQA"]["kv_bytes_per_token"] == ladder["MQA"]["kv_bytes_per_token"]


def test_cli_info_prints_the_latent(tmp_path, capsys):
    save_tiny("deepseek_v3", tmp_path / "m")
    code, out, _ = run_cli(["info", "--model", tmp_path / "m", "--cache-dtype", "bfloat16"], capsys)
    assert code == 0 and "12+8 latent" in out and "<- this model" in out
    save_tiny("llama", tmp_path / "l")
    code, out, _ = run_cli(["info", "--model", tmp_path / "l"], capsys)
    assert code == 0 and "MLA@MQA" in out and "16+16 latent" in out and "48+16 latent" in out


# ---- costs and compensation ----------------------------------------------------------------------------------------


def test_parameters_and_flops_by_hand():
    loaded = _loaded("deepseek_v3")  # C 64, H 4, kv_lora_rank 12, rope 8, qk_nope 16, v 16, no query LoRA, 2 layers
    C, H, R, r, nope, Dv = 64, 4, 12, 8, 16, 16
    per_head = (nope + r) * C + (nope + Dv) * R + C * Dv  # q rows, kv_b rows, o columns
    shared = (R + r) * C  # kv_a_proj_with_mqa
    costs = P.costs(loaded, context=10)
    attention = sum(p.numel() for n, p in loaded.model.named_parameters() if "self_attn" in n)
    assert costs["attention_parameters"] == attention == 2 * (H * per_head + shared + R)  # + the latent norm
    assert costs["attention_flops_per_token"] == 2 * (2 * (H * per_head + shared) + 2 * H * (nope + r + Dv) * 10)
    with P.pruned_in_place(loaded, [{0, 1}, {2, 3}], "physical"):
        after = P.costs(loaded, context=10)
    assert costs["attention_parameters"] - after["attention_parameters"] == 2 * 2 * per_head
    assert costs["kv_bytes_per_token"] == after["kv_bytes_per_token"] == 2 * (R + r) * 4  # pruning keeps the latent


def test_compensation_never_increases_the_calibration_error():
    from test_compensate import test_compensation_never_increases_the_calibration_error as check

    check("deepseek_v3_vdim")  # ridge refit of the output projection over H x v_head_dim columns


def test_speed_holds_the_latent_cache_in_both_runtimes():
    """Transformers' cache (prefilled or synthetic) and llama.cpp's hold kv_lora_rank + qk_rope numbers per token and
    layer; llama.cpp's deepseek2 keeps no separate V (measured from its state size: 40 f16 bytes per token and layer
    here, plus 12 bytes of cell metadata, against 268 - 12 = 256 for the same-sized tiny GQA llama)."""
    import pandas as pd
    from test_gguf import LLAMACPP, tiny

    from headlab.runtimes.speed import SpeedSpec, measure_model

    spec = SpeedSpec(contexts=(16, 32), batches=(1, 2), decode_tokens=2, prefill_limit=32)
    table = pd.DataFrame(measure_model(tiny("deepseek_v3"), "mla", spec, progress=False))
    hf = table[table["runtime"] == "transformers"]
    assert set(hf["cache_fill"]) == {"prefill", "synthetic"} and (hf["decode_tokens_per_s"] > 0).all()
    assert (hf["kv_cache_bytes"] == 2 * (12 + 8) * 4 * hf["context"] * hf["batch"]).all()  # float32 cells
    if LLAMACPP is None:
        cpp = table[table["runtime"] == "llama.cpp"]
        # every (context, batch) point: llama.cpp runs one KV stream per sequence (headlab.runtimes.llamacpp.Sequences)
        assert len(cpp) == len(spec.contexts) * len(spec.batches) and (cpp["decode_tokens_per_s"] > 0).all()
        allocated = cpp["kv_cache_bytes"] // (2 * (12 + 8) * 2)  # f16 cells
        assert (cpp["kv_cache_bytes"] == 2 * (12 + 8) * 2 * allocated).all()
        assert (allocated >= cpp["context"] * cpp["batch"]).all()  # cells for the whole context of every sequence


def test_llamacpp_state_grows_by_the_latent_per_token(tmp_path):
    """llama.cpp's own bytes per cached token (state size at 48 minus at 16 tokens, over 32): the MLA model's equals
    2 layers x (12 + 8) f16 numbers plus the cell metadata the same-shaped GQA llama shows beyond its 2 x 2 x 2 x 16."""
    from test_gguf import LLAMACPP, llamacpp_bytes_per_token, tiny

    if LLAMACPP is not None:
        pytest.skip(LLAMACPP)
    # K and V of 2 KV heads x 16 dims in 2 layers, f16; the rest is the cells' metadata
    metadata = llamacpp_bytes_per_token(tiny("llama"), tmp_path / "gqa.gguf") - 2 * (2 * 2 * 16) * 2
    assert metadata >= 0
    assert llamacpp_bytes_per_token(tiny("deepseek_v3"), tmp_path / "mla.gguf") == 2 * (12 + 8) * 2 + metadata
