"""A character-level tokenizer for tiny test models, and saved tiny checkpoints for CLI tests (no download)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[CLS]", "[SEP]", "[MASK]"]
FIRST_CHAR_ID = 10  # ids below are specials or reserved; printable ASCII 32..126 -> 10..104 (fits vocab 128)


def tiny_tokenizer(encoder: bool = False) -> PreTrainedTokenizerFast:
    """Printable ASCII characters as tokens; BOS <s>=1, EOS </s>=2 (causal) or [CLS]/[SEP]/[MASK] (encoder)."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({chr(c): FIRST_CHAR_ID + c - 32 for c in range(32, 127)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    if encoder:
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            unk_token="<unk>",
            pad_token="<pad>",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def save_tiny(name: str, directory: Path, **overrides) -> Path:
    """Save the tiny model `name` (tests/models.py) with a matching tokenizer as a checkpoint directory."""
    from models import ENCODER_TYPES, tiny_model

    model = tiny_model(name, **overrides)
    model.save_pretrained(directory)
    tiny_tokenizer(encoder=name in ENCODER_TYPES).save_pretrained(directory)
    return Path(directory)


SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Attention heads read keys and values; some of them matter.\n"
    "Pruning removes heads, pooling shares keys and values between them, and perplexity prices the change.\n"
) * 8


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `headlab ARGS` in-process; returns (exit code, stdout, stderr)."""
    import pytest

    from headlab.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def parity_generate(loaded, prompts, max_new_tokens: int) -> list[str]:
    """A stand-in for headlab.measure.longctx.transformers_generate that depends on the model as it is now: the right
    answer when the model's next-token choice after the prompt is even, nothing otherwise (a random tiny model never
    decodes a pass key, so real decoding scores 0 everywhere)."""
    import torch  # start-up: the tokenizer helpers above do not need torch

    texts = []
    for prompt in prompts:
        ids = torch.tensor([loaded.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            token = int(loaded.model(input_ids=ids).logits[0, -1].argmax())
        texts.append(prompt.answers[0] if token % 2 == 0 else "")
    return texts


def launch_headlab(args: list, nproc: int | None, **env_vars: str):
    """`headlab ARGS` under torchrun with `nproc` CPU processes (gloo), or as one plain process (nproc None);
    `env_vars` are added to the environment."""
    import os
    import subprocess
    import sys

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_vars}
    launcher = torchrun if nproc is not None else [sys.executable]
    return subprocess.run(
        [*launcher, "-m", "headlab", *map(str, args)], capture_output=True, text=True, env=env, timeout=240
    )


def saved_kv_pair(root: Path) -> tuple[Path, Path, Path]:
    """(teacher dir, student dir, corpus file) under `root`: the tiny llama and its 2 -> 1 KV-head mean-pooled copy,
    saved with the tiny tokenizer, and a text file to train on."""
    from transformers import AutoModelForCausalLM

    from headlab.core.loading import from_model
    from headlab.kv import gqa

    teacher = save_tiny("llama", root / "teacher")
    student = from_model(AutoModelForCausalLM.from_pretrained(teacher))
    gqa.convert(student, 1)
    student.model.save_pretrained(root / "student")
    tiny_tokenizer().save_pretrained(root / "student")
    corpus = root / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 6)
    return teacher, root / "student", corpus
