"""The names and defaults `headlab prune` and `sweep` choose among, torch-free so the CLI builds its options without
importing torch."""

MODES = ("mask", "physical")  # zero heads in place, or slice them out of the projections (headlab.pruning.prune)
# Calibration tokens for the scores, the OBS statistics and the --compensate refit. The refit estimates an
# (H*D + 1)-row map per layer from the calibration Gram: at 2,048 tokens SmolLM2's 577 dimensions get 3.5 tokens
# each, the held-out ridge has to shrink hard, and both the choice and the refit are noisy; 16,384 gives about 28
# per dimension. Measured (docs/selection.md): lower perplexity on the corpus and on text outside it, for every
# method; the cost is one gradient pass and one forward over these tokens. Wider models want more (docs/selection.md).
DEFAULT_CALIBRATION_TOKENS = 16384
# What one pruning step removes, how the heads are chosen and how many per layer (headlab.pruning.selection).
UNITS = ("head", "kv-group")
SELECTS = ("rank", "fisher-block", "obs")
BUDGETS = ("global", "per-layer", "uniform", "search")
DEFAULT_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # fractions of heads a pruning sweep prunes (headlab.pruning.sweep)
