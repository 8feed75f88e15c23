"""sdpa with values narrower than the keys on a CPU (headlab.core.cpu_attention): the padded call equals sdpa's own
result and a softmax written out by hand, with and without a mask; models whose values are narrower (MLA) switch to
it when loaded or converted on the CPU and give the logits they gave before; other models keep sdpa."""

from __future__ import annotations

import pytest
import torch
from models import tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headlab.core import cpu_attention
from headlab.core.data import TextSpec
from headlab.core.loading import from_model, load_model
from headlab.kv import mla

pytestmark = pytest.mark.usefixtures("one_thread")


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 1


def _operands(seed=0, heads=3, tokens=7, width=8, value_width=5):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, heads, tokens, width, generator=generator) for _ in range(2))
    v = torch.randn(2, heads, tokens, value_width, generator=generator)
    return q, k, v


def _by_hand(q, k, v, mask):
    """softmax(q k^T / sqrt(D) + mask) v, written out in float64, as [B, T, H, Dv]."""
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.double()).transpose(1, 2)


def test_padded_values_give_sdpas_result_causal():
    q, k, v = _operands()
    out, _ = cpu_attention.attention_forward(_Module(), q, k, v, None)
    reference, _ = sdpa_attention_forward(_Module(), q, k, v, None)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    assert out.shape == (2, 7, 3, 5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), _by_hand(q, k, v, causal), rtol=1e-5, atol=1e-6)


def test_padded_values_give_sdpas_result_with_a_padding_mask():
    q, k, v = _operands(seed=1)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # the second row's first two tokens are padding (left padding)
    mask[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # padding queries see themselves, so no row is empty
    out, _ = cpu_attention.attention_forward(_Module(), q, k, v, mask)
    reference, _ = sdpa_attention_forward(_Module(), q, k, v, mask)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), _by_hand(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_equal_widths_call_sdpa_unchanged(monkeypatch):
    calls = []

    def recording(module, q, k, v, mask, **kwargs):
        calls.append(v.shape[-1])
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward", recording)
    q, k, v = _operands(value_width=8)
    cpu_attention.attention_forward(_Module(), q, k, v, None)
    q, k, v = _operands(value_width=5)
    cpu_attention.attention_forward(_Module(), q, k, v, None)
    assert calls == [8, 8]  # the narrower values reach sdpa padded to the keys' width


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_vdim"])
def test_an_mla_model_switches_on_the_cpu_with_the_same_logits(name, tmp_path):
    model = tiny_model(name, attn_implementation="sdpa")
    inputs = tiny_inputs(name)
    with torch.no_grad():
        before = model(**inputs).logits
    loaded = from_model(model, tiny_tokenizer())
    assert model.config._attn_implementation == cpu_attention.FUNCTION_NAME
    assert loaded.meta["cpu_attention"]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "mla")
    tiny_tokenizer().save_pretrained(tmp_path / "mla")
    reloaded = load_model(str(tmp_path / "mla"), device="cpu")
    assert reloaded.model.config._attn_implementation == cpu_attention.FUNCTION_NAME
    assert "_attn_implementation" not in (tmp_path / "mla" / "config.json").read_text()  # not saved as a setting
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(**inputs).logits, before, rtol=1e-5, atol=1e-5)


def test_models_with_equal_widths_and_eager_ones_are_left_alone():
    gqa = from_model(tiny_model("llama", attn_implementation="sdpa"), tiny_tokenizer())
    assert gqa.model.config._attn_implementation == "sdpa" and "cpu_attention" not in gqa.meta
    eager = from_model(tiny_model("deepseek_v3", attn_implementation="eager"), tiny_tokenizer())
    assert eager.model.config._attn_implementation == "eager" and "cpu_attention" not in eager.meta


def test_an_mla_conversion_on_the_cpu_runs_the_fused_path_with_the_exact_logits(tmp_path):
    """One KV head at the GQA budget converts exactly: the converted model, switched to the padded path, still gives
    the source's logits."""
    path = tmp_path / "sample.txt"
    path.write_text(SAMPLE_TEXT * 4)
    text = TextSpec(data=str(path), split="calibration", seq_len=32, batch_size=4, max_tokens=512)
    source = from_model(tiny_model("llama", num_key_value_heads=1, attn_implementation="sdpa"), tiny_tokenizer())
    batches = text.batches(source.tokenizer, max_positions=64)
    converted = mla.convert_to_mla(source, mla.plan_mla(source, budget="gqa"), batches, progress=False)[0]
    assert converted.model.config._attn_implementation == cpu_attention.FUNCTION_NAME
    assert converted.meta["cpu_attention"]
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(
            converted.model(**inputs).logits, source.model(**inputs).logits, rtol=1e-4, atol=1e-4
        )
