"""A per-KV-head cache policy from head statistics: under a KV budget (a fraction of the full cache at a context length),
each KV head keeps either its whole cache or only attention sinks plus a recent window (DuoAttention, Xiao et al.
2024; RazorAttention, Tang et al. 2024). The heads that need the whole cache are those the statistics rank highest:

- "retrieval": a KV head's largest `retrieval` score over its query heads (attention of the query emitting a copied
  passkey token on the token it copies; headlab.measure.stats);
- "streaming": a KV head's largest mass outside sinks + window over its query heads, 1 - stream_W (StreamingLLM's
  sinks + recent window, Xiao et al. 2023), with W the statistics window closest to the policy's window;
- "retrieval-streaming" (the default): the retrieving KV heads (retrieval >= RETRIEVING) first, by retrieval, then
  the others by the streaming mass.

Bytes: a full KV head holds `context` slots, a streaming one min(context, sinks + window - 1) (what the next query can
see), each times its head_dim; the heads with the highest scores become full while the total stays within
budget x the full cache. The policy runs through headlab.mechanisms.head_cache (masked, or a real cache).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from transformers.cache_utils import DynamicCache

from headlab.core.errors import HeadlabError
from headlab.core.tables import write_run
from headlab.kv.duo_gates import GateSpec, optimized_gates
from headlab.kv.methods import DEFAULT_SINKS, DEFAULT_WINDOW, GATE_STEPS, POLICY_SCORES, RETRIEVING
from headlab.measure.long_tasks import check_grid
from headlab.measure.longctx import long_context, recorded_generate
from headlab.measure.stats import STREAMING_WINDOWS, head_statistics, wide_statistics
from headlab.mechanisms.head_cache import HeadPolicyCache, LayerStreaming, cache_bytes, head_policy, policy_cache

DEFAULT_CONTEXT = 8192  # the longest context the long-context tasks use by default
DUO_FILE = "full_attention_heads.tsv"  # DuoAttention's pattern file (rows: layers, columns: KV heads), as kvpress reads


def streaming_slots(context: int, sinks: int, window: int) -> int:
    """Cache slots a streaming head holds at `context` tokens: min(context, sinks + window - 1), what the next query
    can see (the module docstring)."""
    return min(context, sinks + window - 1)


def streaming_floor(head_dims, context: int, sinks: int, window: int) -> float:
    """The least a policy can keep, every KV head streaming, as a fraction of the full cache's bytes at `context`:
    sum_h d_h * slots / sum_h d_h * context (head_dims: one head_dim per KV head)."""
    weight = pd.Series(head_dims, dtype=float)
    return float((weight * streaming_slots(context, sinks, window)).sum() / (weight * context).sum())


def check_budget(budget: float, head_dims, context: int, sinks: int, window: int) -> float:
    """The streaming floor, after refusing a budget outside (0, 1], non-positive sizes, or a budget below the floor."""
    if not 0.0 < budget <= 1.0:
        raise HeadlabError(f"budget={budget} must be a fraction of the full cache in (0, 1]")
    if context < 1 or sinks < 0 or window < 1:
        raise HeadlabError(f"context, sinks and window must be positive (got {context}, {sinks}, {window})")
    floor = streaming_floor(head_dims, context, sinks, window)
    if budget < floor - 1e-12:
        raise HeadlabError(
            f"budget={budget:g} is below what streaming every KV head keeps at {context} tokens ({floor:.3f}); "
            "raise it or shrink --window/--sinks"
        )
    return floor


@dataclass
class CachePolicy:
    """One row per KV head (`layer, kv_head, head_dim, score, policy` with policy "full" or "streaming") and the
    sinks, window, context and budget it was chosen for."""

    table: pd.DataFrame
    sinks: int
    window: int
    context: int
    budget: float | None = None
    score: str | None = None
    meta: dict = field(default_factory=dict)

    def streaming_heads(self) -> dict[int, tuple[int, ...]]:
        rows = self.table[self.table["policy"] == "streaming"]
        return {int(layer): tuple(int(h) for h in group["kv_head"]) for layer, group in rows.groupby("layer")}

    def kv_fraction(self, context: int | None = None) -> float:
        """Cache bytes under the policy over the full cache's, at `context` tokens (default: the policy's)."""
        context = context or self.context
        kept = streaming_slots(context, self.sinks, self.window)
        weight = self.table["head_dim"].astype(float)
        streaming = self.table["policy"] == "streaming"
        return float((weight * streaming.map({True: kept, False: context})).sum() / (weight * context).sum())

    def layers(self, loaded) -> dict[int, LayerStreaming]:
        """{layer index: LayerStreaming} for headlab.mechanisms.head_cache, checked against the model's layers."""
        streaming = self.streaming_heads()
        known = {layer.index: layer for layer in loaded.layers}
        table_layers = set(int(i) for i in self.table["layer"])
        if table_layers != set(known):
            raise HeadlabError(f"the policy covers layers {sorted(table_layers)}, the model has {sorted(known)}")
        for index, layer in known.items():
            heads = self.table[self.table["layer"] == index]
            if len(heads) != layer.num_kv_heads:
                raise HeadlabError(
                    f"the policy has {len(heads)} KV heads in layer {index}, the model {layer.num_kv_heads}"
                )
        return {
            index: LayerStreaming(
                streaming.get(index, ()), layer.num_kv_heads, layer.group_size, self.sinks, self.window
            )
            for index, layer in known.items()
        }


def streaming_column(window: int, windows) -> str:
    """The stream_W statistic whose window is closest to `window` (ties: the larger)."""
    closest = min(windows, key=lambda w: (abs(w - window), -w))
    return f"stream_{closest}"


def _column(stats_wide: pd.DataFrame, column: str) -> pd.Series:
    if column not in stats_wide:
        raise HeadlabError(f"the statistics have no {column!r} column; run `headlab stats` with it")
    if stats_wide[column].isna().any():
        raise HeadlabError(f"the statistics' {column!r} has missing values (a model without a tokenizer?)")
    return stats_wide[column]


def kv_head_scores(stats_wide: pd.DataFrame, loaded, score: str, window: int, windows) -> pd.DataFrame:
    """`layer, kv_head, head_dim, score`: per KV head, the largest of its query heads' need for the whole cache:
    retrieval r, streaming o = 1 - stream_W, or retrieval-then-streaming: 1 + r for a KV head with r >= RETRIEVING,
    else o in [0, 1], so every retrieving head ranks first and the others follow by the mass they would lose."""
    if score not in POLICY_SCORES:
        raise HeadlabError(f"unknown policy score {score!r}; use one of {', '.join(POLICY_SCORES)}")
    if score == "gates":
        raise HeadlabError(
            "the gates score is trained (headlab.kv.duo_gates.optimized_gates), not read from statistics"
        )
    frame = stats_wide[["layer", "kv_head"]].copy()
    if score in ("retrieval", "retrieval-streaming"):
        frame["retrieval"] = _column(stats_wide, "retrieval")
    if score in ("streaming", "retrieval-streaming"):
        frame["outside"] = 1.0 - _column(stats_wide, streaming_column(window, windows))
    per_kv = frame.groupby(["layer", "kv_head"], as_index=False).max()
    if score == "retrieval":
        per_kv["score"] = per_kv["retrieval"]
    elif score == "streaming":
        per_kv["score"] = per_kv["outside"]
    else:
        retrieving = per_kv["retrieval"] >= RETRIEVING
        per_kv["score"] = (1.0 + per_kv["retrieval"]).where(retrieving, per_kv["outside"])
    head_dims = {layer.index: layer.head_dim for layer in loaded.layers}
    per_kv["head_dim"] = per_kv["layer"].map(head_dims)
    if per_kv["head_dim"].isna().any():
        raise HeadlabError("the statistics name layers this model does not have")
    return per_kv[["layer", "kv_head", "head_dim", "score"]]


def choose_policy(
    scores: pd.DataFrame,
    *,
    budget: float,
    context: int,
    sinks: int = DEFAULT_SINKS,
    window: int = DEFAULT_WINDOW,
    score: str | None = None,
) -> CachePolicy:
    """The KV heads with the highest `score` keep the whole cache while the bytes at `context` tokens stay within
    `budget` x the full cache; every other head keeps sinks + window. Ties go to the earlier (layer, kv_head)."""
    floor = check_budget(budget, scores["head_dim"], context, sinks, window)
    kept = streaming_slots(context, sinks, window)
    full_bytes = float((scores["head_dim"].astype(float) * context).sum())
    order = scores.sort_values(["score", "layer", "kv_head"], ascending=[False, True, True], kind="stable")
    used, full = floor * full_bytes, set()
    for row in order.itertuples():
        extra = float(row.head_dim) * (context - kept)
        if used + extra <= budget * full_bytes + 1e-9:
            full.add((int(row.layer), int(row.kv_head)))
            used += extra
    table = scores.copy()
    table["policy"] = [
        "full" if (int(layer), int(head)) in full else "streaming"
        for layer, head in zip(table["layer"], table["kv_head"])
    ]
    table = table.sort_values(["layer", "kv_head"]).reset_index(drop=True)
    policy = CachePolicy(table, sinks, window, context, budget, score)
    policy.meta = {
        "budget": budget,
        "context": context,
        "sinks": sinks,
        "window": window,
        "score": score,
        "kv_fraction": policy.kv_fraction(),
        "full_kv_heads": len(full),
        "streaming_kv_heads": int(len(table) - len(full)),
        "streaming_floor": floor,
        "rule": "full: the highest-scoring KV heads while bytes at `context` stay within budget x the full cache",
    }
    return policy


def duo_attention_files(policy: CachePolicy) -> dict[str, str]:
    """The policy in DuoAttention's pattern format: `full_attention_heads.tsv` (one row per layer, one column per KV
    head) and `config.json` (sink_size, recent_size). Values keep the ranking: streaming heads below 0.5, full heads
    at 0.5 and above, so DuoAttention's threshold 0.5 and a quantile at the streaming share (kvpress's
    head_compression_ratio, DuoAttention's --sparsity) both give this policy back."""
    table = policy.table.sort_values(["score", "layer", "kv_head"], kind="stable").reset_index(drop=True)
    streaming = table["policy"] == "streaming"
    n_streaming, n_full = int(streaming.sum()), int((~streaming).sum())
    values, seen_streaming, seen_full = {}, 0, 0
    for row in table.itertuples():
        if row.policy == "streaming":
            values[(row.layer, row.kv_head)] = seen_streaming / (2 * n_streaming)
            seen_streaming += 1
        else:
            values[(row.layer, row.kv_head)] = 0.5 + seen_full / (2 * n_full)
            seen_full += 1
    lines = []
    for layer in sorted(set(policy.table["layer"])):
        heads = sorted(policy.table[policy.table["layer"] == layer]["kv_head"])
        lines.append("\t".join(f"{values[(layer, head)]:.6f}" for head in heads))
    config = {
        "sink_size": policy.sinks,
        "recent_size": policy.window,
        "sparsity": n_streaming / len(table),
        "threshold": 0.5,
        "written_by": "headlab kv-policy",
    }
    return {DUO_FILE: "\n".join(lines) + "\n", "config.json": json.dumps(config, indent=2) + "\n"}


def measured_generate(loaded, policies: dict[int, LayerStreaming] | None, record: list[dict]):
    """A long_context `generate` that decodes each batch into a fresh cache it then measures: a HeadPolicyCache
    under `policies` (streaming heads store sinks + window), else transformers' DynamicCache. Appends one row per
    batch to `record`: length, prompts, cache_bytes (the cache's tensors after the last decode step), cache_slots."""
    config = loaded.model.config
    if policies is None:
        return recorded_generate(loaded, lambda: DynamicCache(config=config), record, cache_bytes)
    by_block = {layer.block: policies[layer.index] for layer in loaded.layers if layer.index in policies}
    return recorded_generate(
        loaded, lambda: HeadPolicyCache(config, by_block), record, cache_bytes, writing=policy_cache
    )


def evaluate_policy(loaded, policy: CachePolicy, *, text, progress: bool = True, **long_context_options) -> dict:
    """Long-context retrieval and NLL by position of the model as it is ("original") and under `policy`, on the same
    prompts; generation writes a real cache (HeadPolicyCache) whose bytes are measured, NLL by position runs the
    masked policy. Returns {"original": LongContext, "policy": LongContext, "memory": DataFrame}: memory has one row
    per model and length with the measured cache bytes per prompt and their ratio to the original's."""
    policies = policy.layers(loaded)
    records: dict[str, list[dict]] = {"original": [], "policy": []}
    original = long_context(loaded, text=text, generate=measured_generate(loaded, None, records["original"]),
                            progress=progress, **long_context_options)  # fmt: skip
    with head_policy(loaded.model, loaded.layers, policies):
        under = long_context(loaded, text=text, generate=measured_generate(loaded, policies, records["policy"]),
                             progress=progress, **long_context_options)  # fmt: skip
    rows = []
    for name, record in records.items():
        frame = pd.DataFrame(record)
        per_prompt = frame.assign(bytes=frame["cache_bytes"] / frame["prompts"]).groupby("length", as_index=False)
        for row in per_prompt.agg(bytes=("bytes", "mean"), slots=("cache_slots", "max")).itertuples():
            rows.append({"model": name, "length": int(row.length), "cache_slots": int(row.slots),
                         "cache_bytes_per_prompt": float(row.bytes),
                         "kv_fraction_computed": 1.0 if name == "original" else policy.kv_fraction(int(row.slots))})  # fmt: skip
    memory = pd.DataFrame(rows)
    base = memory[memory["model"] == "original"].set_index("length")["cache_bytes_per_prompt"]
    memory["kv_fraction_measured"] = memory["cache_bytes_per_prompt"] / memory["length"].map(base)
    return {"original": original, "policy": under, "memory": memory}


@dataclass
class PolicyRun:
    """What `headlab kv-policy` writes: the policy, where its scores came from, and the evaluation if one ran."""

    policy: CachePolicy
    meta: dict
    evaluation: dict | None = None

    def tables(self) -> dict[str, pd.DataFrame]:
        tables = {"policy": self.policy.table}
        if self.evaluation is not None:
            for name, key in (("long_context", "lengths"), ("cells", "cells"), ("positions", "positions"),
                              ("prompts", "prompts"), ("copying", "copying")):  # fmt: skip
                frames = [getattr(self.evaluation[m], key).assign(model=m) for m in ("original", "policy")]
                tables[name] = pd.concat(frames, ignore_index=True)
            tables["memory"] = self.evaluation["memory"]
        return tables

    def write(self, out: Path, *, overwrite: bool = False) -> Path:
        duo = {f"duo_attention/{name}": content for name, content in duo_attention_files(self.policy).items()}
        return write_run(out, self.tables(), self.meta, overwrite=overwrite, extra_files=duo)

    def summary(self) -> dict:
        summary = {"policy": self.policy.meta}
        if self.evaluation is not None:
            tables = self.tables()
            summary["long_context"] = tables["long_context"].to_dict("records")
            summary["positions"] = tables["positions"].to_dict("records")
            summary["copying"] = tables["copying"].to_dict("records")
            summary["memory"] = tables["memory"].to_dict("records")
        return summary

    def lines(self) -> list[str]:
        meta = self.policy.meta
        lines = [
            f"policy: {meta['full_kv_heads']} KV heads keep the whole cache, {meta['streaming_kv_heads']} keep "
            f"{self.policy.sinks} sinks + {self.policy.window} recent tokens; {meta['kv_fraction']:.3f} of the full "
            f"cache at {self.policy.context} tokens (budget {meta['budget']:g}, score {meta['score']})"
        ]
        if self.evaluation is not None:
            tables = self.tables()
            accuracy = tables["long_context"].pivot_table(index=["task", "length"], columns="model", values="accuracy")
            lines.append("retrieval accuracy (original, policy):")
            lines += [f"  {task}@{length}: {row['original']:.2f}, {row['policy']:.2f}" for (task, length), row
                      in accuracy.iterrows()]  # fmt: skip
            if not tables["copying"].empty:
                copying = tables["copying"].pivot_table(index="length", columns="model", values="accuracy")
                lines += [f"  copy@{length}: {row['original']:.2f}, {row['policy']:.2f}" for length, row
                          in copying.iterrows()]  # fmt: skip
            memory = tables["memory"][tables["memory"]["model"] == "policy"]
            lines += [f"  measured cache at {int(r.length)} tokens: {r.kv_fraction_measured:.3f} of the original's"
                      for r in memory.itertuples()]  # fmt: skip
        return lines


def check_request(loaded, *, budget: float, context: int, sinks: int, window: int, lengths=None, depths=()) -> None:
    """Refuse, before any work, what the policy cannot do: an encoder (no KV cache to keep), a context or an
    evaluation length beyond the model's positions, a budget below the streaming floor."""
    if loaded.adapter.is_encoder:
        raise HeadlabError("a KV-cache policy needs a causal language model; this one is an encoder (masked LM)")
    if loaded.max_positions is not None and context > loaded.max_positions:
        raise HeadlabError(f"--context {context} exceeds the model's maximum positions ({loaded.max_positions})")
    if lengths:
        check_grid(lengths, depths, loaded.max_positions)
    head_dims = [layer.head_dim for layer in loaded.layers for _ in range(layer.num_kv_heads)]
    check_budget(budget, head_dims, context, sinks, window)


@dataclass(frozen=True)
class PolicySpec:
    """What a policy is asked for: KV bytes within `budget` x the full cache at `context` tokens (None: 8192, capped
    by the model's positions), heads ranked by `score`, streaming heads keeping `sinks` + `window` tokens; the
    `gates` score trained for `gate_steps` steps; the passkey prompts of the retrieval score (and of the gates)
    `retrieval_len` tokens long (None: the statistics' 1,024, capped by the model's positions)."""

    budget: float = 0.5
    context: int | None = None
    score: str = "retrieval-streaming"
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    gate_steps: int = GATE_STEPS
    retrieval_len: int | None = None


@dataclass(frozen=True)
class EvaluationSpec:
    """The long-context measurement of a policy: tasks x lengths x depths x samples prompts (headlab.measure.longctx)."""

    lengths: tuple[int, ...]
    tasks: tuple[str, ...] = ("passkey", "niah_multikey")
    depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    samples: int = 2


def policy_run(
    loaded,
    spec: PolicySpec,
    *,
    text,
    stats_dir: Path | None = None,
    evaluation: EvaluationSpec | None = None,
    progress: bool = True,
) -> PolicyRun:
    """Scores (a stats run's, or collected on `text`), the policy `spec` asks for and, with `evaluation`, its
    long-context measurement against the original on the eval part of `text`."""
    budget, score, sinks, window = spec.budget, spec.score, spec.sinks, spec.window
    lengths = evaluation.lengths if evaluation else None
    depths = evaluation.depths if evaluation else ()
    if score not in POLICY_SCORES:
        raise HeadlabError(f"unknown policy score {score!r}; use one of {', '.join(POLICY_SCORES)}")
    context = spec.context or min(DEFAULT_CONTEXT, loaded.max_positions or DEFAULT_CONTEXT)
    check_request(loaded, budget=budget, context=context, sinks=sinks, window=window, lengths=lengths, depths=depths)
    scores, statistics = _policy_scores(loaded, spec, text, stats_dir, progress)
    policy = choose_policy(scores, budget=budget, context=context, sinks=sinks, window=window, score=score)
    meta = {**loaded.describe(), "policy": policy.meta, "statistics": statistics,
            "duo_attention": f"duo_attention/{DUO_FILE} and duo_attention/config.json (DuoAttention's format)"}  # fmt: skip
    measured = None
    if evaluation is not None:
        measured = evaluate_policy(
            loaded, policy, text=text.but(split="eval", max_tokens=None), tasks=evaluation.tasks,
            lengths=evaluation.lengths, depths=evaluation.depths, samples=evaluation.samples, progress=progress,
        )  # fmt: skip
        meta["evaluation"] = {"original": measured["original"].meta, "policy": measured["policy"].meta,
                              "memory": "cache bytes after the last decode step, measured on the cache object"}  # fmt: skip
    return PolicyRun(policy, meta, measured)


def _policy_scores(loaded, spec: PolicySpec, text, stats_dir, progress: bool):
    """(scores per KV head, their record): from a stats run, from statistics collected on `text`, or, for `gates`,
    trained (headlab.kv.duo_gates)."""
    score, window = spec.score, spec.window
    if score == "gates":
        if stats_dir is not None:
            raise HeadlabError("--score gates trains its gates on passkey prompts; it reads no --stats run")
        gates = GateSpec(steps=spec.gate_steps, length=spec.retrieval_len)
        scores, record = optimized_gates(loaded, text, sinks=spec.sinks, window=window, spec=gates, progress=progress)
        return scores, {"gates": record}
    if stats_dir is not None:
        wide = pd.read_csv(Path(stats_dir) / "stats_wide.csv")
        statistics = {"from": str(stats_dir)}
    else:
        tidy = head_statistics(loaded, text=text, induction=False, retrieval=score != "streaming",
                               retrieval_len=spec.retrieval_len, ov=False, progress=progress)  # fmt: skip
        wide = wide_statistics(tidy)
        statistics = {key: tidy.attrs["meta"].get(key) for key in ("data", "tokens", "seq_len", "retrieval")}
    return kv_head_scores(wide, loaded, score, window, STREAMING_WINDOWS), statistics


@contextlib.contextmanager
def applied_policy(loaded, policy: CachePolicy | None):
    """Run `loaded` under `policy` (masked: streaming heads see only sinks + window over the ordinary cache) inside
    the block; yields {layer index: LayerStreaming}, or None and changes nothing when `policy` is None."""
    if policy is None:
        yield None
        return
    layers = policy.layers(loaded)
    with head_policy(loaded.model, loaded.layers, layers):
        yield layers


def policy_record(policy: CachePolicy, source, length: int) -> dict:
    """What a run under a policy records: where it came from, its heads, and the cache fraction it keeps at
    `length` tokens."""
    return {"from": str(source), "sinks": policy.sinks, "window": policy.window, "score": policy.score,
            "full_kv_heads": int((policy.table["policy"] == "full").sum()),
            "streaming_kv_heads": int((policy.table["policy"] == "streaming").sum()),
            "kv_fraction_at": {"tokens": length, "fraction": policy.kv_fraction(length)}}  # fmt: skip


def read_policy(path: Path) -> CachePolicy:
    """A policy from a `headlab kv-policy` run directory (policy.csv + meta.json)."""
    path = Path(path)
    table_file, meta_file = path / "policy.csv", path / "meta.json"
    if not table_file.is_file() or not meta_file.is_file():
        raise HeadlabError(f"{path} is not a kv-policy run (policy.csv and meta.json expected)")
    table = pd.read_csv(table_file)
    missing = {"layer", "kv_head", "head_dim", "score", "policy"} - set(table.columns)
    if missing or not set(table["policy"]) <= {"full", "streaming"}:
        raise HeadlabError(f"{table_file} is not a policy table (columns or policy values)")
    meta = json.loads(meta_file.read_text())
    policy_meta = meta.get("policy", meta)
    return CachePolicy(
        table,
        int(policy_meta["sinks"]),
        int(policy_meta["window"]),
        int(policy_meta["context"]),
        policy_meta.get("budget"),
        policy_meta.get("score"),
        policy_meta,
    )


__all__ = [
    "applied_policy",
    "policy_record",
    "CachePolicy",
    "DEFAULT_SINKS",
    "DEFAULT_WINDOW",
    "POLICY_SCORES",
    "choose_policy",
    "duo_attention_files",
    "evaluate_policy",
    "kv_head_scores",
    "measured_generate",
    "policy_run",
    "PolicySpec",
    "EvaluationSpec",
    "PolicyRun",
    "check_request",
    "read_policy",
    "streaming_column",
]
