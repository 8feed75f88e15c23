"""GGUF export: the file's metadata and tensors read back with the gguf package, the RoPE row permutation checked
against both RoPE conventions written out by hand, refusals, and (when llama-cpp-python is installed) llama.cpp's
own log-probabilities against transformers' on tiny models (the embedded model: slow tests)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.runtimes import gguf_export, llamacpp
from headlab.runtimes.gguf_export import MLA_KEEP_F32, check_type, export_gguf, interleave_rope_rows, plan_export
from headlab.runtimes.llamacpp import compare_logprobs, unavailable

gguf = pytest.importorskip("gguf")
LLAMACPP = unavailable()
needs_llamacpp = pytest.mark.skipif(LLAMACPP is not None, reason=str(LLAMACPP))
VOCAB = 300


def bpe_tokenizer():
    """A byte-level BPE tokenizer (the kind llama.cpp's "gpt2" vocabulary reads) trained on the sample text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([SAMPLE_TEXT], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    return tokenizer


def tiny(name="llama", **overrides):
    return from_model(tiny_model(name, vocab_size=VOCAB, **overrides), bpe_tokenizer())


def pruned(loaded, heads):
    """Physically prune `heads` (one set per layer) with headlab's own layout rules."""
    from headlab.pruning.prune import apply_physical, physical_layout, prepare_config

    layout = physical_layout(loaded.layers, heads)
    apply_physical(loaded, layout)
    prepare_config(loaded, layout)
    return from_model(loaded.model, loaded.tokenizer)


def kv_converted(loaded, kv_heads=1):
    from headlab.kv.gqa import convert

    convert(loaded, kv_heads)
    return from_model(loaded.model, loaded.tokenizer)


def kv_per_layer(loaded, counts=(1, 2)):
    """Per-layer KV-head counts (convert-gqa --kv-budget's layout), mean-pooled."""
    from headlab.kv.budget import BudgetSpec, apply_counts

    apply_counts(loaded, list(counts), BudgetSpec(1.0), None)
    return from_model(loaded.model, loaded.tokenizer)


def llamacpp_bytes_per_token(loaded, path) -> float:
    """llama.cpp's own bytes per cached token of `loaded` exported to `path` (f32): its state size after 48 tokens
    minus after 16, over 32 (the cells' keys, values and metadata)."""
    from headlab.runtimes.llamacpp import open_model

    export_gguf(loaded, path, outtype="f32", progress=False)
    sizes = []
    for n in (16, 48):
        llm = open_model(path, n_ctx=64)
        llm.eval(list(range(3, 3 + n)))
        sizes.append(llm.save_state().llama_state_size)
        llm.close()
    return (sizes[1] - sizes[0]) / 32


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def tensor_of(t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major [out, in]) order."""
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])


# ---- the RoPE permutation, against both conventions by hand ------------------------------------------------------


def rope_rotate_half(x, positions, base=10000.0):
    """transformers: dimension i pairs with i + d/2."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[:, None].double() * inv  # [T, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def rope_adjacent(x, positions, base=10000.0):
    """llama.cpp "normal" RoPE: dimension 2i pairs with 2i + 1, both at frequency i."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        theta = positions.double() * base ** (-2 * i / d)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * theta.cos() - b * theta.sin()
        out[..., 2 * i + 1] = a * theta.sin() + b * theta.cos()
    return out


def test_interleaved_rows_turn_rotate_half_into_adjacent_pair_rope():
    torch.manual_seed(0)
    heads, d, hidden, tokens = 3, 8, 5, 6
    w_q, w_k = torch.randn(heads * d, hidden, dtype=torch.float64), torch.randn(heads * d, hidden, dtype=torch.float64)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    positions = torch.arange(tokens)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).reshape(tokens, heads, d).transpose(0, 1), positions)  # [H, T, d]
        k = rope((x @ wk.T).reshape(tokens, heads, d).transpose(0, 1), positions)
        return q @ k.transpose(1, 2)  # [H, T, T]

    hf = scores(w_q, w_k, rope_rotate_half)
    cpp = scores(interleave_rope_rows(w_q, heads), interleave_rope_rows(w_k, heads), rope_adjacent)
    torch.testing.assert_close(cpp, hf)
    # and the permutation itself: new row 2i of each head is old row i, new row 2i+1 is old row i + d/2
    perm = interleave_rope_rows(torch.arange(heads * d, dtype=torch.float64)[:, None], heads)[:, 0].long()
    assert perm[:d].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert perm[d : 2 * d].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]


# ---- metadata and tensors --------------------------------------------------------------------------------------


def test_uniform_llama_writes_llama_arch_with_permuted_q_k(tmp_path):
    loaded = tiny()
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    fields, tensors = read(tmp_path / "m.gguf")
    assert record["architecture"] == fields["general.architecture"] == "llama"
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.attention.key_length"] == 16 and fields["llama.rope.dimension_count"] == 16
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and "<s>" in fields["tokenizer.chat_template"]
    attn = loaded.model.model.layers[1].self_attn
    np.testing.assert_array_equal(
        tensor_of(tensors["blk.1.attn_q.weight"]), interleave_rope_rows(attn.q_proj.weight, 4).detach().numpy()
    )
    np.testing.assert_array_equal(
        tensor_of(tensors["blk.1.attn_k.weight"]), interleave_rope_rows(attn.k_proj.weight, 2).detach().numpy()
    )
    np.testing.assert_array_equal(tensor_of(tensors["blk.1.attn_v.weight"]), attn.v_proj.weight.detach().numpy())
    np.testing.assert_array_equal(
        tensor_of(tensors["blk.0.ffn_down.weight"]), loaded.model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    )
    assert ("output.weight" in tensors) != loaded.model.config.tie_word_embeddings


def test_tied_embeddings_leave_out_the_output_head(tmp_path):
    loaded = tiny(tie_word_embeddings=True)
    export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    _, tensors = read(tmp_path / "m.gguf")
    assert "output.weight" not in tensors and "token_embd.weight" in tensors


def test_non_uniform_prune_goes_to_deci_with_per_layer_arrays(tmp_path):
    loaded = pruned(tiny(), [{0, 1}, set()])  # layer 0 loses KV group 0 with both its query heads
    plan = plan_export(loaded)
    assert plan.target.arch == "deci" and plan.heads == [2, 4] and plan.kv_heads == [1, 2]
    export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "deci"
    assert list(fields["deci.attention.head_count"]) == [2, 4]
    assert list(fields["deci.attention.head_count_kv"]) == [1, 2]
    assert tensor_of(tensors["blk.0.attn_q.weight"]).shape == (2 * 16, 64)
    assert tensor_of(tensors["blk.0.attn_k.weight"]).shape == (16, 64)
    kept_q = loaded.model.model.layers[0].self_attn.q_proj.weight
    np.testing.assert_array_equal(
        tensor_of(tensors["blk.0.attn_q.weight"]), interleave_rope_rows(kept_q, 2).detach().numpy()
    )


def test_per_layer_kv_budget_goes_to_deci_with_per_layer_kv_counts(tmp_path):
    loaded = kv_per_layer(tiny())
    plan = plan_export(loaded)
    assert plan.target.arch == "deci" and plan.heads == [4, 4] and plan.kv_heads == [1, 2]
    export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    fields, tensors = read(tmp_path / "m.gguf")
    assert list(fields["deci.attention.head_count_kv"]) == [1, 2]
    assert tensor_of(tensors["blk.0.attn_k.weight"]).shape == (16, 64)
    assert tensor_of(tensors["blk.1.attn_k.weight"]).shape == (2 * 16, 64)


def test_an_emptied_layer_is_attention_free_in_deci(tmp_path):
    # Every head of layer 1 pruned: transformers keeps one zero-output padding head; deci gets 0 heads, no tensors.
    loaded = pruned(tiny(), [set(), {0, 1, 2, 3}])
    assert [layer.num_heads for layer in loaded.layers] == [4, 1]  # the padding head
    plan = plan_export(loaded)
    assert plan.target.arch == "deci" and plan.heads == [4, 0] and plan.kv_heads == [2, 0]
    assert plan.attention_free == [1]
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    fields, tensors = read(tmp_path / "m.gguf")
    assert list(fields["deci.attention.head_count"]) == [4, 0] and record["attention_free_layers"] == [1]
    assert not [name for name in tensors if name.startswith("blk.1.attn_")]
    assert {"blk.1.ffn_norm.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight"} <= set(tensors)
    # llama.cpp reads the head size only when layer 0 has heads: an emptied layer 0 keeps its padding head.
    first = plan_export(pruned(tiny(), [{0, 1, 2, 3}, set()]))
    assert first.attention_free == [] and first.heads == [1, 4]


def test_llamacpp_caches_nothing_for_an_attention_free_layer(tmp_path):
    """llama.cpp's bytes per cached token (state size at 48 minus at 16 tokens, over 32): the emptied layer's keys
    and values are gone, the other layer's 2 KV heads x 16 dims (f16) remain."""
    if LLAMACPP is not None:
        pytest.skip(LLAMACPP)
    full = llamacpp_bytes_per_token(tiny(), tmp_path / "full.gguf")
    emptied = llamacpp_bytes_per_token(pruned(tiny(), [set(), {0, 1, 2, 3}]), tmp_path / "emptied.gguf")
    assert full - emptied == 2 * 16 * 2 * 2  # one layer's K and V: 2 KV heads x 16 dims, f16


def test_qwen2_uniform_stays_qwen2_unpermuted_and_a_pruned_qwen2_needs_deci(tmp_path):
    loaded = tiny("qwen2")
    assert plan_export(loaded).target.arch == "qwen2"
    export_gguf(loaded, tmp_path / "q.gguf", outtype="f32", progress=False)
    _, tensors = read(tmp_path / "q.gguf")
    attn = loaded.model.model.layers[0].self_attn
    np.testing.assert_array_equal(tensor_of(tensors["blk.0.attn_q.bias"]), attn.q_proj.bias.detach().numpy())
    uniform = pruned(tiny("qwen2"), [{0, 1}, {0, 1}])  # 2 x 16 < hidden 64: qwen2's n_embd-wide q does not fit
    assert plan_export(uniform).target.arch == "deci"


def test_qwen3_uniform_is_qwen3_and_per_layer_qwen3_is_refused():
    assert plan_export(tiny("qwen3")).target.arch == "qwen3"
    with pytest.raises(HeadlabError, match="llama.cpp cannot run this qwen3 layout"):
        plan_export(pruned(tiny("qwen3"), [{0, 1}, set()]))


@pytest.mark.parametrize("outtype, tolerance", [("f16", 1e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_tensor_types_round_trip(tmp_path, outtype, tolerance):
    loaded = tiny()
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype=outtype, progress=False)
    _, tensors = read(tmp_path / "m.gguf")
    assert tensors["blk.0.attn_v.weight"].tensor_type.name == outtype.upper()
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # vectors stay f32
    assert outtype in record["tensor_types"]
    expected = loaded.model.model.layers[0].self_attn.v_proj.weight.detach().numpy()
    got = tensor_of(tensors["blk.0.attn_v.weight"])
    assert np.abs(got - expected).max() <= tolerance * np.abs(expected).max()


def test_refusals(tmp_path):
    with pytest.raises(HeadlabError, match="not a type export-gguf writes") as refusal:
        check_type("q9_z")
    assert "\n" not in str(refusal.value) and all(name in str(refusal.value) for name in ("q8_0", "q4_k_m", "iq4_nl"))
    with pytest.raises(HeadlabError, match="llama family"):
        export_gguf(from_model(tiny_model("gpt2"), tiny_tokenizer()), tmp_path / "g.gguf", progress=False)
    with pytest.raises(HeadlabError, match="byte-level BPE"):
        export_gguf(from_model(tiny_model("llama"), tiny_tokenizer()), tmp_path / "w.gguf", progress=False)
    (tmp_path / "x.gguf").write_bytes(b"keep")
    with pytest.raises(HeadlabError, match="already exists"):
        export_gguf(tiny(), tmp_path / "x.gguf", progress=False)
    assert (tmp_path / "x.gguf").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]  # no temporary files left behind


def test_failed_verification_publishes_nothing(tmp_path):
    def fail(path):
        raise HeadlabError("llama.cpp disagrees")

    with pytest.raises(HeadlabError, match="disagrees"):
        export_gguf(tiny(), tmp_path / "m.gguf", progress=False, verify=fail)
    assert list(tmp_path.iterdir()) == []


# ---- llama.cpp itself -------------------------------------------------------------------------------------------


def _windows(loaded, n=2, length=48):
    ids = loaded.tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    return [torch.tensor([1] + ids[i * length : (i + 1) * length - 1]) for i in range(n)]


@needs_llamacpp
@pytest.mark.parametrize(
    "variant",
    [
        "original",
        "uniform",
        "non_uniform",
        "kv_3_to_1",
        "kv_per_layer",
        "emptied_layer",
        "qwen2_non_uniform",
        "qwen3",
        "mistral",
    ],
)
def test_llamacpp_log_probs_match_transformers(tmp_path, variant):
    makers = {
        "original": lambda: tiny(),
        "uniform": lambda: pruned(tiny(), [{0, 2}, {1, 3}]),
        "non_uniform": lambda: pruned(tiny(), [{0, 1}, {3}]),
        "kv_3_to_1": lambda: kv_converted(tiny()),
        "kv_per_layer": lambda: kv_per_layer(tiny()),
        "emptied_layer": lambda: pruned(tiny(), [{1}, {0, 1, 2, 3}]),
        "qwen2_non_uniform": lambda: pruned(tiny("qwen2"), [{0, 1}, set()]),
        "qwen3": lambda: tiny("qwen3"),
        "mistral": lambda: tiny("mistral", sliding_window=None),
    }
    loaded = makers[variant]()
    path = tmp_path / "m.gguf"
    export_gguf(loaded, path, outtype="f32", progress=False)
    result = compare_logprobs(loaded, path, _windows(loaded))
    assert result["relative_difference"] < 1e-3, result
    assert result["max_abs_logit_diff"] < 1e-3 * max(1.0, result["max_abs_logit"]), result


@needs_llamacpp
def test_llamacpp_tokenizes_like_transformers(tmp_path):
    from headlab.runtimes.llamacpp import open_model

    loaded = tiny()
    export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    llm = open_model(tmp_path / "m.gguf", n_ctx=64)
    text = SAMPLE_TEXT[:300]
    assert (
        llm.tokenize(text.encode(), add_bos=False, special=False)
        == loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    )


# ---- quantized files: llama.cpp's own quantizer ------------------------------------------------------------------

# Shapes whose matrices split into k-quant blocks (QK_K = 256 input features): hidden 256, 4 x 64-dim heads.
QUANT_SHAPES = dict(hidden_size=256, intermediate_size=512, head_dim=64)


def quant_model(layout):
    """Tiny models of every layout export-gguf writes, at shapes llama.cpp's k-quants apply to: uniform (llama);
    per-layer (deci: layer 0 with 2 of 4 heads, layer 1 with none, attention-free; layer 2 whole); MLA (deepseek2:
    latent 256, 2 heads, qk_nope 64 + rope 64, v 128, so q, kv_a_mqa, v_b and o take rows of 256)."""
    if layout == "uniform":
        return tiny(**QUANT_SHAPES)
    if layout == "deci":
        return pruned(tiny(num_hidden_layers=3, **QUANT_SHAPES), [{0, 1}, {0, 1, 2, 3}, set()])
    return tiny(
        "deepseek_v3", hidden_size=256, intermediate_size=512, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip


def test_outtype_names_pick_the_writer(monkeypatch):
    """Float and gguf-quantizable names are written by headlab (no llama.cpp needed); llama.cpp's file types, by
    llama-quantize's names in any case, go to llama.cpp, and without llama-cpp-python they are one line."""
    assert check_type("Q8_0") == "q8_0" and check_type("BF16") == "bf16" and check_type("q4_0") == "q4_0"
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    assert check_type("q8_0") == "q8_0"  # the numpy path needs no binding
    for name in ("Q4_K_M", "q6_k", "IQ4_NL", "q4_k"):
        with pytest.raises(HeadlabError, match=r"pip install 'headlab\[llamacpp\]'") as refusal:
            check_type(name)
        assert "\n" not in str(refusal.value)


def test_llamacpp_type_without_the_binding_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    loaded = tiny()
    loaded.model.save_pretrained(tmp_path / "model")
    loaded.tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # save_pretrained's progress bar
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    args = ["export-gguf", "--model", tmp_path / "model", "--device", "cpu", "--outtype", "Q4_K_M"]
    code, out, err = run_cli([*args, "--out", tmp_path / "m.gguf"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "pip install 'headlab[llamacpp]'" in err and "--outtype" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@needs_llamacpp
@pytest.mark.parametrize("layout", ["uniform", "deci", "mla"])
def test_quantized_files_run_in_llamacpp_close_to_f32(tmp_path, layout):
    """Q8_0 (headlab's numpy path) and Q4_K_M (llama.cpp's quantizer) files: the asked types in the matrices, read
    back with gguf's reader, and llama.cpp's log-probabilities near the f32 export's (which match transformers to
    ~1e-6). Measured on these random models (logits ~1, perplexity ~300): Q8_0 0.06-0.2% apart in perplexity,
    worst log-probability difference ~0.025; Q4_K_M ~1% and ~0.25. Bounds: Q8_0 1% and 0.1, Q4_K_M 5% and 1, and
    Q4_K_M must differ measurably (> 1e-3) from f32, so a silently unquantized file would fail."""
    loaded = quant_model(layout)
    windows = _windows(loaded)
    results, records = {}, {}
    for outtype in ("f32", "q8_0", "Q4_K_M"):
        path = tmp_path / f"{outtype}.gguf"
        records[outtype] = export_gguf(loaded, path, outtype=outtype, progress=False)
        results[outtype] = compare_logprobs(loaded, path, windows)
    assert results["f32"]["relative_difference"] < 1e-4, results["f32"]
    for outtype, ppl, logprob in (("q8_0", 0.01, 0.1), ("Q4_K_M", 0.05, 1.0)):
        result = results[outtype]
        assert result["relative_difference"] < ppl and result["max_abs_logprob_diff"] < logprob, (outtype, result)
    assert results["Q4_K_M"]["max_abs_logprob_diff"] > 1e-3, results["Q4_K_M"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Q4_K_M.gguf", "f32.gguf", "q8_0.gguf"]  # no scratch

    # The matrices' types as stored. Q8_0: every one. Q4_K_M: llama.cpp's recipe (q4_k, some attn_v / ffn_down and
    # the output head q6_k), with its fallback for rows that 256 does not divide (q5_0).
    fields, tensors = read(tmp_path / "Q4_K_M.gguf")
    _, q8 = read(tmp_path / "q8_0.gguf")
    # MLA's latent down-projection stays f32 in every file type (the latent-norm fold makes it too small for f16)
    kept = [name for name, t in tensors.items() if len(t.shape) > 1 and name.endswith(MLA_KEEP_F32)]
    assert bool(kept) == (layout == "mla")
    assert {q8[name].tensor_type.name for name in kept} | {tensors[name].tensor_type.name for name in kept} <= {"F32"}
    matrices = [name for name, t in tensors.items() if len(t.shape) > 1 and name not in kept]
    assert {q8[name].tensor_type.name for name in matrices} == {"Q8_0"}
    types = {name: tensors[name].tensor_type.name for name in matrices}
    last = max(int(name.split(".")[1]) for name in matrices if name.startswith("blk."))
    core = [n for n in matrices if n.startswith(f"blk.{last}.") and n.split(".")[2] in ("attn_q", "ffn_up", "ffn_gate")]
    assert core and {types[n] for n in core} == {"Q4_K"}, types
    assert {types[n] for n in matrices} <= {"Q4_K", "Q6_K", "Q5_0"}, types
    record = records["Q4_K_M"]
    assert record["outtype"] == "q4_k_m" and record["tensor_type_counts"]["q4_k"] >= len(matrices) // 2, record
    quantization = record["quantization"]
    assert quantization["by"] == "llama.cpp" and quantization["ftype"] == "Q4_K_M" and quantization["from"] == "f32"
    assert quantization["llama_cpp_python"] and quantization["ggml"], quantization
    assert quantization["fallback_matrices"] == {n: "q5_0" for n, t in types.items() if t == "Q5_0"}, quantization
    assert fields["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M, written by llama.cpp
    assert fields["headlab.version"] and fields["headlab.quantized_by"].startswith("llama.cpp Q4_K_M from f32")
    if layout == "deci":  # the attention-free layer stays without attention tensors; layer 0's o has 128 inputs
        assert not [n for n in tensors if n.startswith("blk.1.attn_")] and types["blk.0.attn_output.weight"] == "Q5_0"
        assert any("blk.0.attn_output.weight" in note for note in record["notes"]), record["notes"]
    if layout == "mla":  # attn_k_b's rows are qk_nope_head_dim (64) long: llama.cpp's fallback
        assert types["blk.0.attn_k_b.weight"] == "Q5_0" and types["blk.0.attn_v_b.weight"] == "Q4_K", types


@needs_llamacpp
def test_a_failed_llamacpp_quantization_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """IQ2_XXS without an importance matrix: llama.cpp refuses it (which is why headlab asks for --imatrix first; here
    that check is taken away), the error carries llama.cpp's reason, and neither the f32 scratch file nor the output
    remains."""
    monkeypatch.delitem(gguf_export.IMATRIX_TYPES, "iq2_xxs")
    monkeypatch.setitem(gguf_export.LLAMACPP_TYPES, "iq2_xxs", "IQ2_XXS")
    with pytest.raises(HeadlabError, match="llama.cpp could not quantize to IQ2_XXS: .*imatrix") as refusal:
        export_gguf(tiny(**QUANT_SHAPES), tmp_path / "m.gguf", outtype="iq2_xxs", progress=False)
    assert "\n" not in str(refusal.value)
    assert list(tmp_path.iterdir()) == []


def _batch(loaded, rows):
    """One right-padded batch of token rows (lists of ids): (input_ids, attention_mask)."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def test_importance_matrix_is_each_inputs_mean_square_over_real_tokens():
    """By hand on a tied tiny llama: attn_q's entry is E[x_j^2] of layer 0's normed embeddings and the output head's
    (under token_embd, which llama.cpp multiplies for the output) that of the final normed hidden states, over the
    unpadded tokens only (a padded row's zeros-or-garbage positions count nothing); every product has an entry."""
    loaded = tiny(tie_word_embeddings=True)
    model = loaded.model
    rows = [list(range(5, 29)), list(range(40, 51))]  # 24 + 11 real tokens, the second row padded
    ids, mask = _batch(loaded, rows)
    items = list(gguf_export._gguf_names(model).values())
    weights, record = gguf_export.importance_matrix(loaded, items, _Batches([(ids, mask)]), progress=False)
    assert record["tokens"] == 35 and record["matrices_without"] == [] and record["entries"] == len(weights)
    assert set(weights) == {name for name, _, t in items if t.dim() == 2}  # token_embd: the tied head's product
    real = mask.bool()
    with torch.no_grad():
        normed = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))[real].double()
        final = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[real].double()
    np.testing.assert_allclose(weights["blk.0.attn_q.weight"], (normed**2).mean(0).numpy(), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(weights["token_embd.weight"], (final**2).mean(0).numpy(), rtol=1e-5, atol=1e-9)
    assert all(w.dtype == np.float32 and w.shape == (t.shape[-1],) for w, t in
               ((weights[name], t) for name, _, t in items if name in weights))  # fmt: skip


class _Batches(list):
    """A list of (input_ids, attention_mask) batches with the metadata calibration batches carry."""

    meta = {"corpus": "by hand"}


@needs_llamacpp
def test_an_importance_matrix_steers_llamacpps_rounding_to_the_columns_it_weights(tmp_path):
    """llama.cpp's Q4_K rounding with an importance matrix that puts all weight on 16 of attn_q's 256 input columns:
    those columns come back closer to the f32 weights than without one, and the rest farther (the scales now serve
    the weighted columns); the table reaches llama.cpp by name and size, or the two files would be identical."""
    loaded = tiny(**QUANT_SHAPES)
    source = tmp_path / "f32.gguf"
    export_gguf(loaded, source, outtype="f32", progress=False)
    name = "blk.0.attn_q.weight"
    favoured = np.zeros(256, dtype=np.float32) + 1e-6
    favoured[::16] = 1.0
    errors = {}
    for label, imatrix in (("plain", None), ("weighted", {name: favoured})):
        target = tmp_path / f"{label}.gguf"
        llamacpp.quantize(source, target, "Q4_K_M", imatrix=imatrix)
        error = np.abs(tensor_of(read(target)[1][name]) - tensor_of(read(source)[1][name]))  # [out, in]
        errors[label] = (error[:, ::16].mean(), np.delete(error, np.s_[::16], axis=1).mean())
    assert errors["weighted"][0] < 0.5 * errors["plain"][0], errors
    assert errors["weighted"][1] > errors["plain"][1], errors


@needs_llamacpp
@pytest.mark.parametrize("layout", ["uniform", "mla"])
def test_imatrix_types_write_and_run_with_an_importance_matrix(tmp_path, layout):
    """--imatrix makes llama.cpp's importance-only types writable (IQ2_XXS here): the matrices take the type, MLA's
    attn_k_b / attn_v_b (inputs transformers never forms, so no entry) are written q8_0 and named, the file loads
    in llama.cpp and stays within reach of f32 (a 2-bit file on a random model: loose bound, 50%)."""
    from headlab.core.data import calibration_batches

    loaded = quant_model(layout)
    batches = calibration_batches(loaded.tokenizer, None, seq_len=64, batch_size=2, max_tokens=512)
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="IQ2_XXS", progress=False, imatrix=batches)
    imatrix = record["quantization"]["imatrix"]
    without = imatrix["matrices_without"]
    assert bool(without) == (layout == "mla") and all(n.split(".")[2] in ("attn_k_b", "attn_v_b") for n in without)
    _, tensors = read(tmp_path / "m.gguf")
    assert {tensors[n].tensor_type.name for n in without} <= {"Q8_0"}
    assert record["tensor_type_counts"].get("iq2_xxs", 0) >= 4, record["tensor_type_counts"]
    fields, _ = read(tmp_path / "m.gguf")
    assert "importance matrix of 512 calibration tokens" in fields["headlab.quantized_by"]
    result = compare_logprobs(loaded, tmp_path / "m.gguf", _windows(loaded))
    assert math.isfinite(result["perplexity_llamacpp"]) and result["relative_difference"] < 0.5, result


def calibrated_export_args(tmp_path, capsys, *options) -> list:
    """A tiny model saved under tmp_path/model and a text file beside it: export-gguf's arguments for them, 256
    calibration tokens and no llama.cpp check, plus `options`."""
    loaded = tiny(**QUANT_SHAPES)
    loaded.model.save_pretrained(tmp_path / "model")
    loaded.tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # save_pretrained's progress bar
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT * 4)
    return ["export-gguf", "--model", tmp_path / "model", "--device", "cpu", "--data", tmp_path / "text.txt",
            *options, "--calibration-tokens", "256", "--no-verify"]  # fmt: skip


@needs_llamacpp
def test_export_gguf_imatrix_on_the_command_line(tmp_path, capsys):
    """`export-gguf --outtype Q4_K_M --imatrix`: calibration windows from the corpus's calibration part, the table's
    importance-matrix row, the record and the file's provenance say how many tokens it measured."""
    args = calibrated_export_args(tmp_path, capsys, "--outtype", "Q4_K_M", "--imatrix")
    code, out, err = run_cli([*args, "--out", tmp_path / "m.gguf", "--json"], capsys)
    assert code == 0, err
    import json

    record = json.loads(out)
    imatrix = record["quantization"]["imatrix"]
    assert 0 < imatrix["tokens"] <= 256 and imatrix["entries"] == 15 and imatrix["matrices_without"] == []
    assert imatrix["text"]["split"] == "calibration", imatrix["text"]
    fields, _ = read(tmp_path / "m.gguf")
    assert f"importance matrix of {imatrix['tokens']} calibration tokens" in fields["headlab.quantized_by"]
    code, out, err = run_cli([*args, "--out", tmp_path / "n.gguf"], capsys)
    assert code == 0 and f"15 matrices, {imatrix['tokens']} calibration tokens" in out, (out, err)


def test_imatrix_refusals_come_before_any_work():
    """Importance-only types without --imatrix, and --imatrix with a type headlab writes (no importance weighting in
    its numpy quantizer) or a float type: one line each, from the type check that runs before the model loads."""
    for outtype, imatrix, says in (("iq2_xxs", False, "add --imatrix"), ("q8_0", True, "drop --imatrix"),
                                   ("f16", True, "drop --imatrix")):  # fmt: skip
        with pytest.raises(HeadlabError, match=says) as refusal:
            check_type(outtype, imatrix)
        assert "\n" not in str(refusal.value)


# ---- the embedded model (slow) ------------------------------------------------------------------------------------


def _embedded_variant(variant):
    from headlab.core.loading import load_model

    loaded = load_model(None, device="cpu")
    if variant == "uniform":  # one query head of every KV group, in every layer
        loaded = pruned(loaded, [{0, 3, 6} for _ in loaded.layers])
    elif variant == "non_uniform":  # KV group 0 of the even layers
        loaded = pruned(loaded, [{0, 1, 2} if layer.index % 2 == 0 else set() for layer in loaded.layers])
    elif variant == "kv_3_to_1":
        loaded = kv_converted(loaded)
    return loaded


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("variant", ["original", "uniform", "non_uniform", "kv_3_to_1"])
def test_embedded_model_in_llamacpp_matches_transformers(tmp_path, variant):
    from headlab.runtimes.llamacpp import eval_windows

    loaded = _embedded_variant(variant)
    path = tmp_path / "m.gguf"
    record = export_gguf(loaded, path, outtype="f32", progress=False)
    assert record["architecture"] == ("deci" if variant == "non_uniform" else "llama")
    result = compare_logprobs(loaded, path, eval_windows(loaded, max_tokens=256, seq_len=128))
    print(variant, result)  # the worst token logit difference, for the record
    assert result["relative_difference"] < 0.01, result
    assert result["max_abs_logit_diff"] < 1e-2 * result["max_abs_logit"], result


# ---- multi-head latent attention: deepseek_v3 -> llama.cpp's deepseek2 ----------------------------------------------


def sharpened(loaded, factor=6.0):
    """Every matrix scaled up: logits of order 1 and peaked attention, so a wrong RoPE layout or scale shows (a
    deliberately unpermuted rotate_half reading of these weights differs by ~3 in the logits)."""
    with torch.no_grad():
        for param in loaded.model.parameters():
            if param.dim() == 2:
                param.mul_(factor)
    return loaded


def test_mla_writes_deepseek2_with_split_kv_b(tmp_path):
    loaded = tiny("deepseek_v3_vdim")  # H 4, kv_lora_rank 12, qk_nope 8 + qk_rope 8, v_head_dim 12, no query LoRA
    record = export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    fields, tensors = read(tmp_path / "m.gguf")
    assert record["architecture"] == fields["general.architecture"] == "deepseek2"
    a = "deepseek2.attention."
    assert (fields[a + "head_count"], fields[a + "head_count_kv"]) == (4, 1)  # MQA over the latent
    assert (fields[a + "kv_lora_rank"], fields[a + "q_lora_rank"]) == (12, 0)
    assert (fields[a + "key_length"], fields[a + "value_length"]) == (12 + 8, 12)
    assert (fields[a + "key_length_mla"], fields[a + "value_length_mla"]) == (16, 12)
    assert fields["deepseek2.rope.dimension_count"] == 8 and fields["deepseek2.leading_dense_block_count"] == 2
    attn = loaded.model.model.layers[1].self_attn
    kv_b = attn.kv_b_proj.weight.detach().view(4, 8 + 12, 12)  # [H, nope + Dv, R]
    np.testing.assert_array_equal(tensor_of(tensors["blk.1.attn_k_b.weight"]), kv_b[:, :8].transpose(1, 2).numpy())
    np.testing.assert_array_equal(tensor_of(tensors["blk.1.attn_v_b.weight"]), kv_b[:, 8:].numpy())
    np.testing.assert_array_equal(tensor_of(tensors["blk.1.attn_q.weight"]), attn.q_proj.weight.detach().numpy())
    np.testing.assert_array_equal(
        tensor_of(tensors["blk.1.attn_kv_a_mqa.weight"]), attn.kv_a_proj_with_mqa.weight.detach().numpy()
    )
    assert "blk.1.attn_kv_b.weight" not in tensors and "blk.1.attn_kv_a_norm.weight" in tensors


def test_mla_refusals(tmp_path):
    cases = [
        (lambda: tiny("deepseek_v3_nonorm"), "identity latent norm"),
        (lambda: tiny("deepseek_v3", rms_norm_eps=1e-5), "rms_norm_eps"),
        (lambda: tiny("deepseek_v3", rope_interleave=False), "rope_interleave"),
        (lambda: tiny("deepseek_v3", attention_bias=True), "kv_a_proj_with_mqa.bias has no GGUF counterpart"),
        (lambda: tiny("deepseek_v3", qk_nope_head_dim=0), "qk_nope_head_dim 0"),  # MQA -> MLA's exact form
        (
            lambda: tiny("deepseek_v3", first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1),
            "MoE layers",
        ),
    ]
    for make, message in cases:
        with pytest.raises(HeadlabError, match=message):
            export_gguf(make(), tmp_path / "m.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


@needs_llamacpp
@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3_qlora", "deepseek_v3_vdim", "pruned"])
def test_llamacpp_runs_mla_like_transformers(tmp_path, variant):
    """Perplexity within 1% in f32 (measured: ~1e-7 apart) and the worst logit difference at float32 noise."""
    if variant == "pruned":  # a uniformly pruned MLA model: 2 of 4 heads in each layer
        loaded = sharpened(pruned(tiny("deepseek_v3"), [{0, 2}, {1, 3}]))
    else:
        loaded = sharpened(tiny(variant))
    path = tmp_path / "m.gguf"
    export_gguf(loaded, path, outtype="f32", progress=False)
    result = compare_logprobs(loaded, path, _windows(loaded))
    assert result["max_abs_logit"] > 1.0, result  # the check has logits worth comparing
    assert result["relative_difference"] < 1e-3, result
    assert result["max_abs_logit_diff"] < 1e-4 * max(1.0, result["max_abs_logit"]), result


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("rank, rope", [(320, 64), (64, 64)], ids=["gqa3-budget", "mqa-budget"])
def test_llamacpp_runs_smollm2_shaped_mla(tmp_path, rank, rope):
    """The MLA shapes of SmolLM2-135M's budgets (hidden 576, 9 heads, qk_nope 64, v 64; latent + rope 320 + 64 and
    64 + 64; 4 random layers): measured ~6e-7 apart in perplexity, worst logit difference ~3e-5 of ~7 (f32)."""
    model = tiny_model(
        "deepseek_v3", hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
        num_key_value_heads=9, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=4, vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    loaded = sharpened(from_model(model, bpe_tokenizer()), 3.0)
    export_gguf(loaded, tmp_path / "m.gguf", outtype="f32", progress=False)
    result = compare_logprobs(loaded, tmp_path / "m.gguf", _windows(loaded, n=2, length=96))
    assert result["max_abs_logit"] > 1.0 and result["relative_difference"] < 1e-4, result
    assert result["max_abs_logit_diff"] < 1e-4 * max(1.0, result["max_abs_logit"]), result


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_offloaded_to_disk_exports_the_same_file(tmp_path, tie):
    """Under `--device-map auto --max-memory` the weights wait on disk (meta placeholders): each is read in with its
    module when it is written, and the tied-head rule does not mistake two placeholders for one tensor."""
    from headlab.core.loading import load_model, offloaded_modules

    plain = tiny(tie_word_embeddings=tie, num_hidden_layers=3)
    plain.model.save_pretrained(tmp_path / "model")
    plain.tokenizer.save_pretrained(tmp_path / "model")
    offloaded = load_model(str(tmp_path / "model"), device="cpu", device_map="auto", max_memory=60_000)
    assert "model.layers.2.self_attn.q_proj" in offloaded_modules(offloaded.model)
    export_gguf(plain, tmp_path / "plain.gguf", outtype="f16", progress=False)
    export_gguf(offloaded, tmp_path / "offloaded.gguf", outtype="f16", progress=False)
    (_, expected), (_, got) = read(tmp_path / "plain.gguf"), read(tmp_path / "offloaded.gguf")
    assert got.keys() == expected.keys() and ("output.weight" in got) != tie
    for name in expected:
        np.testing.assert_array_equal(got[name].data, expected[name].data, err_msg=name)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_encoding_a_block_of_rows_at_a_time_writes_the_same_bytes(tmp_path, monkeypatch, outtype):
    """Large matrices are converted and encoded a block of rows at a time (to bound the export's memory); with a
    block of a few rows every tensor still has the bytes of the whole-tensor encoding."""
    loaded = tiny()
    export_gguf(loaded, tmp_path / "whole.gguf", outtype=outtype, progress=False)
    monkeypatch.setattr(gguf_export, "ENCODE_BLOCK_BYTES", 3 * 4 * 64)  # three rows of a 64-wide matrix
    export_gguf(loaded, tmp_path / "blocks.gguf", outtype=outtype, progress=False)
    (_, whole), (_, blocks) = read(tmp_path / "whole.gguf"), read(tmp_path / "blocks.gguf")
    for name in whole:
        np.testing.assert_array_equal(blocks[name].data, whole[name].data, err_msg=name)


def test_a_large_matrix_is_written_without_its_whole_encoded_copy(tmp_path, monkeypatch):
    """The embeddings (the largest tensor; 1 GiB in f16 at 8B) are encoded and written a block of rows at a time,
    so numpy's peak during the export stays below one encoded copy of them (tracemalloc counts numpy's buffers)."""
    import tracemalloc

    loaded = tiny(hidden_size=4096, intermediate_size=64, num_hidden_layers=1)
    embedding_f16_bytes = loaded.model.get_input_embeddings().weight.numel() * 2
    monkeypatch.setattr(gguf_export, "ENCODE_BLOCK_BYTES", 4 * 4096 * 8)  # eight rows
    tracemalloc.start()
    try:
        export_gguf(loaded, tmp_path / "m.gguf", outtype="f16", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * embedding_f16_bytes
    _, tensors = read(tmp_path / "m.gguf")
    np.testing.assert_array_equal(
        tensors["token_embd.weight"].data, loaded.model.get_input_embeddings().weight.detach().half().numpy()
    )

def test_a_disk_too_small_is_refused_before_any_tensor_with_the_bytes_needed(tmp_path, monkeypatch):
    """The export checks free space first (numbers x bytes of the type; a llama.cpp type adds its f32 scratch
    file): one line naming both sizes, and nothing written."""
    import shutil

    loaded = tiny()
    numbers = sum(math.prod(t.shape) for _, _, t in gguf_export._gguf_names(loaded.model).values())
    assert gguf_export.export_bytes(list(gguf_export._gguf_names(loaded.model).values()), "f16", False)[0] == 2 * numbers
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    converted = []
    monkeypatch.setattr(gguf_export, "_encode", lambda *a: converted.append(a))
    with pytest.raises(HeadlabError, match=r"1000 B free .* needs about .*numbers at 2 bytes"):
        export_gguf(loaded, tmp_path / "m.gguf", outtype="f16", progress=False)
    assert converted == [] and list(tmp_path.iterdir()) == []
