"""Corpora, the calibration/eval split and token windows."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from tiny_text import SAMPLE_TEXT, tiny_tokenizer

from headlab.core.data import (
    Corpus,
    batch_windows,
    calibration_batches,
    chunk_windows,
    load_corpus,
    rolling_windows,
    split_text,
    tokenize,
)
from headlab.core.errors import HeadlabError


def test_the_python_reference_stays_available_by_name():
    corpus = load_corpus("pydoc-topics")
    from pydoc_data.topics import topics

    assert len(corpus.documents) == len([t for t in topics.values() if t.strip()])
    assert len(corpus.text) > 100_000


def test_split_is_disjoint_and_complete():
    corpus = Corpus("x", ["line one\nline two\n" * 50, "other document\n" * 30])
    calibration, evaluation, whole = (split_text(corpus, p) for p in ("calibration", "eval", "all"))
    assert calibration.text + evaluation.text == whole.text == corpus.text
    assert calibration.end == evaluation.start
    assert evaluation.text.startswith("\n")  # cut at a line break
    assert abs(calibration.end - len(corpus.text) / 2) < 20


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv", ".parquet"])
def test_local_files(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    docs = ["first document", "second document"]
    if suffix == ".txt":
        path.write_text("\n\n".join(docs))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"body": d}) for d in docs))
    elif suffix == ".csv":
        pd.DataFrame({"body": docs}).to_csv(path, index=False)
    else:
        pd.DataFrame({"body": docs}).to_parquet(path)
    corpus = load_corpus(str(path), text_column=None if suffix == ".txt" else "body")
    assert corpus.text == "\n\n".join(docs)


def test_datasets_directory(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["alpha beta", "", "gamma"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_corpus(str(tmp_path / "ds")).documents == ["alpha beta", "gamma"]


def test_bad_corpora(tmp_path):
    with pytest.raises(HeadlabError, match="no such corpus"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(HeadlabError, match="no text"):
        load_corpus(str(tmp_path / "empty.txt"))
    pd.DataFrame({"body": ["x"]}).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(HeadlabError, match="no column 'text'.*body"):
        load_corpus(str(tmp_path / "t.csv"))


@pytest.mark.parametrize(
    "num_tokens,max_length,stride", [(100, 16, 16), (100, 16, 4), (17, 16, 16), (18, 16, 16), (5, 16, 8), (64, 8, 1)]
)
def test_rolling_windows_score_every_token_once(num_tokens, max_length, stride):
    # The convention changed from "seq_len tokens scoring seq_len - 1" to lm-eval's "max_length inputs scoring up to
    # max_length predictions, the last window full-length"; the invariants below are those of the new convention.
    windows = rolling_windows(num_tokens, max_length, stride)
    scored = [t for w in windows for t in range(w.first_target, w.end + 1)]
    assert scored == list(range(1, num_tokens))  # every token but the prefix, once, in order
    assert windows[0].start == 0 and windows[0].scored == min(max_length, num_tokens - 1)
    for w in windows:
        assert w.end - w.start == min(max_length, num_tokens - 1)  # always a full input where the text allows
        assert w.first_target > w.start  # each scored token's predecessor is inside the input
        assert 1 <= w.scored <= (max_length if w is windows[0] else stride)


def test_window_errors():
    with pytest.raises(HeadlabError, match="stride"):
        rolling_windows(10, 8, 0)
    with pytest.raises(HeadlabError, match="stride"):
        rolling_windows(10, 8, 9)
    with pytest.raises(HeadlabError, match="max_length"):
        rolling_windows(10, 0, 1)
    assert rolling_windows(1, 8) == []  # the prefix alone: nothing to score


def test_chunks_and_batches():
    ids = torch.arange(23)
    windows = chunk_windows(23, 10)
    assert [(w.start, w.end) for w in windows] == [(0, 10), (10, 20), (20, 23)]
    batches = list(batch_windows(ids, windows, batch_size=2, pad_id=-1))
    assert len(batches) == 2
    input_ids, mask, group = batches[1]
    assert input_ids.tolist() == [[20, 21, 22]] and mask.tolist() == [[1, 1, 1]]
    input_ids, mask, _ = batches[0]
    assert input_ids.shape == (2, 10) and mask.sum() == 20


def test_tokenize_cuts_text_to_tokens():
    tokenizer = tiny_tokenizer()
    ids, text = tokenize(tokenizer, "hello world", max_tokens=5)
    assert len(ids) == 5 and text == "hello"


def test_calibration_batches_record_their_part():
    batches = calibration_batches(
        tiny_tokenizer(), Corpus("s", [SAMPLE_TEXT]), seq_len=32, batch_size=3, max_tokens=200
    )
    assert batches.meta["split"] == "calibration" and batches.num_tokens == 200
    assert sum(ids.shape[0] for ids, _, _ in batches) == len(batches.windows) == 7
    with pytest.raises(HeadlabError, match="maximum positions"):
        calibration_batches(tiny_tokenizer(), Corpus("s", [SAMPLE_TEXT]), seq_len=128, max_positions=64)
