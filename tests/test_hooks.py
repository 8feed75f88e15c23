"""The hook primitive (headlab.mechanisms.hooks) and the restore primitive (headlab.mechanisms.restore): sites resolve to the modules the
adapter names, a replacing hook changes the forward exactly as the same edit made by hand, hooks are gone after the
block (also after an error), and `restoring` brings back weights, shapes and config head counts after an error."""

from __future__ import annotations

import pytest
import torch
from models import ALL_TYPES, GQA_TYPES, tiny_inputs, tiny_model

from headlab.core.errors import HeadlabError
from headlab.core.layout import physical_layout
from headlab.core.loading import from_model
from headlab.mechanisms.hooks import SITES, hooks
from headlab.mechanisms.restore import restoring
from headlab.pruning.prune import apply_physical


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("name", ALL_TYPES)
def test_sites_see_the_attention_input_and_the_head_outputs(name):
    loaded = from_model(tiny_model(name))
    inputs = tiny_inputs(name)
    layer = loaded.layers[-1]
    seen = {}

    def keep(site):
        def fn(x):
            seen[site] = x.shape

        return fn

    before = _hook_count(loaded.model)
    with hooks(loaded.adapter, [(site, layer, keep(site)) for site in SITES]):
        _logits(loaded.model, inputs)
    assert _hook_count(loaded.model) == before
    hidden = loaded.model.config.get_text_config().hidden_size
    assert seen["attn_in"][-1] == hidden  # [B, T, C]
    assert seen["heads_out"][-1] == layer.num_heads * layer.head_dim  # [B, T, H*D]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_replacing_hook_equals_the_same_edit_in_the_weights(name):
    """Doubling head 0's output before o_proj == doubling o_proj's columns of head 0 (by hand, in a copy)."""
    loaded = from_model(tiny_model(name))
    inputs = tiny_inputs(name)
    layer = loaded.layers[0]
    D = layer.head_dim

    def double_head_0(z):
        z = z.clone()
        z[..., :D] *= 2
        return z

    with hooks(loaded.adapter, [("heads_out", layer, double_head_0)]):
        hooked = _logits(loaded.model, inputs)
    weights = loaded.adapter.read(layer)
    weights.o[:, 0] *= 2  # o: [C, H, D]
    loaded.adapter.write(layer, weights)
    torch.testing.assert_close(hooked, _logits(loaded.model, inputs), rtol=1e-5, atol=1e-5)


def test_hooks_are_removed_after_an_error_and_unknown_sites_are_refused():
    loaded = from_model(tiny_model("llama"))
    before = _hook_count(loaded.model)

    def fail(x):
        raise RuntimeError("inside the forward")

    with pytest.raises(RuntimeError, match="inside the forward"):
        with hooks(loaded.adapter, [("attn_in", layer, fail) for layer in loaded.layers]):
            _logits(loaded.model, tiny_inputs("llama"))
    assert _hook_count(loaded.model) == before
    with pytest.raises(HeadlabError, match="attn_in, heads_out"):
        with hooks(loaded.adapter, [("q_out", loaded.layers[0], fail)]):
            pass
    assert _hook_count(loaded.model) == before


@pytest.mark.parametrize("name", GQA_TYPES[:2] + ["gpt2"])
def test_restoring_brings_back_weights_shapes_and_head_counts_after_an_error(name):
    loaded = from_model(tiny_model(name))
    inputs = tiny_inputs(name)
    reference = _logits(loaded.model, inputs)
    state = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    config = loaded.model.config.get_text_config()
    counts = (config.num_attention_heads, getattr(config, "num_key_value_heads", None))
    with pytest.raises(RuntimeError, match="mid-edit"):
        with restoring(loaded) as layers:
            apply_physical(loaded, physical_layout(layers, [{0, 1} for _ in layers]))
            layer = loaded.layers[0]
            config.num_attention_heads = layer.num_heads  # GPT-2: through its attribute map, into n_head
            if counts[1] is not None:
                config.num_key_value_heads = layer.num_kv_heads
            assert config.num_attention_heads != counts[0]  # the edit really happened
            raise RuntimeError("mid-edit")
    assert (config.num_attention_heads, getattr(config, "num_key_value_heads", None)) == counts
    after = loaded.model.state_dict()
    assert after.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(after[key], value), key
    torch.testing.assert_close(_logits(loaded.model, inputs), reference, rtol=0, atol=0)
