"""Corpora, the deterministic calibration/evaluation split, and the token windows every command runs on.

A corpus is a list of documents joined with blank lines. The joined text is cut once, at the first line break at
or after `calibration_fraction` of its characters (or at a cut the corpus records, as the built-in `broad` does):
calibration text (statistics, importance) comes before the cut, evaluation text (perplexity) after it, so the two
never share a character. The built-in corpora are in headlab.core.corpora.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from headlab.core import corpora
from headlab.core.errors import HeadlabError

if TYPE_CHECKING:  # annotations only; torch itself loads inside the functions that make tensors
    import torch

DEFAULT_CORPUS = "broad"  # headlab.core.corpora: prose, dialogue, code and docs, interleaved
EMBEDDED_CORPUS = "pydoc-topics"  # the Python language reference alone (the default before the broad corpus)
PARTS = ("calibration", "eval", "all")
CALIBRATION_FRACTION = 0.5
# Fewer tokens than this make a perplexity or a statistic meaningless: such a corpus part is refused as too short.
MIN_TOKENS = 16
DOCUMENT_SEPARATOR = "\n\n"
MLM_PROBABILITY = 0.15
MLM_SEED = 0  # the fixed seed of the masked-LM masking (perplexity and importance)


@dataclass
class Corpus:
    """Documents of one corpus, with where they came from."""

    spec: str
    documents: list[str]
    meta: dict = field(default_factory=dict)
    cut: int | None = None  # where evaluation text starts (None: the first line break after CALIBRATION_FRACTION)
    document_domains: list[str] | None = None  # the domain of each document (built-in `broad`), else None

    @property
    def text(self) -> str:
        return DOCUMENT_SEPARATOR.join(self.documents)


@dataclass
class TextPart:
    """The part of a corpus a command uses, with the character range that defines it."""

    text: str
    part: str
    start: int  # character offsets into the joined corpus text
    end: int
    corpus: str

    def describe(self) -> dict:
        return {
            "data": self.corpus,
            "split": self.part,
            "char_start": self.start,
            "char_end": self.end,
            "calibration_fraction": CALIBRATION_FRACTION,
        }


@dataclass(frozen=True)
class TextSpec:
    """Which text a command reads and how it is cut: a corpus (`data`: a spec string, or a Corpus once resolved),
    its column, the part of it (`split`: calibration | eval | all), windows of `seq_len` tokens taken `batch_size`
    at a time, and at most `max_tokens` tokens (None: no bound, or the reader's own default)."""

    data: Corpus | str | None = None
    text_column: str | None = None
    split: str = "calibration"
    seq_len: int = 256
    batch_size: int = 4
    max_tokens: int | None = 2048

    def resolved(self) -> TextSpec:
        """The same spec with its corpus loaded, so every later reader shares one Corpus (a command loads once)."""
        return self if isinstance(self.data, Corpus) else replace(self, data=load_corpus(self.data, self.text_column))

    @property
    def corpus(self) -> Corpus:
        return self.resolved().data

    @property
    def corpus_name(self) -> str:
        """The corpus spec as records name it, without loading the corpus."""
        return self.data.spec if isinstance(self.data, Corpus) else (self.data or DEFAULT_CORPUS)

    def but(self, **changes) -> TextSpec:
        """A copy with some fields changed (e.g. the eval split with its own token budget)."""
        return replace(self, **changes)

    def batches(self, tokenizer, *, seq_len: int | None = None, max_positions: int | None = None):
        """Its windows as CalibrationBatches; `seq_len` overrides the window length (encoders keep 2 for
        [CLS]/[SEP])."""
        return calibration_batches(
            tokenizer,
            self.corpus,
            split=self.split,
            seq_len=self.seq_len if seq_len is None else seq_len,
            batch_size=self.batch_size,
            max_tokens=self.max_tokens,
            max_positions=max_positions,
        )


# The keywords a TextSpec carries, which a function taking `text` also accepts one by one.
TEXT_KEYWORDS = ("data", "text_column", "split", "seq_len", "batch_size", "max_tokens")


def takes_text(**defaults):
    """Let a function take its text as one `text: TextSpec` (with these defaults), or any of its fields one by one
    (data, text_column, split, seq_len, batch_size, max_tokens) on top of it: `evaluate(loaded, seq_len=128)`."""
    default = TextSpec(**defaults)

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, text: TextSpec | None = None, **kwargs):
            loose = {name: kwargs.pop(name) for name in TEXT_KEYWORDS if name in kwargs}
            text = default if text is None else text
            return function(*args, text=replace(text, **loose) if loose else text, **kwargs)

        wrapper.text_defaults = default
        return wrapper

    return decorate


def _embedded_documents() -> list[str]:
    from pydoc_data.topics import topics  # start-up: a large module, read only when the embedded corpus is used

    return [topics[key] for key in sorted(topics)]


def _read_table(path: Path, text_column: str | None) -> list[str]:
    import pandas as pd  # start-up: the CLI imports this module; only table corpora need pandas

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, text_column)
    try:
        if suffix == ".csv":  # CSV cells are text: read the column as str so "1984" stays a string, not a number
            frame = pd.read_csv(path, dtype={text_column or "text": str}, keep_default_na=False, na_values=[""])
        else:
            frame = pd.read_parquet(path)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read {path}: {str(error).splitlines()[0]}") from None
    return _column(frame.to_dict("list"), text_column, str(path), first_row=2 if suffix == ".csv" else 0)


def _read_jsonl(path: Path, text_column: str | None) -> list[str]:
    """One JSON object per line; read with json (pandas would turn "1984" into a number and hide the line)."""
    column = text_column or "text"
    values, columns = [], {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read {path}: {str(error).splitlines()[0]}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise HeadlabError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict):
            raise HeadlabError(f"{path}:{number}: not a JSON object, a {type(record).__name__}")
        columns.update(dict.fromkeys(record))
        values.append(record.get(column))
    if column not in columns:
        raise HeadlabError(
            f"{path} has no column {column!r}; columns: {', '.join(map(str, columns))} (use text_column)"
        )
    return _column({column: values}, text_column, str(path), first_row=1)


def _column(table: dict, text_column: str | None, where: str, first_row: int = 0) -> list[str]:
    """The text column's strings; missing cells (None, NaN) are skipped, any other non-string is refused with its
    row (line of a .jsonl or .csv file, 0-based index otherwise): numbers, lists or dicts are not text to score."""
    column = text_column or "text"
    if column not in table:
        raise HeadlabError(f"{where} has no column {column!r}; columns: {', '.join(map(str, table))} (use text_column)")
    texts = []
    for row, value in enumerate(table[column], start=first_row):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if not isinstance(value, str):
            kind = "row" if first_row == 0 else "line"
            raise HeadlabError(
                f"{where}: {kind} {row}: column {column!r} holds a {type(value).__name__} ({str(value)[:40]!r}), "
                "not text"
            )
        texts.append(value)
    return texts


def _builtin_corpus(spec: str) -> Corpus:
    """`broad` (the default) or one shipped domain (headlab.core.corpora), with its sources, licences and hashes."""
    if spec == corpora.BROAD:
        calibration, evaluation, record = corpora.broad_documents(CALIBRATION_FRACTION)
        cut = len(DOCUMENT_SEPARATOR.join(piece for _, piece in calibration))
        domains = ", ".join(corpora.BROAD_DOMAINS)
        meta = {"source": f"headlab built-in corpus broad ({domains})", "cut": cut, **record}
        pairs = calibration + evaluation
        return Corpus(spec, [piece for _, piece in pairs], meta, cut=cut, document_domains=[d for d, _ in pairs])
    entry = corpora.sources()["domains"][spec]
    meta = {
        "source": f"headlab built-in domain {spec}: {corpora.DOMAINS[spec].description}",
        "sha256": entry["sha256"],
        "licence": corpora.licences()[spec],
        "in_broad": corpora.DOMAINS[spec].in_broad,
    }
    return Corpus(spec, [corpora.domain_text(spec)], meta)


def load_corpus(spec: str | None = None, text_column: str | None = None) -> Corpus:
    """A built-in corpus (None or "broad", one of its domains such as "prose" or "speeches", or "pydoc-topics"; a
    local file or folder of such a name is read as ./NAME), a local .txt/.jsonl/.csv/.parquet file, a directory saved by `datasets`, or a hub spec "name[:config[:split]]" such
    as "wikitext:wikitext-2-raw-v1:test"."""
    spec = spec or DEFAULT_CORPUS
    if (
        spec in corpora.BUILTIN
    ):  # a bare built-in name is the built-in corpus; ./NAME is a local file or folder of that name
        return _builtin_corpus(spec)
    if spec == EMBEDDED_CORPUS:
        documents, meta = _embedded_documents(), {"source": "pydoc_data.topics (CPython)"}
    else:
        path = Path(spec).expanduser()
        if path.is_file():
            suffix = path.suffix.lower()
            if suffix == ".txt":
                documents = [_read_text_file(path)]
            elif suffix in (".jsonl", ".csv", ".parquet"):
                documents = _read_table(path, text_column)
            else:
                raise HeadlabError(f"unsupported corpus file {spec}; use .txt, .jsonl, .csv or .parquet")
            meta = {"source": str(path)}
        elif path.is_dir():
            documents, meta = _load_saved_dataset(path, text_column), {"source": str(path)}
        elif path.exists():
            raise HeadlabError(f"corpus {spec} is not a regular file or directory (a FIFO or device?)")
        elif spec.startswith((".", "/", "~")) or path.suffix.lower() in (".txt", ".jsonl", ".csv", ".parquet"):
            raise HeadlabError(f"no such corpus file or directory: {spec}")
        else:
            documents, meta = _load_hub_dataset(spec, text_column), {"source": f"hub:{spec}"}
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        raise HeadlabError(f"corpus {spec!r} has no text")
    check_text(documents, f"corpus {spec!r}")
    return Corpus(spec, documents, meta)


# Control characters other than tab, line feed, vertical tab, form feed and carriage return (C0, DEL, C1), and the
# replacement character U+FFFD that a lossy decoding upstream leaves: text has almost none of them, bytes many.
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")
MAX_NOT_TEXT_SHARE = 0.01  # above 1% of a corpus's characters, it is refused as not text


def _read_text_file(path: Path) -> str:
    """A .txt corpus as UTF-8 (a byte-order mark is dropped); bytes that are not UTF-8 are refused with their offset
    instead of being replaced by U+FFFD and scored as if they were text."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise HeadlabError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise HeadlabError(
            f"{path} is not UTF-8 text: byte {raw[error.start]:#04x} at offset {error.start} is invalid UTF-8 "
            "(convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8)"
        ) from None


def check_text(documents: list[str], where: str) -> None:
    """Refuse a corpus more than MAX_NOT_TEXT_SHARE of whose characters are control characters (other than tab,
    line and page breaks) or U+FFFD: binary data saved as text, or text a lossy decoding already damaged."""
    total = sum(len(doc) for doc in documents)
    bad = sum(len(_NOT_TEXT.findall(doc)) for doc in documents)
    if total and bad > MAX_NOT_TEXT_SHARE * total:
        first = next(match.group() for doc in documents for match in [_NOT_TEXT.search(doc)] if match)
        raise HeadlabError(
            f"{where} is not text: {bad} of its {total} characters ({bad / total:.0%}) are control or replacement "
            f"characters (e.g. {first!r}); at most {MAX_NOT_TEXT_SHARE:.0%} are accepted"
        )


def _load_saved_dataset(path: Path, text_column: str | None) -> list[str]:
    import datasets  # start-up: seconds to import, needed only for datasets corpora

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise HeadlabError(f"{path} is not a directory saved by datasets: {str(error).splitlines()[0]}") from None
    if isinstance(dataset, datasets.DatasetDict):
        split = "test" if "test" in dataset else next(iter(dataset))
        dataset = dataset[split]
    return _column(dataset.to_dict(), text_column, str(path))


def _load_hub_dataset(spec: str, text_column: str | None) -> list[str]:
    import datasets  # start-up: seconds to import, needed only for datasets corpora

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        dataset = datasets.load_dataset(name, config, split=split or "test")
    except Exception as error:  # datasets raises many types for "not reachable" / "not found"
        raise HeadlabError(
            f"cannot load data set {spec!r} ({type(error).__name__}); without network, pass a local file or a "
            "directory saved by datasets"
        ) from None
    return _column(dataset.to_dict(), text_column, spec)


def split_text(corpus: Corpus, split: str = "calibration") -> TextPart:
    """The calibration part, the evaluation part or all of a corpus (see the module docstring for the cut; a corpus
    with a recorded cut, such as `broad`, is cut there)."""
    part = split
    if part not in PARTS:
        raise HeadlabError(f"unknown split {part!r}; use one of {', '.join(PARTS)}")
    text = corpus.text
    if part == "all":
        return TextPart(text, part, 0, len(text), corpus.spec)
    cut = corpora.half_cut(text, CALIBRATION_FRACTION) if corpus.cut is None else corpus.cut
    start, end = (0, cut) if part == "calibration" else (cut, len(text))
    if not text[start:end].strip():
        raise HeadlabError(f"the {part} part of corpus {corpus.spec!r} is empty; the corpus is too short")
    return TextPart(text[start:end], part, start, end, corpus.spec)


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> tuple[torch.Tensor, str]:
    """Token ids of `text` (no special tokens), cut to `max_tokens`, with the exact text those tokens cover."""
    import torch  # start-up: the CLI reads TextSpec and the corpus choices without torch

    if max_tokens is not None and max_tokens <= 0:
        raise HeadlabError(f"max_tokens={max_tokens} must be positive")
    if max_tokens is not None:
        # Tokenizing a 100k-character corpus to keep 4k tokens is wasted work: cut the text generously first.
        text = text[: max(4096, 16 * max_tokens)] if len(text) > 16 * max_tokens else text
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[:max_tokens]
            text = text[: offsets[max_tokens - 1][1]]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[:max_tokens]
            text = tokenizer.decode(ids)
    return torch.tensor(ids, dtype=torch.long), text


def require_tokens(ids: torch.Tensor, what: str) -> None:
    """Refuse a corpus part with fewer than MIN_TOKENS tokens."""
    if len(ids) < MIN_TOKENS:
        raise HeadlabError(f"{what} is too short: {len(ids)} tokens, at least {MIN_TOKENS} needed")


@dataclass
class Window:
    """One model input: tokens [start, end) of a stream, of which [score_from, end) are scored."""

    start: int
    end: int
    score_from: int


@dataclass
class ScoredWindow:
    """One model input, stream tokens [start, end), whose last `scored` positions are scored: position p predicts
    token p + 1, so the targets are tokens [end - scored + 1, end + 1)."""

    start: int
    end: int
    scored: int

    @property
    def first_target(self) -> int:
        return self.end - self.scored + 1


def rolling_windows(num_tokens: int, max_length: int, stride: int | None = None) -> list[ScoredWindow]:
    """Perplexity windows over a stream of num_tokens tokens whose first (the prefix token) is never scored:
    lm-evaluation-harness `loglikelihood_rolling` (lm_eval/utils.py get_rolling_token_windows; context_len
    = max_length - stride + 1; stride = max_length is the hf model's context_len=1).

    Every window feeds up to max_length tokens and scores the next-token predictions of its last positions; each
    token after the first is scored exactly once. The first window scores all its predictions (min(max_length,
    num_tokens - 1)); each later one scores up to `stride` new tokens, and its input reaches max_length tokens to the
    left, so the unscored extra context is max_length - stride tokens, also for the last, shorter window. With
    stride < max_length this is the transformers-docs strided evaluation ("Perplexity of fixed-length models")
    with windows of max_length + 1 tokens counting the scored target.
    """
    stride = max_length if stride is None else stride
    if max_length < 1:
        raise HeadlabError(f"max_length={max_length} must be at least 1")
    if stride <= 0 or stride > max_length:
        raise HeadlabError(f"stride={stride} must be between 1 and max_length ({max_length})")
    targets = num_tokens - 1  # stream positions 1 .. num_tokens - 1 are predicted
    if targets <= 0:
        return []
    first = min(max_length, targets)
    windows, predicted = [ScoredWindow(0, first, first)], first
    while predicted < targets:
        scored = min(targets - predicted, stride)
        end = predicted + scored  # the input ends where its last prediction's target sits
        windows.append(ScoredWindow(max(0, end - max_length), end, scored))
        predicted = end
    return windows


def chunk_windows(num_tokens: int, seq_len: int, min_len: int = 2) -> list[Window]:
    """Non-overlapping windows of seq_len tokens (the last may be shorter, dropped under min_len): calibration."""
    if seq_len <= 0:
        raise HeadlabError(f"seq_len={seq_len} must be positive")
    return [
        Window(start, min(start + seq_len, num_tokens), start)
        for start in range(0, num_tokens, seq_len)
        if min(start + seq_len, num_tokens) - start >= min_len
    ]


def right_padded(rows: list, fill, *, width: int | None = None, dtype=None) -> torch.Tensor:
    """Rows of unequal length (id lists or 1-D tensors) as one [B, T] tensor, each row right-padded with `fill`; T is
    `width`, or the longest row's length."""
    import torch  # start-up: the CLI reads TextSpec and the corpus choices without torch

    rows = [torch.as_tensor(row, dtype=dtype) for row in rows]
    width = max(len(row) for row in rows) if width is None else width
    padded = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    for index, row in enumerate(rows):
        padded[index, : len(row)] = row
    return padded


def batch_windows(ids: torch.Tensor, windows: list[Window] | list[ScoredWindow], batch_size: int, pad_id: int = 0):
    """Group windows into right-padded batches: yields (input_ids [B, T], attention_mask [B, T], windows)."""
    import torch  # start-up: the CLI reads TextSpec and the corpus choices without torch

    if batch_size <= 0:
        raise HeadlabError(f"batch_size={batch_size} must be positive")
    for first in range(0, len(windows), batch_size):
        group = windows[first : first + batch_size]
        width = max(w.end - w.start for w in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)  # [B, T]
        for row, window in enumerate(group):
            n = window.end - window.start
            input_ids[row, :n] = ids[window.start : window.end]
            attention_mask[row, :n] = 1
        yield input_ids, attention_mask, group


@dataclass
class CalibrationBatches:
    """Calibration token windows, batched; what statistics and importance run on."""

    ids: torch.Tensor
    windows: list[Window]
    batch_size: int
    pad_id: int
    meta: dict

    def __iter__(self):
        return batch_windows(self.ids, self.windows, self.batch_size, self.pad_id)

    def __len__(self) -> int:
        return (len(self.windows) + self.batch_size - 1) // self.batch_size

    @property
    def num_tokens(self) -> int:
        return sum(w.end - w.start for w in self.windows)


def calibration_batches(
    tokenizer,
    corpus: Corpus | str | None = None,
    *,
    split: str = "calibration",
    seq_len: int = 256,
    batch_size: int = 4,
    max_tokens: int | None = 8192,
    text_column: str | None = None,
    max_positions: int | None = None,
) -> CalibrationBatches:
    """Token windows of the calibration part (by default; `split`) of a corpus, for statistics and importance."""
    part = split
    if max_positions is not None and seq_len > max_positions:
        raise HeadlabError(f"seq_len={seq_len} exceeds the model's maximum positions ({max_positions})")
    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, text_column)
    text_part = split_text(corpus, part)
    ids, text = tokenize(tokenizer, text_part.text, max_tokens)
    require_tokens(ids, f"the {part} part of corpus {corpus.spec!r}")
    windows = chunk_windows(len(ids), seq_len)
    if not windows:
        raise HeadlabError(f"the {part} part of {corpus.spec!r} has too few tokens ({len(ids)})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    meta = {
        **text_part.describe(),
        "tokens": int(sum(w.end - w.start for w in windows)),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "max_tokens": max_tokens,
        "windows": len(windows),
    }
    return CalibrationBatches(ids, windows, batch_size, pad_id, meta)


def masked_lm_batch(tokenizer, rows: list[torch.Tensor], generator: torch.Generator):
    """One masked-LM batch: each row of token ids wrapped as [CLS] row [SEP], 15% of its tokens (at least one) chosen
    with `generator` and replaced by the mask token. Returns input_ids, attention_mask, labels (-100 where not
    scored), each [B, T]. Rows draw from the generator in order, so masks do not depend on how rows are batched."""
    import torch  # start-up: the CLI reads TextSpec and the corpus choices without torch

    if tokenizer.mask_token_id is None:
        raise HeadlabError("this masked-LM tokenizer has no mask token")
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows) + 2
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)  # [B, T]
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for r, row in enumerate(rows):
        n = len(row)
        input_ids[r, 0], input_ids[r, 1 : n + 1], input_ids[r, n + 1] = cls_id, row, sep_id
        attention_mask[r, : n + 2] = 1
        chosen = torch.rand(n, generator=generator) < MLM_PROBABILITY
        if not chosen.any():
            chosen[torch.randint(n, (1,), generator=generator)] = True
        positions = torch.nonzero(chosen).flatten() + 1
        labels[r, positions] = input_ids[r, positions]
        input_ids[r, positions] = tokenizer.mask_token_id
    return input_ids, attention_mask, labels
