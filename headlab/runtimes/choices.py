"""The runtimes `headlab speed` and the tensor type `export-gguf` choose among, torch-free so the CLI builds its
options without importing torch."""

RUNTIMES = ("transformers", "llama.cpp")
DEFAULT_TYPE = "f16"  # GGUF tensor type of `headlab export-gguf --outtype` (headlab.runtimes.gguf_export)
