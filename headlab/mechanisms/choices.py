"""The defaults `headlab stats` chooses among and the KV caches of `--kv-cache`, torch-free so the CLI builds its
options without importing torch."""

DEFAULT_CHUNK = 256  # query rows per chunk: B*H*256*T float32 scores at most live at once

# `--kv-cache` of eval, longeval and speed (headlab.mechanisms.quantized_cache): name -> (transformers'
# QuantizedCache backend, bits, the module the backend needs). "full" is transformers' DynamicCache in the model's dtype; the bits are what
# each backend accepts in transformers 5 (quanto: 2 and 4; HQQ: 1, 2, 3, 4 and 8; fp8: float8_e4m3fn, per tensor).
KV_CACHES = {
    "full": (None, None, None),
    "fp8": ("fp8", 8, None),
    "quanto-int4": ("quanto", 4, "optimum.quanto"),
    "quanto-int2": ("quanto", 2, "optimum.quanto"),
    "hqq-int8": ("hqq", 8, "hqq"),
    "hqq-int4": ("hqq", 4, "hqq"),
    "hqq-int3": ("hqq", 3, "hqq"),
    "hqq-int2": ("hqq", 2, "hqq"),
    "hqq-int1": ("hqq", 1, "hqq"),
}
KV_CACHE_INSTALL = "pip install 'headlab[kvquant]'"
