"""Long-context evaluation: prompts of the asked length with the needle at the asked depth, deterministic from the
seed; scoring and Wilson intervals against hand computations; greedy decoding and NLL by position against slow,
obvious implementations; lm-eval and llama.cpp giving the same per-prompt outcomes; the command and its refusals."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from models import tiny_model
from tiny_text import run_cli, save_tiny, tiny_tokenizer

from headlab.core.data import Corpus, TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.long_tasks import (
    HEADER,
    LONG_TASKS,
    Haystack,
    build_prompt,
    check_grid,
    make_prompts,
    score,
)
from headlab.measure.longctx import (
    accuracy_table,
    answer_prompts,
    long_context,
    position_nll,
    position_tables,
    transformers_generate,
    wilson_interval,
)

POSITIONS = 1024


def _prose(words: int = 3000, seed: int = 0) -> str:
    """Varied word-like text (never one repeated sentence), with sentence ends and paragraph breaks."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "fu", "ga"]
    out = []
    for i in range(words):
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
        out.append(word + ("." if i % 11 == 10 else ""))
    return " ".join(out)


PROSE = _prose()


def _loaded(**overrides):
    model = tiny_model("llama", max_position_embeddings=POSITIONS, **overrides)
    return from_model(model, tiny_tokenizer())


def _haystack(text: str = PROSE) -> Haystack:
    return Haystack(tiny_tokenizer(), text, "prose")


def _text(text: str = PROSE) -> TextSpec:
    return TextSpec(Corpus("prose", [text]), split="all", max_tokens=None)


# ---- prompts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(LONG_TASKS))
@pytest.mark.parametrize("length", [700, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_the_asked_length_and_the_needle_the_asked_depth(task, length, depth):
    haystack = _haystack()
    prompt = build_prompt(haystack, task, length, depth, sample=0, seed=0)
    ids = haystack.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    assert len(ids) == prompt.prompt_tokens == length - LONG_TASKS[task].max_new_tokens
    # Re-derive the depth from the text itself: haystack characters before the first fact over all haystack ones
    # (one character is one token for this tokenizer).
    first = prompt.text.index(prompt.facts[0])
    question = prompt.text.rindex("\n\n")  # the question starts there (this haystack has no newlines)
    before = prompt.text[len(HEADER) : first]
    for fact in prompt.facts[1:]:
        before = before.replace(fact, "")
    body = prompt.text[len(HEADER) : question]
    for fact in prompt.facts:
        body = body.replace(fact, "", 1)
    assert abs(len(before) - depth * len(body)) <= 1, (len(before), depth, len(body))
    assert abs(prompt.depth_actual - depth) <= 1.5 / len(body)
    assert ids[prompt.needle_token] == haystack.tokenizer(prompt.facts[0][0], add_special_tokens=False)["input_ids"][0]
    for answer in prompt.answers:
        assert answer in prompt.text


def test_same_seed_same_prompts_other_seed_other_prompts():
    haystack = _haystack()
    first = make_prompts(haystack, list(LONG_TASKS), [800], [0.0, 0.5], samples=2, seed=3)
    again = make_prompts(_haystack(), list(LONG_TASKS), [800], [0.0, 0.5], samples=2, seed=3)
    other = make_prompts(haystack, list(LONG_TASKS), [800], [0.0, 0.5], samples=2, seed=4)
    assert [p.record() for p in first] == [p.record() for p in again]
    assert all(a.text != b.text for a, b in zip(first, other))
    samples = [p for p in first if p.task == "passkey" and p.depth == 0.0]
    assert samples[0].answers != samples[1].answers and samples[0].haystack_char_start != samples[1].haystack_char_start


def test_needles_of_each_task_hold_what_the_question_asks():
    haystack = _haystack()
    multikey = build_prompt(haystack, "niah_multikey", 800, 0.5, 0, 0)
    assert len(multikey.facts) == 4 and multikey.answers[0] in multikey.facts[0]
    assert all(multikey.answers[0] not in fact for fact in multikey.facts[1:])  # the others are distractors
    multivalue = build_prompt(haystack, "niah_multivalue", 800, 0.5, 0, 0)
    assert len(set(multivalue.answers)) == 4 and all(v in f for v, f in zip(multivalue.answers, multivalue.facts))
    chain = build_prompt(haystack, "vartrack", 800, 0.2, 0, 0)
    positions = [chain.text.index(fact) for fact in chain.facts]
    assert positions == sorted(positions)  # the chain is read front to back
    assert chain.facts[0].split("=")[1].strip(" .") in chain.text.rsplit("\n\n", 1)[1]  # the value is asked


@pytest.mark.parametrize(
    "task, generated, answers, expected",
    [
        ("passkey", " 12345. Remember", ["12345"], (True, 1.0)),
        ("passkey", " 123456", ["12345"], (False, 0.0)),  # a longer number is not the key
        ("passkey", " the key 9 then 12345", ["12345"], (False, 0.0)),  # the first number counts
        ("niah_multikey", "", ["1234567"], (False, 0.0)),
        ("niah_multivalue", " 111, 222 and 333", ["111", "222", "333", "444"], (False, 0.75)),
        ("niah_multivalue", " 444 333 222 111", ["111", "222", "333", "444"], (True, 1.0)),
        ("vartrack", " ABCDE, FGHIJ", ["ABCDE", "FGHIJ"], (True, 1.0)),
        ("vartrack", " ABCDEX, FGHIJ", ["ABCDE", "FGHIJ"], (False, 0.5)),  # whole words only
    ],
)
def test_scoring(task, generated, answers, expected):
    assert score(task, generated, answers) == expected


def test_wilson_interval_matches_the_formula_by_hand():
    # 5 of 10, z = 1.96: centre (0.5 + 0.19208) / 1.38416 = 0.5, half 1.96 sqrt(0.025 + 0.009604) / 1.38416
    low, high = wilson_interval(5, 10)
    half = 1.96 * math.sqrt(0.25 / 10 + 1.96**2 / 400) / (1 + 1.96**2 / 10)
    assert low == pytest.approx(0.5 - half) and high == pytest.approx(0.5 + half)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(6, 6)
    assert high == pytest.approx(1.0) and low == pytest.approx(6 / (6 + 1.96**2))  # p = 1: n / (n + z^2)
    table = accuracy_table(
        __import__("pandas").DataFrame({"task": ["a"] * 4, "length": [1] * 4, "correct": [1, 1, 0, 1],
                                        "recall": [1, 1, 0.5, 1]}), ["task", "length"])  # fmt: skip
    assert table.loc[0, "accuracy"] == 0.75 and table.loc[0, "recall"] == pytest.approx(0.875)


@pytest.mark.parametrize(
    "lengths, depths, message",
    [
        ([2048], [0.5], "exceeds the model's maximum positions"),
        ([512], [1.5], "outside [0, 1]"),
        ([512], [-0.1], "outside [0, 1]"),
    ],
)
def test_grid_refusals(lengths, depths, message):
    with pytest.raises(HeadlabError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_grid(lengths, depths, POSITIONS)


def test_short_corpus_and_lost_needle_are_refused():
    with pytest.raises(HeadlabError, match="corpus is too short"):
        build_prompt(_haystack(PROSE[:500]), "passkey", 1000, 0.5, 0, 0)
    no_digits = tiny_tokenizer()
    vocab = {t: i for t, i in no_digits.get_vocab().items() if not t.isdigit()}
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    with pytest.raises(HeadlabError, match="cannot round-trip the needle"):
        build_prompt(Haystack(tokenizer, PROSE, "prose"), "passkey", 600, 0.5, 0, 0)


# ---- decoding and NLL by position -----------------------------------------------------------------------------------


def _greedy_by_hand(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding without a cache: the whole sequence through the model at every step."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def test_batched_cached_generation_equals_uncached_greedy_by_hand():
    loaded = _loaded()
    prompts = make_prompts(_haystack(), ["passkey"], [400], [0.0, 0.5, 1.0], samples=1)
    texts = transformers_generate(loaded, prompts, 6)
    for prompt, text in zip(prompts, texts):
        ids = loaded.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        expected = _greedy_by_hand(loaded.model, ids, 6)
        assert text == loaded.tokenizer.decode(expected, skip_special_tokens=True)


def test_answers_are_cut_at_the_first_newline_and_scored():
    prompts = make_prompts(_haystack(), ["passkey"], [400], [0.5], samples=2)
    replies = iter([" " + prompts[0].answers[0] + "\n99999", " 1\n" + prompts[1].answers[0]])
    rows = answer_prompts(prompts, lambda batch, budget: [next(replies) for _ in batch], batch_size=1, progress=False)
    assert rows["generated"].tolist() == [" " + prompts[0].answers[0], " 1"]
    assert rows["correct"].tolist() == [True, False]


def test_position_nll_equals_log_softmax_of_the_full_logits():
    loaded = _loaded()
    ids = loaded.tokenizer(PROSE[:200], add_special_tokens=False)["input_ids"]
    ours = position_nll(loaded, [ids], progress=False)[0]
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([[1] + ids[:-1]])).logits[0]  # BOS = 1 in front
    expected = -torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    buckets, curve = position_tables(ours[None], edges=(0, 50, 150), bin_size=64)
    assert buckets[["start", "end", "tokens"]].values.tolist() == [[0, 50, 50], [50, 150, 100], [150, 200, 50]]
    assert buckets.loc[1, "nll"] == pytest.approx(float(expected[50:150].mean()))
    assert curve["tokens"].sum() == 200


def test_long_context_tables_on_a_tiny_model():
    loaded = _loaded()
    result = long_context(loaded, text=_text(), tasks=["passkey", "vartrack"], lengths=[600, 900],
                          depths=[0.0, 1.0], samples=2, position_sequences_count=2, progress=False)  # fmt: skip
    assert len(result.prompts) == 2 * 2 * 2 * 2
    assert set(result.cells["prompts"]) == {2} and len(result.cells) == 8
    assert set(result.lengths["prompts"]) == {4}
    assert (
        (result.lengths["ci_low"] <= result.lengths["accuracy"])
        & (result.lengths["accuracy"] <= result.lengths["ci_high"])
    ).all()
    assert result.positions[["start", "end"]].values.tolist() == [[0, 512], [512, 900]]
    assert result.positions["tokens"].tolist() == [2 * 512, 2 * 388]
    assert result.meta["position_source"] == "joined text" and result.meta["lengths"] == [600, 900]


def test_encoder_models_are_refused():
    loaded = from_model(tiny_model("bert"), tiny_tokenizer(encoder=True))
    with pytest.raises(HeadlabError, match="causal language model"):
        long_context(loaded, text=_text(), lengths=[32], progress=False)


# ---- the same prompts in lm-eval and llama.cpp ----------------------------------------------------------------------


def test_lm_eval_gives_the_same_outcome_per_prompt(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'headlab[lmeval]')")
    from headlab.runtimes.lm_eval_bridge import long_task_name, run_tasks, write_long_tasks

    loaded = _loaded()
    result = long_context(loaded, text=_text(), tasks=["passkey", "niah_multivalue"], lengths=[700], depths=[0.0, 0.6],
                          samples=2, position_sequences_count=0, progress=False)  # fmt: skip
    names = write_long_tasks(tmp_path / "tasks", result.prompt_list)
    assert names == sorted(long_task_name(t, 700) for t in ("passkey", "niah_multivalue"))
    import lm_eval

    captured = {}
    original = lm_eval.simple_evaluate

    def keep_samples(**kwargs):
        out = original(**{**kwargs, "log_samples": True})
        captured.update(out["samples"])
        return out

    lm_eval.simple_evaluate = keep_samples
    try:
        tasks = run_tasks(loaded, names, include_path=tmp_path / "tasks", max_length=POSITIONS, batch_size=1)
    finally:
        lm_eval.simple_evaluate = original
    for task in ("passkey", "niah_multivalue"):
        ours = result.prompts[result.prompts["task"] == task]
        theirs = sorted(captured[long_task_name(task, 700)], key=lambda s: s["doc_id"])
        assert [s["doc"]["prompt"] for s in theirs] == [p.text for p in result.prompt_list if p.task == task]
        assert [s["filtered_resps"][0] for s in theirs] == ours["generated"].tolist()
        assert [s["exact_match"] for s in theirs] == ours["correct"].astype(float).tolist()
        assert tasks.value(long_task_name(task, 700), "exact_match") == pytest.approx(ours["correct"].mean())


def test_llamacpp_decodes_the_same_answers(tmp_path):
    from headlab.runtimes.llamacpp import unavailable

    if unavailable():
        pytest.skip(unavailable())
    pytest.importorskip("gguf")
    from test_gguf import bpe_tokenizer, sharpened

    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.long_context import llamacpp_generate

    loaded = sharpened(
        from_model(tiny_model("llama", vocab_size=300, max_position_embeddings=POSITIONS), bpe_tokenizer())
    )
    path = tmp_path / "m.gguf"
    export_gguf(loaded, path, outtype="f32", progress=False)
    common = dict(text=_text(), tasks=["passkey"], lengths=[256], depths=[0.0, 0.5, 1.0], samples=2,
                  position_sequences_count=0, progress=False)  # fmt: skip
    ours = long_context(loaded, **common)
    theirs = long_context(loaded, generate=llamacpp_generate(loaded, path), **common)
    assert theirs.prompts["generated"].tolist() == ours.prompts["generated"].tolist()
    assert ours.prompts["generated"].str.len().gt(0).any()  # something was generated to compare


# ---- the command ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=POSITIONS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "prose.txt"
    path.write_text(PROSE)
    return path


def test_longeval_command_writes_tables_figures_and_lm_eval_tasks(checkpoint, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, stderr = run_cli(["longeval", "--model", checkpoint, "--data", corpus, "--split", "all",
                                    "--lengths", "500,800", "--depths", "0,1", "--samples", "1",
                                    "--tasks", "passkey,niah_single", "--out", out], capsys)  # fmt: skip
    assert code == 0, stderr
    for name in ("prompts", "cells", "lengths", "positions", "position_curve", "copying"):
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.parquet").is_file()
    copying = __import__("pandas").read_csv(out / "copying.csv")
    assert copying["length"].tolist() == [500, 800] and set(copying["sequences"]) == {2}
    assert copying["scored"].tolist() == [2 * 249, 2 * 399]  # the copy's tokens after its first
    assert "copy @ 500:" in stdout
    assert (out / "figures" / "needle_heatmap.png").stat().st_size > 1000
    assert (out / "figures" / "position_nll.png").stat().st_size > 1000
    meta = json.loads((out / "meta.json").read_text())
    assert meta["lengths"] == [500, 800] and meta["samples"] == 1 and meta["runtime"] == "transformers"
    yaml = (out / "lm_eval_tasks" / "headlab_long_passkey_500.yaml").read_text()
    assert str((out / "lm_eval_tasks" / "headlab_long_passkey_500.jsonl").resolve()) in yaml
    rows = (out / "lm_eval_tasks" / "headlab_long_passkey_500.jsonl").read_text().splitlines()
    assert len(rows) == 2 and json.loads(rows[0])["task"] == "passkey"
    assert "passkey" in stdout and "niah_single" in stdout
    redrawn = tmp_path / "redrawn"
    code, _, stderr = run_cli(["plot", out, "--out", redrawn], capsys)  # the figures come back from the tables alone
    assert code == 0, stderr
    assert {p.name for p in redrawn.iterdir()} >= {"needle_heatmap.png", "position_nll.png"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "4096"], "exceeds the model's maximum positions"),
        (["--depths", "0,1.5"], "outside [0, 1]"),
        (["--tasks", "needle"], "unknown ['needle']"),
        (["--lengths", "two"], "cannot read 'two'"),
        (["--lengths", "1000", "--data", "SHORT"], "corpus is too short"),
        (["--runtime", "llamacpp"], "give --model FILE.gguf"),
        (["--copy-sequences", "-1"], "--copy-sequences"),
    ],
)
def test_longeval_bad_input_is_one_line_and_writes_nothing(checkpoint, corpus, tmp_path, capsys, args, message):
    short = tmp_path / "short.txt"
    short.write_text(PROSE[:400])
    args = [str(short) if a == "SHORT" else a for a in args]
    base = ["longeval", "--model", checkpoint, "--data", corpus, "--split", "all", "--out", tmp_path / "run"]
    code, _, stderr = run_cli(base + args, capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "run").exists()


def test_longeval_refuses_an_encoder(tmp_path, capsys):
    model = save_tiny("bert", tmp_path / "bert")
    code, _, stderr = run_cli(["longeval", "--model", model, "--lengths", "32", "--out", tmp_path / "run"], capsys)
    assert code == 2 and "causal language model" in stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["convert-gqa", "--kv-heads", "1", "--no-eval"],
        ["convert-mla", "--budget", "gqa", "--no-eval"],
        ["prune", "--count", "4", "--uniform", "--mode", "physical", "--max-tokens", "256", "--seq-len", "64"],
    ],
)
def test_conversions_record_long_context_before_and_after(checkpoint, corpus, tmp_path, capsys, command):
    out = tmp_path / "converted"
    args = [*command, "--model", checkpoint, "--data", corpus, "--calibration-tokens", "256", "--long-context", "600",
            "--out", out]  # fmt: skip
    code, stdout, stderr = run_cli(args, capsys)
    assert code == 0, stderr
    table = __import__("pandas").read_csv(out / "long_context.csv")
    assert table["model"].tolist() == ["before", "after"] and set(table["length"]) == {600}
    assert set(table["prompts"]) == {6}  # 3 depths x 2 prompts
    positions = __import__("pandas").read_csv(out / "long_context_positions.csv")
    assert set(positions["model"]) == {"before", "after"}
    copying = __import__("pandas").read_csv(out / "long_context_copying.csv")
    assert copying["model"].tolist() == ["before", "after"] and set(copying["length"]) == {600}
    assert "passkey @ 600:" in stdout and "before" in stdout and "copy @ 600:" in stdout
    assert (out / "headlab.json").is_file()  # the checkpoint itself is unchanged in kind


def test_streaming_conversion_cannot_measure_long_context(checkpoint, tmp_path, capsys):
    args = ["convert-gqa", "--model", checkpoint, "--kv-heads", "1", "--streaming", "--long-context", "600", "--out",
            tmp_path / "out"]  # fmt: skip
    code, _, stderr = run_cli(args, capsys)
    assert code == 2 and "cannot measure --long-context" in stderr and not (tmp_path / "out").exists()


def test_prune_refuses_a_bad_request_before_measuring_long_context(checkpoint, corpus, tmp_path, capsys, monkeypatch):
    import headlab.cli.prune as prune_command

    def never(*args, **kwargs):
        raise AssertionError("the long-context measurement ran before the request was checked")

    monkeypatch.setattr(prune_command, "measure", never)
    args = ["prune", "--count", "100000", "--model", checkpoint, "--data", corpus, "--long-context", "600", "--out",
            tmp_path / "out"]  # fmt: skip
    code, _, stderr = run_cli(args, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "out").exists()
