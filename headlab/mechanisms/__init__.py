"""How headlab reaches inside a running model: the one hook primitive, head gates, the attention-capture
function, restoring context managers, activation recompute and chunked losses.
"""

__all__ = ["capture", "choices", "gates", "head_cache", "hooks", "losses", "quantized_cache", "recompute", "restore"]
