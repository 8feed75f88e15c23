"""The cache dtypes `headlab info` chooses among, with their bytes per element, the detection patterns of
`headlab stats --detect` and `headlab show`'s top-k defaults, torch-free so the CLI builds its options without
importing torch."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

# Detection patterns of `headlab stats --detect` (TransformerLens head_detector's named patterns, without "_head") and
# its error measures; headlab.measure.detectors implements them.
DETECTION_PATTERN_NAMES = ("previous_token", "duplicate_token", "induction")
ERROR_MEASURES = ("mul", "abs")

# `headlab show` (headlab.measure.attention_view): keys kept per query and head, the most a page stores (one byte per
# row count), and the default text length (capped by the model's positions).
DEFAULT_TOP_K = 32
MAX_TOP_K = 255
DEFAULT_SHOW_TOKENS = 2048

# Tokens per forward of the chunked perplexity a quantized --kv-cache runs (`headlab eval --kv-chunk`).
DEFAULT_KV_CHUNK = 64
