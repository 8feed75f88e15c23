"""Out-of-domain evaluation: `domain_perplexities` (the calibration corpus's eval split, then each built-in domain's)
and `headlab eval --domains`."""

from __future__ import annotations

import json

import pytest
from models import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core import corpora
from headlab.core.data import TextSpec, load_corpus
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.evaluate import domain_perplexities, perplexity

pytestmark = pytest.mark.usefixtures("one_thread")

# Small windows and budgets: each row is one perplexity run of the tiny model.
SETTINGS = dict(seq_len=32, batch_size=2, max_tokens=96)
COLUMNS = ["domain", "role", "perplexity", "nll", "bits_per_byte", "scored_tokens"]


@pytest.fixture(scope="module")
def loaded():
    return from_model(tiny_model("llama"), tiny_tokenizer())


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sample.txt"
    path.write_text(SAMPLE_TEXT)
    return path


def test_rows_are_perplexity_of_each_corpus_eval_split(loaded):
    text = TextSpec("broad", split="calibration", **SETTINGS)  # the rows read the eval split whatever text's split
    table = domain_perplexities(loaded, ("speeches", "encyclopedia", "prose"), text=text, stride=16, progress=False)
    assert list(table.columns) == COLUMNS
    assert table["domain"].tolist() == ["broad", "speeches", "encyclopedia", "prose"]
    assert table["role"].tolist() == ["calibration corpus", "held out", "held out", "in calibration"]
    for row in table.itertuples():
        alone = perplexity(loaded, data=row.domain, split="eval", stride=16, progress=False, **SETTINGS)
        assert (row.perplexity, row.nll, row.bits_per_byte, row.scored_tokens) == (
            alone.perplexity,
            alone.nll,
            alone.bits_per_byte,
            alone.scored_tokens,
        )
    assert (table["scored_tokens"] == SETTINGS["max_tokens"]).all()


def test_default_domains_and_a_user_corpus_hold_nothing_in_calibration(loaded, text_file):
    text = TextSpec(str(text_file), split="eval", **SETTINGS)
    table = domain_perplexities(loaded, ["prose", "poetry"], text=text, progress=False)
    assert table["domain"].tolist() == [str(text_file), "prose", "poetry"]
    assert table["role"].tolist() == ["calibration corpus", "held out", "held out"]  # prose is in broad, not here
    default = domain_perplexities(loaded, text=text, progress=False)
    assert default["domain"].tolist() == [str(text_file), *corpora.DEFAULT_EVAL_DOMAINS]
    assert default["perplexity"].iloc[0] == table["perplexity"].iloc[0]


def test_a_domain_that_is_the_corpus_is_not_repeated_and_a_measured_row_is_reused(loaded):
    text = TextSpec(load_corpus("speeches"), split="eval", **SETTINGS)
    table = domain_perplexities(loaded, "speeches,encyclopedia,speeches", text=text, progress=False)
    assert table["domain"].tolist() == ["speeches", "encyclopedia"]
    assert table["role"].tolist() == ["calibration corpus", "held out"]
    first = perplexity(loaded, text=text, progress=False)
    reused = domain_perplexities(loaded, ["encyclopedia"], text=text, progress=False, measured=first)
    assert reused.equals(table)


@pytest.mark.parametrize("domains", [None, (), ""])
def test_no_domains_leaves_the_corpus_row(loaded, domains):
    table = domain_perplexities(loaded, domains, text=TextSpec("speeches", split="eval", **SETTINGS), progress=False)
    assert table["domain"].tolist() == ["speeches"] and table["role"].tolist() == ["calibration corpus"]


def test_an_unknown_domain_is_refused_before_any_model_work(text_file):
    class NoModel:  # any attribute access would be model work
        def __getattr__(self, name):
            raise AssertionError(f"model touched: {name}")

    with pytest.raises(HeadlabError) as error:
        domain_perplexities(NoModel(), ["speeches", "wikipedia"], text=TextSpec(str(text_file)), progress=False)
    message = str(error.value)
    assert "\n" not in message and "'wikipedia'" in message
    assert all(name in message for name in corpora.DOMAINS)


# ---- headlab eval --domains -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("models") / "tiny-llama")


def _eval(tiny_dir, text_file, *extra):
    return ["eval", "--model", tiny_dir, "--device", "cpu", "--data", text_file, "--seq-len", "32",
            "--max-tokens", "96", *extra]  # fmt: skip


def test_eval_domains_table_and_json(tiny_dir, text_file, capsys):
    code, out, _ = run_cli(_eval(tiny_dir, text_file, "--json"), capsys)
    assert code == 0
    record = json.loads(out)
    rows = record["domains"]
    assert [r["domain"] for r in rows] == [str(text_file), *corpora.DEFAULT_EVAL_DOMAINS]
    assert [r["role"] for r in rows] == ["calibration corpus", "held out", "held out"]
    assert rows[0]["perplexity"] == record["perplexity"] and rows[0]["scored_tokens"] == record["scored_tokens"]
    code, out, _ = run_cli(_eval(tiny_dir, text_file, "--domains", "poetry,prose"), capsys)
    assert code == 0 and "perplexity" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("domain"))
    assert lines[header].split() == ["domain", "role", "perplexity", "bits", "per", "byte", "tokens"]
    table = [line.split() for line in lines[header + 1 :]]
    assert [(cells[0], cells[-1]) for cells in table] == [(str(text_file), "96"), ("poetry", "96"), ("prose", "96")]
    assert all(" ".join(cells[1:3]) == "held out" for cells in table[1:])


def test_eval_domains_none_prints_no_table(tiny_dir, text_file, capsys):
    code, out, _ = run_cli(_eval(tiny_dir, text_file, "--domains", "none", "--json"), capsys)
    assert code == 0 and "domains" not in json.loads(out)
    code, out, _ = run_cli(_eval(tiny_dir, text_file, "--domains", "none"), capsys)
    assert code == 0 and "bits per byte" in out and "role" not in out


@pytest.mark.parametrize(
    "value, fragment", [("speeches,wikipedia", "wikipedia"), (",", "--domains is empty")], ids=["unknown", "empty"]
)
def test_eval_bad_domains_is_one_line_exit_2(tiny_dir, text_file, capsys, value, fragment):
    code, out, err = run_cli(["eval", "--model", "./no/such/model", "--data", text_file, "--domains", value], capsys)
    assert code == 2 and out == ""  # refused before the (missing) model is loaded
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err, err
