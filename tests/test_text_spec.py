"""TextSpec (headlab.core.data): one spec for the text a command reads, resolved once; the loose keywords of the
earlier API and the earlier option names still work (issue 13: one name for one thing)."""

from __future__ import annotations

import warnings

import pytest
from models import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import Corpus, TextSpec, takes_text
from headlab.core.errors import renamed_keywords
from headlab.core.loading import from_model
from headlab.measure.evaluate import perplexity


def test_resolved_loads_the_corpus_once(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(SAMPLE_TEXT)
    spec = TextSpec(str(path), split="eval", seq_len=16)
    resolved = spec.resolved()
    assert isinstance(resolved.data, Corpus) and resolved.data.spec == str(path)
    assert resolved.resolved() is resolved  # a resolved spec never reads the file again
    path.unlink()
    assert resolved.corpus.documents == [SAMPLE_TEXT]
    assert (resolved.split, resolved.seq_len) == ("eval", 16)


def test_takes_text_maps_loose_and_earlier_keywords():
    @takes_text(seq_len=512, max_tokens=None)
    def reader(*, text, other=0):
        return text, other

    text, other = reader(data="x", part="eval", batch_size=2, other=3)
    assert text == TextSpec("x", None, "eval", 512, 2, None) and other == 3
    base = TextSpec("y", split="all", seq_len=8)
    assert reader(text=base)[0] is base
    assert reader(text=base, corpus="z")[0] == base.but(data="z")  # a loose keyword refines a given spec


def test_perplexity_same_through_text_spec_and_loose_keywords():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    corpus = Corpus("sample", [SAMPLE_TEXT * 4])
    loose = perplexity(loaded, corpus, part="eval", seq_len=32, batch_size=2, max_tokens=128, progress=False)
    spec = TextSpec(corpus, split="eval", seq_len=32, batch_size=2, max_tokens=128)
    assert perplexity(loaded, text=spec, progress=False).perplexity == loose.perplexity


def test_renamed_keywords_warn_and_refuse_both():
    @renamed_keywords(calib_tokens="calibration_tokens")
    def convert(*, calibration_tokens=1):
        return calibration_tokens

    with pytest.warns(DeprecationWarning, match="calibration_tokens"):
        assert convert(calib_tokens=5) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert convert(calibration_tokens=6) == 6
    with pytest.raises(TypeError, match="both"):
        convert(calib_tokens=1, calibration_tokens=2)


def test_cli_calib_tokens_is_a_hidden_deprecated_alias(tmp_path, capsys):
    save_tiny("qwen2", tmp_path / "src")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    base = ["convert-gqa", "--model", tmp_path / "src", "--kv-heads", "1", "--grouping", "similarity", "--no-eval"]
    base += ["--data", corpus, "--seq-len", "32"]
    code, out, err = run_cli([*base, "--calib-tokens", "64", "--out", tmp_path / "old"], capsys)
    assert code == 0, err
    assert "--calib-tokens is deprecated; use --calibration-tokens" in err
    code, out, err = run_cli([*base, "--calibration-tokens", "64", "--out", tmp_path / "new"], capsys)
    assert code == 0 and "deprecated" not in err
    old = (tmp_path / "old" / "model.safetensors").read_bytes()
    assert old == (tmp_path / "new" / "model.safetensors").read_bytes()
    code, out, err = run_cli(
        [*base, "--calib-tokens", "64", "--calibration-tokens", "64", "--out", tmp_path / "x"], capsys
    )
    assert code == 2 and not (tmp_path / "x").exists()
    code, out, err = run_cli(["convert-gqa", "--help"], capsys)
    assert "--calibration-tokens" in out and "--calib-tokens" not in out
