"""The cache dtypes `headlab info` chooses among, with their bytes per element, torch-free so the CLI builds its
options without importing torch."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}
