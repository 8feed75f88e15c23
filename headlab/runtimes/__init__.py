"""Other runtimes and measured speed: GGUF export, llama.cpp, lm-evaluation-harness, prefill/decode timings."""

__all__ = [
    "choices",
    "gguf_export",
    "gptq",
    "imatrix",
    "llamacpp",
    "lm_eval_bridge",
    "long_context",
    "smoothing",
    "speed",
]
