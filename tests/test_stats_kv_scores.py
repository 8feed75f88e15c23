"""The KV-cache policy statistics of `headlab stats`: the streaming mass stream_<W> (sinks + recent window) and the
retrieval score (attention of an answer token's query on the needle token it copies) equal slow, obvious
implementations on eager attention maps; the retrieval targets point at the pass key in the needle; bad lengths are
refused; the score sources and the command carry them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from models import ALL_TYPES, ENCODER_TYPES, tiny_inputs, tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.arch import AttentionLayer
from headlab.core.data import Corpus, TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.measure.stats import (
    SINK_TOKENS,
    STATISTICS,
    STREAMING_WINDOWS,
    StatisticsCollector,
    _collect_retrieval,
    head_statistics,
    retrieval_depths,
    retrieval_minimum,
    retrieval_sequences,
    retrieval_statistics,
    wide_statistics,
)
from headlab.mechanisms.capture import AttentionCapture, AttentionChunk, capture_attention
from headlab.pruning.scores import ScoreRequest, score_heads

WINDOWS = (2, 3, 5)  # small windows, so that 12-token test sequences have rows reaching past them

# ---- slow references ---------------------------------------------------------------------------------------------


def _stream_reference(attentions, attention_mask, windows) -> dict:
    """stream_W per layer and head from full maps [B, H, T, T], row by row with Python sets: the keys kept are the
    first SINK_TOKENS real tokens and the keys with |i - j| < W; a row counts when a visible key (weight > 0 in any
    head) is outside them."""
    out = {}
    for index, A in enumerate(attentions):
        B, H, T, _ = A.shape
        A = A.double()
        values = {w: [[] for _ in range(H)] for w in windows}
        for b in range(B):
            real = [j for j in range(T) if attention_mask[b, j]]
            sinks = set(real[:SINK_TOKENS])
            for i in real:
                seen = set((A[b, :, i] > 0).any(0).nonzero()[:, 0].tolist())
                for w in windows:
                    kept = sinks | {j for j in range(T) if abs(i - j) < w}
                    if seen - kept:
                        mass = A[b, :, i, sorted(kept)].sum(-1)  # [H]
                        for h in range(H):
                            values[w][h].append(float(mass[h]))
        out[index] = {f"stream_{w}": [sum(v) / len(v) if v else math.nan for v in values[w]] for w in windows}
    return out


def _retrieval_reference(model, sequences) -> dict:
    """Mean A[i, target(i)] per layer and head from eager maps of each sequence run alone (no padding)."""
    sums: dict = {}
    for ids, target in sequences:
        with torch.no_grad():
            maps = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        rows = [i for i, t in enumerate(target) if t >= 0]
        for index, A in enumerate(maps):
            picked = torch.stack([A[0, :, i, target[i]].double() for i in rows])  # [rows, H]
            total, count = sums.get(index, (0.0, 0))
            sums[index] = (total + picked.sum(0), count + len(rows))
    return {index: (total / count).tolist() for index, (total, count) in sums.items()}


def _text(tokenizer, ids) -> str:
    """The tokens' text, each decoded alone and joined (the character-level test tokenizer spaces a joint decode)."""
    return "".join(tokenizer.decode([token]) for token in ids)


# ---- streaming ---------------------------------------------------------------------------------------------------


def test_streaming_by_hand_on_uniform_causal_attention():
    """Row i spreads 1/(i+1) over keys 0..i: stream_W = |sinks u window| / (i+1) on rows i >= W + SINK_TOKENS (the
    first row with a key outside both), chunks of 3 rows."""
    T = 12
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = (causal.double() / torch.arange(1, T + 1)[:, None])[None, None]
    layer = AttentionLayer(0, 0, torch.nn.Identity(), 1, 1, 4)
    collector = StatisticsCollector([layer], windows=WINDOWS)
    valid = torch.ones(1, T, dtype=torch.bool)
    for start in range(0, T, 3):
        seen = causal[None, None, start : start + 3]
        collector.on_chunk(AttentionChunk(layer, probs[:, :, start : start + 3], seen, start, valid[:, :3], valid))
    means = collector.means()[0]
    for w in WINDOWS:
        rows = range(w + SINK_TOKENS, T)
        expected = sum((SINK_TOKENS + w) / (i + 1) for i in rows) / len(rows)
        mean, count = means[f"stream_{w}"]
        assert count == len(rows) and mean.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pattern", ["causal", "sliding", "bidirectional"])
def test_streaming_matches_the_reference_on_random_maps(pattern):
    """Random weights over the visible keys of a left- and right-padded batch (so the sinks are not keys 0..3), fed
    in chunks of 4 rows: causal, sliding window of 6 keys, bidirectional."""
    B, H, T = 3, 2, 20
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 15:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    rule = {"causal": j <= i, "sliding": (j <= i) & (j > i - 6), "bidirectional": torch.ones(T, T, dtype=torch.bool)}
    visible = rule[pattern][None] & mask.bool()[:, None, :]  # [B, T, T]
    visible |= torch.eye(T, dtype=torch.bool)[None]  # padding rows see themselves (their values never count)
    probs = torch.rand(B, H, T, T, generator=generator, dtype=torch.float64) * visible[:, None]
    probs = probs / probs.sum(-1, keepdim=True)
    layer = AttentionLayer(0, 0, torch.nn.Identity(), H, H, 4)
    collector = StatisticsCollector([layer], windows=WINDOWS)
    real = mask.bool()
    for start in range(0, T, 4):
        rows = slice(start, start + 4)
        chunk = AttentionChunk(layer, probs[:, :, rows], visible[:, None, rows], start, real[:, rows], real)
        collector.on_chunk(chunk)
    reference = _stream_reference([probs], mask, WINDOWS)[0]
    means = collector.means()[0]
    for statistic, expected in reference.items():
        assert not any(math.isnan(v) for v in expected)
        assert means[statistic][0].tolist() == pytest.approx(expected, abs=1e-12), statistic


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-6), (torch.float32, 1e-6)], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ALL_TYPES)
def test_streaming_matches_eager_maps(name, dtype, tolerance):
    """Right-padded batch, chunks of 5 rows, sliding-window layers (gemma3, mistral: window 4) and encoders
    (symmetric window). Left padding is left to the random maps above: eager turns a padding row that sees no key
    into NaN, and the next layer's maps with it."""
    if dtype == torch.float64 and name == "qwen3_next":
        pytest.skip("qwen3_next's MoE grouped matmul has no float64 kernel")
    model = tiny_model(name, attn_implementation="eager").to(dtype)
    loaded = from_model(model)
    inputs = tiny_inputs(name, batch=3, seq=14)
    inputs["attention_mask"][1, 10:] = 0
    inputs["attention_mask"][2, 7:] = 0
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True).attentions
    real = inputs["attention_mask"].bool()[:, None, :, None]
    if any(bool(A.isnan().masked_select(real).any()) for A in eager):
        pytest.skip("the eager reference itself is NaN on real rows")
    reference = _stream_reference(eager, inputs["attention_mask"], WINDOWS)
    collector = StatisticsCollector(loaded.layers, is_encoder=name in ENCODER_TYPES, windows=WINDOWS)
    with torch.no_grad(), capture_attention(model, loaded.layers, collector.on_chunk, None, chunk_size=5):
        model(**inputs)
    means = collector.means()
    for layer in loaded.layers:
        assert not any(math.isnan(v) for v in reference[layer.index]["stream_2"])  # every head has counted rows
        for statistic, expected in reference[layer.index].items():
            got = means[layer.index][statistic][0].tolist() if statistic in means[layer.index] else [math.nan] * 4
            assert got == pytest.approx(expected, abs=tolerance, nan_ok=True), (layer.index, statistic)


def test_default_windows_through_head_statistics():
    """stream_16/64/256 of head_statistics on 400-token windows (both right-padded, so the last chunk's keys stop
    short of it), chunks of 64 rows (later chunks start past the largest window), against the reference; the tidy
    and wide tables carry them under those names."""
    model = tiny_model("llama", max_position_embeddings=512).double()
    loaded = from_model(model)
    ids = torch.randint(10, 128, (2, 400), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 390:] = 0
    mask[1, 200:] = 0
    wide = wide_statistics(
        head_statistics(loaded, [(ids, mask)], induction=False, retrieval=False, chunk_size=64, progress=False)
    )
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    reference = _stream_reference(eager, mask, STREAMING_WINDOWS)
    assert STREAMING_WINDOWS == (16, 64, 256)
    for layer in loaded.layers:
        rows = wide[wide["layer"] == layer.index]
        for window in STREAMING_WINDOWS:
            got = rows[f"stream_{window}"].tolist()
            assert got == pytest.approx(reference[layer.index][f"stream_{window}"], abs=1e-6), window


# ---- retrieval ---------------------------------------------------------------------------------------------------

LENGTH = 400  # tokens per passkey prompt: the character-level tokenizer needs about 250 for header, needle, question


@pytest.fixture(scope="module")
def retriever():
    """A tiny llama with 512 positions and the character-level tokenizer, and a corpus of sample text."""
    loaded = from_model(tiny_model("llama", max_position_embeddings=512), tiny_tokenizer())
    return loaded, TextSpec(data=Corpus("sample", [SAMPLE_TEXT * 4]), seq_len=128, max_tokens=256, batch_size=2)


def test_retrieval_targets_point_at_the_pass_key_in_the_needle(retriever):
    loaded, text = retriever
    tokenizer = loaded.tokenizer
    sequences, meta = retrieval_sequences(loaded, text, length=LENGTH, count=3, seed=5)
    assert meta["depths"] == retrieval_depths(3) == [0.1, 0.5, 0.9] and meta["prefix_tokens"] == [1]
    assert meta["length"] == LENGTH and meta["source"]["data"] == "sample" and meta["answer_rows"] == [5, 5, 5]
    for ids, target in sequences:
        assert len(ids) <= LENGTH and len(target) == len(ids)
        rows = [i for i, t in enumerate(target) if t >= 0]
        copied = _text(tokenizer, [ids[i + 1] for i in rows])  # the answer tokens the rows emit
        read = _text(tokenizer, [ids[target[i]] for i in rows])  # the needle tokens they target
        assert read == copied and read.isdigit() and len(read) == 5
        assert rows == list(range(len(ids) - 6, len(ids) - 1))  # answer " NNNNN": the space row is left out
        before = _text(tokenizer, ids[target[rows[0]] - 16 : target[rows[0]]])
        assert before.endswith("The pass key is "), before  # the needle's first sentence, not the question
    passkeys = {_text(tokenizer, ids[-5:]) for ids, _ in sequences}
    assert len(passkeys) == 3  # one seeded pass key per prompt
    again, _ = retrieval_sequences(loaded, text, length=LENGTH, count=3, seed=5)
    assert again == sequences


def test_retrieval_matches_eager_maps_with_padding_and_small_chunks(retriever):
    loaded, text = retriever
    sequences, _ = retrieval_sequences(loaded, text, length=LENGTH, count=3, seed=0)
    ids, target = sequences[1]
    sequences[1] = (ids[:-2], target[:-2])  # shorter: the batch of two is right-padded
    means = _collect_retrieval(loaded, sequences, batch_size=2, chunk_size=7, progress=False)
    reference = _retrieval_reference(loaded.model, sequences)
    for layer in loaded.layers:
        mean, count = means[layer.index]["retrieval"]
        assert count == 5 + 4 + 5
        assert mean.tolist() == pytest.approx(reference[layer.index], abs=1e-6)


def test_retrieval_pass_computes_only_the_answer_chunks(retriever, monkeypatch):
    """The pass reads the answer rows alone: per layer call only the chunks holding one are computed."""
    loaded, text = retriever
    sequences, _ = retrieval_sequences(loaded, text, length=LENGTH, count=2, seed=0)
    computed = []
    run_chunks = AttentionCapture._run_chunks

    def counting(self, layer, call, starts):
        computed.append(list(starts))
        return run_chunks(self, layer, call, starts)

    monkeypatch.setattr(AttentionCapture, "_run_chunks", counting)
    _collect_retrieval(loaded, sequences, batch_size=2, chunk_size=7, progress=False)
    answer_rows = {row for _, target in sequences for row, key in enumerate(target) if key >= 0}
    expected = sorted({row // 7 * 7 for row in answer_rows})
    assert computed == [expected] * len(loaded.layers)
    assert len(expected) < math.ceil(max(len(ids) for ids, _ in sequences) / 7)


def test_retrieval_through_head_statistics_and_meta(retriever):
    loaded, text = retriever
    tidy = head_statistics(
        loaded, text=text, induction=False, retrieval_len=LENGTH, retrieval_count=2, seed=3, progress=False
    )
    wide = wide_statistics(tidy)
    sequences, _ = retrieval_sequences(loaded, text, length=LENGTH, count=2, seed=3)
    reference = _retrieval_reference(loaded.model, sequences)
    for layer in loaded.layers:
        got = wide.loc[wide["layer"] == layer.index, "retrieval"].tolist()
        assert got == pytest.approx(reference[layer.index], abs=1e-6)
    meta = tidy.attrs["meta"]
    assert (
        meta["retrieval"]["length"] == LENGTH and meta["retrieval"]["prompts"] == 2 and meta["retrieval"]["seed"] == 3
    )
    assert meta["retrieval"]["depths"] == [0.1, 0.9] and "skipped" not in meta["retrieval"]
    assert meta["denominators"]["retrieval"] == [10, 10] and "retrieval" in meta["edge_rules"]
    assert meta["streaming_windows"] == list(STREAMING_WINDOWS)
    assert list(wide.columns) == ["layer", "head", "kv_head", "name", *STATISTICS]
    off = head_statistics(loaded, text=text, induction=False, retrieval=False, progress=False)
    assert off.attrs["meta"]["retrieval"] is None and wide_statistics(off)["retrieval"].isna().all()


def test_retrieval_is_nan_where_it_does_not_apply(retriever):
    """The default length capped to 64 positions, an encoder and a model without a tokenizer: NaN and the reason."""
    _, text = retriever
    inputs = tiny_inputs("llama")
    batches = [(inputs["input_ids"], inputs["attention_mask"])]
    cases = {
        "positions": from_model(tiny_model("llama"), tiny_tokenizer()),
        "encoder": from_model(tiny_model("bert"), tiny_tokenizer(encoder=True)),
        "tokenizer": from_model(tiny_model("llama", max_position_embeddings=512)),
    }
    for case, loaded in cases.items():
        tidy = head_statistics(loaded, batches, text=text, induction=False, progress=False)
        skipped = tidy.attrs["meta"]["retrieval"]["skipped"]
        assert wide_statistics(tidy)["retrieval"].isna().all(), case
        assert {"positions": "positions", "encoder": "encoder", "tokenizer": "tokenizer"}[case] in skipped


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(retrieval_len=100), "below the"),
        (dict(retrieval_len=600), "maximum positions"),
        (dict(retrieval_count=0), "retrieval_count=0"),
        (dict(retrieval_len=LENGTH, data=Corpus("short", ["A short text. " * 20])), "fewer than retrieval_len"),
    ],
)
def test_bad_retrieval_settings_are_refused_before_work(retriever, kwargs, message):
    loaded, text = retriever
    calls = []
    hook = loaded.layers[0].module.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(HeadlabError, match=message):
            head_statistics(loaded, text=text, induction=False, progress=False, **kwargs)
    finally:
        hook.remove()
    assert not calls  # refused before the text pass


def test_retrieval_minimum_is_what_a_prompt_needs(retriever):
    loaded, text = retriever
    minimum = retrieval_minimum(loaded.tokenizer)
    assert 200 < minimum < LENGTH
    sequences, _ = retrieval_sequences(loaded, text, length=minimum, count=2)
    assert all(len(ids) <= minimum for ids, _ in sequences)


def test_a_tokenizer_that_loses_the_pass_key_is_refused():
    """Digits unknown to a word-level tokenizer: the needle cannot be located, one-line error."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + sorted(set(SAMPLE_TEXT.split()) | {"The", "pass", "key", "is"})
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    model = tiny_model("llama", max_position_embeddings=512, vocab_size=len(words))
    loaded = from_model(model, tokenizer)
    text = TextSpec(data=Corpus("sample", [SAMPLE_TEXT * 8]))
    with pytest.raises(HeadlabError, match="round-trip") as error:
        retrieval_sequences(loaded, text, length=200, count=1)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_retrieval_targets_with_the_embedded_bpe_tokenizer():
    """SmolLM2's BPE tokenizer (digits one per token, the space apart): targets read the pass key in the needle."""
    from transformers import AutoTokenizer

    from headlab.core.loading import embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint())
    loaded = from_model(tiny_model("llama", max_position_embeddings=2048, vocab_size=len(tokenizer)), tokenizer)
    sequences, meta = retrieval_sequences(loaded, TextSpec(), count=3)
    assert meta["length"] == 1024 and meta["source"]["data"] == "broad"
    for ids, target in sequences:
        rows = [i for i, t in enumerate(target) if t >= 0]
        read = _text(tokenizer, [ids[target[i]] for i in rows])
        assert read == _text(tokenizer, [ids[i + 1] for i in rows]) and read.isdigit() and len(read) == 5
        assert _text(tokenizer, ids[target[rows[0]] - 5 : target[rows[0]]]).endswith("pass key is ")


# ---- score sources and the command -------------------------------------------------------------------------------


def test_score_sources(retriever):
    loaded, text = retriever
    request = ScoreRequest(text.but(seq_len=200, max_tokens=400), progress=False, seed=0)
    streaming = score_heads("streaming", loaded, request)
    wide = wide_statistics(head_statistics(loaded, text=request.text, induction=False, retrieval=False, progress=False))
    for layer in loaded.layers:
        expected = 1.0 - torch.tensor(wide.loc[wide["layer"] == layer.index, "stream_64"].to_numpy())
        torch.testing.assert_close(streaming[layer.index], expected.double(), atol=1e-12, rtol=0)
    retrieval = score_heads("retrieval", loaded, request)
    values, meta = retrieval_statistics(loaded, text=request.text, progress=False)
    assert meta["length"] == 512 and all(bool((r == values[i]).all()) for i, r in enumerate(retrieval))
    with pytest.raises(HeadlabError, match="no query row reaches past"):
        score_heads("streaming", loaded, ScoreRequest(text.but(seq_len=32), progress=False))
    with pytest.raises(HeadlabError, match="does not apply"):
        score_heads("retrieval", from_model(tiny_model("llama"), tiny_tokenizer()), request)


def test_cli_retrieval_options(tmp_path, capsys):
    model = save_tiny("llama", tmp_path / "llama", max_position_embeddings=512)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    common = ["stats", "--model", model, "--data", corpus, "--device", "cpu", "--seq-len", "128", "--max-tokens", "256"]
    out = tmp_path / "stats"
    code, stdout, stderr = run_cli(
        [*common, "--no-induction", "--retrieval-len", LENGTH, "--retrieval-count", "2", "--out", out], capsys
    )
    assert code == 0, stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["retrieval"]["length"] == LENGTH and meta["retrieval"]["prompts"] == 2
    assert "max retrieval" in stdout
    code, _, stderr = run_cli([*common, "--retrieval-len", "100", "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "below the" in stderr and not (tmp_path / "bad").exists()
    code, _, stderr = run_cli([*common, "--no-retrieval", "--no-induction", "--out", tmp_path / "off"], capsys)
    assert code == 0 and json.loads((tmp_path / "off" / "meta.json").read_text())["retrieval"] is None
