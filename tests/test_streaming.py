"""Layer-by-layer conversion of safetensors checkpoints (headlab.kv.streaming): the same tensors as converting the
loaded model, one block in memory at a time, clean errors for what it cannot do."""

from __future__ import annotations

import json

import pytest
import torch
from models import GQA_TYPES, VLM_TYPES, tiny_model
from safetensors import safe_open
from tiny_text import run_cli, save_tiny

from headlab.core import streaming as core_streaming
from headlab.core.errors import HeadlabError
from headlab.core.loading import from_model
from headlab.core.streaming import checkpoint_files
from headlab.kv import gqa, streaming
from headlab.kv import grouping as kv_grouping
from headlab.kv.streaming import convert_streaming


def stored_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory (single file or sharded)."""
    tensors = {}
    for name in checkpoint_files(directory):
        with safe_open(str(directory / name), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def digest(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def in_memory_reference(name: str, kv_heads: int, pool: str, seed: int, directory):
    """What `headlab convert-gqa` (the whole model in memory) saves for the same conversion."""
    model = tiny_model(name)
    gqa.convert(from_model(model), kv_heads, pool=pool, seed=seed)
    model.save_pretrained(directory)
    return stored_tensors(directory)


@pytest.mark.parametrize("name", GQA_TYPES)
@pytest.mark.parametrize("pool", kv_grouping.POOLS)
def test_streaming_equals_converting_the_loaded_model(name, pool, tmp_path):
    """Sharded source, small output shards: every stored tensor equals the in-memory conversion's, bit for bit."""
    tiny_model(name).save_pretrained(tmp_path / "source", max_shard_size="20KB")
    source = digest(tmp_path / "source")
    record = convert_streaming(tmp_path / "source", 1, tmp_path / "out", pool=pool, seed=3, max_shard_bytes=40_000)
    expected = in_memory_reference(name, 1, pool, 3, tmp_path / "reference")
    got = stored_tensors(tmp_path / "out")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), [
        k for k in expected if not torch.equal(got[k], expected[k])
    ]
    assert digest(tmp_path / "source") == source  # the source is never touched
    assert len(record["shards"]) > 1 and record["kv_bytes_per_token_after"] * 2 == record["kv_bytes_per_token_before"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config.get("text_config") or config)["num_key_value_heads"] == 1
    assert json.loads((tmp_path / "out" / "headlab.json").read_text())["streaming"] is True


@pytest.mark.parametrize("name", [n for n in GQA_TYPES if n not in VLM_TYPES])
def test_streamed_checkpoint_loads_with_vanilla_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model(name).save_pretrained(tmp_path / "source")
    convert_streaming(tmp_path / "source", 1, tmp_path / "out", max_shard_bytes=50_000, progress=False)
    reference = tiny_model(name)
    gqa.convert(from_model(reference), 1)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(10, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_expand_then_pool_back_is_bit_exact(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "source")
    convert_streaming(tmp_path / "source", None, tmp_path / "mha", direction="expand", progress=False)
    assert json.loads((tmp_path / "mha" / "config.json").read_text())["num_key_value_heads"] == 4
    convert_streaming(tmp_path / "mha", 2, tmp_path / "back", progress=False)
    original, back = stored_tensors(tmp_path / "source"), stored_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_shard_writer_writes_safetensors_that_load_back(tmp_path):
    """The write-through writer's files are ordinary safetensors: every dtype, an empty tensor and a scalar read back
    equal through safetensors itself, split into shards of at most max_bytes (one tensor alone may exceed it)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "big": torch.randn(40),
        "mask": torch.tensor([True, False]),
    }
    writer = core_streaming.ShardWriter(tmp_path, max_bytes=64)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    names = writer.finish()
    assert len(names) > 1 and sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, core_streaming.INDEX_FILE])
    back = {}
    for name in names:
        part = load_file(tmp_path / name)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 64 or len(part) == 1
        back |= part
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
    index = json.loads((tmp_path / core_streaming.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == writer.total_bytes


@pytest.mark.parametrize("room", [core_streaming.HEADER_ROOM, 64])
def test_shards_are_written_in_place_and_a_header_larger_than_its_room_moves_the_data(tmp_path, monkeypatch, room):
    """Each byte is written once into its shard; a header that outgrows the room left for it (64 bytes here) is
    written before the data all the same, 8-byte aligned, and safetensors reads either file back."""
    from safetensors.torch import load_file

    monkeypatch.setattr(core_streaming, "HEADER_ROOM", room)
    tensors = {f"layer.{i}.weight": torch.randn(4, 3) for i in range(5)}
    writer = core_streaming.ShardWriter(tmp_path, max_bytes=10**6)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.finish() == [core_streaming.SINGLE_FILE]
    raw = (tmp_path / core_streaming.SINGLE_FILE).read_bytes()
    header_bytes = int.from_bytes(raw[:8], "little")
    assert header_bytes % 8 == 0 and len(raw) == 8 + header_bytes + sum(t.numel() * 4 for t in tensors.values())
    assert (header_bytes == room) == (room > 64)  # 1 MiB holds five tensors' header, 64 bytes do not
    back = load_file(tmp_path / core_streaming.SINGLE_FILE)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], t) for k, t in tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == [core_streaming.SINGLE_FILE]


def test_a_config_without_architectures_converts(tmp_path):
    """config.json need not name its class (random-shape checkpoints and some hand-written configs don't): the class
    comes from the Auto mapping of the config's type, and the output equals the one converted with the name."""
    tiny_model("llama").save_pretrained(tmp_path / "named")
    tiny_model("llama").save_pretrained(tmp_path / "nameless")
    config = json.loads((tmp_path / "nameless" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "nameless" / "config.json").write_text(json.dumps(config))
    for name in ("named", "nameless"):
        convert_streaming(tmp_path / name, 1, tmp_path / f"{name}-out", progress=False)
    named, nameless = stored_tensors(tmp_path / "named-out"), stored_tensors(tmp_path / "nameless-out")
    assert named.keys() == nameless.keys() and all(torch.equal(named[k], nameless[k]) for k in named)


def test_bfloat16_checkpoints_stay_bfloat16(tmp_path):
    tiny_model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path / "source")
    record = convert_streaming(tmp_path / "source", 1, tmp_path / "out", progress=False)
    assert {t.dtype for t in stored_tensors(tmp_path / "out").values()} == {torch.bfloat16}
    assert record["kv_bytes_per_token_after"] == 2 * 2 * 1 * 16 * 2  # K and V, 2 layers, 1 head of 16, 2 bytes


def test_one_attention_module_in_memory_at_a_time(tmp_path, monkeypatch):
    """While tensors are written, at most one layer of the skeleton holds real storage and the pending shard stays
    under the limit (or holds a single larger tensor): the peak is one shard plus one layer, not the model."""
    tiny_model("llama", num_hidden_layers=4).save_pretrained(tmp_path / "source", max_shard_size="30KB")
    skeletons, observed = [], []
    build = streaming.skeleton

    def recording_skeleton(config):
        model, adapter = build(config)
        skeletons.append((model, adapter))
        return model, adapter

    add = core_streaming.ShardWriter.add

    def checking_add(self, name, tensor):
        model, adapter = skeletons[0]
        live = [b for b in adapter.blocks(model) if any(p.device.type != "meta" for p in b.parameters())]
        outside_blocks = [n for n, p in model.named_parameters() if p.device.type != "meta" and ".layers." not in n]
        observed.append((len(live), len(outside_blocks), self.pending_bytes, len(self.pending)))
        add(self, name, tensor)

    pool = streaming.pool_weights
    live_while_pooling = []

    def checking_pool(weights, *args, **kwargs):
        model, adapter = skeletons[0]
        live_while_pooling.append(
            sum(any(p.device.type != "meta" for p in b.parameters()) for b in adapter.blocks(model))
        )
        return pool(weights, *args, **kwargs)

    monkeypatch.setattr(streaming, "skeleton", recording_skeleton)
    monkeypatch.setattr(core_streaming.ShardWriter, "add", checking_add)
    monkeypatch.setattr(streaming, "pool_weights", checking_pool)
    limit = 20_000
    convert_streaming(tmp_path / "source", 1, tmp_path / "out", max_shard_bytes=limit, progress=False)
    assert live_while_pooling == [1, 1, 1, 1]  # each layer converted alone
    assert observed and max(live for live, *_ in observed) == 0  # and freed before its tensors are written
    assert all(outside == 0 for _, outside, *_ in observed)
    assert all(pending <= limit or count == 1 for *_, pending, count in observed)


# ---- errors: one line, exit 2, nothing written, the source untouched --------------------------------------------


def test_refuses_checkpoints_without_safetensors(tmp_path):
    """A config beside weights in another format (here: none) is refused before anything is written."""
    tiny_model("llama").config.save_pretrained(tmp_path / "source")
    with pytest.raises(HeadlabError, match="no model.safetensors"):
        convert_streaming(tmp_path / "source", 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_renamed_keys(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "source")
    tensors = {k.replace("model.layers", "model.decoder.layers"): v for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp_path / "source" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HeadlabError, match="renamed keys"):
        convert_streaming(tmp_path / "source", 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_pruned_layouts_and_models_without_kv_heads(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(HeadlabError, match="supports_gqa=False"):
        convert_streaming(tmp_path / "gpt2", 1, tmp_path / "out")
    model = tiny_model("llama")
    model.config.headlab_head_layout = {"version": 1, "layers": []}
    model.save_pretrained(tmp_path / "pruned")
    with pytest.raises(HeadlabError, match="per-layer head layout"):
        convert_streaming(tmp_path / "pruned", 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["convert-gqa", "--kv-heads", "1", "--method", "svd"], "--method mean"),
        (["convert-gqa", "--kv-heads", "1", "--grouping", "similarity"], "--grouping"),
        (["convert-gqa", "--kv-heads", "4"], "expand-kv"),
        (["convert-gqa", "--kv-heads", "1", "--max-shard-size", "lots"], "--max-shard-size"),
        (["expand-kv", "--kv-heads", "1"], "convert-gqa"),
    ],
)
def test_cli_bad_input(args, message, tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "source")
    before = digest(source)
    capsys.readouterr()  # transformers' save progress is not the command's output
    code, _, err = run_cli([*args, "--streaming", "--model", source, "--out", tmp_path / "out"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "out").exists() and digest(source) == before


def test_cli_refuses_hub_ids(tmp_path, capsys):
    code, _, err = run_cli(
        ["convert-gqa", "--streaming", "--model", "someone/model", "--kv-heads", "1", "--out", tmp_path / "o"], capsys
    )
    assert code == 2 and "local checkpoint directory" in err and not (tmp_path / "o").exists()


def test_cli_round_trip(tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "source")
    code, out, err = run_cli(
        ["convert-gqa", "--streaming", "--model", source, "--kv-heads", "1", "--out", tmp_path / "mqa"], capsys
    )
    assert code == 0, err
    assert "device_map='meta'" in out and "512 B -> 256 B (arithmetic)" in out
    assert (tmp_path / "mqa" / "tokenizer.json").is_file()  # tokenizer files travel with the weights
    args = ["expand-kv", "--streaming", "--model", tmp_path / "mqa", "--out", tmp_path / "mha", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["kv_heads_after"] == 4 and record["conversion"]["action"] == "expand"


def test_extra_tensors_of_the_source_pass_through(tmp_path):
    """A tensor transformers ignores on loading (an old checkpoint's rotary inv_freq buffer) is copied as stored and
    does not fail the meta-device check, since the source held it already."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "source")
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    tensors = {**stored_tensors(tmp_path / "source"), extra: torch.arange(8.0)}
    save_file(tensors, str(tmp_path / "source" / "model.safetensors"), metadata={"format": "pt"})
    convert_streaming(tmp_path / "source", 1, tmp_path / "out", progress=False)
    assert torch.equal(stored_tensors(tmp_path / "out")[extra], torch.arange(8.0))
