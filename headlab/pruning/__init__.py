"""Head pruning: score sources, selection (ranking, OBS, budgets), prune itself and pruning sweeps."""

__all__ = ["choices", "obs", "prune", "score_sources", "scores", "selection", "streaming", "sweep"]
