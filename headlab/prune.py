"""Head pruning: choose heads (by score, explicitly, iteratively), remove them by masking or by slicing the
projections, and save checkpoints that load back (vanilla transformers when uniform, headlab's loader otherwise).

Selection works on per-layer sets of original query-head indices. Mask mode keeps every shape; physical mode
rewrites each layer through its adapter (read -> HeadWeights.take -> write), so it holds for every family.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from headlab.arch import Adapter, AttentionLayer
from headlab.errors import HeadlabError
from headlab.loading import HEAD_LAYOUT_KEY, LoadedModel, check_resident

UNITS = ("head", "kv-group")
MODES = ("mask", "physical")
LAYOUT_VERSION = 1
RECORD_DIR = "pruning"  # inside a pruned checkpoint: heads.csv/.parquet, mask.csv (gates format), meta.json


# ---- scores -------------------------------------------------------------------------------------------------------


def read_scores(source, layers: list[AttentionLayer]) -> list[torch.Tensor]:
    """Per-layer scores [H_l] from a table with columns layer, head and `importance` (an importance run) or `score`.

    `source`: a DataFrame, a .csv/.parquet file, or a run directory holding importance.csv. The table must list
    exactly the model's (layer, head) pairs: a table from another model is an error, not a silent mismatch.
    """
    frame, name = _score_frame(source)
    column = "importance" if "importance" in frame.columns else "score" if "score" in frame.columns else None
    if column is None or not {"layer", "head"} <= set(frame.columns):
        raise HeadlabError(f"score table {name} needs columns layer, head and importance or score")
    expected = {(layer.index, h) for layer in layers for h in range(layer.num_heads)}
    try:
        pairs = [(float(a), float(b)) for a, b in zip(frame["layer"], frame["head"])]
        values = [float(v) for v in frame[column]]
    except (TypeError, ValueError):
        pairs = None
    # int() would truncate 0.5 to head 0 (and fail on inf): only whole numbers name a head.
    if pairs is None or not all(math.isfinite(x) and x.is_integer() for pair in pairs for x in pair):
        raise HeadlabError(f"score table {name}: layer and head must be integers, {column} numbers")
    got = [(int(a), int(b)) for a, b in pairs]
    if len(set(got)) != len(got) or set(got) != expected:
        n_layers = len({a for a, _ in got})
        raise HeadlabError(
            f"score table {name} does not match the model: it lists {len(set(got))} heads in {n_layers} layers, "
            f"the model has {len(expected)} heads in {len(layers)} layers (a table from another model?)"
        )
    if not all(math.isfinite(v) for v in values):
        raise HeadlabError(f"score table {name}: every {column} must be finite")
    scores = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in layers]
    for (layer, head), value in zip(got, values):
        scores[layer][head] = value
    return scores


def _score_frame(source) -> tuple[pd.DataFrame, str]:
    if isinstance(source, pd.DataFrame):
        return source, "(table)"
    path = Path(source)
    if path.is_dir():
        for candidate in ("importance.csv", "scores.csv"):
            if (path / candidate).is_file():
                path = path / candidate
                break
        else:
            raise HeadlabError(f"{source} is a directory without importance.csv or scores.csv")
    if not path.is_file():
        raise HeadlabError(f"no such score table: {source}")
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read score table {path}: {str(error).splitlines()[0]}") from None
    return frame, str(path)


def random_scores(layers: list[AttentionLayer], seed: int) -> list[torch.Tensor]:
    """Uniform random scores (the random-order baseline of Michel et al.'s pruning curves)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(layer.num_heads, generator=generator, dtype=torch.float64) for layer in layers]


def entropy_scores(loaded: LoadedModel, **kwargs) -> list[torch.Tensor]:
    """Score = -(mean attention entropy), so the most diffuse heads (highest entropy) are pruned first."""
    from headlab.stats import head_statistics

    table = head_statistics(loaded, induction=False, **kwargs)  # entropy needs no induction sequences
    table = table[table["statistic"] == "entropy"]
    scores = [torch.full((layer.num_heads,), math.nan, dtype=torch.float64) for layer in loaded.layers]
    for layer, head, value in zip(table["layer"], table["head"], table["value"]):
        scores[int(layer)][int(head)] = -float(value)
    if any(bool(torch.isnan(s).any()) for s in scores):
        raise HeadlabError("head_statistics gave no entropy for some heads")
    return scores


def importance_scores(loaded: LoadedModel, pruned: list[set[int]] | None = None, **kwargs) -> list[torch.Tensor]:
    """Head importance (Michel et al. 2019) from headlab.importance, with already pruned heads masked (gate 0)."""
    from headlab.importance import head_importance

    mask = None if pruned is None else gates_from_pruned(loaded.layers, pruned)
    result = head_importance(loaded, mask=mask, **kwargs)
    scores = [torch.zeros(layer.num_heads, dtype=torch.float64) for layer in loaded.layers]
    for layer, head, value in zip(result.table["layer"], result.table["head"], result.table["importance"]):
        scores[int(layer)][int(head)] = float(value)
    return scores


# ---- selection ----------------------------------------------------------------------------------------------------


def parse_heads(spec: str, layers: list[AttentionLayer]) -> list[set[int]]:
    """`"L:h,h;L:h"` -> per-layer sets of query heads; unknown layers or heads are errors."""
    pruned = [set() for _ in layers]
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        match = re.fullmatch(r"(\d+)\s*:\s*(\d+(?:\s*,\s*\d+)*)", part)
        if match is None:
            raise HeadlabError(f"--heads: cannot read {part!r}; use 'LAYER:HEAD,HEAD;LAYER:HEAD'")
        layer = int(match.group(1))
        if layer >= len(layers):
            raise HeadlabError(f"--heads: layer {layer} does not exist (the model has {len(layers)} attention layers)")
        for head in (int(h) for h in match.group(2).split(",")):
            if head >= layers[layer].num_heads:
                raise HeadlabError(f"--heads: layer {layer} has no head {head} ({layers[layer].num_heads} heads)")
            pruned[layer].add(head)
    if not any(pruned):
        raise HeadlabError("--heads names no head")
    return pruned


def _units(layer: AttentionLayer, unit: str) -> list[list[int]]:
    """The prunable units of a layer as lists of query heads: single heads, or a KV head's whole group."""
    if unit == "head":
        return [[h] for h in range(layer.num_heads)]
    gs = layer.group_size
    return [list(range(g * gs, (g + 1) * gs)) for g in range(layer.num_kv_heads)]


def _amount(fraction: float | None, count: int | None, total: int, what: str) -> int:
    if count is not None:
        if count > total:
            raise HeadlabError(f"--count {count} exceeds the {total} {what}")
        return count
    return _nearest(fraction * total)


def _nearest(x: float) -> int:
    """The nearest integer, halves rounded down: a fraction between two layouts prunes the smaller one."""
    return max(0, math.ceil(x - 0.5 - 1e-9))


def check_amount(fraction: float | None, count: int | None) -> None:
    if (fraction is None) == (count is None):
        raise HeadlabError("give exactly one of --fraction and --count")
    if fraction is not None and not 0 <= fraction < 1:
        raise HeadlabError(f"--fraction must be in [0, 1), got {fraction}")
    if count is not None and count < 0:
        raise HeadlabError(f"--count must be >= 0, got {count}")


def select_heads(
    layers: list[AttentionLayer],
    scores: list[torch.Tensor],
    *,
    fraction: float | None = None,
    count: int | None = None,
    per_layer: bool = False,
    unit: str = "head",
    uniform: bool = False,
    allow_empty_layer: bool = False,
    already: list[set[int]] | None = None,
) -> list[set[int]]:
    """The lowest-scoring units (heads, or KV groups scored by the sum of their query heads), globally or per layer.

    `fraction`/`count` is the total to have pruned, including `already` (iterative pruning). A unit that would
    empty a layer is skipped unless allow_empty_layer. Ties go to the lower (layer, head). Returns per-layer sets.
    """
    check_amount(fraction, count)
    check_unit(layers, unit)
    if len(scores) != len(layers) or any(s.shape != (layer.num_heads,) for s, layer in zip(scores, layers)):
        raise HeadlabError("the scores do not match the model's layers and heads")
    pruned = [set(s) for s in already] if already is not None else [set() for _ in layers]
    if uniform:
        return _select_uniform(layers, scores, fraction, count, unit, pruned)
    units = [_units(layer, unit) for layer in layers]

    def score(layer: int, heads: list[int]) -> float:
        return float(scores[layer][heads].sum())

    def open_units(layer: int) -> list[list[int]]:
        return [u for u in units[layer] if not set(u) <= pruned[layer]]

    def fits(layer: int, heads: list[int]) -> bool:
        return allow_empty_layer or len(pruned[layer] | set(heads)) < layers[layer].num_heads

    what = "heads" if unit == "head" else "KV groups"
    if per_layer:
        for i in range(len(layers)):
            target = _amount(fraction, count, len(units[i]), f"{what} of layer {i}")
            done = len(units[i]) - len(open_units(i))
            for heads in sorted(open_units(i), key=lambda u: (score(i, u), u)):
                if done >= target:
                    break
                if fits(i, heads):
                    pruned[i] |= set(heads)
                    done += 1
            if done < target:
                raise HeadlabError(
                    f"cannot prune {target} {what} of layer {i} and keep one head; pass --allow-empty-layer"
                )
        return pruned
    total = sum(len(u) for u in units)
    target = _amount(fraction, count, total, what)
    done = total - sum(len(open_units(i)) for i in range(len(layers)))
    candidates = sorted(
        ((score(i, u), i, u) for i in range(len(layers)) for u in open_units(i)), key=lambda c: (c[0], c[1], c[2])
    )
    for _, i, heads in candidates:
        if done >= target:
            break
        if fits(i, heads):
            pruned[i] |= set(heads)
            done += 1
    if done < target:
        raise HeadlabError(
            f"cannot prune {target} {what} while keeping one head in every layer; pass --allow-empty-layer"
        )
    return pruned


def check_unit(layers: list[AttentionLayer], unit: str) -> None:
    if unit not in UNITS:
        raise HeadlabError(f"unknown --unit {unit!r}; use one of {', '.join(UNITS)}")
    if unit == "kv-group" and all(layer.group_size == 1 for layer in layers):
        raise HeadlabError("--unit kv-group means nothing different on a model without GQA (one query per KV head)")


def _select_uniform(layers, scores, fraction, count, unit, pruned) -> list[set[int]]:
    """Remove the same number k from every container: per KV group (GQA heads), per layer (MHA heads, KV groups)."""
    if any(pruned):
        raise HeadlabError("--uniform cannot be combined with iterative or preset pruning")
    if len({(layer.num_heads, layer.num_kv_heads) for layer in layers}) != 1:
        raise HeadlabError("--uniform needs every attention layer to have the same head layout")
    H, G = layers[0].num_heads, layers[0].num_kv_heads
    gs = H // G
    if unit == "head" and gs > 1:
        containers = [[[g * gs + i for i in range(gs)] for g in range(G)] for _ in layers]  # query heads of a group
        size, what = gs, "query heads per KV group"
    elif unit == "head":
        containers = [[list(range(H))] for _ in layers]
        size, what = H, "heads per layer"
    else:
        containers = [[list(range(G))] for _ in layers]  # one container of KV-group ids per layer
        size, what = G, "KV groups per layer"
    n_containers = sum(len(c) for c in containers)
    if count is not None:
        if count % n_containers:
            raise HeadlabError(
                f"--uniform cannot prune {count} {'KV groups' if unit == 'kv-group' else 'heads'}: the count must be "
                f"a multiple of {n_containers} (the same number in each of {n_containers} "
                f"{'layers' if size != gs or unit != 'head' else 'KV groups'}), e.g. {n_containers}"
            )
        k = count // n_containers
    else:
        k = _nearest(fraction * size)
    if (fraction or count) and k == 0:
        raise HeadlabError(
            f"--uniform cannot prune {fraction if count is None else count}: the nearest uniform layout removes 0 "
            f"of {size} {what} (smallest step: 1/{size} = {1 / size:.3f})"
        )
    if k >= size:
        hint = "; prune whole groups with --unit kv-group" if unit == "head" and gs > 1 else ""
        raise HeadlabError(f"--uniform cannot remove all {size} {what}{hint}")
    for i, layer_containers in enumerate(containers):
        for members in layer_containers:
            if unit == "kv-group":
                ranked = sorted(members, key=lambda g: (float(scores[i][g * gs : (g + 1) * gs].sum()), g))
                for g in ranked[:k]:
                    pruned[i] |= set(range(g * gs, (g + 1) * gs))
            else:
                ranked = sorted(members, key=lambda h: (float(scores[i][h]), h))
                pruned[i] |= set(ranked[:k])
    return pruned


def gates_from_pruned(layers: list[AttentionLayer], pruned: list[set[int]]) -> list[torch.Tensor]:
    """0/1 gates [H_l]: 0 for pruned heads (the mask-file format of headlab.gates)."""
    gates = []
    for layer, heads in zip(layers, pruned):
        gate = torch.ones(layer.num_heads, dtype=torch.float32)
        gate[sorted(heads)] = 0.0
        gates.append(gate)
    return gates


def pruned_table(layers: list[AttentionLayer], pruned: list[set[int]], scores=None) -> pd.DataFrame:
    """Tidy record: one row per head, `layer, head, kv_head, pruned` (+ `score` when known)."""
    rows = []
    for layer, heads in zip(layers, pruned):
        for h in range(layer.num_heads):
            row = {"layer": layer.index, "head": h, "kv_head": layer.kv_head_of(h), "pruned": h in heads}
            if scores is not None:
                row["score"] = float(scores[layer.index][h])
            rows.append(row)
    return pd.DataFrame(rows)


def check_not_empty(layers: list[AttentionLayer], pruned: list[set[int]], allow_empty_layer: bool) -> None:
    if allow_empty_layer:
        return
    for layer, heads in zip(layers, pruned):
        if len(heads) >= layer.num_heads:
            raise HeadlabError(f"this prunes every head of layer {layer.index}; pass --allow-empty-layer to allow it")


# ---- applying a selection -----------------------------------------------------------------------------------------


def apply_mask(loaded: LoadedModel, pruned: list[set[int]]) -> None:
    """Mask mode, in place: zero the pruned heads' output-projection columns (and their query rows, and the key and
    value rows of KV heads left without queries), keeping every shape.

    Output-projection columns alone make the model equal to gating those heads with 0; the query/KV rows are zeroed
    only to make the removal visible in the weights, and not where the q/k norm spans heads (OLMo2), where a zero
    head would change the other heads' normalisation.
    """
    check_resident(loaded, "mask pruning")
    adapter = loaded.adapter
    with torch.no_grad():
        for layer, heads in zip(loaded.layers, pruned):
            if not heads:
                continue
            w = adapter.read(layer)
            index = torch.tensor(sorted(heads))
            w.o[:, index] = 0
            if not adapter.norm_spans_heads:
                w.q[index] = 0
                if w.q_bias is not None:
                    w.q_bias[index] = 0
                dead = [g for g in range(layer.num_kv_heads) if all(h in heads for h in _group(layer, g))]
                for t in (w.k, w.v, w.k_bias, w.v_bias):
                    if t is not None and dead:
                        t[torch.tensor(dead)] = 0
            adapter.write(layer, w)


def _group(layer: AttentionLayer, g: int) -> range:
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
            kept = [h for h in _group(layer, g) if h not in heads]
            if kept:
                groups.append((g, kept))
        if not groups:  # transformers cannot build a 0-head layer
            groups = [(layer.kv_head_of(0), [])]
        size = max(1, *(len(kept) for _, kept in groups))
        kept_heads, kv, padding = [], [], []
        for g, kept in groups:
            extra = [h for h in _group(layer, g) if h not in kept][: size - len(kept)]
            kept_heads += sorted(kept + extra)
            padding += extra
            kv.append(g)
        out.append(LayerLayout(layer.index, kept_heads, kv, layer.num_heads, layer.num_kv_heads, sorted(padding)))
    return out


def apply_physical(loaded: LoadedModel, layout: list[LayerLayout]) -> None:
    """Physical mode, in place: slice q/k/v/o weights, biases and per-head norms to the layout through the adapter."""
    check_resident(loaded, "physical pruning")
    adapter = loaded.adapter
    with torch.no_grad():
        for layer, lay in zip(loaded.layers, layout):
            unchanged = lay.num_heads == layer.num_heads and lay.kv_heads == list(range(layer.num_kv_heads))
            if unchanged and not lay.padding:
                continue
            w = adapter.read(layer).take(lay.heads, lay.kv_heads)
            for position, head in enumerate(lay.heads):
                if head in lay.padding:
                    w.o[:, position] = 0  # [C, D] block of the padding head: it contributes nothing
            adapter.write(layer, w)


def is_uniform(layout: list[LayerLayout], adapter: Adapter) -> bool:
    """Every layer has the same counts and the config can say so (free head_dim): vanilla from_pretrained loads it."""
    counts = {(lay.num_heads, lay.num_kv_heads) for lay in layout}
    if len(counts) != 1 or not adapter.free_head_dim:
        return False
    H, G = counts.pop()
    return adapter.supports_gqa or H == G


@contextlib.contextmanager
def pruned_in_place(loaded: LoadedModel, pruned: list[set[int]], mode: str = "physical"):
    """Apply a selection for the duration of a block, then write the original weights back (also on error)."""
    adapter = loaded.adapter
    originals = [(layer, adapter.read(layer)) for layer in loaded.layers]
    try:
        if mode == "physical":
            layout = physical_layout(loaded.layers, pruned)
            apply_physical(loaded, layout)
            yield layout
        else:
            apply_mask(loaded, pruned)
            yield None
    finally:
        for layer, w in originals:
            adapter.write(layer, w)


# ---- costs --------------------------------------------------------------------------------------------------------


def costs(loaded: LoadedModel, context: int = 1024) -> dict:
    """Parameters, attention FLOPs per token at `context`, and KV-cache bytes per token (model dtype)."""
    from headlab.evaluate import DTYPE_BYTES, attention_flops_per_token, kv_cache_bytes, parameter_counts

    element = DTYPE_BYTES.get(str(loaded.dtype).removeprefix("torch."), 4)
    layers = loaded.layers
    return {
        **parameter_counts(loaded),
        "attention_flops_per_token": attention_flops_per_token(loaded, context),
        "kv_bytes_per_token": kv_cache_bytes([(layer.num_kv_heads, layer.head_dim) for layer in layers], 1, 1, element),
        "query_heads": sum(layer.num_heads for layer in layers),
        "kv_heads": sum(layer.num_kv_heads for layer in layers),
        "flops_context": context,
    }


# ---- saving and loading -------------------------------------------------------------------------------------------


def _compose(config, layout: list[LayerLayout]) -> list[LayerLayout]:
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


def layout_record(loaded: LoadedModel, layout: list[LayerLayout]) -> dict:
    return {
        "version": LAYOUT_VERSION,
        "approximate": bool(loaded.adapter.norm_spans_heads),
        "layers": [lay.to_dict() for lay in _compose(loaded.model.config, layout)],
    }


def prepare_config(loaded: LoadedModel, layout: list[LayerLayout] | None) -> str:
    """Write the pruned layout into the model's config before saving; returns "vanilla" or "headlab" (the loader).

    Uniform layouts update the head counts (vanilla from_pretrained builds them); others keep the original counts
    and record per-layer heads under HEAD_LAYOUT_KEY, so vanilla loading fails on shapes instead of running wrong.
    """
    config = loaded.model.config
    if layout is None:  # mask mode: shapes unchanged
        return "headlab" if getattr(config, HEAD_LAYOUT_KEY, None) else "vanilla"
    if is_uniform(layout, loaded.adapter):
        lay = layout[0]
        loaded.adapter.set_config_heads(config, lay.num_heads, lay.num_kv_heads, loaded.layers[0].head_dim)
        if hasattr(config, HEAD_LAYOUT_KEY):
            delattr(config, HEAD_LAYOUT_KEY)
        return "vanilla"
    setattr(config, HEAD_LAYOUT_KEY, layout_record(loaded, layout))
    return "headlab"


def load_pruned(source, config, adapter: Adapter, **kwargs):
    """Load a checkpoint whose config records a per-layer head layout (HEAD_LAYOUT_KEY).

    The model class is built from the config (original head counts), each attention layer is rewritten to its
    recorded shapes through the adapter, and only then does transformers load the weights into it; any missing,
    unexpected or mismatched tensor is an error. kwargs: dtype, attn_implementation, device_map.
    """
    from headlab.loading import _auto_class

    record = getattr(config, HEAD_LAYOUT_KEY)
    if kwargs.pop("gguf_file", None):
        raise HeadlabError("a pruned checkpoint with a per-layer layout is safetensors, not GGUF")
    if not isinstance(record, dict) or record.get("version") != LAYOUT_VERSION:
        raise HeadlabError(f"{source}: unsupported {HEAD_LAYOUT_KEY} record (headlab version mismatch?)")
    auto = _auto_class(adapter)
    try:
        base = auto._model_mapping[type(config)]
    except KeyError:
        raise HeadlabError(f"{source}: no {auto.__name__} class for {type(config).__name__}") from None
    entries = {entry["layer"]: entry for entry in record["layers"]}

    def __init__(self, config, *args, **kw):
        base.__init__(self, config, *args, **kw)
        with torch.no_grad():
            for layer in adapter.attention_layers(self):
                entry = entries.get(layer.index)
                if entry is None:
                    raise HeadlabError(f"{source}: {HEAD_LAYOUT_KEY} has no entry for attention layer {layer.index}")
                if (entry["original_heads"], entry["original_kv_heads"]) != (layer.num_heads, layer.num_kv_heads):
                    raise HeadlabError(f"{source}: layer {layer.index} layout does not match the config's head counts")
                adapter.write(layer, adapter.read(layer).take(entry["heads"], entry["kv_heads"]))

    # A subclass whose constructor builds the pruned shapes, so transformers' own loading (key renames, tied
    # weights, dtype, device_map) fills them; the class is swapped back to the plain one afterwards.
    pruned_class = type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})
    model, info = pruned_class.from_pretrained(source, config=config, output_loading_info=True, **kwargs)
    model.__class__ = base
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise HeadlabError(f"{source}: the weights do not fit the recorded head layout: {problems}")
    return model


@dataclass
class PruneResult:
    """What `prune` did: the selection, the layout, the costs and perplexities before and after, where it went."""

    pruned: list[set[int]]
    table: pd.DataFrame
    mode: str
    loader: str  # "vanilla" (AutoModel.from_pretrained) or "headlab" (headlab.loading.load_model)
    layout: list[LayerLayout] | None
    before: dict
    after: dict
    ppl_before: float | None
    ppl_after: float | None
    out: Path | None
    verification: dict | None
    meta: dict = field(default_factory=dict)

    @property
    def num_pruned(self) -> int:
        return sum(len(p) for p in self.pruned)


def save_pruned(loaded: LoadedModel, out, result_meta: dict, table: pd.DataFrame, gates, *, overwrite=False) -> dict:
    """Save the pruned model atomically with its record (pruning/heads.csv+.parquet, mask.csv, meta.json), after
    checkpoint.save_checkpoint has reloaded it and compared logits. Returns the verification."""
    from headlab.checkpoint import save_checkpoint
    from headlab.gates import write_mask
    from headlab.loading import atomic_directory
    from headlab.tables import write_run

    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as staging:
        # save_checkpoint stages its own directory and moves it onto `staging`; the record joins it before the one
        # rename that publishes `out`.
        verification = save_checkpoint(loaded.model, loaded.tokenizer, staging, overwrite=True, meta=result_meta)
        write_run(staging / RECORD_DIR, {"heads": table}, result_meta, overwrite=False)
        # The model may no longer have the original shapes: the mask is indexed by the original heads.
        write_mask(staging / RECORD_DIR / "mask.csv", gates, _original_layers(table))
    return verification.to_dict() if verification else None


def _original_layers(table: pd.DataFrame):
    """Minimal layer views (index, num_heads) of the original model, from the pruning record."""
    from types import SimpleNamespace

    return [
        SimpleNamespace(index=int(layer), num_heads=int(len(group)))
        for layer, group in table.groupby("layer", sort=True)
    ]


def prune(
    loaded: LoadedModel,
    *,
    scores=None,
    heads: str | None = None,
    fraction: float | None = None,
    count: int | None = None,
    per_layer: bool = False,
    unit: str = "head",
    uniform: bool = False,
    iterative: int | None = None,
    allow_empty_layer: bool = False,
    mode: str = "mask",
    out=None,
    overwrite: bool = False,
    method: str = "grad",
    data=None,
    text_column: str | None = None,
    calibration_tokens: int = 2048,
    eval_tokens: int | None = 1024,
    seq_len: int = 256,
    batch_size: int = 4,
    evaluate: bool = True,
    progress: bool = True,
    compensate: str | None = None,
    low_memory: bool = True,
) -> PruneResult:
    """Select heads, prune them in place (mask or physical), report costs and perplexity before and after, and save
    a verified checkpoint with its pruning record to `out` (when given). Bad input fails before any work.

    compensate: "ridge" refits the kept heads' output-projection columns, "bias" folds the removed heads' mean output
    into the o_proj bias (headlab.compensate), on `calibration_tokens` calibration tokens, before pruning.
    low_memory: importance runs one sequence per backward pass with activation checkpointing (same scores)."""
    from headlab.checkpoint import check_checkpoint_out
    from headlab.compensate import check_compensation

    check_compensation(loaded, compensate)

    layers = loaded.layers
    if mode not in MODES:
        raise HeadlabError(f"unknown --mode {mode!r}; use mask or physical")
    if heads is not None:
        if scores is not None or iterative or fraction is not None or count is not None or uniform:
            raise HeadlabError("--heads names the heads itself; drop --scores/--fraction/--count/--iterative/--uniform")
    else:
        if fraction is None and count is None:
            fraction = 0.2
        check_amount(fraction, count)
        check_unit(layers, unit)
    if iterative is not None and (iterative < 1 or uniform):
        raise HeadlabError("--iterative needs STEPS >= 1 and cannot be combined with --uniform")
    if out is not None:
        check_checkpoint_out(out, overwrite, loaded.source)
    # Everything cheap is checked; explicit heads and score tables are validated before any forward pass.
    table_scores = read_scores(scores, layers) if scores is not None else None
    importance_kwargs = dict(
        method=method,
        data=data,
        seq_len=seq_len,
        batch_size=batch_size,
        max_tokens=calibration_tokens,
        progress=progress,
        # low_memory: one sequence per backward pass, blocks recomputed; keeps the peak near twice the model's bytes
        max_rows=1 if low_memory else None,
        gradient_checkpointing=low_memory and method != "ablation",
    )
    if heads is not None:
        pruned = parse_heads(heads, layers)
        check_not_empty(layers, pruned, allow_empty_layer)
        current = None
    else:
        if uniform:  # an impossible uniform amount must fail before scoring
            _select_uniform(
                layers,
                [torch.zeros(layer.num_heads) for layer in layers],
                fraction,
                count,
                unit,
                [set() for _ in layers],
            )
        current = table_scores if table_scores is not None else importance_scores(loaded, **importance_kwargs)
        steps = iterative or 1
        pruned = [set() for _ in layers]
        for step in range(1, steps + 1):
            if step > 1:
                current = importance_scores(loaded, pruned, **importance_kwargs)
            pruned = select_heads(
                layers,
                current,
                fraction=None if fraction is None else fraction * step / steps,
                count=None if count is None else round(count * step / steps),
                per_layer=per_layer,
                unit=unit,
                uniform=uniform,
                allow_empty_layer=allow_empty_layer,
                already=pruned,
            )
    table = pruned_table(layers, pruned, current)
    gates = gates_from_pruned(layers, pruned)

    eval_kwargs = dict(seq_len=seq_len, batch_size=batch_size, max_tokens=eval_tokens, text_column=text_column)
    before = costs(loaded)
    ppl_before = _ppl(loaded, data, eval_kwargs, progress) if evaluate else None
    compensation = None
    if compensate is not None:
        from headlab.compensate import apply_compensation, compensation_batches, output_statistics

        batches = compensation_batches(
            loaded, data, text_column=text_column, seq_len=seq_len, batch_size=batch_size, max_tokens=calibration_tokens
        )
        grams = output_statistics(loaded, batches, progress=progress)
        compensation = apply_compensation(loaded, pruned, grams, compensate)
    layout = None
    if mode == "mask":
        with pruned_in_place(loaded, pruned, "physical") as physical:  # what a physical prune would cost
            equivalent = costs(loaded)
            equivalent_heads = [lay.to_dict() for lay in physical]
        apply_mask(loaded, pruned)
    else:
        layout = physical_layout(layers, pruned)
        apply_physical(loaded, layout)
        equivalent, equivalent_heads = None, None
    after = costs(loaded)
    ppl_after = _ppl(loaded, data, eval_kwargs, progress) if evaluate else None
    loader = prepare_config(loaded, layout)
    padding = sum(len(lay.padding) for lay in layout or [])
    meta = {
        **loaded.describe(),
        "mode": mode,
        "loader": loader,
        "selection": {
            "heads": heads,
            "scores": str(scores)
            if scores is not None and not isinstance(scores, pd.DataFrame)
            else scores is not None,
            "method": None if heads is not None or scores is not None else method,
            "fraction": fraction,
            "count": count,
            "per_layer": per_layer,
            "unit": unit,
            "uniform": uniform,
            "iterative": iterative,
            "allow_empty_layer": allow_empty_layer,
            "calibration_tokens": calibration_tokens,
        },
        "pruned_heads": sum(len(p) for p in pruned),
        "total_heads": sum(layer.num_heads for layer in layers),
        "approximate": mode == "physical" and loaded.adapter.norm_spans_heads,
        "padding_heads": padding,
        "costs_before": before,
        "costs_after": after,
        "physical_equivalent": equivalent,
        "physical_equivalent_layout": equivalent_heads,
        "perplexity_before": ppl_before,
        "perplexity_after": ppl_after,
        "compensation": None
        if compensation is None
        else {
            "method": compensate,
            "calibration": batches.meta,
            "error_before": float(compensation["error_before"].mean()),
            "error_after": float(compensation["error_after"].mean()),
            "layers": compensation.to_dict("records"),
        },
        "eval": {"data": data or "pydoc-topics", "split": "eval", **eval_kwargs},
    }
    verification = None
    if out is not None:
        verification = save_pruned(loaded, out, meta, table, gates, overwrite=overwrite)
    return PruneResult(
        pruned,
        table,
        mode,
        loader,
        layout,
        before,
        after,
        ppl_before,
        ppl_after,
        Path(out) if out is not None else None,
        verification,
        meta,
    )


def _ppl(loaded, data, eval_kwargs, progress) -> float:
    from headlab.evaluate import perplexity

    return perplexity(loaded, data, part="eval", progress=progress, **eval_kwargs).perplexity
