"""Adapters: layouts found, and read/write exact enough that pruning and permuting heads are faithful."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from models import ALL_TYPES, ENCODER_TYPES, GATED_TYPES, LAYOUTS, tiny_config, tiny_inputs, tiny_model

from headlab.core.arch import HeadWeights, adapter_for, attention_layers
from headlab.core.errors import HeadlabError


def _out(model, name):
    with torch.no_grad():
        out = model(**tiny_inputs(name))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _rewrite(model, transform, only=None):
    """Write transform(layer, read(layer)) into every attention layer (or only the layer indices in `only`)."""
    adapter = adapter_for(model)
    for layer in attention_layers(model):
        if only is None or layer.index in only:
            adapter.write(layer, transform(layer, adapter.read(layer)))


def _drop_one_query_per_group(layer, w: HeadWeights) -> HeadWeights:
    """Remove query head 1 of every KV group; without GQA (one query per group) its KV head goes too."""
    if layer.group_size == 1:
        keep = [h for h in range(layer.num_heads) if h != 1]
        return w.take(keep, keep)
    return w.take([h for h in range(layer.num_heads) if h % layer.group_size != 1])


def _dropped_heads(layer) -> list[int]:
    return [1] if layer.group_size == 1 else [h for h in range(layer.num_heads) if h % layer.group_size == 1]


def _drop_kv_head_0(layer, w: HeadWeights) -> HeadWeights:
    gs = layer.group_size
    return w.take(range(gs, layer.num_heads), range(1, layer.num_kv_heads))


def _permute(layer, w: HeadWeights) -> HeadWeights:
    """Reverse the KV groups and the query heads inside each group, so every query keeps its KV head."""
    gs = layer.group_size
    kv = list(reversed(range(layer.num_kv_heads)))
    heads = [g * gs + i for g in kv for i in reversed(range(gs))]
    return w.take(heads, kv)


def _zero_heads(adapter, layer, heads):
    """Zero the output-projection input columns of `heads` (Conv1D stores the transpose of nn.Linear)."""
    out = adapter.out_proj(layer)
    D = layer.head_dim
    with torch.no_grad():
        for h in heads:
            if isinstance(out, torch.nn.Linear):
                out.weight[:, h * D : (h + 1) * D] = 0
            else:
                out.weight[h * D : (h + 1) * D, :] = 0


def _in_width(module) -> int:
    return module.in_features if isinstance(module, torch.nn.Linear) else module.weight.shape[0]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_layout(name):
    blocks, H, G, D = LAYOUTS[name]
    for base in (False, True):
        model = tiny_model(name, base=base)
        adapter = adapter_for(model)
        layers = attention_layers(model)
        assert [layer.block for layer in layers] == blocks
        assert [layer.index for layer in layers] == list(range(len(blocks)))
        for layer in layers:
            assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (H, G, D)
            assert _in_width(adapter.out_proj(layer)) == H * D
            w = adapter.read(layer)
            assert (w.num_heads, w.num_kv_heads, w.head_dim) == (H, G, D)
            assert w.q.shape == (H, 2 * D if adapter.gated else D, 64)
            assert w.o.shape == (64, H, D)
    assert adapter.is_encoder == (name in ENCODER_TYPES)
    assert adapter.gated == (name in GATED_TYPES)
    assert adapter.norm_spans_heads == (name == "olmo2")
    assert adapter.layout_fields(model.config) == {"num_heads": H, "num_kv_heads": G, "head_dim": D}


@pytest.mark.parametrize("name", ALL_TYPES)
def test_round_trip_is_bit_identical(name):
    model = tiny_model(name)
    before = _out(model, name)
    _rewrite(model, lambda layer, w: w)
    assert torch.equal(_out(model, name), before)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_permuted_heads_leave_logits_unchanged(name):
    model = tiny_model(name)
    before = _out(model, name)
    _rewrite(model, _permute)
    torch.testing.assert_close(_out(model, name), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_removing_heads_equals_zeroing_their_output_columns(name):
    model = tiny_model(name)
    adapter = adapter_for(model)
    zeroed = copy.deepcopy(model)
    for layer in attention_layers(zeroed):
        _zero_heads(adapter, layer, _dropped_heads(layer))
    _rewrite(model, _drop_one_query_per_group)
    for layer in attention_layers(model):
        assert _in_width(adapter.out_proj(layer)) == layer.num_heads * layer.head_dim
    if adapter.norm_spans_heads:
        # OLMo2 normalises q/k over all heads together: removing a head rescales the others, so it only runs.
        assert _out(model, name).isfinite().all()
        return
    torch.testing.assert_close(_out(model, name), _out(zeroed, name), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_removing_a_kv_head_in_one_layer(name):
    model = tiny_model(name)
    adapter = adapter_for(model)
    _rewrite(model, _drop_kv_head_0, only={0})
    _, H, G, D = LAYOUTS[name]
    gs = H // G
    layers = attention_layers(model)  # re-found from the new shapes
    assert (layers[0].num_heads, layers[0].num_kv_heads) == (H - gs, G - 1)
    assert all((layer.num_heads, layer.num_kv_heads) == (H, G) for layer in layers[1:])
    w = adapter.read(layers[0])
    assert w.k.shape == (G - 1, D, 64) and w.o.shape == (64, H - gs, D)
    out = _out(model, name)
    assert out.shape == (2, 8, 128) and out.isfinite().all()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_eager_and_sdpa_agree_after_write(name):
    model = tiny_model(name, attn_implementation="eager")
    _rewrite(model, _drop_one_query_per_group)
    _rewrite(model, _drop_kv_head_0, only={0})
    eager = _out(model, name)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(_out(model, name), eager, atol=1e-5, rtol=1e-4)
    # deep copies (used to keep an original next to a pruned model) must survive per-layer config views
    torch.testing.assert_close(_out(copy.deepcopy(model), name), eager, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_uniform_layout_loads_into_a_vanilla_model(name):
    """set_config_heads + from_config rebuilds the pruned shapes, so the state dict loads strictly."""
    model = tiny_model(name)
    adapter = adapter_for(model)
    config = copy.deepcopy(model.config)
    if not adapter.free_head_dim:
        with pytest.raises(HeadlabError, match="head_dim"):
            adapter.set_config_heads(config, 3, 3, 16)
        return
    _rewrite(model, _drop_kv_head_0)
    _, H, G, D = LAYOUTS[name]
    H, G = H - H // G, G - 1
    adapter.set_config_heads(config, H, G, D)
    assert adapter.layout_fields(config) == {"num_heads": H, "num_kv_heads": G, "head_dim": D}
    rebuilt = type(model)(config).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(_out(rebuilt, name), _out(model, name))


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi3"])
def test_write_keeps_dtype_and_requires_grad(name):
    model = tiny_model(name).to(torch.bfloat16)
    model.requires_grad_(False)
    adapter = adapter_for(model)
    layer = attention_layers(model)[0]
    adapter.write(layer, _drop_kv_head_0(layer, adapter.read(layer)).copy())
    for param in layer.block_module.parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad
    with torch.no_grad():
        assert model(**tiny_inputs(name)).logits.dtype == torch.bfloat16


def test_written_weights_do_not_alias_the_callers_tensors():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    layer = attention_layers(model)[0]
    w = adapter.read(layer)
    adapter.write(layer, w)
    w.q.zero_()
    assert adapter.read(layer).q.abs().sum() > 0


def test_uneven_groups_and_gqa_on_mha_only_families_are_refused():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    layer = attention_layers(model)[0]
    with pytest.raises(HeadlabError, match="evenly"):
        adapter.write(layer, adapter.read(layer).take([0, 1, 2]))
    model = tiny_model("opt")
    adapter = adapter_for(model)
    layer = attention_layers(model)[0]
    with pytest.raises(HeadlabError, match="KV heads"):
        adapter.write(layer, adapter.read(layer).take([0, 1], [0]))


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(HeadlabError, match=r"'mamba'.*supported:.*gpt2.*llama.*qwen3_next"):
        adapter_for(SimpleNamespace(model_type="mamba"))
    with pytest.raises(HeadlabError, match="no block list"):
        adapter_for(tiny_config("llama")).blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
