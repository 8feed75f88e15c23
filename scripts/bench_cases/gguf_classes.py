"""Where a Q8_0 file's perplexity gap comes from: the embedded model, MLA at the MQA budget and MLA at the GQA budget
(as the gguf case builds them), each exported as Q8_0 with every matrix quantized, then with one class of matrices
quantized alone (the rest f32): the feed-forward matrices, the attention matrices (query, output, and MLA's k_b /
v_b), the token embedding (tied to the output). llama.cpp's perplexity against transformers' on the gguf case's
windows. The classes are chosen through the export plan's f32 list (`ExportPlan.kept_f32`), which is what keeps
MLA's folded latent projections f32 in every file type."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

TITLE = "Q8_0 in llama.cpp: which matrices carry the perplexity gap (original and MLA)"
FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
ATTENTION = ("attn_q.weight", "attn_output.weight", "attn_k.weight", "attn_v.weight", "attn_k_b.weight",
             "attn_v_b.weight", "attn_kv_b.weight")  # fmt: skip
MAX_TOKENS, SEQ_LEN = 4096, 256  # the gguf case's windows
CLASSES = {"every matrix": None, "feed-forward only": FFN, "attention only": ATTENTION,
           "token embedding only": ("token_embd.weight",)}  # fmt: skip


@contextlib.contextmanager
def _quantizing_only(names):
    """Export plans keep every matrix f32 except those named (GGUF names, "blk.N." stripped); None: the plan's own."""
    from headlab.runtimes import gguf_export

    original = gguf_export.ExportPlan.kept_f32
    if names is not None:
        short = lambda name: name.split(".", 2)[-1] if name.startswith("blk.") else name  # noqa: E731
        gguf_export.ExportPlan.kept_f32 = lambda plan, name: original(plan, name) or short(name) not in names
    try:
        yield
    finally:
        gguf_export.ExportPlan.kept_f32 = original


def _mla(budget):
    def build(loaded):
        from headlab.core.data import calibration_batches
        from headlab.kv.mla import convert_to_mla, fold_latent_norm, plan_mla

        batches = calibration_batches(loaded.tokenizer, None, seq_len=512, batch_size=4, max_tokens=2048)
        mla, _ = convert_to_mla(loaded, plan_mla(loaded, budget), batches, progress=False)
        fold_latent_norm(mla.model)
        return mla

    return build


MODELS = {"original": lambda loaded: loaded, "MLA 64+64 (--budget mqa)": _mla("mqa"),
          "MLA 320+64 (--budget gqa)": _mla("gqa")}  # fmt: skip


def run(args) -> dict:
    import tempfile

    from gguf import GGMLQuantizationType, GGUFReader

    from headlab.core.loading import from_model, load_model
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs, eval_windows, unavailable

    if unavailable():
        return {"skipped": unavailable(), "rows": []}
    rows = []
    for label, build in MODELS.items():
        loaded = build(load_model(None, device="cpu"))
        loaded = from_model(loaded.model, loaded.tokenizer)
        windows = eval_windows(loaded, max_tokens=MAX_TOKENS, seq_len=SEQ_LEN)
        for part, names in CLASSES.items():
            with tempfile.TemporaryDirectory() as tmp, _quantizing_only(names):
                path = Path(tmp) / "m.gguf"
                export_gguf(loaded, path, outtype="q8_0", progress=False)
                quantized = sorted({t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
                                    for t in GGUFReader(str(path)).tensors
                                    if t.tensor_type == GGMLQuantizationType.Q8_0})  # fmt: skip
                result = compare_logprobs(loaded, path, windows)
            signed = result["perplexity_llamacpp"] / result["perplexity_transformers"] - 1
            rows.append(
                {"model": label, "quantized": part, "classes": quantized, "signed_difference": signed, **result}
            )
            print(rows[-1], flush=True)
    return {"max_tokens": MAX_TOKENS, "seq_len": SEQ_LEN, "rows": rows}


def markdown(r: dict) -> str:
    if r.get("skipped"):
        return f"Not measured: {r['skipped']}"
    lines = [
        f"Embedded SmolLM2-135M, the eval split's first {r['max_tokens']} tokens in windows of {r['seq_len']} (the gguf "
        "case's), llama.cpp against transformers (float32) on the same ids; Q8_0 (headlab's numpy quantizer) for the "
        "classes named, f32 for every other matrix. `difference`: llama.cpp's perplexity over transformers', less 1.",
        "",
        "| model | Q8_0 matrices | ppl transformers | ppl llama.cpp | difference | worst abs logit diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['quantized']} ({', '.join(c.removesuffix('.weight') for c in row['classes'])}) | "
            f"{row['perplexity_transformers']:.4f} | {row['perplexity_llamacpp']:.4f} | "
            f"{100 * row['signed_difference']:+.3f}% | {row['max_abs_logit_diff']:.2f} |"
        )
    return "\n".join(lines)
