"""Quantized KV caches (`--kv-cache`, headlab.mechanisms.quantized_cache): the chunked perplexity path against the
unchunked one, what an fp8 / int cache changes and the bytes it stores (hand counts), MLA's cached latent under the
fold, and one-line refusals. The quanto and hqq tests skip without their packages (the kvquant extra)."""

from __future__ import annotations

import pytest
import torch
from models import tiny_inputs, tiny_model
from test_longctx import _loaded, _text
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import Corpus, TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.kv import mla
from headlab.measure.evaluate import perplexity
from headlab.measure.longctx import cache_generate, long_context
from headlab.mechanisms import quantized_cache
from headlab.mechanisms.quantized_cache import check_kv_cache, new_kv_cache, quantized_cache_bytes
from headlab.runtimes.speed import SpeedSpec, measure_model

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny llama: 2 layers, 2 KV heads of 16 dims
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _perplexity(loaded, **options):
    return perplexity(loaded, Corpus("sample", [SAMPLE_TEXT]), max_tokens=150, progress=False, **options)


@pytest.mark.parametrize(
    "name,seq_len,stride,batch_size,chunk",
    [("llama", 32, 32, 4, 8), ("llama", 32, 8, 3, 5), ("gpt2", 16, 16, 2, 3), ("qwen3", 32, 32, 1, 64)],
)
def test_chunked_full_cache_equals_one_forward(name, seq_len, stride, batch_size, chunk):
    loaded = from_model(tiny_model(name), tiny_tokenizer())
    windows = dict(seq_len=seq_len, stride=stride, batch_size=batch_size)
    whole = _perplexity(loaded, **windows)
    chunked = _perplexity(loaded, **windows, kv_chunk=chunk)
    assert chunked.scored_tokens == whole.scored_tokens == 150 and chunked.windows == whole.windows
    assert chunked.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
    assert whole.path.startswith("one forward") and chunked.path == f"chunks of {chunk} tokens through a full KV cache"
    # the full cache of the first batch after its windows: float32 keys and values of every layer
    assert chunked.kv_cache_bytes == LAYERS * 2 * KV_HEADS * seq_len * HEAD_DIM * 4 * (2 if name == "gpt2" else 1)


def test_fp8_cache_changes_perplexity_a_little():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    full = _perplexity(loaded, seq_len=32, kv_chunk=8)
    fp8 = _perplexity(loaded, seq_len=32, kv_cache="fp8")  # the default chunk, 64: one chunk per 32-token window
    fp8_chunked = _perplexity(loaded, seq_len=32, kv_cache="fp8", kv_chunk=8)
    assert fp8.path == "chunks of 64 tokens through a fp8 KV cache"
    # One chunk per window: nothing is read back from the cache, so nothing changes.
    assert fp8.perplexity == pytest.approx(full.perplexity, rel=1e-6)
    change = abs(fp8_chunked.perplexity / full.perplexity - 1)
    assert 1e-6 < change < 1e-2  # measured 4.6e-4


def _chunked_logits(model, spec: str, chunk: int, seq: int = 32):
    inputs = tiny_inputs("llama", seq=seq)
    cache, outs = new_kv_cache(model.config, spec), []
    with torch.no_grad():
        for start in range(0, seq, chunk):
            ids = inputs["input_ids"][:, start : start + chunk]
            out = model(input_ids=ids, attention_mask=inputs["attention_mask"][:, : start + chunk], cache=cache)
            outs.append(out.logits)
    return torch.cat(outs, dim=1), cache


def test_fp8_cache_bytes_are_a_quarter_of_float32_by_hand():
    model = tiny_model("llama")
    full, full_cache = _chunked_logits(model, "full", 8)
    fp8, fp8_cache = _chunked_logits(model, "fp8", 8)
    error = float((fp8 - full).abs().max() / full.abs().max())
    assert 0 < error < 2e-2  # measured 1e-3: the first chunk is exact, later chunks read fp8 states
    elements = 2 * KV_HEADS * 32 * HEAD_DIM  # [B=2, G, T, D] per tensor
    assert quantized_cache_bytes(full_cache) == LAYERS * 2 * elements * 4
    # fp8: one byte per number, one float32 scale per tensor, no residual
    assert quantized_cache_bytes(fp8_cache) == LAYERS * 2 * (elements + 4)
    assert quantized_cache_bytes(fp8_cache) / quantized_cache_bytes(full_cache) == pytest.approx(0.25, rel=1e-2)


def _int4_hand_count(elements: int) -> int:
    """Packed 4-bit numbers (two per byte) plus a float32 scale and zero point per group of 64."""
    return elements // 2 + (elements // 64) * 2 * 4


@pytest.mark.parametrize("spec,module", [("hqq-int4", "hqq"), ("quanto-int4", "optimum.quanto")])
def test_int4_cache_bytes_by_hand(spec, module):
    pytest.importorskip(module)
    model = tiny_model("llama")
    full, _ = _chunked_logits(model, "full", 32)
    # one 32-token prefill: quantized whole, the residual empty
    one, cache = _chunked_logits(model, spec, 32)
    assert torch.equal(one, full)  # the prefill attends to its own states unquantized
    elements = 2 * KV_HEADS * 32 * HEAD_DIM
    assert quantized_cache_bytes(cache) == LAYERS * 2 * _int4_hand_count(elements)
    # chunked: the later chunks read the quantized first chunk (and a full-precision residual)
    chunked, cache = _chunked_logits(model, spec, 16)
    error = float((chunked - full).abs().max() / full.abs().max())
    assert 0 < error < 0.1  # measured 2e-2
    quantized, residual = 2 * KV_HEADS * 16 * HEAD_DIM, 2 * KV_HEADS * 16 * HEAD_DIM
    assert quantized_cache_bytes(cache) == LAYERS * 2 * (_int4_hand_count(quantized) + residual * 4)


def test_kivi_axes_follow_what_each_cache_slot_holds():
    """KIVI: a slot of keys alone per channel (quanto axis -1), anything else per token (axis 0). A GQA cache's
    "keys" are keys; MLA's "keys" slot is the latent (keys and values expand from it), its "values" the rotary key."""
    from headlab.core.arch import adapter_for

    gqa, latent = (
        adapter_for(tiny_model("llama")).cache_pure_keys,
        adapter_for(tiny_model("deepseek_v3")).cache_pure_keys,
    )
    assert gqa == (True, False) and latent == (False, True)
    assert quantized_cache.kivi_axes(gqa) == {"axis_key": -1, "axis_value": 0}
    assert quantized_cache.kivi_axes(latent) == {"axis_key": 0, "axis_value": -1}


def _dequantized(layer, quantized) -> torch.Tensor:
    """A layer's quantized states read back: one tensor (transformers' layers) or the -kivi layer's chunks."""
    chunks = quantized if isinstance(quantized, list) else [quantized]
    return torch.cat([layer._dequantize(chunk) for chunk in chunks], dim=-2)


def _dequantized_errors(spec: str, pure_keys) -> tuple[float, float]:
    """Largest error, over the small channels, of the keys and values a fresh `spec` cache stores for 128 tokens
    (the residual length: quantized at once by either layout) whose channel 0 is 100x the others (an outlier
    channel, as RoPE'd keys have)."""
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(1, KV_HEADS, 128, HEAD_DIM, generator=generator) for _ in range(2)]
    for state in states:
        state[..., 0] *= 100
    cache = new_kv_cache(tiny_model("llama").config, spec, pure_keys)
    cache.update(*states, layer_idx=0)
    layer = cache.layers[0]
    stored = [_dequantized(layer, layer._quantized_keys), _dequantized(layer, layer._quantized_values)]
    assert [s.shape for s in stored] == [s.shape for s in states]
    return tuple(float((got - want)[..., 1:].abs().max()) for got, want in zip(stored, states))


@pytest.mark.parametrize("pure_keys", [(True, False), (False, True)])
def test_kivi_cache_quantizes_the_slots_of_keys_per_channel(pure_keys):
    """Per token, a group's scale spans the outlier (error about 100 / 15 on the small channels); per channel each
    channel has its own (about 3 / 15): the -kivi spec is per channel exactly in the slots that hold keys alone."""
    pytest.importorskip("optimum.quanto")
    default = _dequantized_errors("quanto-int4", pure_keys)
    kivi = _dequantized_errors("quanto-int4-kivi", pure_keys)
    assert min(default) > 2.0  # transformers' axis 0: per token in both slots
    for slot, pure in enumerate(pure_keys):
        if pure:
            assert kivi[slot] < 0.5 and kivi[slot] < default[slot] / 10, (kivi, default)
        else:
            assert kivi[slot] == default[slot]


def test_kivi_layer_quantizes_whole_groups_and_keeps_the_rest():
    """Updates of 100, 50 and 1 tokens: nothing is quantized below the residual length (128), then the whole
    groups of 64 (128 tokens) are, once, and the 22 + 1 tokens after them stay exact; every update returns all
    tokens so far."""
    pytest.importorskip("optimum.quanto")
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, KV_HEADS, 151, HEAD_DIM, generator=generator) for _ in range(2))
    cache = new_kv_cache(tiny_model("llama").config, "quanto-int4-kivi")
    layer = cache.layers[0]
    got = cache.update(keys[..., :100, :], values[..., :100, :], layer_idx=0)
    assert torch.equal(got[0], keys[..., :100, :]) and layer._quantized_keys == []
    got = cache.update(keys[..., 100:150, :], values[..., 100:150, :], layer_idx=0)
    assert torch.equal(got[0], keys[..., :150, :]) and torch.equal(got[1], values[..., :150, :])
    assert len(layer._quantized_keys) == 1 and layer.keys.shape[-2] == 22
    got = cache.update(keys[..., 150:, :], values[..., 150:, :], layer_idx=0)
    assert got[0].shape[-2] == got[1].shape[-2] == 151 == cache.get_seq_length()
    assert torch.equal(got[0][..., 128:, :], keys[..., 128:, :])  # the residual and the new token: exact
    error = float((got[0][..., :128, :] - keys[..., :128, :]).abs().max())
    assert 0 < error < 0.5  # int4 per channel over 64 tokens of N(0, 1): measured 0.23
    assert torch.equal(got[0][..., :128, :], _dequantized(layer, layer._quantized_keys))
    residual = 2 * 2 * KV_HEADS * 23 * HEAD_DIM * 4  # keys and values, float32
    assert quantized_cache_bytes(cache) - residual == sum(
        quantized_cache.storage_bytes(chunk) for chunk in layer._quantized_keys + layer._quantized_values
    )
    with pytest.raises(HeadlabError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))


def test_perplexity_builds_the_kivi_cache_with_the_models_slots(monkeypatch):
    pytest.importorskip("optimum.quanto")
    made = []

    class Recording(quantized_cache.KiviQuantoLayer):
        def __init__(self, **options):
            made.append((options["axis_key"], options["axis_value"], options["nbits"]))
            super().__init__(**options)

    monkeypatch.setattr(quantized_cache, "KiviQuantoLayer", Recording)
    for name, axes in (("llama", (-1, 0)), ("deepseek_v3", (0, -1))):
        made.clear()
        loaded = from_model(tiny_model(name), tiny_tokenizer())
        result = _perplexity(loaded, seq_len=32, kv_cache="quanto-int4-kivi", kv_chunk=8)
        assert result.perplexity > 1 and made and set(made) == {(*axes, 4)}


def test_mla_cache_stores_the_normed_latent_and_the_fold_leaves_it_alone(tmp_path):
    # One KV head, budget gqa: the conversion is exact; the cache holds the latent after kv_a_layernorm ("keys",
    # [B, 1, T, R]) and the rotated shared key ("values", [B, 1, T, r]).
    path = tmp_path / "sample.txt"
    path.write_text(SAMPLE_TEXT * 4)
    text = TextSpec(data=str(path), split="calibration", seq_len=32, batch_size=4, max_tokens=512)
    loaded = from_model(tiny_model("llama", num_key_value_heads=1), tiny_tokenizer())
    batches = text.batches(loaded.tokenizer, max_positions=64)
    model = mla.convert_to_mla(loaded, mla.plan_mla(loaded, budget="gqa"), batches, progress=False)[0].model
    full, cache = _chunked_logits(model, "full", 16)
    rank, rope = model.config.kv_lora_rank, model.config.qk_rope_head_dim
    assert cache.layers[0].keys.shape == (2, 1, 32, rank) and cache.layers[0].values.shape == (2, 1, 32, rope)
    latent = float(cache.layers[0].keys.abs().max())
    fp8_error = float((_chunked_logits(model, "fp8", 16)[0] - full).abs().max() / full.abs().max())
    folds = mla.fold_latent_norm(model)
    assert max(f["alpha"] for f in folds) < 1e-4  # the pre-norm latent is scaled far down...
    folded, cache = _chunked_logits(model, "full", 16)
    assert float((folded - full).abs().max() / full.abs().max()) < 1e-5  # (the fold: exact in fp32)
    assert float(cache.layers[0].keys.abs().max()) == pytest.approx(latent, rel=0.5)  # ...the cached one is not
    folded_fp8 = float((_chunked_logits(model, "fp8", 16)[0] - folded).abs().max() / folded.abs().max())
    assert 0 < folded_fp8 < 3e-2 and folded_fp8 == pytest.approx(fp8_error, rel=0.1)  # measured 9.8e-3 both


def test_speed_decodes_from_the_quantized_cache_and_counts_its_bytes():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    rows = {}
    for spec, limit in (("full", 0), ("fp8", 0), ("fp8", 1)):  # prefill limit 1: the synthetic fill
        table = measure_model(
            loaded, "tiny", SpeedSpec((32,), (1,), 4, limit, ("transformers",), kv_cache=spec), progress=False
        )
        rows[spec, limit] = table.iloc[0]
    elements = KV_HEADS * 32 * HEAD_DIM
    assert rows["full", 0]["kv_cache_bytes"] == LAYERS * 2 * elements * 4
    assert rows["fp8", 0]["kv_cache_bytes"] == rows["fp8", 1]["kv_cache_bytes"] == LAYERS * 2 * (elements + 4)
    assert rows["fp8", 1]["cache_fill"] == "synthetic" and rows["fp8", 0]["kv_cache"] == "fp8"


def test_long_context_generates_into_the_quantized_cache():
    loaded, record = _loaded(), []
    grid = dict(tasks=["passkey"], lengths=[300], depths=[0.5], samples=2, position_sequences_count=0)
    result = long_context(loaded, text=_text(), **grid, generate=cache_generate(loaded, "fp8", record), progress=False)
    assert len(result.prompts) == 2 and [row["prompts"] for row in record] == [1, 1]
    for row in record:
        # fp8: one byte per cached number plus a float32 scale per tensor (prompt and decoded tokens but the last)
        layer = loaded.layers[0]
        per_token = layer.num_kv_heads * layer.head_dim * 2
        assert row["cache_bytes"] == len(loaded.layers) * (row["cache_slots"] * per_token + 2 * 4)
        assert 200 < row["cache_slots"] < 400  # a 300-token context, prompt and answer together


def test_check_refuses_unknown_specs_and_names_the_install(monkeypatch):
    with pytest.raises(HeadlabError, match="unknown --kv-cache 'int4'"):
        check_kv_cache("int4")
    monkeypatch.setattr(quantized_cache, "_installed", lambda module: False)
    with pytest.raises(HeadlabError, match=r"optimum-quanto package: pip install 'headlab\[kvquant\]'"):
        check_kv_cache("quanto-int4")
    assert check_kv_cache("fp8") == "fp8"  # built in


def test_sliding_window_models_are_refused_in_one_line():
    with pytest.raises(HeadlabError, match="--kv-cache fp8: .*full attention"):
        new_kv_cache(tiny_model("mistral").config, "fp8")


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--data", "{text}", "--seq-len", "32"],
        ["longeval", "--data", "{text}", "--lengths", "48", "--out", "out"],
        ["speed", "--contexts", "32", "--batches", "1", "--out", "out"],
    ],
)
def test_missing_backend_is_one_line_exit_2_nothing_written(command, tmp_path, monkeypatch, capsys):
    model = save_tiny("llama", tmp_path / "llama")
    (tmp_path / "sample.txt").write_text(SAMPLE_TEXT)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(quantized_cache, "_installed", lambda module: False)
    capsys.readouterr()  # save_tiny's progress bar
    args = [a.format(text=tmp_path / "sample.txt") for a in command]
    where = [str(model)] if command[0] == "speed" else ["--model", str(model)]
    code, out, err = run_cli([*args, *where, "--device", "cpu", "--kv-cache", "hqq-int4"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "hqq package: pip install 'headlab[kvquant]'" in err
    assert list(work.iterdir()) == []
