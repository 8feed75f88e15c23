"""What a model is and does, measured without changing it: per-head statistics, head importance,
perplexity, and costs (parameters, FLOPs, KV-cache bytes).
"""

__all__ = ["choices", "costs", "evaluate", "importance", "importance_methods", "stats"]
