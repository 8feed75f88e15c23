"""What a model is and does, measured without changing it: per-head statistics and head detectors, head
importance, direct logit attribution and activation patching per head, perplexity, long-context retrieval and NLL by
position, in-context copying of random tokens, costs (parameters, FLOPs, KV-cache bytes), and the top-k attention of every head on a text
(`headlab show`).
"""

__all__ = [
    "attention_view",
    "attribution",
    "choices",
    "copying",
    "costs",
    "detectors",
    "evaluate",
    "importance",
    "importance_methods",
    "long_tasks",
    "longctx",
    "stats",
]
