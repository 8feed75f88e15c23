"""Head pruning: score sources, selection (ranking, OBS, budgets), prune itself and pruning sweeps."""

__all__ = ["obs", "prune", "scores", "selection", "sweep"]
