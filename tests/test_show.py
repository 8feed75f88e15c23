"""`headlab show`: the top-k keys equal eager attention's largest weights (across capture chunks), the page's blocks
decode to them, edited models (pruned, GQA, MLA) show, and the page works in a real headless Chromium."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import Chromium, chromium, screenshot_file
from models import tiny_model
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model, load_model
from headlab.measure.attention_view import attention_topk
from headlab.viz.viewer import attention_page, decode_block, dense_map, encode_block

TEXT = "The quick brown fox jumps over the lazy dog."  # 44 character tokens
NO_BROWSER = "no Chromium binary on PATH (apt-get install chromium-headless-shell, or set HEADLAB_CHROMIUM)"


def _eager_attentions(model, ids: list[int]) -> list[torch.Tensor]:
    """Eager attention's weights, [H, T, T] per layer."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return [a[0] for a in out.attentions]


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_top_k_equals_eager_largest_weights_across_chunks(name):
    model = tiny_model(name)  # eager attention
    loaded = from_model(model, tiny_tokenizer())
    k = 5
    view = attention_topk(loaded, TEXT, top_k=k, chunk_size=16)  # chunk boundaries at rows 16 and 32
    ids = view.token_ids
    assert len(ids) == len(TEXT) and model.config._attn_implementation == "eager"  # the capture restored eager
    eager = _eager_attentions(model, ids)
    for layer, attention in enumerate(eager):
        values, indices = torch.topk(attention, k, dim=-1)  # [H, T, k]
        weights, keys = torch.from_numpy(view.weights[layer]), torch.from_numpy(view.keys[layer])
        present = values > 0  # rows 0 .. k-2 see fewer than k keys
        torch.testing.assert_close(weights, torch.where(present, values, 0.0), atol=1e-6, rtol=1e-5)
        assert torch.equal(keys, torch.where(present, indices.to(torch.int32), -1))
        rest = attention.sum(-1) - torch.where(present, values, 0.0).sum(-1)
        torch.testing.assert_close(torch.from_numpy(view.rest[layer]), rest, atol=1e-6, rtol=0)
    summary = view.summary()
    assert list(summary["name"][:2]) == ["L0H0", "L0H1"] and summary["topk_mass"].between(0, 1 + 1e-6).all()


def test_blocks_decode_to_the_top_k_within_their_rounding():
    model = tiny_model("llama")
    view = attention_topk(from_model(model, tiny_tokenizer()), TEXT, top_k=6)
    keys, weights, rest = view.keys[1][2], view.weights[1][2], view.rest[1][2]
    rows = decode_block(encode_block(keys[10:30], weights[10:30], rest[10:30]), 20)
    for row, (got_keys, got_weights, got_rest) in enumerate(rows, start=10):
        top = weights[row, 0]
        kept = weights[row] >= top / 510  # weights under 1/510 of the row's largest join the rest
        order = np.argsort(keys[row][kept])
        assert np.array_equal(got_keys, keys[row][kept][order])
        np.testing.assert_allclose(got_weights, weights[row][kept][order], atol=top / 510 + 2e-5)
        assert got_rest == pytest.approx(rest[row] + weights[row][~kept].sum(), abs=1e-4)
    grid = dense_map(keys, weights, len(keys))
    assert grid.shape == (44, 44) and np.allclose(grid.sum(1), weights.sum(1))


def test_page_is_self_contained_and_refuses_mismatched_arrays():
    view = attention_topk(from_model(tiny_model("llama"), tiny_tokenizer()), TEXT + "</script><!--", top_k=4)
    page = attention_page(view.tokens, view.summary(), view.keys, view.weights, view.rest, page=8, title="t")
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert page.count("</script>") == page.count("<script")  # the text cannot close an element early
    with pytest.raises(HeadlabError, match="do not match"):
        attention_page(view.tokens[:-1], view.heads, view.keys, view.weights, view.rest)
    with pytest.raises(HeadlabError, match="page=0"):
        attention_page(view.tokens, view.heads, view.keys, view.weights, view.rest, page=0)


def test_bad_library_input_is_one_line():
    loaded = from_model(tiny_model("llama"), tiny_tokenizer())
    for kwargs, fragment in [
        (dict(top_k=0), "top_k=0"),
        (dict(max_tokens=65), "maximum positions (64)"),
    ]:
        with pytest.raises(HeadlabError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as error:
            attention_topk(loaded, TEXT, **kwargs)
        assert "\n" not in str(error.value)
    with pytest.raises(HeadlabError, match="text is empty"):
        attention_topk(loaded, "  ")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A physically pruned llama (layer 0 keeps 3 of 4 heads), a GQA-converted MHA llama and an MLA model."""
    from headlab.kv import gqa  # start-up: only these tests convert
    from headlab.pruning.prune import Selection, prune

    root = tmp_path_factory.mktemp("show")
    text = root / "sample.txt"
    text.write_text(SAMPLE_TEXT)
    mha = load_model(str(save_tiny("llama_mha", root / "mha")), device="cpu")
    prune(mha, selection=Selection(heads="0:1"), mode="physical", out=root / "pruned", data=str(text), seq_len=32,
          evaluate=False, progress=False)  # fmt: skip
    converted = load_model(str(root / "mha"), device="cpu")
    gqa.convert(converted, 2)
    converted.model.save_pretrained(root / "gqa")
    converted.tokenizer.save_pretrained(root / "gqa")
    return {"pruned": root / "pruned", "gqa": root / "gqa", "mla": save_tiny("deepseek_v3", root / "mla")}


@pytest.mark.parametrize(
    ("kind", "heads", "kv"),
    [("pruned", [3, 4], [3, 4]), ("gqa", [4, 4], [2, 2]), ("mla", [4, 4], [4, 4])],
)
def test_edited_models_show(kind, heads, kv, checkpoints, tmp_path, capsys):
    out = tmp_path / "show"
    chosen = "L0H2,L1H3"
    code, stdout, err = run_cli(
        ["show", "--model", checkpoints[kind], "--device", "cpu", "--text", TEXT, "--heads", chosen, "--top-k", "4",
         "--chunk", "16", "--out", out],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    meta = json.loads((out / "meta.json").read_text())
    assert [layer["heads"] for layer in meta["layers"]] == heads
    assert [layer["kv_heads"] for layer in meta["layers"]] == kv
    assert meta["tokens"] == len(TEXT) and meta["page"]["bytes"] == (out / "attention.html").stat().st_size
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["L0H2.png", "L1H3.png"]
    assert (out / "figures" / "L0H2.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "attention.html").read_text()
    info = json.loads(page.split('id="info">', 1)[1].split("</script>", 1)[0])
    assert [len(layer["names"]) for layer in info["layers"]] == heads
    assert info["layers"][0]["kv"] == {"pruned": [0, 1, 2], "gqa": [0, 0, 1, 1], "mla": [0, 1, 2, 3]}[kind]
    assert info["pages"] == 3 and "attention.html" in stdout


def test_pruned_head_that_is_gone_is_refused(checkpoints, tmp_path, capsys):
    args = ["show", "--model", checkpoints["pruned"], "--device", "cpu", "--text", TEXT, "--heads", "L0H3"]
    code, _, err = run_cli([*args, "--out", tmp_path / "s"], capsys)
    assert code == 2 and "layer 0 has 3 heads" in err and not (tmp_path / "s").exists()


# ---- in a real browser --------------------------------------------------------------------------------------------

needs_browser = pytest.mark.skipif(chromium() is None, reason=NO_BROWSER)


@pytest.fixture(scope="module")
def page_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("page")
    model = save_tiny("llama", root / "llama")
    text = SAMPLE_TEXT[:60]  # 60 tokens: pages of 16 queries, the last one short
    args = ["show", "--model", model, "--device", "cpu", "--text", text, "--chunk", "16", "--top-k", "8"]
    from headlab.cli import main  # start-up: the CLI parses here, outside pytest's capture fixture

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in [*args, "--out", root / "show"]])
    assert exit_info.value.code == 0
    return root / "show"


STATE = """(async () => { await window.headlab.idle(); return {
  head: document.getElementById("head-name").textContent,
  page: document.getElementById("page-select").value,
  queries: document.querySelectorAll("#tokens span.q").length,
  query: window.headlab.state.query,
  weights: Array.from(document.querySelectorAll("#tokens span[data-w]"), (s) => s.dataset.i + ":" + s.dataset.w),
  info: document.getElementById("query-info").textContent,
  hash: location.hash,
}; })()"""


@needs_browser
def test_page_in_headless_chromium(page_dir, tmp_path):
    url = (page_dir / "attention.html").as_uri()
    with Chromium() as browser:
        browser.open(url)
        first = browser.evaluate(STATE)
        assert first["head"] == "L0H0" and first["page"] == "0" and first["queries"] == 16
        assert first["query"] == 15 and first["weights"] and first["info"].startswith("query #15")
        # the picker: another head changes the view
        browser.evaluate("document.querySelector('#picker button[data-head=\"L1H2\"]').click()")
        second = browser.evaluate(STATE)
        assert second["head"] == "L1H2" and second["hash"].startswith("#L1H2")
        assert second["weights"] != first["weights"] and second["query"] == 15
        # the page decodes what decode_block reads
        page = (page_dir / "attention.html").read_text()
        blocks = json.loads(page.split('id="layer-1">', 1)[1].split("</script>", 1)[0])
        keys, weights, _ = decode_block(base64.b64decode(blocks[2 * 4 + 0]), 16)[15]  # L1H2, page 0, row 15
        shown = dict(w.split(":") for w in second["weights"])
        assert sorted(map(int, shown)) == keys.tolist()
        shown_weights = [float(shown[str(k)]) for k in keys]  # 3 decimals (2 digits under 0.01)
        assert shown_weights == pytest.approx(weights.tolist(), rel=0.05, abs=5.1e-4)
        # the pager: the next page's queries, its last row chosen
        browser.evaluate('document.getElementById("next").click()')
        third = browser.evaluate(STATE)
        assert third["page"] == "1" and third["query"] == 31 and third["queries"] == 16
        # hovering a query of the page shows its row
        browser.evaluate(
            'document.querySelector(\'#tokens span[data-i="20"]\').dispatchEvent(new MouseEvent("mouseover", '
            "{bubbles: true}))"
        )
        hovered = browser.evaluate(STATE)
        assert hovered["query"] == 20 and all(int(w.split(":")[0]) <= 20 for w in hovered["weights"])
        # the last, short page and the matrix
        browser.evaluate("window.headlab.page(3)")
        last = browser.evaluate(STATE)
        assert last["queries"] == 60 - 48 and last["query"] == 59
        assert browser.evaluate('document.getElementById("matrix").height') == 12
        shot = browser.screenshot()
        assert shot[:4] == b"\x89PNG" and len(shot) > 10_000
        # a link to a head and query opens it (from another page: a hash change alone fires no load event)
        browser.open("about:blank")
        browser.open(url + "#L1H3:q=40")
        linked = browser.evaluate(STATE)
        assert linked["head"] == "L1H3" and linked["query"] == 40 and linked["page"] == "2"
        assert browser.errors() == []
    out = screenshot_file(url + "#L1H1:q=33", tmp_path / "shot.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_head_map_png_bins_long_texts_and_keeps_row_mass():
    from headlab.viz.plots import binned_map, figure_bytes, plot_attention_map  # start-up: matplotlib

    rng = np.random.default_rng(0)
    grid = np.tril(rng.random((300, 300)))
    grid /= grid.sum(1, keepdims=True)
    binned, b = binned_map(grid)
    assert b == 2 and binned.shape == (150, 150) and np.allclose(binned.sum(1), 1.0)
    assert figure_bytes(plot_attention_map(grid, [f"t{i}" for i in range(300)], title="L0H0"))[:4] == b"\x89PNG"
    assert figure_bytes(plot_attention_map(grid[:10, :10], list("abcdefghij")))[:4] == b"\x89PNG"
    with pytest.raises(HeadlabError, match="does not match"):
        plot_attention_map(grid, ["a"])
