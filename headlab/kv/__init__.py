"""KV-cache compression: KV-head grouping and pooling, calibrated merges, GQA and MLA conversion, the streaming
converter and the KV ladder.
"""

__all__ = ["budget", "duo_gates", "gqa", "grouping", "ladder", "layer_rope", "merge", "methods", "mla", "mla_streaming", "policy", "post_norms", "streaming"]
