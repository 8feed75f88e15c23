"""The ground every wing stands on: architecture adapters, loading, corpora and windows, checkpoints, head
layouts, validation, tables and atomic files, data parallelism, the one error type. Imports nothing above it.
"""

__all__ = [
    "arch",
    "checkpoint",
    "corpora",
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
