"""What a model is and does, measured without changing it: per-head statistics, head importance,
perplexity, long-context retrieval and NLL by position, and costs (parameters, FLOPs, KV-cache bytes).
"""

__all__ = [
    "choices",
    "costs",
    "evaluate",
    "importance",
    "importance_methods",
    "long_tasks",
    "longctx",
    "stats",
]
