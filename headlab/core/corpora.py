"""The built-in corpora: seven text domains shipped with headlab, and `broad`, the default calibration corpus that
mixes four of them.

Domains (headlab/core/corpus_texts, rebuilt by scripts/build_corpora.py; sources and licences in docs/corpora.md):
- in `broad` (calibration and the in-domain evaluation): prose (Moby-Dick), dialogue (three Shakespeare plays),
  code (Python standard-library modules), docs (the Python language reference);
- held out (never in a built-in calibration corpus; the out-of-domain evaluation): speeches (State of the Union
  addresses), encyclopedia (Britannica 1911), poetry (Shakespeare's sonnets, Milton).

Every domain is cut like any corpus (headlab.core.data.split_text: calibration before the first line break at or
after half its characters, evaluation after it). `broad` cuts each of its domains that way, slices both halves into
chunks of about CHUNK_CHARS characters at line breaks, and orders the chunks of each half by their relative position
in their domain, so any prefix of the calibration part (the first 8,192 tokens, the held-out tail) holds every domain
in about equal shares. Its calibration part is all the calibration chunks, its eval part all the eval chunks: the two
never share a character, and the cut is recorded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
from dataclasses import dataclass
from pathlib import Path

from headlab.core.errors import HeadlabError

TEXTS = Path(__file__).with_name("corpus_texts")
BROAD = "broad"
CHUNK_CHARS = 2000  # about 500 tokens: a few chunks of every domain in each 4,096-token stretch of `broad`


@dataclass(frozen=True)
class Domain:
    """One shipped text domain: its name, what it is, and whether `broad` (the default calibration) includes it."""

    name: str
    description: str
    in_broad: bool


DOMAINS = {
    d.name: d
    for d in (
        Domain("prose", "Melville, Moby-Dick (1851), the first chapters", True),
        Domain("dialogue", "Shakespeare: As You Like It, Hamlet, Henry V", True),
        Domain("code", "Python standard-library source (argparse, dataclasses, difflib, ...)", True),
        Domain("docs", "the Python language reference (pydoc topics)", True),
        Domain("speeches", "State of the Union addresses, 1900-2021", False),
        Domain("encyclopedia", "Encyclopaedia Britannica (1911), the article on Shakespeare", False),
        Domain("poetry", "Shakespeare's sonnets, Milton's Paradise Lost", False),
    )
}
BROAD_DOMAINS = tuple(name for name, d in DOMAINS.items() if d.in_broad)
HELD_OUT_DOMAINS = tuple(name for name, d in DOMAINS.items() if not d.in_broad)
# The out-of-domain texts every trade table reports beside the calibration corpus (`eval --domains`, the report,
# recovery's record, the benchmark cases): two held-out domains unlike each other (modern oratory, expository prose).
DEFAULT_EVAL_DOMAINS = ("speeches", "encyclopedia")
BUILTIN = (BROAD, *DOMAINS)


@functools.cache
def sources() -> dict:
    """SOURCES.json: per domain its archive, selection, characters and sha256; per archive its package and licence."""
    return json.loads((TEXTS / "SOURCES.json").read_text())


@functools.cache
def domain_text(name: str) -> str:
    """The shipped text of one domain, checked against its recorded sha256 (a damaged install fails here)."""
    if name not in DOMAINS:
        raise HeadlabError(f"unknown domain {name!r}; use one of {', '.join(DOMAINS)}")
    try:
        text = lzma.decompress((TEXTS / f"{name}.txt.xz").read_bytes()).decode("utf-8")
    except (OSError, lzma.LZMAError) as error:
        raise HeadlabError(f"cannot read headlab's {name} text ({error}); reinstall headlab") from None
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != sources()["domains"][name]["sha256"]:
        raise HeadlabError(f"headlab's {name} text differs from its recorded sha256; reinstall headlab")
    return text


def half_cut(text: str, fraction: float) -> int:
    """The calibration/eval cut of a text: the first line break at or after `fraction` of its characters."""
    cut = text.find("\n", int(len(text) * fraction))
    return cut if cut > 0 else int(len(text) * fraction)


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of at least `size` characters, at the first paragraph break (blank line) after that,
    or at a line break where no paragraph ends within 3 x size; pieces lose their edge line breaks, so joining them
    with blank lines gives the text back wherever it was cut at a paragraph break."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        if end < 0 or end - start > 3 * size:
            end = text.find("\n", start + size)
        end = len(text) if end < 0 else end
        pieces.append(text[start:end].strip("\n"))
        start = end + 1
    return [p for p in pieces if p.strip()]


def interleave(parts: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(domain, chunk) pairs ordered by each chunk's relative position in its domain (ties in domain order), so every
    stretch of the result holds every domain in proportion."""
    order = {name: rank for rank, name in enumerate(parts)}
    keyed = [
        ((i + 0.5) / len(pieces), order[name], name, piece)
        for name, pieces in parts.items()
        for i, piece in enumerate(pieces)
    ]
    return [(name, piece) for *_, name, piece in sorted(keyed, key=lambda k: k[:2])]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def domain_halves(name: str, fraction: float) -> tuple[str, str]:
    """(calibration, eval) text of one domain, cut as split_text cuts any corpus."""
    text = domain_text(name)
    cut = half_cut(text, fraction)
    return text[:cut], text[cut:]


def broad_documents(fraction: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    """`broad`: (calibration chunks, eval chunks, record), chunks as (domain, text): the BROAD_DOMAINS' halves,
    chunked and interleaved."""
    halves = {name: domain_halves(name, fraction) for name in BROAD_DOMAINS}
    calibration = interleave({name: chunks(cal) for name, (cal, _) in halves.items()})
    evaluation = interleave({name: chunks(ev) for name, (_, ev) in halves.items()})
    record = {
        "domains": {
            name: {
                "description": DOMAINS[name].description,
                "calibration_chars": len(cal),
                "eval_chars": len(ev),
                "calibration_sha256": digest(cal),
                "eval_sha256": digest(ev),
                "calibration_chunks": sum(1 for d, _ in calibration if d == name),
            }
            for name, (cal, ev) in halves.items()
        },
        "chunk_chars": CHUNK_CHARS,
        "held_out_domains": list(HELD_OUT_DOMAINS),
    }
    return calibration, evaluation, record


def licences() -> dict[str, str]:
    """Domain -> the licence of its source package (and of the work)."""
    archives = sources()["archives"]
    return {name: archives[entry["archive"]]["licence"] for name, entry in sources()["domains"].items()}
