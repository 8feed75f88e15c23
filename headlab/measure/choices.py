"""The cache dtypes `headlab info` chooses among, with their bytes per element, and the detection patterns of
`headlab stats --detect`, torch-free so the CLI builds its options without importing torch."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

# Detection patterns of `headlab stats --detect` (TransformerLens head_detector's named patterns, without "_head") and
# its error measures; headlab.measure.detectors implements them.
DETECTION_PATTERN_NAMES = ("previous_token", "duplicate_token", "induction")
ERROR_MEASURES = ("mul", "abs")
