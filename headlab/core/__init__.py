"""The ground every wing stands on: architecture adapters, loading (with float32 products for 16-bit models on CPUs
without 16-bit kernels), corpora and windows, checkpoints, head layouts, validation, tables and atomic files, data
parallelism, the one error type. Imports nothing above it.
"""

__all__ = [
    "arch",
    "checkpoint",
    "corpora",
    "cpu_attention",
    "cpu_matmul",
    "data",
    "distributed",
    "errors",
    "fsio",
    "layout",
    "loading",
    "model_names",
    "registry",
    "reload_stream",
    "shapes",
    "streaming",
    "tables",
    "units",
    "validate",
]
