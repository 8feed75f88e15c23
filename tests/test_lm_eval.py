"""headlab against the real lm-evaluation-harness: window layout, rolling perplexity equality, and lm-eval tasks on
in-memory (also non-uniformly pruned) models. Skipped with a reason where the lmeval extra is not installed."""

from __future__ import annotations

import json
import math
import sys

import pandas as pd
import pytest
import torch
from models import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import Corpus, load_corpus, rolling_windows, split_text, tokenize
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model, load_model
from headlab.measure.evaluate import perplexity

lm_eval_utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is not installed (pip install 'headlab[lmeval]')")

from headlab.runtimes.lm_eval_bridge import (  # noqa: E402 - after the skip
    ROLLING_METRICS,
    ROLLING_TASK,
    lm_eval_rolling_perplexity,
    run_tasks,
)

# ---- window layout ------------------------------------------------------------------------------------------------


def _lm_eval_windows(tokens: list[int], prefix: int, max_length: int, stride: int):
    """(model input, predicted tokens) per window as lm-eval's hf model builds them: get_rolling_token_windows
    (context_len = max_length - stride + 1), make_disjoint_window, then HFLM's (context + continuation)[-(L+1):][:-1]."""
    pairs = lm_eval_utils.get_rolling_token_windows(tokens, prefix, max_length, max_length - stride + 1)
    out = []
    for context, continuation in map(lm_eval_utils.make_disjoint_window, pairs):
        out.append(((context + continuation)[-(max_length + 1) :][:-1], continuation))
    return out


LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 100]


@pytest.mark.parametrize("max_length", [1, 2, 8, 16])
@pytest.mark.parametrize("stride_kind", ["window", "half", "one"])
def test_windows_equal_lm_eval_for_every_length(max_length, stride_kind):
    # Lengths cover a text shorter than one window, exactly one, one token over, and many windows.
    stride = {"window": max_length, "half": max(1, max_length // 2), "one": 1}[stride_kind]
    prefix = 1000
    for n in LENGTHS + [max_length - 1, max_length, max_length + 1, 3 * max_length + 1]:
        if n < 1:
            continue
        tokens = list(range(n))  # distinct values: equal lists mean equal positions
        stream = [prefix] + tokens
        ours = [
            (stream[w.start : w.end], stream[w.first_target : w.end + 1])
            for w in rolling_windows(n + 1, max_length, stride)
        ]
        assert ours == _lm_eval_windows(tokens, prefix, max_length, stride), (n, max_length, stride)


# ---- rolling perplexity equal to lm-eval's --------------------------------------------------------------------------


def _assert_equal_to_lm_eval(loaded, text, max_length, batch_size, tmp_path):
    ours = perplexity(
        loaded,
        Corpus("t", [text]),
        split="all",
        seq_len=max_length,
        batch_size=batch_size,
        max_tokens=None,
        progress=False,
    )
    theirs = lm_eval_rolling_perplexity(loaded, [text], tmp_path, max_length=max_length, batch_size=batch_size)
    for metric in ROLLING_METRICS:
        assert getattr(ours, metric) == pytest.approx(theirs.value(ROLLING_TASK, metric), rel=1e-6), metric
    return ours, theirs


@pytest.mark.parametrize("max_length,batch_size,chars", [(32, 3, 700), (16, 1, 16), (64, 4, 64), (8, 2, 301)])
def test_rolling_perplexity_equals_lm_eval_on_a_tiny_model(max_length, batch_size, chars, tmp_path):
    # 16 chars with max_length 16: exactly one window; 64 chars with max_length 64: one window at full positions.
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    ours, _ = _assert_equal_to_lm_eval(loaded, SAMPLE_TEXT[:chars], max_length, batch_size, tmp_path)
    assert ours.scored_tokens == chars  # the character tokenizer: one token per character, all scored


@pytest.mark.slow
def test_rolling_perplexity_equals_lm_eval_on_the_embedded_model(tmp_path):
    loaded = load_model(None, device="cpu")
    _, text = tokenize(loaded.tokenizer, split_text(load_corpus(None), "eval").text, 600)
    ours, _ = _assert_equal_to_lm_eval(loaded, text, 256, 2, tmp_path)
    assert ours.windows == 3 and ours.scored_tokens == 600  # two full windows and a full-context last one


# ---- lm-eval tasks on in-memory models ---------------------------------------------------------------------------

MC_ITEMS = [
    ("Which word is an animal?", ["fox", "table", "blue"]),
    ("The sky is", ["green", "blue"]),
    ("Heads that can be pruned are", ["few", "many", "all", "none"]),
]


def _hand_choice_logliks(model, tokenizer, question: str, choices: list[str]) -> list[float]:
    """log p(" " + choice | question), one forward per choice (lm-eval's target delimiter is a space)."""
    context = tokenizer(question, add_special_tokens=False)["input_ids"]
    out = []
    for choice in choices:
        continuation = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), -1)  # [T - 1, V]
        positions = range(len(context) - 1, ids.shape[1] - 1)
        out.append(sum(float(log_probs[p, ids[0, p + 1]]) for p in positions))
    return out


def write_mc_task(directory, labels: list[int]):
    """A local 3-item multiple-choice task (YAML over a jsonl) whose answers are `labels`."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "tiny_mc.jsonl"
    rows = [{"question": q, "choices": c, "label": label} for (q, c), label in zip(MC_ITEMS, labels, strict=True)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n"
    )
    return directory


def _labels_with_one_wrong(model, tokenizer) -> tuple[list[int], float]:
    """Answers chosen so that the hand-computed accuracy is 2/3: the model's own choice for the first two items,
    another choice for the third."""
    best = [max(range(len(c)), key=_hand_choice_logliks(model, tokenizer, q, c).__getitem__) for q, c in MC_ITEMS]
    labels = best[:2] + [(best[2] + 1) % len(MC_ITEMS[2][1])]
    return labels, 2 / 3


def test_tasks_multiple_choice_accuracy_equals_hand_computation(tmp_path):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    labels, expected = _labels_with_one_wrong(model, tokenizer)
    include = write_mc_task(tmp_path / "tasks", labels)
    result = run_tasks(from_model(model, tokenizer), ["tiny_mc"], include_path=include, batch_size=2)
    row = result.table.set_index("metric").loc["acc"]
    assert row["task"] == "tiny_mc" and row["samples"] == 3
    assert row["value"] == pytest.approx(expected, abs=1e-12)
    # lm-eval's mean stderr: sample standard deviation (ddof 1) over sqrt(n), here of [1, 1, 0]
    assert row["stderr"] == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2) / math.sqrt(3))


def test_non_uniform_pruned_checkpoint_through_tasks_cli(tmp_path, capsys):
    # Layer 0 keeps 3 heads, layer 1 keeps 2: a layout plain lm-eval (from_pretrained) cannot load.
    source = save_tiny("llama", tmp_path / "tiny")
    pruned = tmp_path / "pruned"
    heads = [{0}, {1, 2}]
    code, _, err = run_cli(
        [
            "prune",
            "--model",
            source,
            "--device",
            "cpu",
            "--heads",
            "0:0;1:1,2",
            "--mode",
            "physical",
            "--seq-len",
            "32",
            "--out",
            pruned,
        ],
        capsys,
    )
    assert code == 0, err
    reloaded = load_model(str(pruned), device="cpu")
    assert [layer.num_heads for layer in reloaded.layers] != [4, 4]
    # The hand computation runs on the unpruned model with the same heads masked (equal logits to the physical prune).
    from headlab.pruning.prune import pruned_in_place

    masked = from_model(tiny_model("llama"), tiny_tokenizer())
    with pruned_in_place(masked, heads, "mask"):
        labels, expected = _labels_with_one_wrong(masked.model, masked.tokenizer)
    include = write_mc_task(tmp_path / "tasks", labels)
    out = tmp_path / "task-run"
    args = ["eval", "--model", pruned, "--device", "cpu", "--tasks", "tiny_mc", "--include-path", include]
    code, stdout, err = run_cli([*args, "--json", "--out", out], capsys)
    assert code == 0, err
    rows = {r["metric"]: r for r in json.loads(stdout)["results"]}
    assert rows["acc"]["value"] == pytest.approx(expected, abs=1e-12)
    assert (out / "tasks.csv").is_file() and (out / "tasks.parquet").is_file() and (out / "meta.json").is_file()


# ---- bad input that needs the lm-eval module itself (the rest are rows in test_bad_input.py) ------------------------


def test_tasks_without_lm_eval_say_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["eval", "--model", save_tiny("llama", tmp_path / "m"), "--tasks", "x"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "pip install 'headlab[lmeval]'" in err


def test_hub_task_offline_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = save_tiny("llama", tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["eval", "--model", model, "--device", "cpu", "--tasks", "arc_easy"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "arc_easy" in err and "without network" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "m"]


def test_task_errors_are_headlab_errors(tmp_path):
    from headlab.runtimes.lm_eval_bridge import task_manager

    with pytest.raises(HeadlabError, match="not a directory"):
        task_manager(["x"], tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.yaml").write_text("task: [unclosed\n")
    with pytest.raises(HeadlabError, match="broken.yaml does not parse"):
        task_manager(["broken"], tmp_path / "bad")


def _hand_accuracy(model, tokenizer, labels: list[int]) -> float:
    picks = [max(range(len(c)), key=_hand_choice_logliks(model, tokenizer, q, c).__getitem__) for q, c in MC_ITEMS]
    return sum(p == label for p, label in zip(picks, labels, strict=True)) / len(labels)


def test_sweep_tasks_adds_the_task_metric_of_each_pruned_model(tmp_path):
    from headlab.pruning.prune import pruned_in_place, select_heads
    from headlab.pruning.scores import random_scores
    from headlab.pruning.sweep import SweepPlan, TaskSpec, sweep, write_sweep

    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    labels, _ = _labels_with_one_wrong(loaded.model, loaded.tokenizer)
    include = write_mc_task(tmp_path / "tasks", labels)
    corpus = tmp_path / "sample.txt"
    corpus.write_text(SAMPLE_TEXT)
    result = sweep(
        loaded,
        SweepPlan(fractions=[0.0, 0.5], orders=["random"], seeds=[0]),
        data=str(corpus),
        eval_tokens=200,
        seq_len=32,
        progress=False,
        tasks=TaskSpec(["tiny_mc"], include_path=include),
    )
    assert {"tiny_mc/acc", "tiny_mc/acc_stderr"} <= set(result.table.columns)
    assert len(result.table) == 2
    for row in result.table.to_dict("records"):
        pruned = select_heads(loaded.layers, random_scores(loaded.layers, 0), fraction=row["fraction"])
        assert row["pruned_heads"] == sum(len(p) for p in pruned)
        with pruned_in_place(loaded, pruned, "mask"):
            assert row["tiny_mc/acc"] == pytest.approx(_hand_accuracy(loaded.model, loaded.tokenizer, labels))
    out = write_sweep(result, tmp_path / "sweep")
    assert (out / "sweep_tasks.png").stat().st_size > 10_000


def test_report_tasks_draw_accuracy_against_heads_pruned(tmp_path, capsys):
    model_dir = save_tiny("llama", tmp_path / "ckpt")
    include = write_mc_task(tmp_path / "tasks", [0, 1, 2])
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    out = tmp_path / "report"
    args = ["report", "--model", model_dir, "--data", corpus, "--quick", "--out", out]
    code, _, err = run_cli([*args, "--tasks", "tiny_mc", "--include-path", include], capsys)
    assert code == 0, err
    sweep_table = pd.read_csv(out / "sweep" / "sweep.csv")
    assert sweep_table["tiny_mc/acc"].between(0, 1).all() and len(sweep_table) > 1
    markdown = (out / "report.md").read_text()
    assert "figures/sweep_tasks.png" in markdown and "tiny_mc/acc" in markdown
    assert f"--tasks tiny_mc --include-path {include}" in markdown  # the reproduce command of the sweep step
