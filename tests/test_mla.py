"""MHA/GQA -> MLA (headlab.kv.mla): RoRoPE checked against a slow per-position rotation, exactness where the format
allows it (MQA sources, keys with no dropped RoPE components, full-rank latents), the latent-norm fold, and the
vanilla deepseek_v3 checkpoint round trip."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from models import tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM

from headlab.core.data import TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import mla, post_norms
from headlab.kv.methods import mla_budget, mla_budget_numbers


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "sample.txt"
    path.write_text(SAMPLE_TEXT * 4)
    return TextSpec(data=str(path), split="calibration", seq_len=32, batch_size=4, max_tokens=512)


def loaded_tiny(name="llama", **overrides):
    return from_model(tiny_model(name, **overrides), tiny_tokenizer())


def converted(loaded, text, **plan):
    batches = text.batches(loaded.tokenizer, max_positions=64)
    return mla.convert_to_mla(loaded, mla.plan_mla(loaded, **plan), batches, progress=False)


def logits(model, seq=32):
    with torch.no_grad():
        return model(**tiny_inputs("llama", seq=seq)).logits


def rel_diff(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- RoRoPE against a slow, obvious rotation ---------------------------------------------------------------------


def _rotate(vec: torch.Tensor, angle: torch.Tensor, F: int) -> torch.Tensor:
    """rotate_half RoPE by hand, one pair (f, f + F) at a time."""
    out = vec.clone()
    for f in range(F):
        c, s = math.cos(angle[f]), math.sin(angle[f])
        out[f], out[f + F] = vec[f] * c - vec[f + F] * s, vec[f + F] * c + vec[f] * s
    return out


def test_rorope_decomposition_is_exact_with_rope_kept_everywhere():
    # G=3 key heads, D=8 (4 frequencies), C=5 inputs; H=6 query heads, two per KV head.
    torch.manual_seed(0)
    G, D, C, H = 3, 8, 5, 6
    F = D // 2
    plan = mla.MlaPlan(H, G, D, D, kv_lora_rank=2 * G * D - D, rope_dim=D)
    k_aug = torch.randn(G, D, C + 1, dtype=torch.float64)
    q = torch.randn(H, D, C + 1, dtype=torch.float64)
    X = torch.randn(50, C + 1, dtype=torch.float64)
    Sk = k_aug.reshape(G * D, C + 1) @ (X.T @ X) @ k_aug.reshape(G * D, C + 1).T
    energy = torch.rand(G, F, dtype=torch.float64) + 0.5
    rope_rows, factors, nope = mla._rorope(k_aug, Sk, energy, plan)
    qmap = mla._query_map(factors, plan)
    scale = math.sqrt((D + D) / D)
    inv_freq = 1.0 / (10000 ** (torch.arange(F, dtype=torch.float64) / F))
    xq, xk = X[0], X[1]
    for pq, pk in ((7, 3), (30, 0)):
        for h in range(H):
            g = h // (H // G)
            original = _rotate(q[h] @ xq, pq * inv_freq, F) @ _rotate(k_aug[g] @ xk, pk * inv_freq, F)
            # MLA side, by hand: the shared rotary key and the query's rope part in consecutive pairs
            q_mla = (qmap[h] @ (q[h] @ xq)) / scale  # [D nope; D rope]
            k_rope = rope_rows @ xk
            rope = sum(
                (
                    torch.complex(q_mla[D + 2 * j], q_mla[D + 2 * j + 1]).conj()
                    * torch.complex(k_rope[2 * j], k_rope[2 * j + 1])
                    * complex(math.cos((pk - pq) * inv_freq[j]), math.sin((pk - pq) * inv_freq[j]))
                ).real
                for j in range(F)
            )
            # The residual keys: with RoPE kept on them too the sum is exact ...
            resid_rotated = _rotate(q[h] @ xq, pq * inv_freq, F) @ _rotate(nope[g] @ xk, pk * inv_freq, F)
            assert float(rope + resid_rotated) == pytest.approx(float(original), rel=1e-9, abs=1e-9)
            # ... and the MLA's nope part (no RoPE on them) differs by exactly the dropped rotation
            plain = q_mla[:D] @ (nope[g] @ xk)
            assert float(rope + plain - original) == pytest.approx(float(plain - resid_rotated), abs=1e-9)


@pytest.mark.parametrize("name", ["llama", "llama_yarn"])
def test_rope_phases_match_a_slow_loop_over_eager_attention(name, text):
    # llama_yarn: the phases rotate at the source's scaled frequencies (its rotary embedding's own inv_freq).
    loaded = loaded_tiny(name)
    batches = text.batches(loaded.tokenizer, max_positions=64)
    phases = mla.rope_phases(loaded, batches, progress=False)
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    if name == "llama_yarn":
        inv_freq = loaded.model.model.rotary_emb.inv_freq.double()
        assert not torch.allclose(inv_freq, 1e6 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    total = torch.zeros(2, 4, 8, dtype=torch.complex128)
    mass = torch.zeros(2, 4, 1, dtype=torch.float64)
    for input_ids, attention_mask, *_ in batches:
        with torch.no_grad():
            out = loaded.model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        for layer, probs in enumerate(out.attentions):  # [B, H, T, T]
            for b in range(probs.shape[0]):
                for t in range(probs.shape[2]):
                    if not attention_mask[b, t]:
                        continue
                    for s_ in range(t + 1):
                        p = probs[b, :, t, s_].double()  # [H]
                        angle = -(t - s_) * inv_freq  # [F]
                        total[layer] += p[:, None] * torch.complex(angle.cos(), angle.sin())[None, :]
                        mass[layer] += p[:, None]
    for layer in range(2):
        assert torch.allclose(phases[layer], total[layer] / mass[layer], atol=1e-6)
    assert float(phases[0].abs().max()) <= 1 + 1e-9  # an average of unit rotations


# ---- exactness ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_mqa_to_mla_is_exact_apart_from_the_norm(name, text):
    # One KV head: k_rope = K, latent = V; qwen2 adds q/k/v biases (the query bias rides the q_lora path).
    extra = {"sliding_window": None} if name == "mistral" else {}
    loaded = loaded_tiny(name, num_key_value_heads=1, **extra)
    model, record = converted(loaded, text, budget="gqa")
    assert (record["plan"]["kv_lora_rank"], record["plan"]["rope_dim"]) == (16, 16)
    assert (model.model.config.q_lora_rank is not None) == (name == "qwen2")
    expected = logits(loaded.model)
    assert rel_diff(logits(model.model), expected) < 1e-5
    assert record["steps"]["rope_truncation"]["exact"] and record["steps"]["latent_rank"]["exact"]
    folds = mla.fold_latent_norm(model.model)
    assert len(folds) == (4 if name == "qwen2" else 2)  # kv_a (and q_a) norms of 2 layers
    assert rel_diff(logits(model.model), expected) < 1e-5  # the eps-dominance fold keeps it exact in fp32


def _rank_one_keys(loaded, kept: list[int]):
    """Make each layer's 2 KV heads complex multiples of one another at the kept frequencies and zero elsewhere:
    then no RoPE component is dropped, so the conversion at full rank must be exact."""
    torch.manual_seed(1)
    for layer in loaded.layers:
        w = loaded.adapter.read(layer)
        F = w.head_dim // 2
        k = torch.zeros_like(w.k)
        for f in kept:
            c = torch.randn(2, dtype=torch.float64)
            x, y = w.k[0, f], w.k[0, f + F]
            k[0, f], k[0, f + F] = x, y
            k[1, f], k[1, f + F] = c[0] * x - c[1] * y, c[1] * x + c[0] * y
        w.k = k
        loaded.adapter.write(layer, w)


@pytest.mark.parametrize("rope_dim", [16, 8, 4])
def test_full_rank_error_is_only_the_dropped_rope_components(rope_dim, text):
    loaded = loaded_tiny("llama")  # H=4, G=2, D=16
    full = 2 * 2 * 16 - rope_dim
    # Random keys: the dropped components are real and so is the error.
    model, record = converted(loaded, text, kv_lora_rank=full, rope_dim=rope_dim)
    assert record["steps"]["latent_rank"]["exact"] and not record["steps"]["rope_truncation"]["exact"]
    assert rel_diff(logits(model.model), logits(loaded.model)) > 1e-4
    # Keys with nothing to drop: exact.
    _rank_one_keys(loaded, kept=list(range(0, 8, 16 // rope_dim)))
    model, record = converted(loaded, text, kv_lora_rank=full, rope_dim=rope_dim)
    assert rel_diff(logits(model.model), logits(loaded.model)) < 1e-5


def test_full_rank_latent_reconstructs_keys_and_values_exactly():
    # At positions that coincide (no rotation), q_mla . [k_nope; k_rope] / s must be q . k for every head, and the
    # decoded values the source's; with an all but unexcited calibration Gram, so exactness needs no data.
    loaded = loaded_tiny("qwen2")  # biases on q, k, v
    plan = mla.plan_mla(loaded, budget="gqa")
    w = loaded.adapter.read(loaded.layers[0])
    layer = mla.convert_layer(w, torch.eye(65, dtype=torch.float64) * 1e-3, plan)
    recon = layer.decode @ layer.latent_rows  # [H, 2D, C+1]

    def aug(weight, bias):
        return torch.cat([weight.double(), bias.double()[..., None]], -1)

    q_aug, k_aug, v_aug = aug(w.q, w.q_bias), aug(w.k, w.k_bias), aug(w.v, w.v_bias)
    x = torch.cat([torch.randn(64, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    s = math.sqrt((16 + plan.rope_dim) / 16)  # the query scale: D^-0.5 = s (D + r)^-0.5
    for h in range(4):
        g = h // 2
        assert torch.allclose(recon[h, 16:] @ x, v_aug[g] @ x, atol=1e-8)
        q_mla = layer.query_map[h] @ (q_aug[h] @ x)
        k_mla = torch.cat([recon[h, :16] @ x, layer.rope_rows @ x])
        assert float(q_mla @ k_mla / s) == pytest.approx(float((q_aug[h] @ x) @ (k_aug[g] @ x)), rel=1e-9)


def test_lower_rank_costs_more_calibration_loss(text):
    loaded = loaded_tiny("llama")
    nll = [converted(loaded, text, kv_lora_rank=r, rope_dim=8)[1]["calibration_nll_after"] for r in (56, 16, 2)]
    assert nll[0] < nll[2] and nll[1] < nll[2]


def test_measured_rope_dim_search_uses_calibration(text):
    loaded = loaded_tiny("llama")
    _, record = converted(loaded, text, budget="mqa")  # 32 numbers, full rank would need 64 - r
    tried = record["rope_dim_search"]
    assert [t["rope_dim"] for t in tried] == [16, 8, 4]
    assert all(t["rope_dim"] + t["kv_lora_rank"] == 32 for t in tried)
    best = min(tried, key=lambda t: t["calibration_nll"])
    assert record["plan"]["rope_dim"] == best["rope_dim"] and record["plan"]["rope_choice"] == "measured"


def test_measured_split_also_measures_the_key_weight(text):
    """Under a budget the latent metric's key weight is tried at every KEY_WEIGHTS entry with the chosen split (its
    weight 1 the split search's own build) and the lowest calibration NLL kept; given numbers keep weight 1."""
    loaded = loaded_tiny("llama")
    _, record = converted(loaded, text, budget="mqa")
    tried = record["key_weight_search"]
    assert sorted(t["key_weight"] for t in tried) == sorted(mla.KEY_WEIGHTS)
    split = [t for t in record["rope_dim_search"] if t["rope_dim"] == record["plan"]["rope_dim"]][0]
    assert [t["calibration_nll"] for t in tried if t["key_weight"] == 1.0] == [split["calibration_nll"]]
    best = min(tried, key=lambda t: t["calibration_nll"])
    assert record["plan"]["key_weight"] == best["key_weight"]
    assert record["calibration_nll_after"] == pytest.approx(best["calibration_nll"], rel=1e-6)
    _, given = converted(loaded, text, kv_lora_rank=16, rope_dim=16)
    assert "key_weight_search" not in given and given["plan"]["key_weight"] == 1.0


def test_key_weight_scales_the_equal_energy_balance():
    """beta = key_weight x E_v / E_k (equal relative energy at 1), read back from the layer's record."""
    loaded = loaded_tiny("llama")
    plan = mla.plan_mla(loaded, kv_lora_rank=16, rope_dim=16)
    w = loaded.adapter.read(loaded.layers[0])
    x = torch.randn(65, 200, dtype=torch.float64)
    gram = x @ x.T
    equal = mla.convert_layer(w, gram, plan).balance
    quarter = mla.convert_layer(w, gram, mla._replace(plan, key_weight=0.25)).balance
    assert quarter == pytest.approx(0.25 * equal, rel=1e-12) and equal > 0


@pytest.mark.parametrize(
    ("written", "parsed"),
    [("gqa", "gqa"), ("MQA", "mqa"), ("48", 48), ("0.125", 0.125), ("12.5%", 0.125), ("1", 1.0), (" 100% ", 1.0)],
)
def test_budget_reads_rungs_counts_and_fractions(written, parsed):
    value = mla_budget(written)
    assert value == parsed and type(value) is type(parsed)


@pytest.mark.parametrize("written", ["half", "0", "-3", "48.5", "150%", "nan", ""])
def test_budget_refuses_what_is_not_a_budget(written):
    with pytest.raises(ValueError):
        mla_budget(written)


def test_count_and_fraction_budgets_plan_the_same_split():
    """Tiny llama: H 4, G 2, D 16, rd 16, so the source caches 2GD = 64 numbers per token per layer."""
    loaded = loaded_tiny("llama")
    assert mla_budget_numbers(0.375, 2, 16) == 24 and mla_budget_numbers("mqa", 2, 16) == 32
    by_count, by_fraction = mla.plan_mla(loaded, budget=24), mla.plan_mla(loaded, budget="37.5%")
    assert by_count.cache_numbers == by_fraction.cache_numbers == 24
    assert by_count.rope_choice == "measured" and by_count.budget == "24" and by_fraction.budget == "0.375"
    # the three largest rope dims that leave a latent: 16 (latent 8), 8 (16), 4 (20)
    assert [(p.rope_dim, p.kv_lora_rank) for p in mla.auto_rope_dims(by_count)] == [(16, 8), (8, 16), (4, 20)]
    # 16 numbers: rd itself leaves nothing, so the search starts one step down
    assert [p.rope_dim for p in mla.auto_rope_dims(mla.plan_mla(loaded, budget=16))] == [8, 4, 2]
    whole = mla.plan_mla(loaded, budget=64)  # the whole cache is the gqa rung: every frequency, full-rank latent
    assert (whole.rope_dim, whole.kv_lora_rank, whole.rope_choice) == (16, 48, "full")
    assert mla.plan_mla(loaded, budget="gqa").to_dict() | {"budget": "64"} == whole.to_dict()


def test_a_count_budget_is_searched_on_calibration(text):
    _, record = converted(loaded_tiny("llama"), text, budget=24)
    assert [t["rope_dim"] for t in record["rope_dim_search"]] == [16, 8, 4]
    assert record["plan"]["rope_dim"] + record["plan"]["kv_lora_rank"] == 24


@pytest.mark.parametrize(
    ("budget", "message"), [(65, "above the source's own cache"), (2, "no room for a latent"), ("x", "unknown budget")]
)
def test_plan_refuses_a_budget_out_of_range(budget, message):
    with pytest.raises(HeadlabError, match=message):
        mla.plan_mla(loaded_tiny("llama"), budget=budget)


# ---- the fold, the format, saving ----------------------------------------------------------------------------------


def test_fold_error_is_small_in_fp32_and_bf16(text):
    loaded = loaded_tiny("llama")
    model, _ = converted(loaded, text, kv_lora_rank=24, rope_dim=8)
    before = logits(model.model)
    folds = mla.fold_latent_norm(model.model)
    assert all(f["bound_mean_square"] * f["alpha"] ** 2 <= 2 * mla.FOLD_TOLERANCE * 1e-6 for f in folds)
    assert rel_diff(logits(model.model), before) < 1e-5
    assert mla.fold_latent_norm(model.model) == []  # already folded: nothing more to do
    # A plain (unfolded) RMSNorm on the latent would change the model a lot: the fold is doing the work.
    bf16 = converted(loaded, text, kv_lora_rank=24, rope_dim=8)[0].model.to(torch.bfloat16)
    reference = logits(bf16).float()
    mla.fold_latent_norm(bf16)
    assert rel_diff(logits(bf16).float(), reference) < 0.05
    with pytest.raises(HeadlabError, match="float16"):
        mla.fold_latent_norm(converted(loaded, text, kv_lora_rank=24, rope_dim=8)[0].model.to(torch.float16))


def test_save_reloads_as_vanilla_deepseek_v3_with_identical_logits(text, tmp_path):
    loaded = loaded_tiny("qwen2")
    model, record = converted(loaded, text, budget="mqa")
    out = tmp_path / "mla"
    saved = mla.save_mla(model, out, record)
    assert saved["verification"]["loader"] == "transformers.AutoModelForCausalLM.from_pretrained"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["first_k_dense_replace"] == 2 and config["num_key_value_heads"] == 4 and config["rope_interleave"]
    assert config["num_mtp_layers"] == 0 if "num_mtp_layers" in config else config["num_nextn_predict_layers"] == 0
    assert "auto_map" not in config  # no remote code
    attn = model.model.config._attn_implementation
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation=attn).eval()
    assert type(reloaded.model.layers[1].mlp).__name__ == "DeepseekV3MLP"
    assert torch.equal(logits(reloaded), logits(model.model))
    assert json.loads((out / "headlab.json").read_text())["latent_norm_fold"]["norms_folded"] == 4


def test_convert_checkpoint_records_every_step(text, tmp_path):
    loaded = loaded_tiny("llama")
    record = mla.convert_mla_checkpoint(
        loaded, tmp_path / "o", budget="mqa", text=text.but(split="eval"), calibration_tokens=256, progress=False
    )
    assert set(record["steps"]) == {"rorope_rotation", "query_scale", "rope_truncation", "latent_rank",
                                    "decoder_norm_eps"}  # fmt: skip
    assert record["measured_kv_bytes_per_token_after"] == 2 * 32 * 4  # 2 layers x (latent + rope) x fp32
    latent = record["steps"]["latent_rank"]  # below full rank: a real, measured error
    assert latent["max_abs_logit_diff"] > 0 and 0 < latent["attention_output_rel_error_mean"] < 1
    assert record["measured_kv_bytes_per_token_before"] == 2 * 2 * 2 * 16 * 4
    assert record["perplexity_after"]["perplexity"] > 0
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_low_rank_query_is_exact_when_the_query_has_that_rank(text):
    """A source whose q_proj has rank 12 (of 64) converts through q_lora_rank 12 exactly: the key-metric regression
    keeps the whole range of the converted query, so the logits equal the full-query conversion's."""
    loaded = loaded_tiny("llama")
    torch.manual_seed(0)
    for layer in loaded.model.model.layers:
        q = layer.self_attn.q_proj.weight
        q.data.copy_(torch.randn(q.shape[0], 12) @ torch.randn(12, q.shape[1]) / 12)
    full, full_record = converted(loaded, text, budget="gqa")
    low, record = converted(loaded, text, budget="gqa", q_lora_rank=12)
    assert low.model.config.q_lora_rank == 12 and full.model.config.q_lora_rank is None
    assert rel_diff(logits(low.model), logits(full.model)) < 1e-5
    assert all(layer["query_energy_kept"] == pytest.approx(1.0) for layer in record["layers"])
    # per layer: q_proj C 64 -> H (D + r) = 4 x 32 becomes q_a 64 -> 12 and q_b 12 -> 128 (the q_a norm, an identity
    # in memory, adds its 12 weights only at save)
    saved = full_record["parameters"]["converted"] - record["parameters"]["converted"]
    assert saved == 2 * (64 * 128 - (64 * 12 + 12 * 128))


def test_lower_query_rank_costs_more_and_the_checkpoint_reloads(text, tmp_path):
    loaded = loaded_tiny("qwen2")  # a query bias: it rides in q_a's bias
    error = {}
    for rank in (4, 32):
        record = mla.convert_mla_checkpoint(
            loaded, tmp_path / f"q{rank}", budget="gqa", q_lora_rank=rank, text=text.but(split="eval"),
            calibration_tokens=256, progress=False, evaluate=False,
        )  # fmt: skip
        step = record["steps"]["query_rank"]
        assert not step["exact"] and step["max_abs_logit_diff"] > 0
        error[rank] = step["attention_output_rel_error_mean"]  # a random tiny model's NLL barely moves: its outputs do
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"q{rank}")
        assert reloaded.config.q_lora_rank == rank and reloaded.model.layers[0].self_attn.q_a_proj.bias is not None
        assert record["verification"]["max_abs_diff"] < 1e-4, record["verification"]
    assert error[4] > error[32] > 0
    with pytest.raises(HeadlabError, match="saves nothing"):
        mla.plan_mla(loaded, budget="gqa", q_lora_rank=64)


def test_cli_converts_and_prints_each_step(tmp_path, capsys):
    source = save_tiny("qwen2", tmp_path / "src", num_key_value_heads=1)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 4)
    args = ["convert-mla", "--model", source, "--device", "cpu", "--data", tmp_path / "t.txt", "--seq-len", "32"]
    code, out, err = run_cli([*args, "--budget", "gqa", "--calibration-tokens", "256", "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    for line in (
        r"latent 16 \+ rope 16",
        r"step rope_truncation\s+exact,",
        r"step latent_norm_fold\s+eps",
        "reload check",
    ):
        assert re.search(line, out), line
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert reloaded.config.model_type == "deepseek_v3"


# ---- scaled RoPE: llama3 and yarn -----------------------------------------------------------------------------------


def sharpened(model, factor=3.0):
    """Every matrix scaled up: logits of a few units and peaked attention, so a wrong RoPE magnitude or frequency
    shows in the logits."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(factor)
    return model


def far_logits(model, seq=32, stride=997):
    """Logits at positions 0, 997, 1994, ...: up to ~31k, where the scaled and the plain frequencies part ways."""
    inputs = tiny_inputs("llama", seq=seq)
    with torch.no_grad():
        return model(**inputs, position_ids=torch.arange(seq)[None].expand(2, -1) * stride).logits


@pytest.mark.parametrize("name", ["llama3_2", "qwen2_yarn", "llama_linear"])
def test_scaled_rope_mqa_to_mla_is_exact(name, text):
    # From one KV head every step but the fold is exact; the converted config carries the source's scaling.
    loaded = from_model(sharpened(tiny_model(name, num_key_value_heads=1)), tiny_tokenizer())
    model, record = converted(loaded, text, budget="gqa")
    source = loaded.model.config.rope_parameters
    target = model.model.config.rope_parameters
    assert target["rope_type"] == source["rope_type"] == record["rope"]["source_type"]
    assert record["rope"]["frequencies_max_rel_diff"] == 0.0  # the same float32 frequencies, bit for bit
    if name == "qwen2_yarn":  # DeepSeek's own yarn form: cos/sin unscaled, softmax scale times mscale^2
        assert (target["mscale"], target["mscale_all_dim"]) == (1.0, 1.0)
    for positions in (logits, far_logits):
        expected = positions(loaded.model)
        assert expected.abs().max() > 1.0  # logits worth comparing
        assert rel_diff(positions(model.model), expected) < 1e-5
    mla.fold_latent_norm(model.model)
    assert rel_diff(far_logits(model.model), far_logits(loaded.model)) < 1e-5


@pytest.mark.parametrize("name", ["llama3_2", "llama_yarn", "llama_linear"])
@pytest.mark.parametrize("rope_dim", [16, 8, 4])
def test_scaled_rope_keeps_the_scaled_frequencies_at_every_rope_dim(name, rope_dim, text):
    """Keys with nothing to drop at full rank: exact at far positions only if deepseek_v3's rotary embedding at dim
    rope_dim has the source's scaled frequencies at the kept indices (yarn below rd: its ramp re-anchored)."""
    loaded = from_model(sharpened(tiny_model(name)), tiny_tokenizer())  # G = 2, D = 16
    _rank_one_keys(loaded, kept=list(range(0, 8, 16 // rope_dim)))
    model, record = converted(loaded, text, kv_lora_rank=2 * 2 * 16 - rope_dim, rope_dim=rope_dim)
    source = loaded.model.model.rotary_emb.inv_freq
    target = model.model.model.rotary_emb.inv_freq
    assert torch.equal(target, source[:: 16 // rope_dim])  # the scaled ones, in order, bit for bit
    if name == "llama_yarn" and rope_dim < 16:
        assert record["rope"]["parameters"]["truncate"] is False
    assert rel_diff(far_logits(model.model), far_logits(loaded.model)) < 1e-5


def test_yarn_attention_factor_is_folded_into_the_queries(text, monkeypatch):
    """DeepSeek's yarn form scales the softmax by m = mscale(factor)^2 with cos/sin unscaled; the source scales its
    rotary q.k by a^2 (a = mscale(factor) by default, or an explicit attention_factor). The query rows take a^2 / m:
    1 for a default yarn source, 1 / m for attention_factor 1, and leaving it out moves the logits."""
    g = 1 + 0.1 * math.log(4.0)  # mscale(factor 4)
    loaded = from_model(sharpened(tiny_model("llama_yarn", num_key_value_heads=1)), tiny_tokenizer())
    assert converted(loaded, text, budget="gqa")[1]["rope"]["magnitude"] == pytest.approx([1.0, 1 / g**2, 1.0])
    plain = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768,
                 attention_factor=1.0)  # fmt: skip
    loaded = from_model(sharpened(tiny_model("llama_yarn", num_key_value_heads=1, rope_parameters=plain)),
                        tiny_tokenizer())  # fmt: skip
    model, record = converted(loaded, text, budget="gqa")
    assert record["rope"]["magnitude"] == pytest.approx([1 / g**2] * 3)
    assert rel_diff(far_logits(model.model), far_logits(loaded.model)) < 1e-5
    monkeypatch.setattr(mla, "rope_magnitudes", lambda *_: (1.0, 1.0, 1.0))
    unfolded, _ = converted(loaded, text, budget="gqa")
    assert rel_diff(far_logits(unfolded.model), far_logits(loaded.model)) > 1e-2


@pytest.mark.parametrize("name", ["llama3_2", "qwen2_yarn"])
def test_cli_converts_scaled_rope_checkpoints_that_reload(name, tmp_path, capsys):
    """convert-mla and convert-gqa on saved Llama-3.2- and Qwen2.5-yarn-shaped checkpoints: both reload in vanilla
    transformers; the MLA of the one-KV-head variant has the source's logits."""
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 4)
    data = ["--device", "cpu", "--data", tmp_path / "t.txt", "--seq-len", "32", "--no-eval"]
    for kv, budget in ((1, "gqa"), (2, "mqa")):
        source = save_tiny(name, tmp_path / f"src{kv}", num_key_value_heads=kv)
        out = tmp_path / f"mla{kv}"
        args = ["convert-mla", "--model", source, *data, "--budget", budget, "--calibration-tokens", "256"]
        code, printed, err = run_cli([*args, "--out", out], capsys)
        assert code == 0, err
        assert re.search(r"RoPE\s+(llama3|yarn) carried exactly", printed), printed
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        assert reloaded.config.rope_parameters["rope_type"] == tiny_model(name).config.rope_parameters["rope_type"]
        if kv == 1:
            original = AutoModelForCausalLM.from_pretrained(source).eval()
            assert rel_diff(far_logits(reloaded), far_logits(original)) < 1e-4  # the fold's fp32 change only
    code, _, err = run_cli(["convert-gqa", "--model", tmp_path / "src2", *data, "--kv-heads", "1",
                            "--out", tmp_path / "gqa"], capsys)  # fmt: skip
    assert code == 0, err
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa")
    assert reloaded.config.num_key_value_heads == 1 and reloaded.config.rope_parameters["rope_type"] != "default"


# ---- per-head q/k norms (Qwen3): a calibrated constant ------------------------------------------------------------


def test_qk_norm_multipliers_match_a_token_by_token_loop(text):
    """r = sqrt(E[mean over a head's dims of y^2] + eps), y = q_proj / k_proj output per head, computed by hooking the
    projections on every real calibration token, equals the Gram-based multiplier's g / r."""
    loaded = loaded_tiny("qwen3")
    batches = text.batches(loaded.tokenizer, max_positions=64)
    grams = mla.input_grams(loaded, batches, progress=False)
    layer = loaded.layers[0]
    attention = layer.block_module.self_attn
    sums = {"q": torch.zeros(layer.num_heads, dtype=torch.float64), "k": torch.zeros(layer.num_kv_heads, dtype=torch.float64)}
    count = [0]
    seen = {}
    for input_ids, attention_mask, *_ in batches:
        seen.clear()
        handles = [getattr(attention, f"{n}_proj").register_forward_hook(
            lambda _m, _i, out, n=n: seen.__setitem__(n, out.detach().double())) for n in ("q", "k")]  # fmt: skip
        with torch.no_grad():
            loaded.model(input_ids=input_ids, attention_mask=attention_mask)
        for handle in handles:
            handle.remove()
        real = attention_mask.bool()
        for n, heads in (("q", layer.num_heads), ("k", layer.num_kv_heads)):
            y = seen[n][real].unflatten(-1, (heads, layer.head_dim))  # [N, h, D]
            sums[n] += y.pow(2).mean(-1).sum(0)
        count[0] += int(real.sum())
    mq, mk = mla.qk_norm_multipliers(loaded, layer, loaded.adapter.read(layer), grams[layer.index])
    for n, m in (("q", mq), ("k", mk)):
        norm = getattr(attention, f"{n}_norm")
        expected = norm.weight.double()[None, :] / (sums[n] / count[0] + norm.variance_epsilon).sqrt()[:, None]
        torch.testing.assert_close(m, expected, rtol=1e-6, atol=0)  # float32 projections, float64 sums


def test_qwen3_mla_equals_the_source_with_constant_qk_norms(text):
    """One KV head at the GQA budget converts exactly except for the q/k norms, so the MLA model's logits equal the
    source's with each norm replaced by its constant (constant_qk_norms): the fold is the only new approximation, and
    the record measures it on its own."""
    loaded = from_model(sharpened(tiny_model("qwen3", num_key_value_heads=1)), tiny_tokenizer())
    model, record = converted(loaded, text, budget="gqa")
    batches = text.batches(loaded.tokenizer, max_positions=64)
    multipliers = mla.all_qk_norm_multipliers(loaded, mla.input_grams(loaded, batches, progress=False))
    with mla.constant_qk_norms(loaded, multipliers):
        folded = logits(loaded.model)
    assert rel_diff(logits(model.model), folded) < 1e-5
    plain = logits(loaded.model)  # the norms are back once the context ends
    assert rel_diff(folded, plain) > 1e-3  # ... and the constant is a real change, which the record reports
    step = record["steps"]["qk_norm_fold"]
    assert step["exact"] is False and step["max_abs_logit_diff"] > 0
    assert step["calibration_nll"][0] == pytest.approx(record["calibration_nll_before"])


# ---- post-norm blocks (OLMo 2): the nearest pre-norm form ----------------------------------------------------------


def test_pre_norm_constants_match_a_token_by_token_loop(text):
    """E[mean(x^2)] of each post-norm's and raw sublayer's input over the real calibration tokens of a padded batch,
    computed by hooking the modules and summing token by token, gives the form's gains c and constants g / r."""
    loaded = loaded_tiny("olmo2")
    ids, mask = tiny_inputs("olmo2", batch=2, seq=24).values()
    mask[1, 16:] = 0  # padding: excluded from every mean
    batches = [(ids, mask)]
    block = loaded.adapter.blocks(loaded.model)[1]
    modules = {"attn_out": block.post_attention_layernorm, "mlp_out": block.post_feedforward_layernorm,
               "attn_in": block.self_attn, "mlp_in": block.mlp}  # fmt: skip
    seen = {}
    handles = [m.register_forward_pre_hook(
        lambda _m, args, kwargs, n=n: seen.__setitem__(n, (args[0] if args else kwargs["hidden_states"]).double()),
        with_kwargs=True) for n, m in modules.items()]  # fmt: skip
    with torch.no_grad():
        loaded.model(input_ids=ids, attention_mask=mask)
    for handle in handles:
        handle.remove()
    real = [(row, t) for row in range(2) for t in range(24) if mask[row, t]]
    square = {n: sum(float(x[row, t].pow(2).mean()) for row, t in real) / len(real) for n, x in seen.items()}
    form = post_norms.PreNormForm.measure(loaded, batches, eps=1e-6)
    assert form.gains[1] == pytest.approx((square["attn_in"] ** 0.5, square["mlp_in"] ** 0.5), rel=1e-9)
    for norm, name, m in ((modules["attn_out"], "attn_out", form.outputs[1][0]),
                          (modules["mlp_out"], "mlp_out", form.outputs[1][1])):  # fmt: skip
        expected = norm.weight.double() / (square[name] + norm.variance_epsilon) ** 0.5
        torch.testing.assert_close(m, expected.detach(), rtol=1e-9, atol=0)


def nearest_form_logits(loaded, text):
    """The source's logits in its nearest pre-norm form (post-norms constant) with its q/k norms constant: what an
    MLA conversion that is otherwise exact must equal."""
    batches = text.batches(loaded.tokenizer, max_positions=64)
    form = post_norms.PreNormForm.measure(loaded, batches, mla.LATENT_NORM_EPS)
    with form.applied(loaded):
        multipliers = mla.all_qk_norm_multipliers(loaded, mla.input_grams(loaded, batches, progress=False))
        with mla.constant_qk_norms(loaded, multipliers):
            return logits(loaded.model)


def test_olmo2_mla_equals_its_nearest_pre_norm_form(text):
    """One KV head at the GQA budget converts exactly except for the norms, so the MLA model's logits equal the
    source's in its nearest pre-norm form with constant q/k norms: the post-norm fold is the only new approximation,
    and the record measures it on its own against the real source."""
    loaded = from_model(sharpened(tiny_model("olmo2", num_key_value_heads=1)), tiny_tokenizer())
    plain = logits(loaded.model)
    model, record = converted(loaded, text, budget="gqa")
    nearest = nearest_form_logits(loaded, text)
    assert rel_diff(logits(model.model), nearest) < 1e-5
    assert torch.equal(logits(loaded.model), plain)  # the source is back as it was
    assert rel_diff(nearest, plain) > 1e-3  # ... and the form is a real change, which the record reports
    step = record["steps"]["post_norm_fold"]
    assert step["exact"] is False and step["max_abs_logit_diff"] > 0
    assert step["calibration_nll"][0] == pytest.approx(record["calibration_nll_before"])
    assert step["calibration_nll"][1] == pytest.approx(record["steps"]["qk_norm_fold"]["calibration_nll"][0])


def test_gemma3_mla_equals_its_nearest_pre_norm_form(text):
    """Gemma 3's blocks hold a scaled embedding, 1 + w norms, pre- and post-norms around each sublayer, a GELU MLP and
    query_pre_attn_scalar: with one KV head, a window no input reaches and one RoPE base, every fold but the norm
    constants is exact, so the MLA model's logits equal the source's with its post-norms and q/k norms constant."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    same = {"sliding_attention": rope, "full_attention": rope}
    source = tiny_model("gemma3_text", num_key_value_heads=1, sliding_window=64, rope_parameters=same)
    loaded = from_model(sharpened(source), tiny_tokenizer())
    assert loaded.model.config.query_pre_attn_scalar != loaded.model.config.head_dim  # the scale fold is tested
    plain = logits(loaded.model)
    model, record = converted(loaded, text, budget="gqa")
    nearest = nearest_form_logits(loaded, text)
    assert rel_diff(logits(model.model), nearest) < 1e-5
    assert torch.equal(logits(loaded.model), plain)
    assert model.model.config.hidden_act == "gelu_pytorch_tanh" and not model.model.config.tie_word_embeddings
    steps = record["steps"]
    assert steps["embedding_scale"]["exact"] and steps["norm_offset"]["exact"]
    assert "sliding_window" not in steps and "layer_rope" not in steps  # nothing slides, one base


def test_gemma3_sliding_layers_keep_their_own_frequencies_where_the_target_has_them(text):
    """Sliding layers at base 1e4 under deepseek_v3's single RoPE (the full layers' 1e6): each target pair carries
    the sliding layer's pair nearest in frequency, exactly where the two sets meet, none beyond a factor of 2; the
    record names the window and the frequency change, and rope_truncation measures them."""
    loaded = from_model(sharpened(tiny_model("gemma3_text")), tiny_tokenizer())
    plan = mla.plan_mla(loaded, budget="gqa")
    sliding, full = mla.gqa_layers(loaded)
    local, shared = mla.source_rope(loaded, sliding)[0], mla.source_rope(loaded)[0]
    kept = mla.layer_kept_frequencies(loaded, plan, sliding)
    assert mla.layer_kept_frequencies(loaded, plan, full) == plan.kept_frequencies
    # F = 8: shared f_j = 1e6^(-j/8), local f_i = 1e4^(-i/8), so f_j = f_i at i = 1.5 j (j = 0, 2, 4 -> 0, 3, 6).
    assert [kept[j] for j in (0, 2, 4)] == [0, 3, 6]
    for j, i in enumerate(kept):  # by hand: a pair within a factor of 2, or none at all
        if i is None:
            assert all(abs(math.log(shared[j] / local[k])) > math.log(2) for k in range(8) if k not in kept)
        else:
            assert abs(math.log(shared[j] / local[i])) <= math.log(2) + 1e-12
    matched = [i for i in kept if i is not None]
    assert kept.count(None) > 0 and len(set(matched)) == len(matched)  # each local pair carried once at most
    _, record = converted(loaded, text, budget="gqa")
    steps = record["steps"]
    assert steps["sliding_window"]["window"] == 4 and steps["sliding_window"]["layers"] == [sliding.block]
    assert 0 < steps["layer_rope"]["max_relative_frequency_change"][sliding.block] < 1
    assert steps["rope_truncation"]["exact"] is False and steps["rope_truncation"]["max_abs_logit_diff"] > 0


def test_mistral_window_converts_to_full_attention_on_record(text):
    """A window on every layer (Mistral v0.1) becomes full attention: named in the record, measured in
    rope_truncation, which is no longer exact even from one KV head; one RoPE base, so no layer_rope step."""
    loaded = loaded_tiny("mistral", num_key_value_heads=1)
    _, record = converted(loaded, text, budget="gqa")
    steps = record["steps"]
    assert steps["sliding_window"]["window"] == 4 and steps["sliding_window"]["layers"] == [0, 1]
    assert "layer_rope" not in steps and steps["rope_truncation"]["exact"] is False
    assert steps["rope_truncation"]["max_abs_logit_diff"] > 0


def test_export_gguf_refuses_gemma3s_gelu_mla(text, tmp_path):
    """llama.cpp's deepseek2 runs a SiLU-gated MLP: an MLA model that keeps Gemma 3's GELU is refused in one line."""
    pytest.importorskip("gguf")
    from headlab.runtimes.gguf_export import export_gguf

    loaded = from_model(tiny_model("gemma3_text"), tiny_tokenizer())
    model, _ = converted(loaded, text, budget="mqa")
    mla.fold_latent_norm(model.model)
    with pytest.raises(HeadlabError, match="hidden_act gelu_pytorch_tanh"):
        export_gguf(from_model(model.model, loaded.tokenizer), tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def _cli_convert(tmp_path, capsys, family, *extra):
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 4)
    source = save_tiny(family, tmp_path / family)
    args = ["convert-mla", "--model", source, "--device", "cpu", "--data", tmp_path / "t.txt", "--seq-len", "32",
            "--no-eval", "--budget", "mqa", "--calibration-tokens", "256", "--out", tmp_path / "mla", *extra]  # fmt: skip
    return run_cli(args, capsys)


@pytest.mark.parametrize(
    ("family", "step", "gone"),
    [
        ("qwen3", "qk_norm_fold", ("q_norm", "k_norm")),
        ("olmo2", "post_norm_fold", ("feedforward_layernorm",)),
        ("gemma3_text", "rope_truncation", ("feedforward_layernorm", "q_norm")),
    ],
)
def test_cli_converts_and_prints_what_each_fold_costs(tmp_path, capsys, family, step, gone):
    """Qwen3's per-head q/k norms, OLMo 2's post-norm blocks and Gemma 3's sliding layers: the CLI prints the
    approximation's measured cost, and the checkpoint reloads as a vanilla deepseek_v3 without the source's norms."""
    code, printed, err = _cli_convert(tmp_path, capsys, family)
    assert code == 0, err
    line = next(row for row in printed.splitlines() if row.startswith(f"step {step}"))
    assert "approximate" in line and "attention-output rel. error" in line and "calibration NLL" in line
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mla")
    assert reloaded.config.model_type == "deepseek_v3"
    assert not any(part in name for name, _ in reloaded.named_parameters() for part in gone)
    if family == "gemma3_text":  # the two approximations say what they changed and where their cost shows
        assert re.search(r"step sliding_window\s+approximate, window 4 in layers 0 \(cost in rope_truncation\)", printed)
        assert re.search(r"step layer_rope\s+approximate, rotary frequencies moved by up to [\d.]+% in layers 0 \(cost", printed)


def test_streaming_refuses_post_norm_blocks(tmp_path, capsys):
    code, _, err = _cli_convert(tmp_path, capsys, "olmo2", "--streaming")
    assert code == 2 and "without --streaming" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "mla").exists()


SCALED_ROPE = {
    "yarn": dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", rope_theta=1e4, factor=8.0),  # Gemma 3's global layers from 4B up
}


def _yarn_mla(text, rope="yarn"):
    """A sharpened one-KV-head llama with scaled RoPE (yarn: its ramp shows at positions < 48, original context 64,
    theta 1e4), converted exactly (budget gqa) and folded, as a LoadedModel with test_gguf's byte-level BPE
    tokenizer."""
    from test_gguf import VOCAB, bpe_tokenizer  # optional: test_gguf skips itself without the gguf package

    scaled = SCALED_ROPE[rope]
    source = sharpened(tiny_model("llama", vocab_size=VOCAB, num_key_value_heads=1, rope_parameters=scaled), 6.0)
    loaded = from_model(source, bpe_tokenizer())
    model, _ = converted(loaded, text, budget="gqa")
    mla.fold_latent_norm(model.model)
    return loaded, from_model(model.model, loaded.tokenizer)


def test_export_gguf_writes_deepseek_yarn_and_refuses_llama3(text, tmp_path):
    """deepseek2 with DeepSeek's yarn keys (0.1 x mscale_all_dim as the log multiplier, as convert_hf_to_gguf writes);
    llama3 (deepseek2 applies no frequency factors) and a yarn ramp re-anchored below the rotary dims are refused."""
    pytest.importorskip("gguf")
    from test_gguf import VOCAB, bpe_tokenizer, read  # optional: needs the gguf package (checked above)

    from headlab.runtimes.gguf_export import export_gguf

    loaded, model = _yarn_mla(text)
    export_gguf(model, tmp_path / "yarn.gguf", outtype="f32", progress=False)
    fields, _ = read(tmp_path / "yarn.gguf")
    assert fields["deepseek2.rope.scaling.type"] == "yarn" and fields["deepseek2.rope.scaling.factor"] == 4.0
    assert fields["deepseek2.rope.scaling.original_context_length"] == 64
    assert fields["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    cases = [
        (from_model(tiny_model("llama3_2", vocab_size=VOCAB), bpe_tokenizer()), dict(budget="gqa"), "rope_freqs"),
        (loaded, dict(kv_lora_rank=16, rope_dim=8), "beta_fast 32"),  # yarn re-anchored at rope_dim 8 < 16
    ]
    for source, plan, message in cases:
        converted_model, _ = converted(source, text, **plan)
        mla.fold_latent_norm(converted_model.model)
        with pytest.raises(HeadlabError, match=message):
            export_gguf(from_model(converted_model.model, source.tokenizer), tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("rope", list(SCALED_ROPE))
def test_llamacpp_runs_yarn_mla_like_transformers(text, tmp_path, rope):
    """llama.cpp's log-probs of the yarn or linear-RoPE MLA model equal transformers' (measured for yarn: worst
    logit difference ~5e-6 of ~4; writing no yarn keys gives 3.6, no log multiplier 2.3)."""
    pytest.importorskip("gguf")
    from test_gguf import LLAMACPP, _windows, read  # optional: needs the gguf package (checked above)

    if LLAMACPP is not None:
        pytest.skip(LLAMACPP)
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs

    _, model = _yarn_mla(text, rope)
    export_gguf(model, tmp_path / "yarn.gguf", outtype="f32", progress=False)
    if rope == "linear":
        fields, _ = read(tmp_path / "yarn.gguf")
        assert fields["deepseek2.rope.scaling.type"] == "linear" and fields["deepseek2.rope.scaling.factor"] == 8.0
    result = compare_logprobs(model, tmp_path / "yarn.gguf", _windows(model))
    assert result["max_abs_logit"] > 1.0 and result["relative_difference"] < 1e-4, result
    assert result["max_abs_logit_diff"] < 1e-4 * result["max_abs_logit"], result


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_llamacpp_runs_qwen3_and_olmo2_mla_like_transformers(text, tmp_path, family):
    """A Qwen3-shaped source (per-head q/k norms folded to constants) or an OLMo 2-shaped one (its post-norm blocks
    in their nearest pre-norm form besides) converted at the MQA budget is an ordinary deepseek2 model for
    llama.cpp: its log-probs equal transformers'."""
    pytest.importorskip("gguf")
    from test_gguf import LLAMACPP, VOCAB, _windows, bpe_tokenizer  # optional: needs the gguf package (checked above)

    if LLAMACPP is not None:
        pytest.skip(LLAMACPP)
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs

    source = from_model(sharpened(tiny_model(family, vocab_size=VOCAB), 2.0), bpe_tokenizer())
    model, _ = converted(source, text, budget="mqa")
    mla.fold_latent_norm(model.model)
    model = from_model(model.model, source.tokenizer)
    export_gguf(model, tmp_path / "mla.gguf", outtype="f32", progress=False)
    result = compare_logprobs(model, tmp_path / "mla.gguf", _windows(model))
    assert result["max_abs_logit"] > 1.0 and result["relative_difference"] < 1e-4, result
    assert result["max_abs_logit_diff"] < 1e-4 * result["max_abs_logit"], result


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_k_m"])
def test_quantized_mla_gguf_keeps_the_folded_latent_in_f32(text, tmp_path, outtype):
    """The latent-norm fold leaves the latent down-projection near 2^-20 of its size: f16 and the f16 block scales of
    quantized types flush it to zero (the model's perplexity went 91 -> 24,918 as q8_0), so it stays f32 in every file
    type and the quantized file's log-probs stay near transformers'."""
    pytest.importorskip("gguf")
    from test_gguf import LLAMACPP, VOCAB, _windows, bpe_tokenizer, read  # optional: needs the gguf package

    if LLAMACPP is not None and outtype == "q4_k_m":
        pytest.skip(LLAMACPP)
    from headlab.runtimes.gguf_export import export_gguf

    source = from_model(sharpened(tiny_model("llama", vocab_size=VOCAB), 2.0), bpe_tokenizer())
    model, _ = converted(source, text, budget="mqa")
    mla.fold_latent_norm(model.model)
    model = from_model(model.model, source.tokenizer)
    record = export_gguf(model, tmp_path / "m.gguf", outtype=outtype, progress=False)
    _, tensors = read(tmp_path / "m.gguf")
    kept = {name: t.tensor_type.name for name, t in tensors.items() if "attn_kv_a_mqa" in name}
    assert kept and set(kept.values()) == {"F32"}, kept
    assert any("kept in f32" in note for note in record["notes"])
    if LLAMACPP is None:
        from headlab.runtimes.llamacpp import compare_logprobs

        result = compare_logprobs(model, tmp_path / "m.gguf", _windows(model))
        assert result["relative_difference"] < 0.05, result  # a flushed latent gives hundreds of times the perplexity


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides", "plan", "message"),
    [
        ("llama", {}, dict(kv_lora_rank=60, rope_dim=8), "above the full rank"),
        ("llama", {}, dict(kv_lora_rank=8, rope_dim=6), "even divisor"),
        ("llama", {}, dict(kv_lora_rank=0, rope_dim=8), "no room"),
        ("llama", {}, {}, "budget="),
        ("llama", {}, dict(budget="gqa", kv_lora_rank=8), "not both"),
        ("llama", {}, dict(budget="half"), "half"),
        ("gemma3_text", {"use_bidirectional_attention": True}, dict(budget="gqa"), "bidirectional attention"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, dict(budget="gqa"), "attn_logit_softcapping"),
        ("gpt2", {}, dict(budget="gqa"), "gpt2"),
        ("phi3", {}, dict(budget="gqa"), "do not map"),  # fused gate_up MLP
        ("llama", {"mlp_bias": True}, dict(budget="gqa"), "MLP biases"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            {"budget": "gqa"},
            "dynamic",
        ),
    ],  # fmt: skip
)
def test_plan_refuses_what_the_format_cannot_express(name, overrides, plan, message):
    model = tiny_model(name, **overrides)
    with pytest.raises(HeadlabError, match=message):
        mla.plan_mla(from_model(model), **plan)


# ---- recovery and the ladder ------------------------------------------------------------------------------------


def test_recovery_trains_the_norm_free_model_and_the_saved_checkpoint_holds_it(text, tmp_path):
    """convert-mla's recovery hook: local reconstruction of the norm-free MLA model towards the untouched source (a
    teacher of another model type), then the fold at save; the reloaded checkpoint computes the recovered model."""
    from headlab.recovery.recover import RecoverySpec, recover

    loaded = loaded_tiny("llama")
    spec = RecoverySpec(stages=["local"], minutes=None, local_tokens=256, local_seq_len=32)
    spec.local.steps = 3
    seen = {}

    def recovery(student):
        seen["before"] = logits(student.model)
        record = recover(student, loaded, spec, data=text.data, progress=False)
        seen["logits"] = logits(student.model)
        return record

    record = mla.convert_mla_checkpoint(
        loaded, tmp_path / "o", kv_lora_rank=8, rope_dim=8, text=text.but(split="eval"), calibration_tokens=256,
        progress=False, recovery=recovery,
    )  # fmt: skip
    local = record["recovery"]["local"]
    assert local["error_after"] < local["error_before"]  # each layer's held-out reconstruction error went down
    # the stage gate keeps the stage only if no held-out domain got worse (on a tiny random model it may be undone)
    assert local["layers_changed"] > 0 and local["kept"] == (not torch.equal(seen["logits"], seen["before"]))
    assert (tmp_path / "o" / "recovery" / "local.csv").is_file()
    assert "tables" not in json.loads((tmp_path / "o" / "headlab.json").read_text())["recovery"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    assert rel_diff(logits(reloaded), seen["logits"]) < 1e-4  # the fold's small change only


def test_cli_recover_flag_reaches_the_conversion(tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "src")
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 4)
    args = ["convert-mla", "--model", source, "--device", "cpu", "--data", tmp_path / "t.txt", "--seq-len", "32"]
    args += ["--kv-lora-rank", "8", "--rope-dim", "8", "--calibration-tokens", "256", "--out", tmp_path / "o"]
    code, out, err = run_cli([*args, "--recover", "uptrain", "--recover-steps", "2"], capsys)
    assert code == 0, err
    assert re.search(r"after recovery \(uptrain, [\d,]+ tokens\)\s+\d", out)
    assert (tmp_path / "o" / "recovery" / "curve.csv").is_file()
    # convert-mla's default recovery distils on half the teacher's own samples, each from a random first token
    meta = json.loads((tmp_path / "o" / "recovery" / "meta.json").read_text())
    generated = meta["uptrain"]["calibration"]["generated"]
    assert generated["windows_per_batch"] == 2 and generated["start"] == "random"
    # under --recover-parallel fsdp (no sampling there) the default share is dropped, not refused: what refuses here
    # is the missing torchrun, the option the user did give
    code, out, err = run_cli([*args[:-1], tmp_path / "f", "--recover", "uptrain", "--recover-parallel", "fsdp"], capsys)
    assert code == 2 and "torchrun" in err and "generated" not in err and not (tmp_path / "f").exists()


def test_ladder_adds_mla_rows_measured_from_a_real_cache(text, tmp_path):
    """gqa-sweep --mla: one row per budget beside the KV-head rows; the MLA rows' measured cache is (latent + rope)
    numbers per layer, the same bytes as the rung they are named after."""
    from headlab.kv import ladder

    loaded = loaded_tiny("llama")
    frame, meta = ladder.ladder(
        loaded, mla=("gqa", "mqa"), text=text.but(split="eval", max_tokens=256), calibration_tokens=256,
        groupings=("contiguous",), pools=("mean",), progress=False,
    )  # fmt: skip
    rungs = frame.set_index("variant")
    mla_rows = frame[frame["action"] == "mla"]
    assert len(mla_rows) == 2 and meta["mla"]["budgets"] == ["gqa", "mqa"]
    gqa_bytes = rungs.loc[rungs["kv_heads"] == 2, "kv_bytes_per_token"].iloc[0]  # the source's own cache
    mqa_bytes = rungs.loc[rungs["kv_heads"] == 1, "kv_bytes_per_token"].iloc[0]
    assert list(mla_rows["kv_bytes_per_token"]) == [gqa_bytes, mqa_bytes]
    assert all(mla_rows["kv_lora_rank"] + mla_rows["rope_dim"] == [64, 32])  # 2 x G x D and 2 x D, G = 2, D = 16
    assert (mla_rows["perplexity"] > 0).all() and (mla_rows["relative_kv_bytes"] <= 1).all()
    ladder.run_ladder(loaded, tmp_path / "run", mla=("mqa",), text=text.but(split="eval", max_tokens=256),
                      calibration_tokens=256, groupings=("contiguous",), pools=("mean",), progress=False)  # fmt: skip
    assert (tmp_path / "run" / "gqa_sweep.png").is_file() and (tmp_path / "run" / "sweep.csv").is_file()
