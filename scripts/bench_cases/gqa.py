"""KV-head conversion on the embedded model: perplexity and KV-cache bytes per token for MQA (3 -> 1 KV heads) with
each pooling rule and grouping, and for the expanded model (9 KV heads) pooled back to 3."""

from __future__ import annotations

TITLE = "GQA conversion: perplexity against KV-cache bytes (`headlab convert-gqa`, `expand-kv`, `gqa-sweep`)"
MAX_TOKENS, SEQ_LEN, CALIB_TOKENS = 2048, 512, 2048


def run(args) -> dict:
    from unittest import mock

    import torch

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import load_corpus
    from headlab.core.loading import load_model
    from headlab.kv import gqa
    from headlab.kv import grouping as kv_grouping
    from headlab.measure.evaluate import perplexity

    loaded = load_model(None, device=args.device)
    corpus = load_corpus(None)
    common = dict(data=corpus, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN, calibration_tokens=CALIB_TOKENS, progress=False)
    domains = {name: load_corpus(name) for name in DEFAULT_EVAL_DOMAINS}
    rows = []
    sweep_numbers = gqa._variant_numbers

    def with_domains(model, text, conversion):
        """A sweep row's numbers plus perplexity_<domain>: each out-of-domain text's eval split, read with the
        sweep's eval settings, while the converted model is in memory (gqa_sweep has no hook for extra measures)."""
        row = sweep_numbers(model, text, conversion)
        for name, domain in domains.items():
            row[f"perplexity_{name}"] = perplexity(model, text=text.but(data=domain), progress=False).perplexity
        return row

    def add(frame, source):
        for row in frame.to_dict("records"):
            rows.append({"source": source, **{k: (None if v != v else v) for k, v in row.items()}})

    with mock.patch.object(gqa, "_variant_numbers", with_domains):
        # 1. the model as shipped (3 KV heads) -> MQA with every pool and grouping
        frame, _ = gqa.gqa_sweep(loaded, [3, 1], **common)
        add(frame, "original (3 KV)")
        # 2. expanded to MHA (lossless), pooled back to 3 with each grouping
        gqa.convert(loaded, 9)
        frame, _ = gqa.gqa_sweep(loaded, [9, 3], pools=("mean",), **common)
        add(frame, "expanded (9 KV)")
        # 3. expanded, then KV heads shuffled (function unchanged): contiguous groups now mix unrelated heads, while
        #    similarity grouping should find the copies again
        order = torch.randperm(9, generator=torch.Generator().manual_seed(0)).tolist()
        kv_grouping.permute_heads(loaded, [order] * len(loaded.layers))
        frame, _ = gqa.gqa_sweep(loaded, [9, 3], pools=("mean",), **common)
        add(frame, f"expanded, KV order shuffled {order}")
    return {"max_tokens": MAX_TOKENS, "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
            "domains": list(DEFAULT_EVAL_DOMAINS), "rows": rows}  # fmt: skip


def markdown(r: dict) -> str:
    names = r.get("domains", [])  # results from before the out-of-domain columns have none
    lines = [
        f"Embedded SmolLM2-135M (9 query heads, 3 KV heads, 30 layers, float32), eval split, first {r['max_tokens']} "
        f"tokens, seq-len {r['seq_len']}; similarity measured on {r['calib_tokens']} calibration tokens. KV bytes "
        "are measured from a real cache (float32). No uptraining (Ainslie et al. uptrain with 5% of pre-training)."
        + (
            f" Columns {', '.join(names)}: eval-split perplexity of those built-in held-out domains, same settings "
            "(docs/evaluation.md, Out-of-domain perplexity)."
            if names
            else ""
        ),
        "",
        "| starting model | KV heads | grouping | pool | perplexity | "
        + "".join(f"{name} | " for name in names)
        + "KV bytes / token | note |",
        "|---|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for row in r["rows"]:
        note = f"same partition as {row['same_as']}" if row.get("same_as") else ""
        domains = "".join(f"{row[f'perplexity_{name}']:.4g} | " for name in names)
        lines.append(
            f"| {row['source']} | {row['kv_heads']} | {row['grouping'] or row['action']} | {row['pool'] or row.get('method') or '-'} | "
            f"{row['perplexity']:.4g} | {domains}{row['kv_bytes_per_token']:,} | {note} |"
        )
    return "\n".join(lines)
