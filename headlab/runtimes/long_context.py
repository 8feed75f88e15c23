"""Long-context prompts on llama.cpp: the same token ids transformers gets (the HF tokenizer's encoding of each
prompt, no special tokens) and the same greedy decode, so a GGUF file is scored on exactly headlab's prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from headlab.core.loading import LoadedModel
from headlab.measure.long_tasks import LongPrompt
from headlab.runtimes.llamacpp import Sequences


def llamacpp_generate(loaded: LoadedModel, gguf_path: Path):
    """A `generate` for headlab.measure.longctx.long_context that runs each prompt through llama.cpp on
    `gguf_path`: one prefill, then greedy steps (argmax of the logits) until max_new_tokens or an end-of-sequence
    token, decoded with the model's tokenizer as transformers' path decodes."""
    tokenizer = loaded.tokenizer
    stops = {tokenizer.eos_token_id} - {None}

    def generate(prompts: list[LongPrompt], max_new_tokens: int) -> list[str]:
        texts = []
        for prompt in prompts:
            ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
            runner = Sequences(Path(gguf_path), per_sequence=len(ids) + max_new_tokens, count=1)
            try:
                runner.prefill(0, ids)
                generated: list[int] = []
                for step in range(max_new_tokens):
                    token = int(np.argmax(runner.logits(-1)))  # -1: the last token of the last decode
                    if token in stops:
                        break
                    generated.append(token)
                    if step + 1 < max_new_tokens:
                        runner.step([token], len(ids) + step)
            finally:
                runner.close()
            texts.append(tokenizer.decode(generated, skip_special_tokens=True))
        return texts

    return generate


__all__ = ["llamacpp_generate"]
