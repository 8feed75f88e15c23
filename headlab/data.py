"""Corpora, the deterministic calibration/evaluation split, and the token windows every command runs on.

A corpus is a list of documents joined with blank lines. The joined text is cut once, at the first line break at
or after `calibration_fraction` of its characters: calibration text (statistics, importance) comes before the
cut, evaluation text (perplexity) after it, so the two never share a character.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from headlab.errors import HeadlabError

DEFAULT_CORPUS = "pydoc-topics"
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


def _embedded_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _read_table(path: Path, text_column: str | None) -> list[str]:
    import pandas as pd

    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            frame = pd.read_csv(path)
        elif suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:  # .jsonl
            frame = pd.read_json(path, lines=True)
    except (ValueError, OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"cannot read {path}: {str(error).splitlines()[0]}") from None
    return _column(frame.to_dict("list"), text_column, str(path))


def _column(table: dict, text_column: str | None, where: str) -> list[str]:
    column = text_column or "text"
    if column not in table:
        raise HeadlabError(
            f"{where} has no column {column!r}; columns: {', '.join(map(str, table))} (use --text-column)"
        )
    return [str(value) for value in table[column] if value is not None and str(value) != "nan"]


def load_corpus(spec: str | None = None, text_column: str | None = None) -> Corpus:
    """The embedded corpus (None or "pydoc-topics"), a local .txt/.jsonl/.csv/.parquet file, a directory saved by
    `datasets`, or a hub spec "name[:config[:split]]" such as "wikitext:wikitext-2-raw-v1:test"."""
    spec = spec or DEFAULT_CORPUS
    if spec == DEFAULT_CORPUS:
        documents, meta = _embedded_documents(), {"source": "pydoc_data.topics (CPython)"}
    else:
        path = Path(spec).expanduser()
        if path.is_file():
            suffix = path.suffix.lower()
            if suffix == ".txt":
                documents = [path.read_text(encoding="utf-8", errors="replace")]
            elif suffix in (".jsonl", ".csv", ".parquet"):
                documents = _read_table(path, text_column)
            else:
                raise HeadlabError(f"unsupported corpus file {spec}; use .txt, .jsonl, .csv or .parquet")
            meta = {"source": str(path)}
        elif path.is_dir():
            documents, meta = _load_saved_dataset(path, text_column), {"source": str(path)}
        elif spec.startswith((".", "/", "~")) or path.suffix.lower() in (".txt", ".jsonl", ".csv", ".parquet"):
            raise HeadlabError(f"no such corpus file or directory: {spec}")
        else:
            documents, meta = _load_hub_dataset(spec, text_column), {"source": f"hub:{spec}"}
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        raise HeadlabError(f"corpus {spec!r} has no text")
    return Corpus(spec, documents, meta)


def _load_saved_dataset(path: Path, text_column: str | None) -> list[str]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise HeadlabError(f"{path} is not a directory saved by datasets: {str(error).splitlines()[0]}") from None
    if isinstance(dataset, datasets.DatasetDict):
        split = "test" if "test" in dataset else next(iter(dataset))
        dataset = dataset[split]
    return _column(dataset.to_dict(), text_column, str(path))


def _load_hub_dataset(spec: str, text_column: str | None) -> list[str]:
    import datasets

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        dataset = datasets.load_dataset(name, config, split=split or "test")
    except Exception as error:  # datasets raises many types for "not reachable" / "not found"
        raise HeadlabError(
            f"cannot load data set {spec!r} ({type(error).__name__}); without network, pass a local file or a "
            "directory saved by datasets"
        ) from None
    return _column(dataset.to_dict(), text_column, spec)


def split_text(corpus: Corpus, part: str = "calibration") -> TextPart:
    """The calibration part, the evaluation part or all of a corpus (see the module docstring for the cut)."""
    if part not in PARTS:
        raise HeadlabError(f"unknown split {part!r}; use one of {', '.join(PARTS)}")
    text = corpus.text
    if part == "all":
        return TextPart(text, part, 0, len(text), corpus.spec)
    cut = text.find("\n", int(len(text) * CALIBRATION_FRACTION))
    cut = cut if cut > 0 else int(len(text) * CALIBRATION_FRACTION)
    start, end = (0, cut) if part == "calibration" else (cut, len(text))
    if not text[start:end].strip():
        raise HeadlabError(f"the {part} part of corpus {corpus.spec!r} is empty; the corpus is too short")
    return TextPart(text[start:end], part, start, end, corpus.spec)


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> tuple[torch.Tensor, str]:
    """Token ids of `text` (no special tokens), cut to `max_tokens`, with the exact text those tokens cover."""
    if max_tokens is not None and max_tokens <= 0:
        raise HeadlabError(f"--max-tokens must be positive, got {max_tokens}")
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


def sliding_windows(num_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """Windows of at most seq_len tokens moved by stride (transformers docs, "Perplexity of fixed-length models"):
    every token after the first is scored exactly once, with up to seq_len - stride earlier tokens as extra context.

    A token is predicted from the position before it, so a window scores at most seq_len - 1 new tokens: a stride
    equal to seq_len moves by seq_len - 1 (one token of overlap), where the docs' loop would drop one token per
    window.
    """
    if seq_len < 2:
        raise HeadlabError(f"--seq-len must be at least 2, got {seq_len}")
    if stride <= 0 or stride > seq_len:
        raise HeadlabError(f"--stride must be in 1..seq-len ({seq_len}), got {stride}")
    step = min(stride, seq_len - 1)
    windows, previous_end = [], 1  # token 0 has no context and is never scored
    for begin in range(0, num_tokens, step):
        end = min(begin + seq_len, num_tokens)
        if end > previous_end:
            windows.append(Window(begin, end, previous_end))
        previous_end = max(previous_end, end)
        if end == num_tokens:
            break
    return windows


def chunk_windows(num_tokens: int, seq_len: int, min_len: int = 2) -> list[Window]:
    """Non-overlapping windows of seq_len tokens (the last may be shorter, dropped under min_len): calibration."""
    if seq_len <= 0:
        raise HeadlabError(f"--seq-len must be positive, got {seq_len}")
    return [
        Window(start, min(start + seq_len, num_tokens), start)
        for start in range(0, num_tokens, seq_len)
        if min(start + seq_len, num_tokens) - start >= min_len
    ]


def batch_windows(ids: torch.Tensor, windows: list[Window], batch_size: int, pad_id: int = 0):
    """Group windows into right-padded batches: yields (input_ids [B, T], attention_mask [B, T], windows)."""
    if batch_size <= 0:
        raise HeadlabError(f"--batch-size must be positive, got {batch_size}")
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
    part: str = "calibration",
    seq_len: int = 256,
    batch_size: int = 4,
    max_tokens: int | None = 8192,
    text_column: str | None = None,
    max_positions: int | None = None,
) -> CalibrationBatches:
    """Token windows of the calibration part (by default) of a corpus, for statistics and importance."""
    if max_positions is not None and seq_len > max_positions:
        raise HeadlabError(f"--seq-len {seq_len} exceeds the model's maximum positions ({max_positions})")
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
