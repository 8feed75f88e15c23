"""The names and defaults `headlab prune` and `sweep` choose among, torch-free so the CLI builds its options without
importing torch."""

MODES = ("mask", "physical")  # zero heads in place, or slice them out of the projections (headlab.pruning.prune)
# Calibration tokens for the scores, the OBS statistics and the --compensate refit. The refit estimates an
# (H*D + 1)-row map per layer from the calibration Gram: at 2,048 tokens SmolLM2's 577 dimensions get 3.5 tokens
# each and the held-out ridge has to shrink hard; 8,192 gives about 14 per dimension. Measured on the embedded model
# (docs/selection.md, "How many calibration tokens"): 90 heads uniform + --compensate gives 12.35 at 8,192 against
# 12.50 at 16,384 (the earlier default) and 13.04 at 4,096; the gradient scores alone need no more than 4,096. 8,192
# halves the first run's cost (one gradient pass and, with --compensate, one forward over these tokens). Wider
# models want more (docs/selection.md).
DEFAULT_CALIBRATION_TOKENS = 8192
# What one pruning step removes, how the heads are chosen and how many per layer (headlab.pruning.selection).
UNITS = ("head", "kv-group")
SELECTS = ("rank", "fisher-block", "obs")
BUDGETS = ("global", "per-layer", "uniform", "search")
DEFAULT_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # fractions of heads a pruning sweep prunes (headlab.pruning.sweep)
