"""`prune --streaming` (headlab.pruning.streaming): the checkpoint and pruning record of the in-memory prune, written
one attention module at a time, never running the model; refusals for what needs the model."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from models import CAUSAL_TYPES, tiny_model
from test_streaming import digest, stored_tensors
from tiny_text import run_cli, save_tiny, tiny_tokenizer

from headlab.core.errors import HeadlabError
from headlab.core.layout import HEAD_LAYOUT_KEY
from headlab.core.loading import from_model
from headlab.pruning.prune import PruneSpec, Selection, prune
from headlab.pruning.streaming import prune_streaming


def uneven_heads(loaded) -> str:
    """A --heads value that leaves the layers different: the last head of the first attention layer, and every head
    of the first KV group of the last one (plus its first head where that group is one head)."""
    first, last = loaded.layers[0], loaded.layers[-1]
    group = [h for h in range(last.num_heads) if last.kv_head_of(h) == 0]
    heads = sorted(set(group) | {0}) if len(group) < last.num_heads else [0]
    return f"{first.index}:{first.num_heads - 1};{last.index}:{','.join(map(str, heads))}"


def both_ways(name: str, tmp_path, spec: PruneSpec, selection, mode: str = "physical"):
    """(streamed directory, in-memory directory) for the same request on a sharded tiny checkpoint."""
    tiny_model(name).save_pretrained(tmp_path / "source", max_shard_size="20KB")
    tiny_tokenizer().save_pretrained(tmp_path / "source")
    before = digest(tmp_path / "source")
    selection = selection(from_model(tiny_model(name))) if callable(selection) else selection
    prune_streaming(tmp_path / "source", spec, selection, mode=mode, out=tmp_path / "streamed", max_shard_bytes=30_000,
                    progress=False)  # fmt: skip
    loaded = from_model(tiny_model(name), tiny_tokenizer())
    prune(loaded, spec, selection, mode=mode, evaluate=False, out=tmp_path / "memory", progress=False)
    assert digest(tmp_path / "source") == before  # the source is never touched
    return tmp_path / "streamed", tmp_path / "memory"


def assert_same_checkpoint(streamed, memory) -> None:
    got, expected = stored_tensors(streamed), stored_tensors(memory)
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    config, reference = (json.loads((d / "config.json").read_text()) for d in (streamed, memory))
    text, text_reference = config.get("text_config") or config, reference.get("text_config") or reference
    for key in ("num_attention_heads", "num_key_value_heads", HEAD_LAYOUT_KEY):
        assert text.get(key) == text_reference.get(key), key
    for table in ("heads.csv", "mask.csv"):
        assert pd.read_csv(streamed / "pruning" / table).equals(pd.read_csv(memory / "pruning" / table)), table


@pytest.mark.parametrize("name", CAUSAL_TYPES)
def test_streamed_prune_equals_the_in_memory_prune(name, tmp_path):
    """Named heads that leave the layers uneven: the same tensors, config layout and pruning record."""
    selection = lambda loaded: Selection(heads=uneven_heads(loaded))  # noqa: E731 - needs the model's layers
    streamed, memory = both_ways(name, tmp_path, PruneSpec(), selection)
    assert_same_checkpoint(streamed, memory)
    record = json.loads((streamed / "headlab.json").read_text())
    assert record["streaming"] is True and record["costs_after"]["query_heads"] < record["costs_before"]["query_heads"]
    assert record["verification"]["tensors"] == len(stored_tensors(streamed))


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
def test_a_score_table_and_an_amount_select_the_same_heads(name, tmp_path):
    """A score table with a fraction, uniform over layers (vanilla-loadable when the architecture allows it)."""
    loaded = from_model(tiny_model(name))
    rows = [(layer.index, h, float((7 * layer.index + 3 * h) % 11)) for layer in loaded.layers
            for h in range(layer.num_heads)]  # fmt: skip
    table = pd.DataFrame(rows, columns=["layer", "head", "importance"])
    table.to_csv(tmp_path / "scores.csv", index=False)
    selection = Selection(scores=str(tmp_path / "scores.csv"))
    streamed, memory = both_ways(name, tmp_path, PruneSpec(fraction=0.5, uniform=True), selection)
    assert_same_checkpoint(streamed, memory)


def test_mask_mode_streams_too(tmp_path):
    selection = lambda loaded: Selection(heads=uneven_heads(loaded))  # noqa: E731 - needs the model's layers
    streamed, memory = both_ways("llama", tmp_path, PruneSpec(), selection, mode="mask")
    assert_same_checkpoint(streamed, memory)


def test_the_streamed_checkpoint_runs_like_the_pruned_model(tmp_path):
    """Loaded back with headlab's loader, the streamed non-uniform prune gives the in-memory prune's logits."""
    from headlab.core.loading import load_model

    selection = lambda loaded: Selection(heads=uneven_heads(loaded))  # noqa: E731 - needs the model's layers
    streamed, memory = both_ways("llama", tmp_path, PruneSpec(), selection)
    ids = torch.arange(12).reshape(1, 12) % 50
    with torch.no_grad():
        a = load_model(str(streamed), device="cpu").model(input_ids=ids).logits
        b = load_model(str(memory), device="cpu").model(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "selection, message",
    [
        (Selection(), "cannot score heads"),
        (Selection(scores="x.csv", iterative=2), "re-score or measure"),
        (Selection(scores="x.csv", budget="search"), "re-score or measure"),
    ],
)
def test_what_needs_the_model_is_refused_before_reading(selection, message, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(HeadlabError, match=message):
        prune_streaming(tmp_path / "source", PruneSpec(), selection, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_streaming_prune(tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "source")
    code, out, err = run_cli(["prune", "--streaming", "--model", source, "--heads", "0:1;1:0,1", "--mode",
                              "physical", "--out", tmp_path / "out"], capsys)  # fmt: skip
    assert code == 0, err
    assert "streaming" in out and "8 / 4 -> 6 / 3" in out and "structural check" in out
    assert (tmp_path / "out" / "pruning" / "heads.csv").is_file()
    code, out, err = run_cli(["prune", "--streaming", "--model", source, "--heads", "0:1", "--compensate", "ridge",
                              "--out", tmp_path / "other"], capsys)  # fmt: skip
    assert code == 2 and "--streaming" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_next", "gpt2"])
def test_info_reads_the_structure_only_and_equals_a_full_load(name, tmp_path):
    """`headlab info` builds the model on the meta device (an 8B model costs its config, not 16-32 GB): the same
    numbers as model_info of the loaded model, for a plain and a per-layer pruned checkpoint."""
    from headlab.core.loading import load_model, load_structure
    from headlab.measure.costs import model_info

    save_tiny(name, tmp_path / "plain")
    loaded = load_model(str(tmp_path / "plain"), device="cpu")
    prune(loaded, PruneSpec(), Selection(heads=uneven_heads(loaded)), mode="physical", evaluate=False,
          out=tmp_path / "pruned", progress=False)  # fmt: skip
    for directory in (tmp_path / "plain", tmp_path / "pruned"):
        structure = load_structure(str(directory), device="cpu")
        assert {p.device.type for p in structure.model.parameters()} == {"meta"}
        expected = model_info(load_model(str(directory), device="cpu"))
        assert model_info(structure) == expected, directory.name


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_checkpoint_pruned_per_layer_is_refused_by_the_streaming_edits(name, tmp_path):
    """The layout record sits on the top-level config, a multimodal model's too (as prune writes it): both streaming
    edits refuse the checkpoint in one line instead of reading shapes it does not have."""
    from headlab.kv.streaming import convert_streaming

    loaded = from_model(tiny_model(name), tiny_tokenizer())
    prune(loaded, PruneSpec(), Selection(heads=uneven_heads(loaded)), mode="physical", evaluate=False,
          out=tmp_path / "pruned", progress=False)  # fmt: skip
    with pytest.raises(HeadlabError, match="already pruned per layer"):
        prune_streaming(tmp_path / "pruned", PruneSpec(), Selection(heads="0:0"), out=tmp_path / "again")
    with pytest.raises(HeadlabError, match="per-layer head layout"):
        convert_streaming(tmp_path / "pruned", 1, tmp_path / "pooled", progress=False)
    assert not (tmp_path / "again").exists() and not (tmp_path / "pooled").exists()
