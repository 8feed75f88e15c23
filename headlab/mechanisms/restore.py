"""The one way to change a model for a while: `restoring(loaded)` snapshots every attention layer's weights and the
config's head counts, and puts them back on exit, also after an error. Pruning, compensation and the sweeps use it.
"""

from __future__ import annotations

import contextlib

from headlab.core.loading import LoadedModel

# The config fields a head-count edit changes (Adapter.set_config_heads); restored to exactly their old values.
HEAD_COUNT_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim")


@contextlib.contextmanager
def restoring(loaded: LoadedModel):
    """Run a block that may edit attention weights (masking, slicing, pooling, compensating) and config head counts;
    on exit every attention layer gets its weights (and so its shapes) back through the adapter, and the text
    config its head-count fields. Yields the attention layers as they were on entry."""
    adapter = loaded.adapter
    layers = loaded.layers
    originals = [(layer, adapter.read(layer)) for layer in layers]  # read() copies: later edits cannot reach these
    config = loaded.model.config.get_text_config()
    # getattr/setattr, not __dict__: configs map names (GPT-2's num_attention_heads is n_head).
    before = {name: getattr(config, name) for name in HEAD_COUNT_FIELDS if hasattr(config, name)}
    try:
        yield layers
    finally:
        for layer, weights in originals:
            adapter.write(layer, weights)
        for name in HEAD_COUNT_FIELDS:
            if name in before:
                setattr(config, name, before[name])
            elif name in vars(config):  # set inside the block where the config had no such field
                delattr(config, name)
