"""KV-head conversion: MHA/GQA -> fewer KV heads by pooling (Ainslie et al. 2023), GQA -> MHA by repeating, and
similarity-aware grouping that permutes heads so learned groups are contiguous and the result loads with vanilla
transformers.

Layout rule (transformers' repeat_kv): query head h reads KV head h // (H / G). Pooling KV heads that are
contiguous, [g*m, (g+1)*m), into KV head g keeps that rule for the same query heads, so query weights never change.
Any other equal-size grouping is first turned into a contiguous one by permuting KV heads together with the query
heads that read them (query rows, per-head query norms, output-projection columns); the permutation alone leaves
the model's function unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.arch import ADAPTERS, AttentionLayer, HeadWeights
from headlab.checkpoint import check_checkpoint_out, probe_inputs, save_checkpoint
from headlab.data import Corpus, calibration_batches, load_corpus
from headlab.errors import HeadlabError
from headlab.evaluate import DTYPE_BYTES, kv_cache_bytes, perplexity
from headlab.loading import LoadedModel, check_resident
from headlab.tables import check_out, versions, write_run

POOLS = ("mean", "first", "random")
# mean: pool by POOLS (Ainslie et al. 2023); svd: calibrated, training-free merge (headlab.merge)
METHODS = ("mean", "svd")
GROUPINGS = ("contiguous", "similarity")
# Enumerate every equal-size partition up to this many (9 heads in 3s: 280; 12 in 3s: 15,400; 12 in 4s: 5,775).
EXACT_SEARCH_LIMIT = 100_000


# ---- layout checks -----------------------------------------------------------------------------------------------


def gqa_layers(loaded: LoadedModel) -> list[AttentionLayer]:
    """The softmax-attention layers to convert (hybrids: linear-attention blocks are skipped), with one uniform
    (H, G, D) layout, since a config holds one num_key_value_heads."""
    adapter = loaded.adapter
    if not adapter.supports_gqa:
        capable = sorted(t for t, a in ADAPTERS.items() if a.supports_gqa)
        raise HeadlabError(
            f"{loaded.model.config.model_type} cannot hold fewer KV heads than query heads (its config has no "
            f"num_key_value_heads; supports_gqa=False); KV-head conversion works for: {', '.join(capable)}"
        )
    layers = loaded.layers
    layouts = sorted({(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers})
    if len(layouts) != 1:
        raise HeadlabError(f"KV-head conversion needs the same (H, G, D) in every layer, found {layouts}")
    return layers


def check_kv_heads(num_heads: int, num_kv_heads: int, kv_heads: int) -> str:
    """'pool', 'expand' or 'keep' for a target of `kv_heads` KV heads; bad targets raise HeadlabError."""
    if kv_heads < 1:
        raise HeadlabError(f"--kv-heads must be at least 1, got {kv_heads}")
    if kv_heads == num_kv_heads:
        return "keep"
    if kv_heads < num_kv_heads:
        if num_kv_heads % kv_heads:
            divisors = [g for g in range(1, num_kv_heads + 1) if num_kv_heads % g == 0]
            raise HeadlabError(
                f"--kv-heads {kv_heads} does not divide the model's {num_kv_heads} KV heads; use one of {divisors}"
            )
        return "pool"
    if kv_heads > num_heads or num_heads % kv_heads or kv_heads % num_kv_heads:
        larger = [g for g in range(num_kv_heads + 1, num_heads + 1) if num_heads % g == 0 and g % num_kv_heads == 0]
        raise HeadlabError(
            f"--kv-heads {kv_heads} is not reachable from {num_kv_heads} KV heads and {num_heads} query heads: "
            f"pooling needs a divisor of {num_kv_heads}, expanding a multiple of {num_kv_heads} that divides "
            f"{num_heads} ({larger or 'none'})"
        )
    return "expand"


# ---- grouping ----------------------------------------------------------------------------------------------------


def check_direction(direction: str, action: str, num_heads: int, num_kv_heads: int, kv_heads: int) -> None:
    """convert-gqa ("pool") refuses more KV heads than the model has, expand-kv ("expand") fewer or the same."""
    G = num_kv_heads
    if direction == "pool" and action == "expand":
        raise HeadlabError(f"--kv-heads {kv_heads} is more than the model's {G} KV heads; use `headlab expand-kv`")
    if direction == "expand" and action == "pool":
        raise HeadlabError(f"--kv-heads {kv_heads} is fewer than the model's {G} KV heads; use `headlab convert-gqa`")
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
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]  # [B, T, C]
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

    handles = [layer.module.register_forward_pre_hook(hook_for(layer), with_kwargs=True) for layer in layers]
    try:
        for input_ids, attention_mask, *_ in tqdm(batches, desc="KV similarity", disable=not progress, unit="batch"):
            state["valid"] = attention_mask.bool().to(loaded.device)
            count += float(attention_mask.sum())
            try:
                model(input_ids=input_ids.to(loaded.device), attention_mask=attention_mask.to(loaded.device))
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
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


def pool_weights(weights: HeadWeights, kv_heads: int, pool: str = "mean", seed: int = 0) -> HeadWeights:
    """Pool contiguous runs of m = G / kv_heads KV heads into one each (Ainslie et al. 2023, sec. 2.2).

    mean: k_g = (1/m) sum_{i in group g} k_i (likewise v, biases; float64 sum, so m equal copies give the copy
    back exactly); first: the group's first head; random: N(0, s^2) per group with s the std of the members'
    tensor (seeded). Norm weights shared by all heads ([D]) are unchanged; a norm spanning heads (OLMo2: one RMS
    over G*D values) gets the group mean of the members' [D] slices, an approximation since its RMS is then taken
    over fewer, pooled values.
    """
    if pool not in POOLS:
        raise HeadlabError(f"unknown --pool {pool!r}; use one of {', '.join(POOLS)}")
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

    spans = weights.k_norm is not None and weights.k_norm.dim() == 2
    return replace(
        weights,
        k=pooled(weights.k),
        v=pooled(weights.v),
        k_bias=pooled(weights.k_bias),
        v_bias=pooled(weights.v_bias),
        k_norm=mean(weights.k_norm) if spans else weights.k_norm,
    )


def expand_weights(weights: HeadWeights, kv_heads: int) -> HeadWeights:
    """Repeat each KV head kv_heads / G times in place (what repeat_kv does at run time): lossless."""
    factor = kv_heads // weights.num_kv_heads

    def repeat(t):
        return None if t is None else t.repeat_interleave(factor, dim=0)

    # A spanning norm over repeated copies has the same RMS (each value repeated `factor` times): still exact.
    spans = weights.k_norm is not None and weights.k_norm.dim() == 2
    return replace(
        weights,
        k=repeat(weights.k),
        v=repeat(weights.v),
        k_bias=repeat(weights.k_bias),
        v_bias=repeat(weights.v_bias),
        k_norm=repeat(weights.k_norm) if spans else weights.k_norm,
    )


def permute_heads(loaded: LoadedModel, kv_orders: list[list[int]]) -> None:
    """Permute each layer's KV heads (kv_orders[layer]) and their query heads, in place; the function is unchanged."""
    for layer in gqa_layers(loaded):
        loaded.adapter.write(layer, permute_weights(loaded.adapter.read(layer), kv_orders[layer.index]))


@dataclass
class Conversion:
    """What `convert` did: per-layer groups of original KV heads (new KV head g = groups[layer][g])."""

    kv_heads_before: int
    kv_heads_after: int
    action: str  # pool, expand or keep
    pool: str | None
    grouping: str | None
    seed: int
    groups: list[list[list[int]]] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)  # per layer: contiguous, trivial, exact or greedy
    permuted_layers: int = 0
    method: str = "mean"  # mean (pooled by `pool`) or svd (headlab.merge)
    merge: dict | None = None  # what the svd merge did (keys/values: svd or mean, calibration tokens)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def groups_table(self, layers: list[AttentionLayer]) -> pd.DataFrame:
        """One row per original KV head: layer, kv_head (original), new_kv_head, method."""
        rows = [
            (layer.index, kv, g, self.methods[layer.index])
            for layer in layers
            for g, group in enumerate(self.groups[layer.index])
            for kv in group
        ]
        return pd.DataFrame(rows, columns=["layer", "kv_head", "new_kv_head", "method"])


def plan_groups(
    loaded: LoadedModel, kv_heads: int, grouping: str = "contiguous", similarity: dict | None = None
) -> tuple[list[list[list[int]]], list[str]]:
    """Per layer, the groups of current KV heads to pool (and how they were found)."""
    if grouping not in GROUPINGS:
        raise HeadlabError(f"unknown --grouping {grouping!r}; use one of {', '.join(GROUPINGS)}")
    layers = gqa_layers(loaded)
    G = layers[0].num_kv_heads
    if grouping == "contiguous":
        return [contiguous_groups(G, kv_heads) for _ in layers], ["contiguous"] * len(layers)
    if similarity is None:
        raise ValueError("similarity grouping needs kv_similarity(...) results")
    found = [best_groups(similarity["similarity"][layer.index], kv_heads) for layer in layers]
    return [g for g, _ in found], [m for _, m in found]


def convert(
    loaded: LoadedModel,
    kv_heads: int,
    *,
    pool: str = "mean",
    grouping: str = "contiguous",
    similarity: dict | None = None,
    groups: list[list[list[int]]] | None = None,
    seed: int = 0,
    method: str = "mean",
    batches=None,
    progress: bool = False,
) -> Conversion:
    """Change every softmax-attention layer to `kv_heads` KV heads in place (pool, expand, or keep) and write the
    count into the config (num_key_value_heads), so save_pretrained gives a vanilla-loadable checkpoint.

    Pooling with grouping="similarity" needs `similarity` (kv_similarity) or explicit per-layer `groups`.
    method="svd" merges each group with headlab.merge, calibrated on `batches` (calibration windows), instead of
    pooling by `pool`.
    """
    if method not in METHODS:
        raise HeadlabError(f"unknown --method {method!r}; use one of {', '.join(METHODS)}")
    check_resident(loaded, "KV-head conversion")
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    action = check_kv_heads(H, G, kv_heads)
    if pool not in POOLS:
        raise HeadlabError(f"unknown --pool {pool!r}; use one of {', '.join(POOLS)}")
    if action != "pool":
        if action == "expand":
            for layer in layers:
                loaded.adapter.write(layer, expand_weights(loaded.adapter.read(layer), kv_heads))
            loaded.adapter.set_config_heads(loaded.model.config, H, kv_heads, D)
        identity = [identity_groups(G, kv_heads) for _ in layers]
        return Conversion(G, kv_heads, action, None, None, seed, identity, [action] * len(layers))
    if groups is None:
        groups, methods = plan_groups(loaded, kv_heads, grouping, similarity)
    else:
        methods = ["given"] * len(layers)
    conversion = Conversion(
        G, kv_heads, "pool", pool, grouping, seed, [canonical(g) for g in groups], methods, method=method
    )
    if method == "svd" and batches is None:
        raise ValueError("method='svd' needs calibration batches")
    for layer in layers:
        layer_groups = conversion.groups[layer.index]
        if sorted(i for g in layer_groups for i in g) != list(range(G)) or {len(g) for g in layer_groups} != {
            G // kv_heads
        }:
            raise HeadlabError(
                f"layer {layer.index}: groups {layer_groups} are not {kv_heads} equal parts of {G} heads"
            )
        weights = loaded.adapter.read(layer)
        order = [i for g in layer_groups for i in g]
        if order != list(range(G)):
            weights = permute_weights(weights, order)
            conversion.permuted_layers += 1
            if method == "svd":  # groups made contiguous; the merge below works on contiguous groups
                loaded.adapter.write(layer, weights)
        if method == "mean":
            loaded.adapter.write(layer, pool_weights(weights, kv_heads, pool, seed=seed + layer.index))
    if method == "svd":
        from headlab.merge import merge_kv_heads

        conversion.pool = None
        conversion.merge = merge_kv_heads(loaded, kv_heads, batches, progress=progress)
    loaded.adapter.set_config_heads(loaded.model.config, H, kv_heads, D)
    return conversion


# ---- KV-cache bytes ------------------------------------------------------------------------------------------------


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Arithmetic (as `headlab info`): 2 x sum over softmax layers of G x D x bytes per element (model dtype)."""
    element = DTYPE_BYTES[str(loaded.dtype).removeprefix("torch.")]
    return kv_cache_bytes([(layer.num_kv_heads, layer.head_dim) for layer in loaded.layers], 1, 1, element)


@torch.no_grad()
def measured_kv_bytes_per_token(loaded: LoadedModel, tokens: int = 8) -> int:
    """Bytes of the key and value tensors of a real cache (forward with use_cache=True) per cached token.

    Each cache layer's bytes are divided by its own cached length and batch, so sliding-window layers (which keep
    only the window) count per token like the rest; linear-attention layers of hybrids hold no keys and are skipped.
    """
    model = loaded.model
    inputs = probe_inputs(model, batch=1, seq_len=tokens)
    out = model(**{k: v.to(loaded.device) for k, v in inputs.items()}, use_cache=True)
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")
    if cache is None:
        raise HeadlabError(f"{type(model).__name__} returned no cache with use_cache=True")
    total = 0
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not torch.is_tensor(keys) or not torch.is_tensor(values):
            continue
        B, T = keys.shape[0], keys.shape[-2]  # keys [B, G, T, D]
        total += (keys.numel() * keys.element_size() + values.numel() * values.element_size()) // (B * T)
    return int(total)


# ---- the commands' functions ---------------------------------------------------------------------------------------


def _perplexity(loaded, corpus, eval_args, progress):
    return perplexity(loaded, corpus, progress=progress, **eval_args)


def _similarity_for(loaded, corpus, calib_args, progress):
    batches = calibration_batches(loaded.tokenizer, corpus, max_positions=loaded.max_positions, **calib_args)
    return kv_similarity(loaded, batches, progress=progress), batches.meta


def _merge_batches(loaded, corpus, seq_len, batch_size, calib_tokens):
    """Calibration windows for the calibrated (svd) merge."""
    return calibration_batches(
        loaded.tokenizer,
        corpus,
        part="calibration",
        seq_len=seq_len,
        batch_size=batch_size,
        max_tokens=calib_tokens,
        max_positions=loaded.max_positions,
    )


def convert_checkpoint(
    loaded: LoadedModel,
    kv_heads: int,
    out,
    *,
    pool: str = "mean",
    grouping: str = "contiguous",
    corpus: Corpus | str | None = None,
    text_column: str | None = None,
    part: str = "eval",
    max_tokens: int | None = 2048,
    seq_len: int = 512,
    batch_size: int = 4,
    calib_tokens: int = 2048,
    seed: int = 0,
    evaluate: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    direction: str = "pool",
    method: str = "mean",
    recovery=None,
) -> dict:
    """`headlab convert-gqa` / `expand-kv`: perplexity and KV bytes before, convert in place, perplexity and KV
    bytes after, save to `out` verified by a vanilla reload. Bad input fails before any work; the source files are
    never touched (an --out equal to or containing the source is refused). direction "pool" (convert-gqa) refuses
    more KV heads than the model has, "expand" (expand-kv) fewer. recovery: a function(loaded) -> record run on the
    converted model before saving (headlab.recover; the checkpoint then holds recovery/)."""
    check_checkpoint_out(out, overwrite, loaded.source)
    layers = gqa_layers(loaded)
    H, G = layers[0].num_heads, layers[0].num_kv_heads
    action = check_kv_heads(H, G, kv_heads)
    check_direction(direction, action, H, G, kv_heads)
    if pool not in POOLS or grouping not in GROUPINGS or method not in METHODS:
        raise HeadlabError(
            f"--pool must be one of {POOLS}, --grouping one of {GROUPINGS} and --method one of {METHODS}"
        )
    calibrate = action == "pool" and (grouping == "similarity" or method == "svd")
    if not isinstance(corpus, Corpus) and (evaluate or calibrate):
        corpus = load_corpus(corpus, text_column)
    eval_args = dict(part=part, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens)
    record = {"model": loaded.spec, "source": loaded.source, "kv_heads_before": G, "kv_heads_after": kv_heads}
    record["kv_bytes_per_token_before"] = kv_bytes_per_token(loaded)
    record["measured_kv_bytes_per_token_before"] = measured_kv_bytes_per_token(loaded)
    if evaluate:
        record["perplexity_before"] = _perplexity(loaded, corpus, eval_args, progress).to_dict()
    similarity = None
    if action == "pool" and grouping == "similarity":
        calib = dict(part="calibration", seq_len=seq_len, batch_size=batch_size, max_tokens=calib_tokens)
        similarity, record["calibration"] = _similarity_for(loaded, corpus, calib, progress)
    batches = None
    if action == "pool" and method == "svd":
        batches = _merge_batches(loaded, corpus, seq_len, batch_size, calib_tokens)
        record["merge_calibration"] = batches.meta
    conversion = convert(
        loaded,
        kv_heads,
        pool=pool,
        grouping=grouping,
        similarity=similarity,
        seed=seed,
        method=method,
        batches=batches,
        progress=progress,
    )
    record["conversion"] = conversion.to_dict()
    record["kv_bytes_per_token_after"] = kv_bytes_per_token(loaded)
    record["measured_kv_bytes_per_token_after"] = measured_kv_bytes_per_token(loaded)
    if evaluate:
        record["perplexity_after"] = _perplexity(loaded, corpus, eval_args, progress).to_dict()
        record["eval"] = {"data": getattr(corpus, "spec", corpus), **eval_args}
    if recovery is not None:
        from headlab.recover import save_recovered

        recovered = recovery(loaded)
        if evaluate:
            record["perplexity_recovered"] = _perplexity(loaded, corpus, eval_args, progress).to_dict()
        record["verification"] = save_recovered(loaded, out, recovered, record, overwrite=overwrite)
        record["recovery"] = {k: v for k, v in recovered.items() if k != "tables"}
    else:
        verification = save_checkpoint(loaded.model, loaded.tokenizer, out, overwrite=overwrite, meta=record)
        record["verification"] = verification.to_dict()
    record["out"] = str(out)
    return record


def gqa_sweep(
    loaded: LoadedModel,
    kv_heads: list[int] | None = None,
    *,
    groupings: tuple[str, ...] = GROUPINGS,
    pools: tuple[str, ...] = POOLS,
    methods: tuple[str, ...] = ("mean",),
    corpus: Corpus | str | None = None,
    text_column: str | None = None,
    part: str = "eval",
    max_tokens: int | None = 2048,
    seq_len: int = 512,
    batch_size: int = 4,
    calib_tokens: int = 2048,
    seed: int = 0,
    progress: bool = True,
) -> tuple[pd.DataFrame, dict]:
    """Perplexity and KV bytes per token for each target KV-head count x grouping x pool (expanded and unchanged
    models get one row each). Default targets: every reachable count, from H (MHA) down to 1 (MQA).

    Conversions whose per-layer groups and pool equal an earlier row's give the same weights and reuse its numbers
    (column same_as). The model is restored to its original weights after each row. methods: "mean" pools by each
    of `pools`; "svd" adds one calibrated merge (headlab.merge) per grouping (pool column "svd").
    """
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    if kv_heads is None:
        kv_heads = [g for g in range(H, 0, -1) if (G % g == 0) or (H % g == 0 and g % G == 0)]
    actions = {g: check_kv_heads(H, G, g) for g in kv_heads}  # validate every target before any work
    checks = (("--grouping", groupings, GROUPINGS), ("--pool", pools, POOLS), ("--method", methods, METHODS))
    for name, values, allowed in checks:
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise HeadlabError(f"{name}: unknown {unknown or 'empty list'}; use some of {', '.join(allowed)}")
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, text_column)
    eval_args = dict(part=part, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens)
    originals = [loaded.adapter.read(layer) for layer in layers]
    meta = {"model": loaded.spec, "source": loaded.source, "eval": {"data": corpus.spec, **eval_args}, "seed": seed}
    similarity = None
    if "similarity" in groupings and any(a == "pool" for a in actions.values()):
        calib = dict(part="calibration", seq_len=seq_len, batch_size=batch_size, max_tokens=calib_tokens)
        similarity, meta["calibration"] = _similarity_for(loaded, corpus, calib, progress)
    batches = None
    if "svd" in methods and any(a == "pool" for a in actions.values()):
        batches = _merge_batches(loaded, corpus, seq_len, batch_size, calib_tokens)
        meta["merge_calibration"] = batches.meta

    jobs = []
    for g in kv_heads:
        if actions[g] == "pool":
            pooled = [p for p in pools if "mean" in methods] + (["svd"] if "svd" in methods else [])
            jobs += [(g, grouping, pool) for grouping in groupings for pool in pooled]
        else:
            jobs.append((g, None, None))
    rows, seen = [], {}
    for g, grouping, pool in tqdm(jobs, desc="GQA sweep", disable=not progress, unit="variant"):
        groups = None
        if grouping is not None:
            groups, _ = plan_groups(loaded, g, grouping, similarity)
            groups = [canonical(x) for x in groups]
        key = (g, pool, repr(groups))
        label = f"{g}/{grouping or actions[g]}/{pool or '-'}"
        if key in seen:
            row = dict(seen[key], grouping=grouping, pool=pool, variant=label, same_as=seen[key]["variant"])
            rows.append(row)
            continue
        conversion = convert(
            loaded,
            g,
            pool="mean" if pool in (None, "svd") else pool,
            grouping=grouping or "contiguous",
            groups=groups,
            seed=seed,
            method="svd" if pool == "svd" else "mean",
            batches=batches,
        )
        result = _perplexity(loaded, corpus, eval_args, progress=False)
        row = {
            "variant": label,
            "kv_heads": g,
            "action": conversion.action,
            "grouping": grouping,
            "pool": pool,
            "perplexity": result.perplexity,
            "nll": result.nll,
            "scored_tokens": result.scored_tokens,
            "kv_bytes_per_token": measured_kv_bytes_per_token(loaded),
            "kv_bytes_per_token_formula": kv_bytes_per_token(loaded),
            "permuted_layers": conversion.permuted_layers,
            "same_as": None,
        }
        rows.append(row)
        seen[key] = row
        for layer, weights in zip(layers, originals):  # back to the original model for the next variant
            loaded.adapter.write(layer, weights)
        loaded.adapter.set_config_heads(loaded.model.config, H, G, D)
    frame = pd.DataFrame(rows)
    frame["relative_kv_bytes"] = frame["kv_bytes_per_token"] / kv_bytes_per_token(loaded)
    meta.update({"query_heads": H, "kv_heads": G, "head_dim": D, "targets": kv_heads, "dtype": str(loaded.dtype)})
    return frame, meta


def run_sweep(loaded: LoadedModel, out, *, overwrite: bool = False, **kwargs) -> tuple[pd.DataFrame, dict]:
    """`headlab gqa-sweep`: the sweep table (CSV + Parquet), meta.json, the similarity pairs and the plot."""
    check_out(out, overwrite)
    frame, meta = gqa_sweep(loaded, **kwargs)
    from headlab.plots import figure_bytes, plot_gqa_sweep

    fig = plot_gqa_sweep(frame, f"{loaded.spec}: {meta['query_heads']} query heads, KV heads swept")
    write_run(
        out,
        {"sweep": frame},
        {**meta, "versions": versions()},
        overwrite=overwrite,
        extra_files={"gqa_sweep.png": figure_bytes(fig)},
    )
    return frame, meta
