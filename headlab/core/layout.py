"""The saved head layout of a physically pruned model: per-layer kept heads in original indices, the config record
that holds it (HEAD_LAYOUT_KEY, versioned) and the loader that rebuilds a non-uniform model from it.

Below loading: load_model reads this record, and pruning, checkpoints and streaming conversion write or check it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError

from headlab.core.arch import Adapter, AttentionLayer
from headlab.core.errors import HeadlabError
from headlab.core.validate import check_layout_record

# config.json key where a non-uniform (per-layer) head layout is recorded by physical pruning.
HEAD_LAYOUT_KEY = "headlab_head_layout"
LAYOUT_VERSION = 1

# transformers 5.25 turned Hub kernels on by default: from_pretrained swaps module forwards for kernels fetched from
# the Hub, and refuses the meta device. headlab checks its numbers against the modeling code's own forwards, hooks
# those modules and runs offline, so every load of its own asks for the modeling code as written.
WITHOUT_HUB_KERNELS = {"use_kernels": False}


def has_head_layout(config) -> bool:
    """Whether a config records a per-layer head layout: on the top-level config, where prune writes it (a multimodal
    model's too), or on its text config."""
    return any(getattr(part, HEAD_LAYOUT_KEY, None) is not None for part in (config, config.get_text_config()))


def group_heads(layer: AttentionLayer, g: int) -> range:
    """Original query heads of KV group g: [g * group_size, (g + 1) * group_size)."""
    return range(g * layer.group_size, (g + 1) * layer.group_size)


@dataclass
class LayerLayout:
    """Physical layout of one pruned layer, in original indices: query heads kept (in order) and, per new KV head,
    the original KV head it keeps. `padding`: pruned heads kept in place with zero output columns, so that every
    KV group keeps the same number of query heads (repeat_kv needs equal groups), or so that an emptied layer
    keeps one head (transformers cannot build a 0-head layer)."""

    layer: int
    heads: list[int]
    kv_heads: list[int]
    original_heads: int
    original_kv_heads: int
    padding: list[int] = field(default_factory=list)
    # Per kept KV head, the original KV heads pooled or merged into it (per-layer KV budgets, headlab.kv.budget);
    # None when each kept KV head is the original kv_heads[i] itself (pruning).
    kv_groups: list[list[int]] | None = None

    @property
    def zeroed(self) -> bool:
        """Every head of the layer is padding: the layer was emptied."""
        return bool(self.heads) and set(self.heads) == set(self.padding)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "original_heads": self.original_heads,
            "original_kv_heads": self.original_kv_heads,
            "padding_heads": self.padding,
            **({"kv_groups": self.kv_groups} if self.kv_groups is not None else {}),
        }


def physical_layout(layers: list[AttentionLayer], pruned: list[set[int]]) -> list[LayerLayout]:
    """Kept heads per layer, valid for repeat_kv (query h' reads KV h' // (H'/G')).

    A KV head goes once all its query heads are gone, and no KV head is ever added: groups left with different sizes
    (GQA pruned head by head) are padded up to the largest with some of their own pruned heads, kept with zero
    output columns (exact, but those heads still cost FLOPs and parameters; recorded; --uniform avoids it). An
    emptied layer keeps its head 0 as padding.
    """
    out = []
    for layer, heads in zip(layers, pruned):
        groups = []
        for g in range(layer.num_kv_heads):
            kept = [h for h in group_heads(layer, g) if h not in heads]
            if kept:
                groups.append((g, kept))
        if not groups:  # transformers cannot build a 0-head layer
            groups = [(layer.kv_head_of(0), [])]
        size = max(1, *(len(kept) for _, kept in groups))
        kept_heads, kv, padding = [], [], []
        for g, kept in groups:
            extra = [h for h in group_heads(layer, g) if h not in kept][: size - len(kept)]
            kept_heads += sorted(kept + extra)
            padding += extra
            kv.append(g)
        out.append(LayerLayout(layer.index, kept_heads, kv, layer.num_heads, layer.num_kv_heads, sorted(padding)))
    return out


def is_uniform(layout: list[LayerLayout], adapter: Adapter, config=None, head_dim: int | None = None) -> bool:
    """Every layer has the same counts and the config can say so (free head_dim): vanilla from_pretrained loads it.
    With `config` and `head_dim`, also that the config class accepts those counts (`config_accepts_heads`)."""
    counts = {(lay.num_heads, lay.num_kv_heads) for lay in layout}
    if len(counts) != 1 or not adapter.free_head_dim:
        return False
    H, G = counts.pop()
    if not (adapter.supports_gqa or H == G):
        return False
    return config is None or config_accepts_heads(config, adapter, H, G, head_dim)


def config_accepts_heads(config, adapter: Adapter, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `config`'s class takes these uniform head counts when it is saved. Some validate more than their
    modeling needs: Llama's config (transformers 5) refuses a hidden_size that is not a multiple of the heads, though
    its attention reads head_dim; such a prune keeps the per-layer layout record instead."""
    trial = copy.deepcopy(config)
    try:
        adapter.set_config_heads(trial, num_heads, num_kv_heads, head_dim)
        for part in {id(trial): trial, id(trial.get_text_config()): trial.get_text_config()}.values():
            if hasattr(part, "validate"):
                part.validate()
    except (HeadlabError, ValueError, TypeError, StrictDataclassError):
        return False
    return True


def compose(config, layout: list[LayerLayout]) -> list[LayerLayout]:
    """Re-pruning a checkpoint that already has a headlab layout: map indices back to the original model's."""
    previous = getattr(config, HEAD_LAYOUT_KEY, None)
    if not previous:
        return layout
    earlier = {entry["layer"]: entry for entry in previous["layers"]}
    out = []
    for lay in layout:
        old = earlier[lay.layer]
        heads = [old["heads"][h] for h in lay.heads]
        kv = [old["kv_heads"][g] for g in lay.kv_heads]
        # Padding of the earlier pruning that survives stays padding (its output columns are already zero).
        padding = sorted({old["heads"][h] for h in lay.padding} | (set(heads) & set(old.get("padding_heads", []))))
        out.append(LayerLayout(lay.layer, heads, kv, old["original_heads"], old["original_kv_heads"], padding))
    return out


def layout_record(config, layout: list[LayerLayout], approximate: bool) -> dict:
    """The config record (HEAD_LAYOUT_KEY) of a per-layer layout, in the original model's indices (compose);
    `approximate`: the layout was cut through a norm spanning heads (recorded, not exact)."""
    return {
        "version": LAYOUT_VERSION,
        "approximate": bool(approximate),
        "layers": [lay.to_dict() for lay in compose(config, layout)],
    }


def auto_class(adapter: Adapter):
    """The transformers Auto class for the adapter's family: masked-LM for encoders, causal-LM otherwise."""
    # start-up: the Auto model classes import transformers' modeling code, which `headlab --help` never needs
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if adapter.is_encoder else AutoModelForCausalLM


def model_class(config, adapter):
    """The class the checkpoint was saved from (config.architectures, e.g. a multimodal wrapper whose names differ
    from its text model's), else the concrete class the adapter's Auto class maps this config to (an Auto class
    cannot be instantiated from a config directly, and a config written without `architectures` is valid)."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    auto = auto_class(adapter)
    try:
        return auto._model_mapping[type(config)]
    except KeyError:
        return auto


def load_pruned(source, config, adapter: Adapter, **kwargs):
    """Load a checkpoint whose config records a per-layer head layout (HEAD_LAYOUT_KEY).

    The model class is built from the config (original head counts), each attention layer is rewritten to its
    recorded shapes through the adapter, and only then does transformers load the weights into it; any missing,
    unexpected or mismatched tensor is an error. kwargs: dtype, attn_implementation, device_map.
    """
    record = getattr(config, HEAD_LAYOUT_KEY)
    if kwargs.pop("gguf_file", None):
        raise HeadlabError("a pruned checkpoint with a per-layer layout is safetensors, not GGUF")
    if not isinstance(record, dict) or record.get("version") != LAYOUT_VERSION:
        raise HeadlabError(f"{source}: unsupported {HEAD_LAYOUT_KEY} record (headlab version mismatch?)")
    where = f"{source}/config.json {HEAD_LAYOUT_KEY}"
    check_layout_record(record, where)  # ids in range and distinct, counts equal to the lists
    auto = auto_class(adapter)
    try:
        base = auto._model_mapping[type(config)]
    except KeyError:
        raise HeadlabError(f"{source}: no {auto.__name__} class for {type(config).__name__}") from None
    entries = {entry["layer"]: entry for entry in record["layers"]}

    def __init__(self, config, *args, **kw):
        base.__init__(self, config, *args, **kw)
        with torch.no_grad():
            layers = adapter.attention_layers(self)
            check_layout_record(record, where, num_layers=len(layers))  # one entry per attention layer
            for layer in layers:
                entry = entries.get(layer.index)
                if entry is None:
                    raise HeadlabError(f"{source}: {HEAD_LAYOUT_KEY} has no entry for attention layer {layer.index}")
                if (entry["original_heads"], entry["original_kv_heads"]) != (layer.num_heads, layer.num_kv_heads):
                    raise HeadlabError(f"{source}: layer {layer.index} layout does not match the config's head counts")
                adapter.write(layer, adapter.read(layer).take(entry["heads"], entry["kv_heads"]))

    # A subclass whose constructor builds the pruned shapes, so transformers' own loading (key renames, tied
    # weights, dtype, device_map) fills them; the class is swapped back to the plain one afterwards.
    pruned_class = type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})
    model, info = pruned_class.from_pretrained(
        source, config=config, output_loading_info=True, **WITHOUT_HUB_KERNELS, **kwargs
    )
    model.__class__ = base
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise HeadlabError(f"{source}: the weights do not fit the recorded head layout: {problems}")
    return model
