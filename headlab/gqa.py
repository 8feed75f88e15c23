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

from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.arch import AttentionLayer
from headlab.checkpoint import check_checkpoint_out, probe_inputs, save_checkpoint
from headlab.costs import kv_bytes_per_token
from headlab.data import Corpus, calibration_batches, load_corpus
from headlab.errors import HeadlabError, moved_names
from headlab.evaluate import perplexity
from headlab.fsio import check_out
from headlab.kv_heads import (
    GROUPINGS,
    POOLS,
    best_groups,
    canonical,
    check_direction,
    check_kv_heads,
    contiguous_groups,
    expand_weights,
    gqa_layers,
    identity_groups,
    kv_similarity,
    permute_weights,
    pool_weights,
)
from headlab.loading import LoadedModel, check_resident
from headlab.merge import merge_kv_heads
from headlab.recover import save_recovered
from headlab.restore import restoring
from headlab.tables import versions, write_run

# mean: pool by POOLS (Ainslie et al. 2023); svd: calibrated, training-free merge (headlab.merge)
METHODS = ("mean", "svd")


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
        conversion.pool = None
        conversion.merge = merge_kv_heads(loaded, kv_heads, batches, progress=progress)
    loaded.adapter.set_config_heads(loaded.model.config, H, kv_heads, D)
    return conversion


# ---- KV-cache bytes ------------------------------------------------------------------------------------------------


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
    _check_choices(groupings, pools, methods)
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, text_column)
    eval_args = dict(part=part, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens)
    meta = {"model": loaded.spec, "source": loaded.source, "eval": {"data": corpus.spec, **eval_args}, "seed": seed}
    pooling = any(a == "pool" for a in actions.values())
    similarity = None
    if "similarity" in groupings and pooling:
        calib = dict(part="calibration", seq_len=seq_len, batch_size=batch_size, max_tokens=calib_tokens)
        similarity, meta["calibration"] = _similarity_for(loaded, corpus, calib, progress)
    batches = None
    if "svd" in methods and pooling:
        batches = _merge_batches(loaded, corpus, seq_len, batch_size, calib_tokens)
        meta["merge_calibration"] = batches.meta

    rows, seen = [], {}
    jobs = _sweep_jobs(kv_heads, actions, groupings, pools, methods)
    for g, grouping, pool in tqdm(jobs, desc="GQA sweep", disable=not progress, unit="variant"):
        groups = None
        if grouping is not None:
            groups, _ = plan_groups(loaded, g, grouping, similarity)
            groups = [canonical(x) for x in groups]
        key = (g, pool, repr(groups))
        label = f"{g}/{grouping or actions[g]}/{pool or '-'}"
        if key in seen:
            rows.append(dict(seen[key], grouping=grouping, pool=pool, variant=label, same_as=seen[key]["variant"]))
            continue
        with restoring(loaded):  # back to the original model for the next variant, also after an error
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
    frame = pd.DataFrame(rows)
    frame["relative_kv_bytes"] = frame["kv_bytes_per_token"] / kv_bytes_per_token(loaded)
    meta.update({"query_heads": H, "kv_heads": G, "head_dim": D, "targets": kv_heads, "dtype": str(loaded.dtype)})
    return frame, meta


def _check_choices(groupings, pools, methods) -> None:
    checks = (("--grouping", groupings, GROUPINGS), ("--pool", pools, POOLS), ("--method", methods, METHODS))
    for name, values, allowed in checks:
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise HeadlabError(f"{name}: unknown {unknown or 'empty list'}; use some of {', '.join(allowed)}")


def _sweep_jobs(kv_heads, actions, groupings, pools, methods) -> list[tuple[int, str | None, str | None]]:
    """(target, grouping, pool) per variant: every grouping x pool for a pooled target, one row otherwise."""
    jobs = []
    for g in kv_heads:
        if actions[g] == "pool":
            pooled = [p for p in pools if "mean" in methods] + (["svd"] if "svd" in methods else [])
            jobs += [(g, grouping, pool) for grouping in groupings for pool in pooled]
        else:
            jobs.append((g, None, None))
    return jobs


def run_sweep(loaded: LoadedModel, out, *, overwrite: bool = False, **kwargs) -> tuple[pd.DataFrame, dict]:
    """`headlab gqa-sweep`: the sweep table (CSV + Parquet), meta.json, the similarity pairs and the plot."""
    check_out(out, overwrite)
    frame, meta = gqa_sweep(loaded, **kwargs)
    # seaborn/matplotlib take about a second to import: only the sweep draws, so conversion skips that start-up time.
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


__getattr__ = moved_names(
    "headlab.gqa",
    {"similarity_table": "headlab.kv_heads", "permute_heads": "headlab.kv_heads", "pool_weights": "headlab.kv_heads"},
)
