"""The defaults `headlab stats` chooses among and the KV caches of `--kv-cache`, torch-free so the CLI builds its
options without importing torch."""

DEFAULT_CHUNK = 256  # query rows per chunk: B*H*256*T float32 scores at most live at once

# `--kv-cache` of eval, longeval and speed (headlab.mechanisms.quantized_cache): name -> (transformers'
# QuantizedCache backend, bits, the module the backend needs, grouping). "full" is transformers' DynamicCache in the
# model's dtype; the bits are what each backend accepts in transformers 5 (quanto: 2 and 4; HQQ: 1, 2, 3, 4 and 8;
# fp8: float8_e4m3fn, per tensor). Grouping "transformers": its defaults (quanto: groups of 64 numbers within one
# token, keys and values alike); "kivi": KIVI's (Liu et al. 2024), a cache slot holding keys alone quantized per
# channel over 64 tokens, any other per token (quantized_cache.kivi_axes).
KV_CACHES = {
    "full": (None, None, None, "transformers"),
    "fp8": ("fp8", 8, None, "transformers"),
    "quanto-int4": ("quanto", 4, "optimum.quanto", "transformers"),
    "quanto-int2": ("quanto", 2, "optimum.quanto", "transformers"),
    "quanto-int4-kivi": ("quanto", 4, "optimum.quanto", "kivi"),
    "quanto-int2-kivi": ("quanto", 2, "optimum.quanto", "kivi"),
    "hqq-int8": ("hqq", 8, "hqq", "transformers"),
    "hqq-int4": ("hqq", 4, "hqq", "transformers"),
    "hqq-int3": ("hqq", 3, "hqq", "transformers"),
    "hqq-int2": ("hqq", 2, "hqq", "transformers"),
    "hqq-int1": ("hqq", 1, "hqq", "transformers"),
}
KV_CACHE_INSTALL = "pip install 'headlab[kvquant]'"
