"""MHA/GQA -> MLA on the embedded model, training-free (`convert-mla`): perplexity at the GQA-3 budget (384 numbers
per token per layer) and at the MQA budget (128) for each latent + rope split, beside the svd-merged and mean-pooled
MQA (`convert-gqa --kv-heads 1`) measured in the same run; calibration from the calibration split only."""

from __future__ import annotations

TITLE = "Multi-head latent attention, training-free (`convert-mla`)"
EVAL_TOKENS, SEQ_LEN, CALIB_TOKENS = 2048, 512, 2048
MQA_SPLITS = ((64, 64), (96, 32), (112, 16))  # (latent, rope) at 128 numbers per token per layer


def run(args) -> dict:
    import time

    import torch

    from headlab.core.corpora import DEFAULT_EVAL_DOMAINS
    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import load_model
    from headlab.kv import gqa, mla
    from headlab.measure.evaluate import perplexity

    corpus = load_corpus(None)
    text = TextSpec(data=corpus, split="eval", seq_len=SEQ_LEN, batch_size=1, max_tokens=EVAL_TOKENS)
    domains = {name: text.but(data=load_corpus(name)) for name in DEFAULT_EVAL_DOMAINS}

    def ppl(loaded, text=text):
        return perplexity(loaded, text=text, progress=False).perplexity

    def domain_ppl(loaded) -> dict:
        """Eval perplexity of each out-of-domain text (DEFAULT_EVAL_DOMAINS), with ppl's settings."""
        return {name: ppl(loaded, domain) for name, domain in domains.items()}

    source = load_model(None, device=args.device)
    result = {"eval_tokens": EVAL_TOKENS, "seq_len": SEQ_LEN, "calib_tokens": CALIB_TOKENS,
              "threads": torch.get_num_threads(), "dtype": str(source.dtype), "shared_machine": True}  # fmt: skip
    result["domains"] = list(DEFAULT_EVAL_DOMAINS)
    result["original"] = ppl(source)
    result["original_domains"] = domain_ppl(source)
    batches = text.but(split="calibration", max_tokens=CALIB_TOKENS, batch_size=4).batches(source.tokenizer)
    start = time.perf_counter()
    grams = mla.input_grams(source, batches, progress=False)
    phases = mla.rope_phases(source, batches, progress=False)
    result["calibration_seconds"] = time.perf_counter() - start
    points = []
    targets = [("gqa", mla.plan_mla(source, "gqa"))]
    targets += [("mqa", mla.plan_mla(source, kv_lora_rank=r, rope_dim=d)) for r, d in MQA_SPLITS]
    # the latent metric's other key weights (mla.KEY_WEIGHTS), for the split --budget mqa picks at weight 1
    first = mla.plan_mla(source, kv_lora_rank=MQA_SPLITS[0][0], rope_dim=MQA_SPLITS[0][1])
    targets += [("mqa", mla._replace(first, key_weight=w)) for w in mla.KEY_WEIGHTS if w != 1.0]
    for budget, plan in targets:
        start = time.perf_counter()
        converted = mla.build_mla(source, plan, grams, phases)
        seconds = time.perf_counter() - start
        points.append({"budget": budget, "kv_lora_rank": plan.kv_lora_rank, "rope_dim": plan.rope_dim,
                       "key_weight": plan.key_weight, "numbers": plan.cache_numbers, "build_seconds": seconds,
                       "calibration_nll": mla.calibration_nll(converted.model, batches, source.device),
                       "perplexity": ppl(converted), "domains": domain_ppl(converted)})  # fmt: skip
        del converted
    mqa = [p for p in points if p["budget"] == "mqa"]
    # what --budget mqa picks: the split of lowest calibration NLL at key weight 1, then that split's best weight
    split = min((p for p in mqa if p.get("key_weight", 1.0) == 1.0), key=lambda p: p["calibration_nll"])["rope_dim"]
    result["mqa_rule_pick"] = split
    result["mqa_rule_key_weight"] = min((p for p in mqa if p["rope_dim"] == split),
                                        key=lambda p: p["calibration_nll"])["key_weight"]  # fmt: skip
    result["mla"] = points
    for method in ("svd", "mean"):
        merged = load_model(None, device=args.device)
        start = time.perf_counter()
        gqa.convert(merged, 1, method=method, batches=batches if method == "svd" else None)
        result[f"gqa_{method}_seconds"] = time.perf_counter() - start
        result[f"gqa_{method}"] = ppl(merged)
        result[f"gqa_{method}_domains"] = domain_ppl(merged)
        del merged
    return result


def markdown(r: dict) -> str:
    names = r.get("domains", [])  # results from before the out-of-domain columns have none

    def cells(values) -> str:
        """The out-of-domain perplexities of one model as table cells."""
        return "".join(f"{values[name]:.2f} | " for name in names)

    lines = [
        f"Embedded SmolLM2-135M ({r['dtype'].removeprefix('torch.')}, {r['threads']} threads, on a machine shared with "
        f"other jobs: wall times are indicative), eval split, first {r['eval_tokens']:,} tokens at seq-len "
        f"{r['seq_len']}; calibration split, {r['calib_tokens']:,} tokens (one input-Gram pass and one "
        f"attention pass for the RoPE phases, {r['calibration_seconds']:.0f} s, shared by every MLA point)."
        + (
            f" Columns {', '.join(names)}: eval-split perplexity of those built-in held-out domains, same settings "
            "(docs/evaluation.md, Out-of-domain perplexity)."
            if names
            else ""
        ),
        "",
        "| model | KV numbers / token / layer | perplexity | "
        + "".join(f"{name} | " for name in names)
        + "calibration NLL | build (s) |",
        "|---|---|---|" + "---|" * len(names) + "---|---|",
        f"| original GQA, 3 KV heads | 384 | {r['original']:.2f} | {cells(r.get('original_domains'))}| |",
    ]
    for p in r["mla"]:
        weight = p.get("key_weight", 1.0)  # results from before the key-weight search have weight 1 only
        picked = (p["rope_dim"], weight) == (r["mqa_rule_pick"], r.get("mqa_rule_key_weight", 1.0))
        pick = " (rule's pick)" if p["budget"] == "mqa" and picked else ""
        keyed = "" if weight == 1.0 else f", key weight {weight:g}"
        lines.append(
            f"| MLA {p['kv_lora_rank']} + {p['rope_dim']}{keyed}, {p['budget'].upper()} budget{pick} | {p['numbers']} | "
            f"{p['perplexity']:.2f} | {cells(p.get('domains'))}{p['calibration_nll']:.4f} | {p['build_seconds']:.0f} |"
        )
    lines += [
        f"| MQA, svd merge (`convert-gqa --kv-heads 1 --method svd`) | 128 | {r['gqa_svd']:.2f} | "
        f"{cells(r.get('gqa_svd_domains'))}| {r['gqa_svd_seconds']:.0f} |",
        f"| MQA, mean pool (`convert-gqa --kv-heads 1`) | 128 | {r['gqa_mean']:.2f} | "
        f"{cells(r.get('gqa_mean_domains'))}| {r['gqa_mean_seconds']:.0f} |",
        "",
        "`--budget mqa` picks the split with the lowest calibration NLL (never the eval split), then that split's key "
        "weight of the latent metric (1, 0.5, 0.25: multiples of equal relative energy) the same way; its pick is "
        "marked. "
        "Reproduce: `python scripts/benchmark.py --case mla`.",
    ]
    return "\n".join(lines)
