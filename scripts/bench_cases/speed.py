"""Decode and prefill speed with a KV cache (`headlab speed`): the embedded model against a 3 -> 1 KV conversion and
a uniform prune of a third of the query heads, at contexts 512 / 2,048 / 8,192 and batch 1 / 8, in transformers
and llama.cpp."""

from __future__ import annotations

from pathlib import Path

TITLE = "Speed: prefill and decode tokens/s, KV-cache bytes and peak memory (`headlab speed`)"
CONTEXTS, BATCHES, DECODE_TOKENS, PREFILL_LIMIT = (512, 2048, 8192), (1, 8), 4, 2048


def run(args) -> dict:
    import pandas as pd

    from headlab.core.loading import from_model, load_model
    from headlab.kv.gqa import convert
    from headlab.pruning.prune import apply_physical, physical_layout, prepare_config
    from headlab.runtimes.speed import SpeedSpec, measure_model, relative_to_first

    spec = SpeedSpec(CONTEXTS, BATCHES, DECODE_TOKENS, PREFILL_LIMIT)

    def pruned(loaded):
        layout = physical_layout(loaded.layers, [{0, 3, 6} for _ in loaded.layers])
        apply_physical(loaded, layout)
        prepare_config(loaded, layout)

    edits = [
        ("original (9 q / 3 KV)", lambda m: None),
        ("3 -> 1 KV (9 q / 1 KV)", lambda m: convert(m, 1)),
        ("pruned (6 q / 3 KV)", pruned),
    ]
    frames = []
    for label, edit in edits:
        loaded = load_model(None, device=args.device)
        edit(loaded)
        frames.append(measure_model(from_model(loaded.model, loaded.tokenizer), label, spec, progress=False))
        del loaded
    table = relative_to_first(pd.concat(frames, ignore_index=True))
    write_figure(table)
    rows = [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
        for row in table.to_dict("records")
    ]
    return {"spec": spec.to_dict(), "rows": rows}


FIGURE = Path(__file__).resolve().parents[2] / "docs" / "images" / "speed_decode.png"


def write_figure(table) -> None:
    """The decode plot `headlab speed --out` writes, for docs/runtimes.md (docs/images/speed_decode.png)."""
    import matplotlib.pyplot as plt

    from headlab.viz.plots import figure_bytes, plot_speed

    figure = plot_speed(table, "decode speed with a KV cache (embedded model, 2-core CPU)")
    FIGURE.write_bytes(figure_bytes(figure))
    plt.close(figure)


def markdown(r: dict) -> str:
    s = r["spec"]
    mib = 2**20
    lines = [
        f"Embedded SmolLM2-135M (float32) and two edits of it; {s['decode_tokens']} timed greedy decode steps per point "
        f"after the cache holds `context` tokens. Points above {s['prefill_limit']:,} tokens (context x batch) get a "
        "cache of random keys/values instead of a timed prefill (`cache_fill` synthetic; decode is still measured on "
        "the full cache). llama.cpp: f32 weights, f16 KV cache allocated for the whole context, one KV stream per "
        "sequence; above the same limit only the first sequence is prefilled and its cache copied into the others "
        "(`cache_fill` copied: real cells, the same decode cost). "
        "The CPU machine was shared with other jobs: read ratios within a row group, not absolute speeds.",
        "",
        "| model | runtime | context | batch | prefill tok/s | decode tok/s | decode vs original | KV cache held | "
        "KV vs original | peak RSS | cache |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        prefill = "-" if row["prefill_tokens_per_s"] is None else f"{row['prefill_tokens_per_s']:,.0f}"
        lines.append(
            f"| {row['model']} | {row['runtime']} | {row['context']:,} | {row['batch']} | {prefill} | "
            f"{row['decode_tokens_per_s']:,.1f} | {row['decode_speedup']:.2f}x | {row['kv_cache_bytes'] / mib:,.1f} MiB | "
            f"{row['kv_ratio']:.2f}x | {row['peak_memory_bytes'] / mib:,.0f} MiB | {row['cache_fill']} |"
        )
    return "\n".join(lines)
