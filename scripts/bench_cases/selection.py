"""Head selection on the embedded model: perplexity after pruning 90 heads (uniform, one query head per KV group)
and 135 heads (global ranking), without and with the ridge compensation, for every score source / selection, with
random (3 seeds) as the floor; and each per-head score's Spearman correlation with exact ablation.

Calibration split only for every choice (scores, Grams, Fisher); the eval split only for the reported perplexity.
Calibration: `headlab prune`'s default (headlab.pruning.prune.DEFAULT_CALIBRATION_TOKENS) for every method, and the
earlier default of 2,048 tokens for obs and grad beside it. Every compensated row is also evaluated on text from
outside the embedded corpus: the package descriptions of the installed distributions (importlib.metadata, sorted by
name, those over 2,000 characters), whose eval split is read the same way; and every row, the original too, on the
eval split of each built-in out-of-domain text (headlab.core.corpora.DEFAULT_EVAL_DOMAINS), read the same way.
Partial results are kept in ~/.cache/headlab/bench-selection-partial-<tokens>.json, so an interrupted run resumes.
Environment: HEADLAB_SELECTION_METHODS (comma list, default all), HEADLAB_SELECTION_ABLATION=0 skips the
ablation reference (270 forward-pass sets on 512 tokens), HEADLAB_SELECTION_COMPARE=0 skips the 2,048-token rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

TITLE = "Head selection: Fisher, structured OBS and per-layer budgets against gradient importance"
CALIBRATION_SEQ, BATCH = 256, 4  # scores, Fisher, Grams
EARLIER_TOKENS, COMPARED = 2048, ("obs", "grad")  # the calibration default before, and the methods rerun at it
EVAL_TOKENS, EVAL_SEQ = 2048, 512
SPEARMAN_TOKENS, SPEARMAN_SEQ = 512, 128  # the importance case's ablation setting
SETTINGS = {"90 uniform": ("uniform", 90), "135 global": ("global", 135)}
METHODS = (
    "obs",
    "grad",
    "fisher",
    "random-0",
    "fisher-block",
    "taylor",
    "random-1",
    "random-2",
    "entropy",
    "second-order",
)
PARTIAL = Path.home() / ".cache" / "headlab" / "bench-selection-partial-{tokens}.json"
OUTSIDE = Path.home() / ".cache" / "headlab" / "bench-selection-outside.txt"


def calibration_tokens() -> int:
    from headlab.pruning.prune import DEFAULT_CALIBRATION_TOKENS

    return DEFAULT_CALIBRATION_TOKENS


def outside_text() -> Path:
    """Text from outside the embedded corpus: long package descriptions of the installed distributions."""
    from importlib.metadata import distributions

    if not OUTSIDE.is_file():
        described = {}
        for dist in distributions():
            body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
            if isinstance(body, str) and len(body) > 2000:
                described[dist.metadata["Name"].lower()] = body.strip()
        OUTSIDE.parent.mkdir(parents=True, exist_ok=True)
        OUTSIDE.write_text("\n\n".join(described[name] for name in sorted(described)))
    return OUTSIDE


def spearman(a, b) -> float:
    import pandas as pd

    return float(pd.Series(list(a)).rank().corr(pd.Series(list(b)).rank()))


class Store:
    """Results kept on disk after every measurement (the run can be interrupted and resumed)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)
        return value


def _flat(scores):
    return [float(v) for s in scores for v in s]


def _paths(loaded, method, budget, count, stats, grams):
    """The joint selection's paths under one budget, from statistics computed once."""
    from headlab.pruning import selection as S

    layers = loaded.layers
    cap = S.uniform_cap(layers, "head", None, count) if budget == "uniform" else None
    units = [S.layer_units(layer, "head") for layer in layers]
    allowed = [S._allowed(layer, "head", budget, cap, False) for layer in layers]
    steps = [S._steps(layer, "head", budget, cap) for layer in layers]
    if method == "obs":
        paths = S.obs_paths(loaded, grams, stats.output, units, allowed, steps, progress=False)
    else:
        paths = [S.fisher_block_path(la, units[i], stats.block[i], allowed[i], steps[i]) for i, la in enumerate(layers)]
    taken = S.allocate(loaded, paths, budget=budget, unit="head", fraction=None, count=count, cap=cap)
    return [set(h for u in p.units[:k] for h in u) for p, k in zip(paths, taken)]


def _select(loaded, method, prepared, grams, data_kw):
    """{setting: pruned sets} for one method, and its wall time (scores + selection, both settings)."""
    from headlab.core.data import TextSpec
    from headlab.measure.importance import fisher_statistics
    from headlab.pruning import prune as P
    from headlab.pruning.scores import ScoreRequest, score_heads

    start = time.perf_counter()
    out = {}
    if method in ("obs", "fisher-block"):
        stats = fisher_statistics(loaded, prepared, output_fisher=method == "obs", progress=False)
        for name, (budget, count) in SETTINGS.items():
            out[name] = _paths(loaded, method, budget, count, stats, grams)
    else:
        name, seed = method.split("-", 1) if method.startswith("random-") else (method, 0)
        request = ScoreRequest(TextSpec(**data_kw), progress=False, seed=int(seed or 0), grams=grams)
        scores = score_heads(name, loaded, request)
        for setting, (budget, count) in SETTINGS.items():
            out[setting] = P.select_heads(loaded.layers, scores, count=count, uniform=budget == "uniform")
    return out, time.perf_counter() - start


def _ppl(loaded, pruned, grams, compensate, data=None):
    """Eval-split perplexity of the default corpus (data None), of the text file `data` or of the built-in domain
    `data`, pruned as masks."""
    from headlab.measure.evaluate import perplexity
    from headlab.pruning.prune import pruned_in_place
    from headlab.recovery.compensate import compensated

    refit = compensated(loaded, pruned, grams, "ridge") if compensate else contextlib.nullcontext()
    with refit, pruned_in_place(loaded, pruned, "mask"):
        return perplexity(
            loaded, data, split="eval", seq_len=EVAL_SEQ, max_tokens=EVAL_TOKENS, progress=False
        ).perplexity


def _spearman_part(loaded, store, methods):
    """Per-head scores on the 512 Spearman calibration tokens, and exact ablation there (resumable, head by head)."""
    from headlab.core.data import calibration_batches
    from headlab.measure.importance import _total_nll, fisher_statistics, head_importance, scoring_batches
    from headlab.measure.stats import head_statistics
    from headlab.pruning.selection import single_obs_scores
    from headlab.recovery.compensate import output_statistics

    windows = list(
        calibration_batches(loaded.tokenizer, None, seq_len=SPEARMAN_SEQ, batch_size=2, max_tokens=SPEARMAN_TOKENS)
    )
    prepared = scoring_batches(loaded, windows)
    scores = store.get("spearman_scores") or {}
    for method in ("grad", "taylor", "fisher", "second-order"):
        if method not in scores:
            scores[method] = (
                head_importance(loaded, windows, method=method, progress=False).table["importance_raw"].tolist()
            )
    if "obs" not in scores:
        grams = output_statistics(loaded, windows, progress=False)
        stats = fisher_statistics(loaded, prepared, output_fisher=True, progress=False)
        scores["obs"] = _flat(single_obs_scores(loaded, grams, stats.output, progress=False))
    if "entropy" in methods and "entropy" not in scores:
        table = head_statistics(loaded, None, seq_len=SPEARMAN_SEQ, batch_size=2, max_tokens=SPEARMAN_TOKENS,
                                induction=False, retrieval=False, progress=False)  # fmt: skip
        table = table[table["statistic"] == "entropy"].sort_values(["layer", "head"])
        scores["entropy"] = [-v for v in table["value"]]  # pruned first = most diffuse, as the entropy source
    store.put("spearman_scores", scores)
    if os.environ.get("HEADLAB_SELECTION_ABLATION", "1") == "0":
        return scores, None
    ablation = store.get("ablation") or {}
    N = float(sum(b.scored for b in prepared))
    base = [torch.ones(layer.num_heads) for layer in loaded.layers]
    if "reference" not in ablation:
        ablation["reference"] = _total_nll(loaded, prepared, base)
    start = time.perf_counter()
    for layer in loaded.layers:
        for h in range(layer.num_heads):
            key = f"{layer.index}:{h}"
            if key in ablation:
                continue
            gates = [g.clone() for g in base]
            gates[layer.index][h] = 0.0
            ablation[key] = (_total_nll(loaded, prepared, gates) - ablation["reference"]) / N
            ablation["seconds"] = ablation.get("seconds", 0.0) + time.perf_counter() - start
            start = time.perf_counter()
            store.put("ablation", ablation)
    values = [ablation[f"{la.index}:{h}"] for la in loaded.layers for h in range(la.num_heads)]
    return scores, {"values": values, "seconds": ablation["seconds"], "scored_tokens": int(N)}


def run(args) -> dict:
    """Measure what the stores lack; with HEADLAB_SELECTION_PARTIAL_ONLY=1 only report what they hold (no model)."""
    methods = [m for m in os.environ.get("HEADLAB_SELECTION_METHODS", ",".join(METHODS)).split(",") if m]
    tokens = calibration_tokens()
    sizes = [(tokens, methods)]
    if os.environ.get("HEADLAB_SELECTION_COMPARE", "1") != "0" and tokens != EARLIER_TOKENS:
        sizes.append((EARLIER_TOKENS, [m for m in COMPARED if m in methods]))
    partial_only = os.environ.get("HEADLAB_SELECTION_PARTIAL_ONLY") == "1"
    loaded = None
    if not partial_only:
        from headlab.core.loading import load_model

        loaded = load_model(None, device=args.device)
    store = Store(Path(str(PARTIAL).format(tokens=tokens)))
    rows, main_work = [], None
    for size, chosen in sizes:
        size_store = store if size == tokens else Store(Path(str(PARTIAL).format(tokens=size)))
        work = None if partial_only else _Work(loaded, size_store, size)
        rows += _rows(size_store, work, chosen, size, partial_only)
        if size == tokens:
            main_work = work
    original = {
        key: store.get(key) if partial_only else main_work.original(key, data)
        for key, data in (("original", None), ("original_outside", None if partial_only else str(outside_text())))
    }
    domains = eval_domains()
    original_domains = {
        name: store.get(f"original_{name}") if partial_only else main_work.original(f"original_{name}", name)
        for name in domains
    }
    spearman_rows, ablation_seconds = {}, None
    scores = store.get("spearman_scores") if partial_only else _spearman_part(loaded, store, methods)[0]
    ablation = store.get("ablation") or {}
    heads = [key for key in ablation if ":" in key]
    if scores and len(heads) == len(scores["grad"]):
        values = [ablation[key] for key in heads]
        ablation_seconds = ablation["seconds"]
        for method, mine in scores.items():
            spearman_rows[method] = {
                "ablation": spearman(mine, values),
                "abs_ablation": spearman(mine, [abs(v) for v in values]),
            }
    expected = sum(2 * len(SETTINGS) * len(chosen) for _, chosen in sizes)
    return {
        "calibration": {
            "tokens": tokens,
            "seq_len": CALIBRATION_SEQ,
            "batch_size": BATCH,
            "compared_tokens": [size for size, _ in sizes[1:]],
        },  # fmt: skip
        "eval": {"tokens": EVAL_TOKENS, "seq_len": EVAL_SEQ},
        "spearman_setting": {"tokens": SPEARMAN_TOKENS, "seq_len": SPEARMAN_SEQ},
        "original": original["original"],
        "original_outside": original["original_outside"],
        "domains": list(domains),
        "original_domains": original_domains,
        "rows": rows,
        "spearman": spearman_rows,
        "ablation_seconds": ablation_seconds,
        "ablation_heads_done": len(heads),
        "load_average": os.getloadavg(),
        # a report from the stores alone is partial only if something was never measured
        "partial": partial_only and not (len(rows) == expected and spearman_rows),
    }


def eval_domains() -> tuple[str, ...]:
    """The built-in out-of-domain texts every row is also evaluated on."""
    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS

    return DEFAULT_EVAL_DOMAINS


def _rows(store, work, methods, tokens, partial_only) -> list[dict]:
    """Compensated rows of every method first (the goals), then the plain ones; compensated ones also outside; every
    row also on each out-of-domain text (perplexity_<domain>)."""
    rows = []
    for compensate, method in [(c, m) for c in (True, False) for m in methods]:
        record = store.get(f"select:{method}") if partial_only else work.select(method)
        for setting in SETTINGS if record is not None else ():
            key = f"ppl:{method}:{setting}:{compensate}"
            pruned = [set(p) for p in record["pruned"][setting]]
            value = store.get(key) if partial_only else work.ppl(key, pruned, compensate)
            if value is None:
                continue
            outside = None
            if compensate:
                key = f"outside:{method}:{setting}"
                outside = store.get(key) if partial_only else work.ppl(key, pruned, True, str(outside_text()))
            domains = {}
            for name in eval_domains():
                key = f"domain:{name}:{method}:{setting}:{compensate}"
                domains[f"perplexity_{name}"] = (
                    store.get(key) if partial_only else work.ppl(key, pruned, compensate, name)
                )
            rows.append(
                {"method": method, "setting": setting, "compensation": compensate, "perplexity": value,
                 "perplexity_outside": outside, **domains, "calibration_tokens": tokens,
                 "pruned": sum(len(p) for p in pruned), "seconds": record["seconds"]}
            )  # fmt: skip
            print(rows[-1], flush=True)
    return rows


class _Work:
    """The measurements at one calibration size, each stored as soon as it is made (the model loaded once)."""

    def __init__(self, loaded, store, tokens: int):
        from headlab.core.data import calibration_batches
        from headlab.measure.importance import scoring_batches
        from headlab.recovery.compensate import output_statistics

        self.store, self.loaded, self.tokens = store, loaded, tokens
        windows = list(
            calibration_batches(loaded.tokenizer, None, seq_len=CALIBRATION_SEQ, batch_size=BATCH, max_tokens=tokens)
        )
        self.prepared = scoring_batches(loaded, windows)
        self.grams = output_statistics(loaded, windows, progress=False)

    def original(self, key, data=None):
        unpruned = [set() for _ in self.loaded.layers]
        value = self.store.get(key)
        return value if value is not None else self.store.put(key, _ppl(self.loaded, unpruned, None, False, data))

    def select(self, method):
        record = self.store.get(f"select:{method}")
        if record is None:
            data_kw = dict(seq_len=CALIBRATION_SEQ, batch_size=BATCH, max_tokens=self.tokens)
            chosen, seconds = _select(self.loaded, method, self.prepared, self.grams, data_kw)
            pruned = {k: [sorted(p) for p in v] for k, v in chosen.items()}
            record = self.store.put(f"select:{method}", {"seconds": seconds, "pruned": pruned})
        return record

    def ppl(self, key, pruned, compensate, data=None):
        value = self.store.get(key)
        if value is None:
            value = self.store.put(key, _ppl(self.loaded, pruned, self.grams, compensate, data))
        return value


def _domain_lines(result: dict) -> list[str]:
    """Every row on the corpus and on each out-of-domain text, side by side (none for results from before)."""
    names = result.get("domains") or []
    if not names:
        return []

    def f(value) -> str:
        return f"{value:.2f}" if value is not None and value == value else "-"

    original = result.get("original_domains") or {}
    lines = [
        "",
        f"Out of domain: eval-split perplexity of the built-in held-out texts {', '.join(names)} (docs/evaluation.md, "
        "Out-of-domain perplexity), same settings, beside the corpus's. Original: "
        + ", ".join(f"{name} **{f(original.get(name))}**" for name in names)
        + ".",
        "",
        "| method | calibration tokens | setting | compensation | perplexity | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for row in result["rows"]:
        cells = [f(row.get(f"perplexity_{name}")) for name in names]
        lines.append(
            f"| {row['method']} | {row.get('calibration_tokens', result['calibration']['tokens']):,} | "
            f"{row['setting']} | {'ridge' if row['compensation'] else '-'} | {f(row['perplexity'])} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def markdown(result: dict) -> str:
    import pandas as pd

    rows = pd.DataFrame(result["rows"])
    if len(rows) and "calibration_tokens" not in rows:
        rows["calibration_tokens"], rows["perplexity_outside"] = result["calibration"]["tokens"], None
    outside = result.get("original_outside")
    lines = [
        f"Embedded SmolLM2-135M (float32), eval split first {result['eval']['tokens']:,} tokens at seq-len "
        f"{result['eval']['seq_len']}; every choice (scores, Fisher, Grams, ridge alpha) on the calibration tokens "
        f"given per row (`prune`'s default: {result['calibration']['tokens']:,}), in windows of "
        f"{result['calibration']['seq_len']}. Original: **{result['original']:.2f}**"
        + (
            f"; outside the corpus (eval split of the installed packages' descriptions): **{outside:.2f}**"
            if outside
            else ""
        )
        + ". Compensation: `--compensate` ridge refit of o_proj (alpha per layer on held-out "
        "calibration windows). obs and fisher-block are joint per-layer selections (`--select`); the others rank "
        "per-head scores (`--method`). random-N: seed N.",
        "",
        "| method | calibration tokens | 90 uniform | 90 uniform + comp. | 90 + comp., outside | 135 global | "
        "135 global + comp. | 135 + comp., outside | selection s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups = rows.groupby(["calibration_tokens", "method"], sort=False) if len(rows) else ()
    for (tokens, method), part in groups:
        cell = {(r.setting, bool(r.compensation)): r.perplexity for r in part.itertuples()}
        cell.update({(r.setting, "outside"): r.perplexity_outside for r in part.itertuples() if r.compensation})

        def f(key, cell=cell):
            return f"{cell[key]:.2f}" if cell.get(key) is not None and cell[key] == cell[key] else "-"

        lines.append(
            f"| {method} | {tokens:,} | {f(('90 uniform', False))} | {f(('90 uniform', True))} | "
            f"{f(('90 uniform', 'outside'))} | {f(('135 global', False))} | {f(('135 global', True))} | "
            f"{f(('135 global', 'outside'))} | {part['seconds'].iloc[0]:.0f} |"
        )
    lines += _domain_lines(result)
    if result["spearman"]:
        lines += [
            "",
            f"Spearman correlation with exact ablation (the loss increase with one head masked) on the first "
            f"{result['spearman_setting']['tokens']} calibration tokens in windows of "
            f"{result['spearman_setting']['seq_len']}; ablation took {result['ablation_seconds']:.0f} s.",
            "",
            "| score | vs ablation | vs abs(ablation) |",
            "|---|---|---|",
        ]
        for method, r in result["spearman"].items():
            lines.append(f"| {method} | {r['ablation']:.3f} | {r['abs_ablation']:.3f} |")
    else:
        lines += [
            "",
            "Spearman with exact ablation: not measured in this run (HEADLAB_SELECTION_ABLATION=0, or the ablation "
            "incomplete). It reads its own 512 calibration tokens, so the calibration budget does not change it; "
            "docs/selection.md quotes the last run that measured it.",
        ]
    if result.get("partial"):
        lines += [
            "",
            "**Partial run**: the machine was shared with up to 8 other jobs (load average about 30 on 2 cores), "
            "and the case was stopped before every measurement was made; '-' marks the ones not made. "
            f"Exact ablation: {result.get('ablation_heads_done', 0)} of 270 heads done (no Spearman without all).",
        ]
    load = result.get("load_average")
    if load:
        lines += [
            "",
            f"Load average {load[0]:.1f} on 2 cores when the result was written; measurements resumed from a store "
            "may have been made under other load (the 2026-12-01 measurements: 17-30, shared with other jobs).",
        ]
    return "\n".join(lines)
