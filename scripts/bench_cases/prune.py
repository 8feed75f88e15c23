"""Physical head pruning: forward time of the pruned embedded model against the original, measured in one run,
beside the theoretical reductions in attention FLOPs and parameters."""

from __future__ import annotations

TITLE = "Physical pruning: forward time of a uniformly pruned model against the original"
TOKENS, SEQ_LEN, BATCH = 1024, 512, 2


def run(args) -> dict:
    import statistics
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark import median_time

    from headlab.core.data import load_corpus, split_text, tokenize
    from headlab.core.layout import physical_layout
    from headlab.core.loading import load_model
    from headlab.measure.costs import costs
    from headlab.pruning.prune import pruned_in_place, select_heads

    loaded = load_model(None, device=args.device)
    ids, _ = tokenize(loaded.tokenizer, split_text(load_corpus(None), "eval").text, TOKENS)
    input_ids = ids[: BATCH * SEQ_LEN].view(BATCH, SEQ_LEN).to(loaded.device)  # [B, T], 1,024 tokens

    def forward():
        with torch.no_grad():
            loaded.model(input_ids=input_ids, use_cache=False)

    layers = loaded.layers
    H, G = layers[0].num_heads, layers[0].num_kv_heads
    # The uniform layout nearest to half of the heads: with 3 query heads per KV group, 1 or 2 per group (1/3 or
    # 2/3) are equally near; halves go to the smaller prune, so 1 query head of every group, in every layer. The
    # heads are chosen by index here: speed depends on the layout only.
    scores = [torch.arange(layer.num_heads, dtype=torch.float64) for layer in layers]
    pruned = select_heads(layers, scores, fraction=0.5, uniform=True)
    layout = physical_layout(layers, pruned)
    before = costs(loaded, context=SEQ_LEN)
    with pruned_in_place(loaded, pruned, "physical"):
        after = costs(loaded, context=SEQ_LEN)
    # Interleaved: each repeat times the original, then the pruned model, so load on a shared machine hits both.
    original_runs, pruned_runs = [], []
    forward()  # warm-up
    for _ in range(args.repeats):
        original_runs.append(median_time(forward, 1, warmup=0)[0])
        with pruned_in_place(loaded, pruned, "physical"):
            pruned_runs.append(median_time(forward, 1, warmup=0 if pruned_runs else 1)[0])
    original_s, pruned_s = statistics.median(original_runs), statistics.median(pruned_runs)
    original_again = original_runs[-1]
    return {
        "tokens": BATCH * SEQ_LEN,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "layout": f"{H} query / {G} KV heads -> {layout[0].num_heads} / {layout[0].num_kv_heads} in all "
        f"{len(layers)} layers",
        "pruned_heads": sum(len(p) for p in pruned),
        "total_heads": sum(layer.num_heads for layer in layers),
        "original_s": original_s,
        "pruned_s": pruned_s,
        "original_runs": original_runs,
        "pruned_runs": pruned_runs,
        "original_again_s": original_again,
        "speedup": original_s / pruned_s,
        "params_before": before["parameters"],
        "params_after": after["parameters"],
        "attn_params_before": before["attention_parameters"],
        "attn_params_after": after["attention_parameters"],
        "flops_before": before["attention_flops_per_token"],
        "flops_after": after["attention_flops_per_token"],
        "kv_before": before["kv_bytes_per_token"],
        "kv_after": after["kv_bytes_per_token"],
    }


def markdown(r: dict) -> str:
    def drop(a, b):
        return f"{100 * (1 - b / a):.1f}%"

    return "\n".join(
        [
            f"Embedded model, float32, {r['batch']} x {r['seq_len']} = {r['tokens']} tokens per forward (no cache). "
            f"Layout: {r['layout']} ({r['pruned_heads']} of {r['total_heads']} heads = "
            f"{r['pruned_heads'] / r['total_heads']:.1%}; the uniform layout nearest to half, halves rounded down).",
            "",
            "| | original | pruned | reduction |",
            "|---|---|---|---|",
            f"| forward, median s | {r['original_s']:.3f} | {r['pruned_s']:.3f} | "
            f"{drop(r['original_s'], r['pruned_s'])} (speed-up {r['speedup']:.2f}x) |",
            f"| attention FLOPs/token @{r['seq_len']} | {r['flops_before']:,} | {r['flops_after']:,} | "
            f"{drop(r['flops_before'], r['flops_after'])} |",
            f"| attention parameters | {r['attn_params_before']:,} | {r['attn_params_after']:,} | "
            f"{drop(r['attn_params_before'], r['attn_params_after'])} |",
            f"| parameters | {r['params_before']:,} | {r['params_after']:,} | "
            f"{drop(r['params_before'], r['params_after'])} |",
            f"| KV cache bytes/token | {r['kv_before']:,} | {r['kv_after']:,} | {drop(r['kv_before'], r['kv_after'])} |",
            "",
            f"The forward pass also runs the MLPs, embeddings and the 49k-vocabulary LM head, which pruning does not "
            f"touch, so the measured time should fall by less than the attention FLOPs. KV bytes are unchanged: "
            f"query heads go, every KV head keeps a query. Original and pruned forwards alternate "
            f"within each repeat (runs: original {', '.join(f'{t:.2f}' for t in r['original_runs'])} s; pruned "
            f"{', '.join(f'{t:.2f}' for t in r['pruned_runs'])} s).",
        ]
    )
