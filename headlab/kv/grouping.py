"""KV-head grouping and pooling algebra: which KV heads to group (contiguous, or by calibrated similarity), the pure
conversion plan (`plan_conversion`), and the weight edits that pool, repeat or permute them (Ainslie et al. 2023).
No saving or evaluation: see gqa.py, which applies a plan to a model.

Layout rule (transformers' repeat_kv): query head h reads KV head h // (H / G). Pooling contiguous KV heads
[g*m, (g+1)*m) into KV head g keeps that rule for the same query heads, so query weights never change; any other
equal-size grouping is made contiguous first by permuting KV heads together with the query heads that read them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.arch import ADAPTERS, AttentionLayer, HeadWeights
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.kv.methods import GROUPINGS, KV_METHODS, POOLS
from headlab.mechanisms.hooks import hooks

# Enumerate every equal-size partition up to this many (9 heads in 3s: 280; 12 in 3s: 15,400; 12 in 4s: 5,775).
EXACT_SEARCH_LIMIT = 100_000


# ---- layout checks -----------------------------------------------------------------------------------------------


def gqa_layers(loaded: LoadedModel) -> list[AttentionLayer]:
    """The softmax-attention layers to convert (hybrids: linear-attention blocks are skipped), with one uniform
    (H, G, D) layout, since a config holds one num_key_value_heads."""
    adapter = loaded.adapter
    if adapter.latent_kv:
        raise HeadlabError(
            f"{loaded.model.config.model_type} caches one latent shared by all heads (multi-head latent attention): "
            "there are no KV heads to pool or expand; KV-head conversion and merging do not apply"
        )
    if not adapter.supports_gqa:
        capable = sorted(t for t, a in ADAPTERS.items() if a.supports_gqa)
        raise HeadlabError(
            f"{loaded.model.config.model_type} cannot hold fewer KV heads than query heads (its config has no "
            f"num_key_value_heads; supports_gqa=False); KV-head conversion works for: {', '.join(capable)}"
        )
    layers = loaded.layers
    uniform_layout(layers)
    return layers


def uniform_layout(layers: Sequence[AttentionLayer]) -> tuple[int, int, int]:
    """The one (H, G, D) of every layer; a model whose layers differ cannot be converted (one config count)."""
    layouts = sorted({(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers})
    if len(layouts) != 1:
        raise HeadlabError(f"KV-head conversion needs the same (H, G, D) in every layer, found {layouts}")
    return layouts[0]


def check_kv_heads(num_heads: int, num_kv_heads: int, kv_heads: int) -> str:
    """'pool', 'expand' or 'keep' for a target of `kv_heads` KV heads; bad targets raise HeadlabError."""
    if kv_heads < 1:
        raise HeadlabError(f"kv_heads={kv_heads} must be at least 1")
    if kv_heads == num_kv_heads:
        return "keep"
    if kv_heads < num_kv_heads:
        if num_kv_heads % kv_heads:
            divisors = [g for g in range(1, num_kv_heads + 1) if num_kv_heads % g == 0]
            raise HeadlabError(
                f"kv_heads={kv_heads} does not divide the model's {num_kv_heads} KV heads; use one of {divisors}"
            )
        return "pool"
    if kv_heads > num_heads or num_heads % kv_heads or kv_heads % num_kv_heads:
        larger = [g for g in range(num_kv_heads + 1, num_heads + 1) if num_heads % g == 0 and g % num_kv_heads == 0]
        raise HeadlabError(
            f"kv_heads={kv_heads} is not reachable from {num_kv_heads} KV heads and {num_heads} query heads: "
            f"pooling needs a divisor of {num_kv_heads}, expanding a multiple of {num_kv_heads} that divides "
            f"{num_heads} ({larger or 'none'})"
        )
    return "expand"


# ---- grouping ----------------------------------------------------------------------------------------------------


def check_direction(direction: str, action: str, num_heads: int, num_kv_heads: int, kv_heads: int) -> None:
    """convert-gqa ("pool") refuses more KV heads than the model has, expand-kv ("expand") fewer or the same."""
    G = num_kv_heads
    if direction == "pool" and action == "expand":
        raise HeadlabError(f"kv_heads={kv_heads} is more than the model's {G} KV heads; use `headlab expand-kv`")
    if direction == "expand" and action == "pool":
        raise HeadlabError(f"kv_heads={kv_heads} is fewer than the model's {G} KV heads; use `headlab convert-gqa`")
    if direction == "expand" and action == "keep":
        # Expanding to the current count would only copy the checkpoint (e.g. expand-kv on an MHA model).
        raise HeadlabError(f"the model already has {G} KV heads for its {num_heads} query heads: nothing to expand")


def contiguous_groups(num_kv_heads: int, kv_heads: int) -> list[list[int]]:
    """transformers' layout: new KV head g pools old KV heads [g*m, (g+1)*m), m = G_old / G_new."""
    m = num_kv_heads // kv_heads
    return [list(range(g * m, (g + 1) * m)) for g in range(kv_heads)]


def identity_groups(num_kv_heads: int, kv_heads: int) -> list[list[int]]:
    """Expansion (or keep): KV head g of the original becomes new heads g*f .. g*f+f-1, f = kv_heads / G."""
    factor = max(kv_heads // num_kv_heads, 1)
    return [[g * factor + i for i in range(factor)] for g in range(num_kv_heads)]


def canonical(groups) -> list[list[int]]:
    """Members ascending, groups ordered by their smallest member (so identity stays identity)."""
    return sorted((sorted(int(i) for i in g) for g in groups), key=lambda g: g[0])


def partition_count(n: int, m: int) -> int:
    """Partitions of n items into n/m unordered groups of m: n! / (m!^(n/m) (n/m)!)."""
    k = n // m
    return math.factorial(n) // (math.factorial(m) ** k * math.factorial(k))


def partition_score(similarity: torch.Tensor, groups) -> float:
    """Sum over groups of the pairwise similarities inside each group (what the grouping maximises)."""
    return float(sum(similarity[i, j] for g in groups for i, j in itertools.combinations(g, 2)))


def _partitions(items: tuple[int, ...], m: int):
    """Every partition of `items` into groups of m: the first item picks its m-1 partners, recurse on the rest."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partners in itertools.combinations(rest, m - 1):
        left = tuple(i for i in rest if i not in partners)
        for tail in _partitions(left, m):
            yield [[first, *partners], *tail]


def _greedy_groups(similarity: torch.Tensor, m: int) -> list[list[int]]:
    """Seed each group with the most similar remaining pair, grow it by the head closest on average, then improve
    by swapping heads between groups while the total within-group similarity rises (a local optimum)."""
    n = similarity.shape[0]
    left, groups = set(range(n)), []
    while left:
        pool = sorted(left)
        if m == 1 or len(pool) == m:
            group = pool[:1] if m == 1 else pool
        else:
            group = list(max(itertools.combinations(pool, 2), key=lambda p: float(similarity[p[0], p[1]])))
            while len(group) < m:
                group.append(max((i for i in pool if i not in group), key=lambda i: float(similarity[i, group].mean())))
        groups.append(group)
        left -= set(group)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(len(groups)), 2):
            for i, j in itertools.product(range(m), range(m)):
                ga, gb = groups[a][:], groups[b][:]
                before = partition_score(similarity, [ga, gb])
                ga[i], gb[j] = gb[j], ga[i]
                if partition_score(similarity, [ga, gb]) > before + 1e-12:
                    groups[a], groups[b], improved = ga, gb, True
    return groups


def best_groups(similarity: torch.Tensor, kv_heads: int) -> tuple[list[list[int]], str]:
    """Equal-size groups of KV heads maximising the summed within-group pairwise similarity; (groups, method).

    Exact search over all partitions up to EXACT_SEARCH_LIMIT of them, else greedy seeding plus pairwise swaps.
    Ties keep the first partition enumerated (the contiguous one comes first), so equal heads stay in place.
    """
    n = similarity.shape[0]
    m = n // kv_heads
    if kv_heads == n or kv_heads == 1:
        return contiguous_groups(n, kv_heads), "trivial"
    similarity = similarity.double().cpu()
    if partition_count(n, m) <= EXACT_SEARCH_LIMIT:
        best, best_score = None, -math.inf
        for groups in _partitions(tuple(range(n)), m):
            score = partition_score(similarity, groups)
            if score > best_score + 1e-12:
                best, best_score = groups, score
        return canonical(best), "exact"
    return canonical(_greedy_groups(similarity, m)), "greedy"


def layer_groups(
    layers: Sequence[AttentionLayer], kv_heads: int, grouping: str = "contiguous", similarity: dict | None = None
) -> tuple[list[list[list[int]]], list[str]]:
    """Per layer, the groups of current KV heads to pool into `kv_heads` (and how each layer's were found):
    contiguous (transformers' layout) or similarity (`best_groups` on `similarity["similarity"][layer]`)."""
    if grouping not in GROUPINGS:
        raise HeadlabError(f"unknown grouping={grouping!r}; use one of {', '.join(GROUPINGS)}")
    G = layers[0].num_kv_heads
    if grouping == "contiguous":
        return [contiguous_groups(G, kv_heads) for _ in layers], ["contiguous"] * len(layers)
    if similarity is None:
        raise ValueError("similarity grouping needs kv_similarity(...) results")
    found = [best_groups(similarity["similarity"][layer.index], kv_heads) for layer in layers]
    return [g for g, _ in found], [m for _, m in found]


# ---- the conversion plan (pure: no weight is read or written) ---------------------------------------------------


@dataclass(frozen=True)
class ConversionPlan:
    """What a KV-head conversion will do, decided before any weight is touched (`plan_conversion`); headlab.kv.gqa.apply
    does it. Per softmax-attention layer i, `groups[i]` says what each KV head becomes:
    - pool: new KV head g is the pool (`pool`) or calibrated merge (method "svd") of the original KV heads
      groups[i][g]; a layer whose groups are not contiguous is permuted first (`order`, `permutes`);
    - expand / keep: original KV head g becomes the new KV heads groups[i][g] (copies; keep: itself).
    """

    num_heads: int  # H, query heads (unchanged)
    kv_heads_before: int  # G
    kv_heads_after: int  # G'
    head_dim: int  # D
    action: str  # pool, expand or keep
    pool: str | None  # the pooling rule (POOLS) of method "mean"; None otherwise
    grouping: str | None  # how the groups were chosen (GROUPINGS); None when not pooling
    method: str | None  # a KV_METHODS name (headlab.kv.methods) when pooling; None otherwise
    seed: int
    groups: list[list[list[int]]]  # [layer][new or original KV head] -> KV heads
    methods: list[str]  # per layer: contiguous, trivial, exact, greedy, given, expand or keep

    def order(self, layer: int) -> list[int]:
        """The original KV heads in the order that makes the layer's groups contiguous (identity when they are)."""
        return [i for group in self.groups[layer] for i in group]

    def permutes(self, layer: int) -> bool:
        """True when pooling this layer needs its KV heads (and their query heads) permuted first."""
        return self.action == "pool" and self.order(layer) != list(range(self.kv_heads_before))

    def table(self) -> pd.DataFrame:
        """One row per (original, new) KV-head pair: layer, kv_head, new_kv_head. Pooling maps a group of original
        heads to one new head; expanding maps one original head to a group of new ones."""
        pooled = self.action == "pool"
        rows = [
            (layer, member if pooled else g, g if pooled else member)
            for layer, layer_groups in enumerate(self.groups)
            for g, group in enumerate(layer_groups)
            for member in group
        ]
        return pd.DataFrame(rows, columns=["layer", "kv_head", "new_kv_head"])


def plan_conversion(
    layers: Sequence[AttentionLayer],
    kv_heads: int,
    *,
    pool: str = "mean",
    grouping: str = "contiguous",
    method: str = "mean",
    similarity: dict | None = None,
    groups: list[list[list[int]]] | None = None,
    seed: int = 0,
) -> ConversionPlan:
    """Pure: layers' (H, G, D) + target `kv_heads` + grouping, pool and method -> the ConversionPlan. Bad choices and
    bad explicit `groups` (not `kv_heads` equal parts of every layer's G heads) raise before any weight is touched.
    grouping="similarity" needs `similarity` (kv_similarity) unless `groups` are given."""
    KV_METHODS[method]  # an unknown name is an error listing the registry
    H, G, D = uniform_layout(layers)
    action = check_kv_heads(H, G, kv_heads)
    if pool not in POOLS:
        raise HeadlabError(f"unknown pool={pool!r}; use one of {', '.join(POOLS)}")
    if action != "pool":
        identity = [identity_groups(G, kv_heads) for _ in layers]
        return ConversionPlan(H, G, kv_heads, D, action, None, None, None, seed, identity, [action] * len(layers))
    if groups is None:
        groups, methods = layer_groups(layers, kv_heads, grouping, similarity)
    else:
        methods = ["given"] * len(layers)
    groups = [canonical(g) for g in groups]
    for layer in layers:
        members = groups[layer.index]
        if sorted(i for g in members for i in g) != list(range(G)) or {len(g) for g in members} != {G // kv_heads}:
            raise HeadlabError(f"layer {layer.index}: groups {members} are not {kv_heads} equal parts of {G} heads")
    pooled_by = pool if KV_METHODS[method].pools else None
    return ConversionPlan(H, G, kv_heads, D, "pool", pooled_by, grouping, method, seed, groups, methods)


# ---- similarity on calibration text --------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised after the last attention layer's inputs are captured: the rest of the forward is not needed."""


@torch.no_grad()
def kv_similarity(loaded: LoadedModel, batches, progress: bool = True) -> dict[str, torch.Tensor]:
    """Mean per-token cosine similarity between KV heads, per layer: {"key", "value", "similarity"} each [L, G, G].

    For token t: cos(k_i(t), k_j(t)) with k_g(t) = W_k[g] x_t + b_k[g], x_t the attention module's input (from a
    forward pre-hook), averaged over the unpadded calibration tokens; same for values; similarity = their mean.
    Rotary embeddings rotate every head's key at a token by the same orthogonal matrix, so these cosines are the
    post-rotary ones too. Per-head key norms are not applied (their RMS scaling does not change a cosine; their
    learned scale is shared by all heads except in OLMo2).
    """
    check_resident(loaded, "KV-head similarity")  # reads each layer's weights
    layers = gqa_layers(loaded)
    adapter, model = loaded.adapter, loaded.model
    weights = {}
    for layer in layers:
        w = adapter.read(layer)
        weights[layer.index] = tuple(
            None if t is None else t.float()
            for t in (w.k, w.v, w.k_bias, w.v_bias)  # on the layer's device
        )
    G = layers[0].num_kv_heads
    sums = {kind: torch.zeros(len(layers), G, G, dtype=torch.float64) for kind in ("key", "value")}
    count = torch.zeros((), dtype=torch.float64)
    state = {}
    last = layers[-1].index

    def hook_for(layer: AttentionLayer):
        def hook(x):  # [B, T, C]
            x = x[state["valid"].to(x.device)].float()  # [N, C], padding dropped
            k_w, v_w, k_b, v_b = (None if t is None else t.to(x.device) for t in weights[layer.index])
            for kind, w, b in (("key", k_w, k_b), ("value", v_w, v_b)):
                proj = torch.einsum("nc,gdc->ngd", x, w)  # [N, G, D]
                if b is not None:
                    proj = proj + b
                unit = torch.nn.functional.normalize(proj, dim=-1)
                sums[kind][layer.index] += torch.einsum("ngd,nhd->gh", unit, unit).double().cpu()  # [G, G]
            if layer.index == last:
                raise _Stop

        return hook

    with hooks(adapter, [("attn_in", layer, hook_for(layer)) for layer in layers]):
        for input_ids, attention_mask, *_ in tqdm(batches, desc="KV similarity", disable=not progress, unit="batch"):
            state["valid"] = attention_mask.bool().to(loaded.device)
            count += float(attention_mask.sum())
            try:
                model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
            except _Stop:
                pass
    if count == 0:
        raise HeadlabError("no calibration tokens to measure KV-head similarity on")
    key, value = sums["key"] / count, sums["value"] / count
    return {"key": key, "value": value, "similarity": (key + value) / 2, "tokens": int(count)}


def similarity_table(similarity: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Tidy pairs: layer, kv_head, other_kv_head, key_cosine, value_cosine, similarity."""
    L, G, _ = similarity["similarity"].shape
    rows = [
        (layer, i, j, float(similarity["key"][layer, i, j]), float(similarity["value"][layer, i, j]))
        for layer in range(L)
        for i in range(G)
        for j in range(G)
        if i != j
    ]
    frame = pd.DataFrame(rows, columns=["layer", "kv_head", "other_kv_head", "key_cosine", "value_cosine"])
    frame["similarity"] = (frame["key_cosine"] + frame["value_cosine"]) / 2
    return frame


# ---- weight edits --------------------------------------------------------------------------------------------------


def permute_weights(weights: HeadWeights, kv_order: list[int]) -> HeadWeights:
    """Reorder KV heads as `kv_order` and move each one's query heads with it (function-preserving)."""
    r = weights.num_heads // weights.num_kv_heads
    heads = [k * r + i for k in kv_order for i in range(r)]
    return weights.take(heads, kv_order)


def _std(t: torch.Tensor) -> torch.Tensor:
    return t.float().std() if t.numel() > 1 else t.float().abs().mean()


Edit = Callable[[torch.Tensor | None], torch.Tensor | None]


def _edit_kv_heads(weights: HeadWeights, edit: Edit, spanning_norm: Edit) -> HeadWeights:
    """`edit` applied to every per-KV-head tensor (k, v and their biases, leading dim G); a key norm spanning the
    heads ([G, D], OLMo2) gets `spanning_norm`, a norm shared by all heads ([D]) is left as it is."""
    spans = weights.k_norm is not None and weights.k_norm.dim() == 2
    return replace(
        weights,
        k=edit(weights.k),
        v=edit(weights.v),
        k_bias=edit(weights.k_bias),
        v_bias=edit(weights.v_bias),
        k_norm=spanning_norm(weights.k_norm) if spans else weights.k_norm,
    )


def pool_weights(weights: HeadWeights, kv_heads: int, pool: str = "mean", seed: int = 0) -> HeadWeights:
    """Pool contiguous runs of m = G / kv_heads KV heads into one each (Ainslie et al. 2023, sec. 2.2).

    mean: k_g = (1/m) sum_{i in group g} k_i (likewise v, biases; float64 sum, so m equal copies give the copy
    back exactly); first: the group's first head; random: N(0, s^2) per group with s the std of the members'
    tensor (seeded). Norm weights shared by all heads ([D]) are unchanged; a norm spanning heads (OLMo2: one RMS
    over G*D values) gets the group mean of the members' [D] slices, an approximation since its RMS is then taken
    over fewer, pooled values.
    """
    if pool not in POOLS:
        raise HeadlabError(f"unknown pool={pool!r}; use one of {', '.join(POOLS)}")
    G = weights.num_kv_heads
    m = G // kv_heads
    generator = torch.Generator().manual_seed(seed)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(kv_heads, m, *t.shape[1:])  # [G', m, ...]

    def mean(t):
        return None if t is None else grouped(t).double().mean(1).to(t.dtype)

    def pooled(t):
        if t is None:
            return None
        if pool == "mean":
            return mean(t)
        if pool == "first":
            return grouped(t)[:, 0].clone()
        members = grouped(t)
        scale = torch.stack([_std(members[g]) for g in range(kv_heads)])  # [G']
        noise = torch.randn(members[:, 0].shape, generator=generator, dtype=torch.float32)  # [G', ...]
        return (noise * scale.view(-1, *[1] * (noise.dim() - 1))).to(t.dtype).to(t.device)

    return _edit_kv_heads(weights, pooled, spanning_norm=mean)


def expand_weights(weights: HeadWeights, kv_heads: int) -> HeadWeights:
    """Repeat each KV head kv_heads / G times in place (what repeat_kv does at run time): lossless."""
    factor = kv_heads // weights.num_kv_heads

    def repeat(t):
        return None if t is None else t.repeat_interleave(factor, dim=0)

    # A spanning norm over repeated copies has the same RMS (each value repeated `factor` times): still exact.
    return _edit_kv_heads(weights, repeat, spanning_norm=repeat)


def permute_heads(loaded: LoadedModel, kv_orders: list[list[int]]) -> None:
    """Permute each layer's KV heads (kv_orders[layer]) and their query heads, in place; the function is unchanged."""
    for layer in gqa_layers(loaded):
        loaded.adapter.write(layer, permute_weights(loaded.adapter.read(layer), kv_orders[layer.index]))
