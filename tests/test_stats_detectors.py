"""The head detectors of `headlab stats` beside the attention statistics: duplicate_token (the induction pass's second
target) against eager maps, successor and copy_suppression (effective OV circuit) against a dense [V x V] computation
on tiny vocabularies, detection patterns (TransformerLens detect_head, "mul" and "abs") by hand and against a plain
re-implementation of TransformerLens's formula on eager maps, the `name` column, bad input and the command."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from models import ENCODER_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.arch import AttentionLayer
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.detectors import (
    DETECTION_PATTERNS,
    PatternDetector,
    copy_suppression_scores,
    frequent_tokens,
    ov_circuit,
    ov_logits,
    succession_forms,
    successor_scores,
)
from headlab.measure.stats import (
    STATISTICS,
    StatisticsCollector,
    detect_heads,
    head_statistics,
    induction_batches,
    wide_statistics,
)
from headlab.mechanisms.capture import AttentionChunk, capture_attention

TYPES = ["llama", "gpt2", "gemma3_text", "qwen2", "opt", "gpt_neox", "bert"]


def _model(name: str, dtype=torch.float64):
    return tiny_model(name, attn_implementation="eager").to(dtype)


# ---- duplicate_token ---------------------------------------------------------------------------------------------


def _target_reference(maps, attention_mask, targets: dict) -> dict:
    """layer -> name -> mean A[b, h, i, t(i)] per head over real rows whose target t(i) >= 0 is visible (weight > 0
    in some head), from full eager maps."""
    out = {}
    for index, A in enumerate(maps):
        A = A.double()
        B, H, T, _ = A.shape
        out[index] = {}
        for name, target in targets.items():
            values = [[] for _ in range(H)]
            for b in range(B):
                for i in range(T):
                    j = int(target[b, i])
                    if attention_mask[b, i] and j >= 0 and bool((A[b, :, i, j] > 0).any()):
                        for h in range(H):
                            values[h].append(float(A[b, h, i, j]))
            out[index][name] = [sum(v) / len(v) if v else math.nan for v in values]
    return out


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "gpt2", "bert"])
def test_named_targets_match_eager_maps_with_padding_and_chunks(name):
    """Two named targets in one pass (induction i-5 and duplicate_token i-6 of a right-padded batch), chunks of 5 rows,
    against eager maps; gemma3's sliding window (4) hides both targets in its sliding layer (NaN there)."""
    model = _model(name)
    loaded = from_model(model)
    inputs = tiny_inputs(name, batch=3, seq=14)
    # At most 3 padding tokens: every padding row of a sliding layer (window 4) still sees a key, so eager's maps stay
    # finite (a row that sees none turns NaN there, and the next layer's maps with it).
    inputs["attention_mask"][1, 11:] = 0
    inputs["attention_mask"][2, 12:] = 0
    rows = torch.arange(14)
    targets = {
        "induction": torch.where(rows >= 6, rows - 5, -1).expand(3, 14),
        "duplicate_token": torch.where(rows >= 6, rows - 6, -1).expand(3, 14),
    }
    with torch.no_grad():
        maps = model(**inputs, output_attentions=True).attentions
    assert not any(bool(A.isnan().any()) for A in maps)
    reference = _target_reference(maps, inputs["attention_mask"], targets)
    collector = StatisticsCollector(loaded.layers, is_encoder=name in ENCODER_TYPES, induction_only=True)
    collector.set_batch(targets=targets)
    with torch.no_grad(), capture_attention(model, loaded.layers, collector.on_chunk, None, chunk_size=5):
        model(**inputs)
    means = collector.means()
    for layer in loaded.layers:
        for statistic, expected in reference[layer.index].items():
            got = means[layer.index][statistic][0].tolist()
            assert got == pytest.approx(expected, abs=1e-6, nan_ok=True), (layer.index, statistic)


def test_duplicate_token_through_head_statistics():
    """The induction pass's sequences (BOS + S random tokens twice, batches of 2 with a shorter last batch): the
    duplicate_token column is A[i, i-S] over the second copy, equal to eager maps of the same sequences, and it
    ranks the heads as the reference does."""
    model = _model("llama")
    loaded = from_model(model, tiny_tokenizer())
    ids = torch.randint(10, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    settings = dict(induction_len=7, induction_count=3, retrieval=False, ov=False, chunk_size=4, batch_size=2)
    wide = wide_statistics(head_statistics(loaded, [(ids, torch.ones_like(ids))], progress=False, **settings))
    sums: dict = {}
    for batch_ids, mask, targets in induction_batches(loaded, length=7, count=3, seed=0, batch_size=2):
        assert (targets["duplicate_token"] >= 0).sum() == (targets["induction"] >= 0).sum() == 7 * len(batch_ids)
        assert bool((batch_ids.gather(1, targets["duplicate_token"].clamp(min=0)) == batch_ids)[:, 8:].all())
        with torch.no_grad():
            maps = model(input_ids=batch_ids, attention_mask=mask, output_attentions=True).attentions
        for index, values in _target_reference(maps, mask, targets).items():
            for name, per_head in values.items():
                n = 7 * len(batch_ids)
                total = sums.setdefault((index, name), [0.0] * len(per_head))
                sums[(index, name)] = [s + v * n for s, v in zip(total, per_head)]
    for layer in loaded.layers:
        rows = wide[wide["layer"] == layer.index]
        for name in ("induction", "duplicate_token"):
            expected = [v / 21 for v in sums[(layer.index, name)]]
            assert rows[name].tolist() == pytest.approx(expected, abs=1e-6), name
            assert rows[name].rank().tolist() == pd.Series(expected).rank().tolist()  # Spearman 1


# ---- effective OV circuit: successor and copy suppression ----------------------------------------------------------

FINAL_NORM = {  # the final norm's gain as each family applies it, read without the adapter
    "llama": lambda m: m.model.norm.weight,
    "qwen2": lambda m: m.model.norm.weight,
    "gemma3_text": lambda m: 1.0 + m.model.norm.weight,
    "gpt2": lambda m: m.transformer.ln_f.weight,
    "opt": lambda m: m.model.decoder.final_layer_norm.weight,
    "gpt_neox": lambda m: m.gpt_neox.final_layer_norm.weight,
}


def _randomised(name: str):
    """A tiny float64 model whose final norm has a random gain (ones would hide a missing gain)."""
    model = _model(name)
    with torch.no_grad():
        gain = FINAL_NORM[name](model)
        weight = gain if isinstance(gain, torch.nn.Parameter) else model.model.norm.weight
        weight.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(1), dtype=weight.dtype) + 0.5)
    return from_model(model, tiny_tokenizer())


def _dense_ov(loaded, name: str) -> dict[int, torch.Tensor]:
    """layer -> [H, V, V]: logits[h, t, u] = W_U[u] . (g * W_O,h W_V,h W_E[t]), the whole vocabulary at once."""
    model = loaded.model
    embed = model.get_input_embeddings().weight.double()
    unembed = model.get_output_embeddings().weight.double() * FINAL_NORM[name](model).double()
    out = {}
    for layer in loaded.layers:
        weights = loaded.adapter.read(layer)
        heads = []
        for h in range(layer.num_heads):
            ov = weights.o[:, h].double() @ weights.v[layer.kv_head_of(h)].double()  # [C, C]
            heads.append(embed @ ov.T @ unembed.T)  # [V, V]
        out[layer.index] = torch.stack(heads)
    return out


@pytest.mark.parametrize("name", list(FINAL_NORM))
def test_ov_logits_equal_the_dense_circuit_in_any_chunking(name):
    loaded = _randomised(name)
    dense = _dense_ov(loaded, name)
    inputs, outputs = torch.tensor([3, 17, 40, 41, 99, 127, 12]), torch.tensor([5, 17, 99, 0])
    for layer in loaded.layers:
        blocks = list(ov_logits(loaded, layer, inputs, outputs, chunk=3))
        assert [b.shape[1] for _, b in blocks] == [3, 3, 1]
        got = torch.cat([b for _, b in blocks], dim=1)
        torch.testing.assert_close(got, dense[layer.index][:, inputs][:, :, outputs], atol=1e-9, rtol=1e-9)
        whole = torch.cat([b for _, b in ov_logits(loaded, layer, inputs, chunk=2)], dim=1)  # the whole vocabulary
        torch.testing.assert_close(whole, dense[layer.index][:, inputs], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", list(FINAL_NORM))
def test_successor_equals_the_dense_reference(name):
    """Character tokens: the digits 1..9 and letters A..Z are the single-token sequences; each pair (t, succ(t))
    counts when succ(t) has the highest logit among its sequence's tokens."""
    loaded = _randomised(name)
    forms = succession_forms(loaded.tokenizer)
    assert [f for f, _ in forms] == ["numbers", "letters"]
    assert [sum(i is not None for i in ids) for _, ids in forms] == [9, 26]
    dense = _dense_ov(loaded, name)
    scores = successor_scores(loaded, forms)
    for layer in loaded.layers:
        hits, pairs = [0] * layer.num_heads, 0
        for _, ids in forms:
            members = [i for i in ids if i is not None]
            for t, succ in zip(ids, ids[1:]):
                if t is None or succ is None:
                    continue
                pairs += 1
                for h in range(layer.num_heads):
                    row = dense[layer.index][h, t]
                    hits[h] += all(row[succ] > row[u] for u in members if u != succ)
        mean, counted = scores[layer.index]
        assert counted == pairs == 8 + 25
        assert mean.tolist() == pytest.approx([x / pairs for x in hits], abs=1e-12)


@pytest.mark.parametrize("name", list(FINAL_NORM))
@pytest.mark.parametrize("subset", [False, True], ids=["vocabulary", "subset"])
def test_copy_suppression_equals_the_dense_reference(name, subset):
    """t counts when fewer than k tokens of S have a strictly lower logit than t's own; S the whole (non-special)
    vocabulary, or 40 of its tokens."""
    loaded = _randomised(name)
    tokens = torch.arange(10, 128)
    if subset:
        tokens = tokens[torch.randperm(len(tokens), generator=torch.Generator().manual_seed(2))[:40]]
    dense = _dense_ov(loaded, name)
    scores = copy_suppression_scores(loaded, tokens, k=10)
    for layer in loaded.layers:
        sub = dense[layer.index][:, tokens][:, :, tokens]  # [H, n, n]
        expected = []
        for h in range(layer.num_heads):
            own = sub[h].diagonal()
            lower = (sub[h] < own[:, None]).sum(-1)  # tokens of S below t's own logit
            expected.append(float((lower < 10).double().mean()))
        mean, counted = scores[layer.index]
        assert counted == len(tokens) and mean.tolist() == pytest.approx(expected, abs=1e-12)


def test_ov_scores_do_not_apply_to_encoders_and_need_tokens():
    with pytest.raises(HeadlabError, match="encoder"):
        ov_circuit(from_model(tiny_model("bert")))
    loaded = _randomised("llama")
    assert math.isnan(copy_suppression_scores(loaded, torch.arange(10, 20), k=10)[0][0][0].item())
    with pytest.raises(HeadlabError, match="k >= 1"):
        copy_suppression_scores(loaded, torch.arange(10, 20), k=0)
    assert frequent_tokens(torch.tensor([0.0, 5, 2, 5, 0, 1]), 3, exclude={1}).tolist() == [3, 2, 5]


def test_ov_scores_run_on_latent_attention():
    """MLA: W_V reaches the hidden state through the latent (adapter.ov_weights); the scores are finite."""
    from models import MLA_SPECS

    name = next(iter(MLA_SPECS))
    loaded = from_model(tiny_model(name), tiny_tokenizer())
    scores = successor_scores(loaded, succession_forms(loaded.tokenizer))
    suppression = copy_suppression_scores(loaded, torch.arange(10, 128))
    assert all(bool(torch.isfinite(scores[i][0]).all() and torch.isfinite(suppression[i][0]).all()) for i in scores)


def test_ov_scores_through_head_statistics():
    """The tables carry successor and copy_suppression (S: the text pass's tokens, specials left out); an encoder
    and a model without a tokenizer get NaN and the reason in meta."""
    loaded = _randomised("llama")
    ids = torch.randint(10, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    batches = [(ids, torch.ones_like(ids))]
    tidy = head_statistics(loaded, batches, induction=False, retrieval=False, progress=False)
    wide = wide_statistics(tidy)
    tokens = frequent_tokens(torch.bincount(ids.flatten(), minlength=128).double(), 2000)
    expected = copy_suppression_scores(loaded, tokens)
    successor = successor_scores(loaded, succession_forms(loaded.tokenizer))
    for layer in loaded.layers:
        rows = wide[wide["layer"] == layer.index]
        assert rows["copy_suppression"].tolist() == pytest.approx(expected[layer.index][0].tolist(), abs=1e-12)
        assert rows["successor"].tolist() == pytest.approx(successor[layer.index][0].tolist(), abs=1e-12)
    meta = tidy.attrs["meta"]
    assert meta["copy_suppression"]["tokens"] == len(tokens) and meta["successor"]["pairs"] == 33
    off = wide_statistics(head_statistics(loaded, batches, induction=False, retrieval=False, ov=False, progress=False))
    assert off["successor"].isna().all() and off["copy_suppression"].isna().all()
    for model, tokenizer, reason in (
        (tiny_model("bert"), tiny_tokenizer(encoder=True), "encoder"),
        (tiny_model("llama"), None, "tokenizer"),
    ):
        tidy = head_statistics(from_model(model, tokenizer), batches, induction=False, retrieval=False, progress=False)
        assert wide_statistics(tidy)["successor"].isna().all()
        assert reason in tidy.attrs["meta"]["successor"]["skipped"]


# ---- detection patterns --------------------------------------------------------------------------------------------


def _detect_by_hand(probs, pattern, measure, chunk=2, **excludes):
    """PatternDetector on hand-made weights [1, H, T, T] (all tokens real), fed in query chunks."""
    H, T = probs.shape[1], probs.shape[2]
    layer = AttentionLayer(0, 0, torch.nn.Identity(), H, H, 4)
    detector = PatternDetector([layer], pattern, measure, **excludes)
    ids, valid = torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool)
    detector.set_batch(ids, valid.long())
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    for start in range(0, T, chunk):
        rows = slice(start, start + chunk)
        detector.on_chunk(
            AttentionChunk(layer, probs[:, :, rows], visible[None, None, rows], start, valid[:, rows], valid)
        )
    return detector.means()[0][0].tolist()


def test_detection_scores_by_hand():
    """Four tokens; head 0 attends to the previous token (row 0 to itself), head 1 half to itself, half to token 0
    (row 0 wholly to itself). Previous-token pattern: P[i, i-1] = 1 for i = 1..3."""
    previous = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.float64)
    halves = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [0.5, 0, 0.5, 0], [0.5, 0, 0, 0.5]], dtype=torch.float64)
    probs = torch.stack([previous, halves])[None]
    # mul: sum(A * P) / sum(A) = 3/4 and (1 + 0 + 0) / 4 (row 1 of head 1 puts its 1 on key 0 = i-1)
    assert _detect_by_hand(probs, "previous_token", "mul") == pytest.approx([0.75, 0.25])
    # abs: 1 - sum|A - P| / T: head 0 differs only in row 0 (1); head 1 in row 0 (1), rows 2, 3 (0.5+1+0.5 each)
    assert _detect_by_hand(probs, "previous_token", "abs") == pytest.approx([1 - 1 / 4, 1 - 5 / 4])
    # exclude_bos drops key 0 from A (mul: head 1 keeps 0.5 + 0.5 of mass, none on P) and from |A - P| (head 1:
    # rows 2 and 3 keep 1 + 0.5 each)
    assert _detect_by_hand(probs, "previous_token", "mul", exclude_bos=True) == pytest.approx([2 / 2, 0.0])
    assert _detect_by_hand(probs, "previous_token", "abs", exclude_bos=True) == pytest.approx([1.0, 1 - 3 / 4])
    # exclude_current_token drops the diagonal: head 1 keeps mass 1 + 0.5 + 0.5 on keys off the diagonal
    assert _detect_by_hand(probs, "previous_token", "mul", exclude_current_token=True) == pytest.approx([1.0, 0.5])
    custom = _detect_by_hand(
        probs, lambda tokens, start, stop: torch.ones(stop - start, len(tokens)).tril(start), "mul"
    )
    assert custom == pytest.approx([1.0, 1.0])


def _tl_patterns(tokens: np.ndarray) -> dict:
    """TransformerLens head_detector's named patterns, as written there (numpy, roll and tril)."""
    n = len(tokens)
    previous = torch.zeros(n, n)
    previous[1:, :-1] = torch.eye(n - 1)
    token_pattern = np.tile(tokens, (n, 1))
    eq = np.equal(token_pattern, token_pattern.T).astype(int)
    np.fill_diagonal(eq, 0)
    duplicate = torch.tril(torch.as_tensor(eq).float())
    shifted = torch.roll(duplicate, shifts=1, dims=1)
    induction = torch.tril(torch.cat((torch.zeros(n, 1), shifted[:, 1:]), dim=1))
    return {"previous_token": torch.tril(previous), "duplicate_token": duplicate, "induction": induction}


def _tl_score(A, P, measure, exclude_bos=False, exclude_current_token=False) -> float:
    """TransformerLens's compute_head_attention_similarity_score, without its rounding to 3 decimals."""
    A = A.clone()
    if measure == "mul":
        if exclude_bos:
            A[:, 0] = 0
        if exclude_current_token:
            A.fill_diagonal_(0)
        return float((A * P).sum() / A.sum())
    diff = (A - P).abs()
    if exclude_bos:
        diff[:, 0] = 0
    if exclude_current_token:
        diff.fill_diagonal_(0)
    return 1 - float(diff.mean() * len(diff))


TEXTS = ["abcabcabc xyz abc", "the cat sat on the mat, the cat sat", "aaaa bbbb aaaa", "hello hello"]


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3_text", "opt", "bert"])
def test_detect_heads_matches_transformer_lens_formula_on_eager_maps(name):
    """Texts of different lengths (padded batches of 3), chunks of 4 rows, every named pattern, both measures, and the
    exclusions, against TransformerLens's formula on each text's eager maps, one text at a time."""
    model = _model(name)
    encoder = name in ENCODER_TYPES
    loaded = from_model(model, tiny_tokenizer(encoder=encoder))
    frame = ([4], [5]) if encoder else ([1], [])
    maps = []
    for text in TEXTS:
        ids = frame[0] + loaded.tokenizer(text, add_special_tokens=False)["input_ids"] + frame[1]
        with torch.no_grad():
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        maps.append((np.array(ids), [A[0].double() for A in attentions]))
    cases = [("mul", {}), ("abs", {}), ("mul", {"exclude_bos": True}), ("abs", {"exclude_current_token": True})]
    for pattern in DETECTION_PATTERNS:
        for measure, excludes in cases:
            got = detect_heads(loaded, pattern, TEXTS, measure, batch_size=3, chunk_size=4, **excludes)
            for layer in loaded.layers:
                expected = [
                    np.mean(
                        [
                            _tl_score(A[layer.index][h], _tl_patterns(ids)[pattern], measure, **excludes)
                            for ids, A in maps
                        ]
                    )
                    for h in range(layer.num_heads)
                ]
                assert got[layer.index].tolist() == pytest.approx(expected, abs=1e-6), (pattern, measure, excludes)
                ranks = pd.Series(got[layer.index].tolist()).rank().tolist()
                assert ranks == pd.Series(expected).rank().tolist()  # Spearman 1


def test_detect_heads_on_batches_leaves_padding_out():
    """Token batches: a right-padded row scores as that row alone, unpadded."""
    loaded = from_model(_model("qwen2"))
    ids = tiny_inputs("qwen2", batch=2, seq=12)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    padded = detect_heads(loaded, "duplicate_token", [(ids, mask)], "abs", chunk_size=5)
    apart = detect_heads(loaded, "duplicate_token", [(ids[:1], mask[:1]), (ids[1:, :7], mask[1:, :7])], "abs")
    for index in padded:
        torch.testing.assert_close(padded[index], apart[index], atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda loaded: detect_heads(loaded, "magic", ["abc"]), "unknown detection pattern 'magic'"),
        (lambda loaded: detect_heads(loaded, "induction", ["abc"], "sq"), "unknown error_measure='sq'"),
        (lambda loaded: detect_heads(loaded, 3, ["abc"]), "a detection pattern is a name"),
        (lambda loaded: detect_heads(loaded, lambda t, a, b: torch.ones(2, 2), ["abcd"]), "rows of shape"),
        (lambda loaded: detect_heads(loaded, "induction", []), "no texts"),
        (
            lambda loaded: head_statistics(loaded, [(torch.ones(1, 4).long(),) * 2], detect=("magic",), progress=False),
            "unknown detection pattern",
        ),
        (
            lambda loaded: head_statistics(
                loaded, [(torch.ones(1, 4).long(),) * 2], detect_measure="x", progress=False
            ),
            "error_measure='x'",
        ),
    ],
)
def test_bad_detection_input_is_one_line(call, message):
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    with pytest.raises(HeadlabError, match=message.replace("(", r"\(")) as error:
        call(loaded)
    assert "\n" not in str(error.value)


def test_detect_columns_and_names_in_the_tables():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    ids = torch.randint(10, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    tidy = head_statistics(
        loaded,
        [(ids, torch.ones_like(ids))],
        induction=False,
        retrieval=False,
        detect=("induction", "previous_token"),
        detect_measure="abs",
        progress=False,
    )
    wide = wide_statistics(tidy)
    assert list(tidy.columns) == ["layer", "head", "kv_head", "name", "statistic", "value"]
    columns = ["layer", "head", "kv_head", "name", *STATISTICS, "detect_induction", "detect_previous_token"]
    assert list(wide.columns) == columns
    assert wide["name"].tolist() == [f"L{la}H{h}" for la in range(2) for h in range(4)]
    expected = detect_heads(loaded, "previous_token", [(ids, torch.ones_like(ids))], "abs")
    for layer in loaded.layers:
        got = wide.loc[wide["layer"] == layer.index, "detect_previous_token"].tolist()
        assert got == pytest.approx(expected[layer.index].tolist(), abs=1e-9)
    assert tidy.attrs["meta"]["detect"] == {
        "patterns": ["detect_induction", "detect_previous_token"],
        "error_measure": "abs",
    }
    old = tidy.drop(columns="name")  # a tidy table from before the name column still widens
    pd.testing.assert_frame_equal(wide_statistics(old), wide)


def test_cli_detect(tmp_path, capsys):
    model = save_tiny("llama", tmp_path / "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT)
    common = ["stats", "--model", model, "--data", corpus, "--device", "cpu", "--seq-len", "32", "--max-tokens", "96"]
    out = tmp_path / "stats"
    args = [*common, "--induction-len", "8", "--detect", "previous_token", "--detect", "induction", "--out", out]
    code, stdout, stderr = run_cli(args, capsys)
    assert code == 0, stderr
    wide = pd.read_csv(out / "stats_wide.csv")
    assert {"name", "detect_previous_token", "detect_induction", "successor", "copy_suppression"} <= set(wide.columns)
    assert wide["detect_previous_token"].notna().all() and wide["duplicate_token"].notna().all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["detect"]["error_measure"] == "mul" and meta["successor"]["pairs"] == 33
    code, _, stderr = run_cli([*common, "--detect", "magic", "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "magic" in stderr and len(stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_embedded_induction_and_duplicate_scores_agree_with_a_transformer_lens_style_loop():
    """The embedded model's induction and duplicate-token scores (headlab's defaults: the fast kernel, 8 seeded
    sequences of 64 tokens) rank the 270 heads as a plain eager loop does on its own sample, written as
    TransformerLens's tutorials score them: BOS + x + x with x uniform over the whole vocabulary (special tokens
    included), output_attentions, and the mean over the second copy of A[i, i-S+1] (induction) and A[i, i-S]
    (duplicate token)."""
    from headlab.core.loading import load_model
    from headlab.viz.plots import spearman

    loaded = load_model(None, device="cpu")
    tidy = head_statistics(loaded, max_tokens=256, retrieval=False, progress=False)
    wide = wide_statistics(tidy).set_index(["layer", "head"])
    eager = load_model(None, device="cpu", attn_implementation="eager")
    S, B = 64, 16
    tokens = torch.randint(0, eager.model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1234))
    ids = torch.cat([torch.full((B, 1), eager.tokenizer.bos_token_id), tokens, tokens], dim=1)
    with torch.no_grad():
        maps = eager.model(input_ids=ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    reference = {"induction": {}, "duplicate_token": {}}
    for layer, weights in enumerate(maps):
        for head in range(weights.shape[1]):
            sums, n = {"induction": 0.0, "duplicate_token": 0.0}, 0
            for b in range(B):
                for i in range(1 + S, 1 + 2 * S):
                    sums["induction"] += float(weights[b, head, i, i - S + 1])
                    sums["duplicate_token"] += float(weights[b, head, i, i - S])
                    n += 1
            for name in sums:
                reference[name][(layer, head)] = sums[name] / n
    for name, values in reference.items():
        heads = list(values)
        assert len(heads) == 270
        rho = spearman(pd.Series([wide.loc[h, name] for h in heads]), pd.Series([values[h] for h in heads]))
        assert rho >= 0.95, (name, rho)


@pytest.mark.parametrize("name", list(FINAL_NORM))
def test_an_ov_circuit_of_some_tokens_gives_their_logits(name):
    """ov_circuit(loaded, tokens) keeps only those rows of W_E and W_U (an 8B vocabulary's are 2 GiB each in float32):
    the same logits for them, and a one-line refusal for a token it does not hold or for the whole vocabulary."""
    loaded = _randomised(name)
    inputs, outputs = torch.tensor([40, 3, 17, 3]), torch.tensor([99, 17, 5])
    some = ov_circuit(loaded, torch.cat([inputs, outputs]))
    assert some.embed.shape[0] == 5
    for layer in loaded.layers:
        whole = torch.cat([b for _, b in ov_logits(loaded, layer, inputs, outputs)], dim=1)
        torch.testing.assert_close(torch.cat([b for _, b in ov_logits(loaded, layer, inputs, outputs, circuit=some)],
                                             dim=1), whole, atol=0, rtol=0)  # fmt: skip
    with pytest.raises(HeadlabError, match="other tokens"):
        next(ov_logits(loaded, loaded.layers[0], torch.tensor([41]), outputs, circuit=some))
    with pytest.raises(HeadlabError, match="whole vocabulary"):
        next(ov_logits(loaded, loaded.layers[0], inputs, circuit=some))
