"""One `headlab speed` point, context 8,192 x batch 8, for the embedded model and its 3 -> 1 KV conversion (synthetic
cache, 2 decode steps): the measurement quoted in docs/runtimes.md. Prints JSON."""

import json

from headlab.core.loading import from_model, load_model
from headlab.kv.gqa import convert
from headlab.runtimes.speed import SpeedSpec, transformers_point

spec = SpeedSpec(contexts=(8192,), batches=(8,), decode_tokens=2, prefill_limit=2048)
loaded = load_model(None, device="cpu")
rows = {"original": transformers_point(loaded, 8192, 8, spec)}
print(json.dumps(rows), flush=True)
convert(loaded, 1)
rows["3->1 KV"] = transformers_point(from_model(loaded.model, loaded.tokenizer), 8192, 8, spec)
print(json.dumps(rows), flush=True)
