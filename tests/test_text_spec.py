"""TextSpec (headlab.core.data): one spec for the text a command reads, resolved once; the loose keywords of the
earlier API and the earlier option names still work (issue 13: one name for one thing)."""

from __future__ import annotations

from models import tiny_model
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core.data import Corpus, TextSpec, takes_text
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


def test_takes_text_maps_loose_keywords_onto_the_spec():
    @takes_text(seq_len=512, max_tokens=None)
    def reader(*, text, other=0):
        return text, other

    text, other = reader(data="x", split="eval", batch_size=2, other=3)
    assert text == TextSpec("x", None, "eval", 512, 2, None) and other == 3
    base = TextSpec("y", split="all", seq_len=8)
    assert reader(text=base)[0] is base
    assert reader(text=base, data="z")[0] == base.but(data="z")  # a loose keyword refines a given spec


def test_perplexity_same_through_text_spec_and_loose_keywords():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    corpus = Corpus("sample", [SAMPLE_TEXT * 4])
    loose = perplexity(loaded, corpus, split="eval", seq_len=32, batch_size=2, max_tokens=128, progress=False)
    spec = TextSpec(corpus, split="eval", seq_len=32, batch_size=2, max_tokens=128)
    assert perplexity(loaded, text=spec, progress=False).perplexity == loose.perplexity
