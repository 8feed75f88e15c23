"""Device maps (accelerate dispatch, one process): a model whose embeddings, some decoder layers and the LM head are
offloaded to disk (hooks stream their weights in per forward) gives the numbers of the same model loaded plainly.

Without a GPU every execution device is the CPU, so these tests prove the hook path (capture, gates, offloaded
weights, input placement); the cross-device moves themselves are checked where a second device can be faked (meta).
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny, tiny_tokenizer

from headlab.core.loading import from_model, input_device, load_model
from headlab.measure.evaluate import perplexity
from headlab.measure.importance import ScoringBatch, head_importance, sequence_nll
from headlab.measure.stats import head_statistics

# Embeddings, the middle layer and the LM head on disk; the other layers on the CPU.
DEVICE_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(plain, dispatched, corpus path): one tiny 3-layer llama checkpoint loaded twice."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("device_map")
    directory = save_tiny("llama", root / "model", num_hidden_layers=3)
    corpus = root / "sample.txt"
    corpus.write_text(SAMPLE_TEXT)
    plain = load_model(str(directory), device="cpu")
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        device_map=DEVICE_MAP,
        offload_folder=root / "offload",
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    dispatched = from_model(model, AutoTokenizer.from_pretrained(directory))
    return plain, dispatched, str(corpus)


def test_the_model_is_really_dispatched_with_offloaded_weights(models):
    _, dispatched, _ = models
    model = dispatched.model
    assert model.hf_device_map == DEVICE_MAP
    # Offloaded weights wait on meta; accelerate's hooks bring them to the execution device (the CPU) per forward.
    assert model.model.layers[1].self_attn.o_proj.weight.device.type == "meta"
    assert model.get_input_embeddings().weight.device.type == "meta"
    assert hasattr(model.get_input_embeddings(), "_hf_hook")
    # Inputs go to where the embeddings run, not to the meta device of their offloaded weight.
    assert input_device(model) == torch.device("cpu") and dispatched.device == torch.device("cpu")


def test_perplexity_equals_the_plain_model(models):
    plain, dispatched, corpus = models
    kwargs = dict(seq_len=32, stride=16, batch_size=2, max_tokens=512, progress=False)
    a, b = perplexity(plain, corpus, **kwargs), perplexity(dispatched, corpus, **kwargs)
    assert b.scored_tokens == a.scored_tokens > 100
    assert b.nll == pytest.approx(a.nll, rel=1e-5)


def test_head_statistics_equal_the_plain_model(models):
    plain, dispatched, corpus = models
    kwargs = dict(data=corpus, seq_len=32, batch_size=2, max_tokens=256, induction_len=8, induction_count=2)
    a = head_statistics(plain, progress=False, **kwargs)
    b = head_statistics(dispatched, progress=False, **kwargs)
    assert a[["layer", "head", "statistic"]].equals(b[["layer", "head", "statistic"]])
    assert a["value"].notna().sum() > 100  # real numbers, not NaN everywhere
    assert b["value"].to_numpy() == pytest.approx(a["value"].to_numpy(), rel=1e-5, abs=1e-7, nan_ok=True)
    assert b.attrs["meta"]["tokens"] == a.attrs["meta"]["tokens"]


@pytest.mark.parametrize("method", ["grad", "taylor", "ablation"])
def test_importance_equals_the_plain_model(models, method):
    plain, dispatched, corpus = models
    kwargs = dict(method=method, data=corpus, seq_len=32, batch_size=2, max_tokens=128, progress=False)
    a, b = head_importance(plain, **kwargs), head_importance(dispatched, **kwargs)
    raw_a, raw_b = a.table["importance_raw"].to_numpy(), b.table["importance_raw"].to_numpy()
    assert (raw_a != 0).all()  # every head scored, so equality is not trivial
    assert raw_b == pytest.approx(raw_a, rel=1e-5, abs=1e-9)
    # The gates were removed and the offloaded weights went back to disk.
    o_proj = dispatched.model.model.layers[1].self_attn.o_proj
    assert not o_proj._forward_pre_hooks and o_proj.weight.device.type == "meta"


def test_sequence_nll_moves_labels_to_the_logits_device():
    """Under a device map the logits come from the last layer's device: a fake model whose logits live on meta
    (a second device on a CPU-only machine) must get its labels there too."""

    class LogitsOnMeta(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            B, T = input_ids.shape
            return type("Output", (), {"logits": torch.empty(B, T, 11, device="meta")})

    ids = torch.randint(0, 11, (2, 5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    nll = sequence_nll(LogitsOnMeta(), ScoringBatch(ids, torch.ones_like(ids), labels), torch.device("cpu"))
    assert nll.device.type == "meta" and nll.shape == (2,)


def test_cli_eval_with_device_map_auto_equals_without(models, tmp_path, capsys):
    plain, _, corpus = models
    args = ["eval", "--model", plain.source, "--data", corpus, "--seq-len", "32", "--device", "cpu", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    code_map, out_map, err_map = run_cli([*args, "--device-map", "auto"], capsys)
    assert code_map == 0, err_map
    without, with_map = json.loads(out), json.loads(out_map)
    assert with_map["device"] == "cpu" and with_map["scored_tokens"] == without["scored_tokens"]
    assert with_map["perplexity"] == pytest.approx(without["perplexity"], rel=1e-5)


def test_cli_max_memory_offloads_to_disk_and_equals_without(models, capsys, monkeypatch):
    """--max-memory caps the CPU's share of --device-map auto: the layers past it wait on disk and stream in per
    forward (`disk_offload`), with the perplexity of the model loaded plainly."""
    from headlab.core import loading

    plain, _, corpus = models
    placed = {}
    original = loading.disk_offload

    def recording(device, max_memory):
        placed.update(original(device, max_memory))
        return placed

    monkeypatch.setattr(loading, "disk_offload", recording)
    args = ["eval", "--model", plain.source, "--data", corpus, "--seq-len", "32", "--device", "cpu", "--json"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    code, out_map, err = run_cli([*args, "--device-map", "auto", "--max-memory", "60KB"], capsys)
    assert code == 0, err
    assert placed["max_memory"] == {"cpu": 60_000} and placed["device_map"] == "auto"
    without, offloaded = json.loads(out), json.loads(out_map)
    assert offloaded["perplexity"] == pytest.approx(without["perplexity"], rel=1e-5)


def test_input_device_prefers_the_embeddings_execution_device():
    """A GPU dispatch as accelerate records it (execution_device an index or a name, one hook or a SequentialHook),
    faked on the hook attribute because init_hook would move the weights to a GPU this machine lacks."""
    from types import SimpleNamespace

    from models import tiny_model

    model = tiny_model("llama")
    embeddings = model.get_input_embeddings()
    assert input_device(model) == torch.device("cpu")  # no hook: the embedding weight's device
    embeddings._hf_hook = SimpleNamespace(execution_device=0)
    assert input_device(model) == torch.device("cuda", 0)
    embeddings._hf_hook = SimpleNamespace(hooks=[SimpleNamespace(), SimpleNamespace(execution_device="cuda:1")])
    assert input_device(model) == torch.device("cuda", 1)


# ---- editing weights under a device map ---------------------------------------------------------------------------


def _edits(dispatched):
    """Every headlab entry point that rewrites weights in place, as (name, call) pairs."""
    from headlab.kv import gqa, merge
    from headlab.kv import grouping as kv_grouping
    from headlab.pruning import prune
    from headlab.recovery import uptrain
    from headlab.recovery.compensate import check_compensation
    from headlab.recovery.reconstruct import reconstruct
    from headlab.recovery.recover import RecoverySpec, recover

    layers = dispatched.layers
    pruned = [{0}] + [set() for _ in layers[1:]]
    return [
        ("convert", lambda: gqa.convert(dispatched, 1)),
        ("similarity", lambda: kv_grouping.kv_similarity(dispatched, [], progress=False)),
        ("merge", lambda: merge.merge_kv_heads(dispatched, 1, [], progress=False)),
        ("mask", lambda: prune.apply_mask(dispatched, pruned)),
        ("physical", lambda: prune.apply_physical(dispatched, prune.physical_layout(layers, pruned))),
        ("compensate", lambda: check_compensation(dispatched, "ridge")),
        ("uptrain", lambda: uptrain.uptrain(dispatched, dispatched, steps=1, progress=False)),
        ("reconstruct", lambda: reconstruct(dispatched, dispatched, [], progress=False)),
        ("recover", lambda: recover(dispatched, dispatched, RecoverySpec(), progress=False)),
    ]


@pytest.mark.parametrize(
    "edit", ["convert", "similarity", "merge", "mask", "physical", "compensate", "uptrain", "reconstruct", "recover"]
)
def test_edits_of_offloaded_weights_are_refused(models, edit):
    """accelerate refills offloaded weights from its store at every forward, so an in-place edit would be silently
    undone: each command that edits weights refuses, with one line, and leaves the model as it was."""
    from headlab.core.errors import HeadlabError
    from headlab.core.loading import offloaded_modules

    _, dispatched, _ = models
    assert "model.layers.1.self_attn.k_proj" in offloaded_modules(dispatched.model)
    before = {k: v.clone() for k, v in dispatched.model.state_dict().items() if v.device.type != "meta"}
    call = dict(_edits(dispatched))[edit]
    with pytest.raises(HeadlabError, match="offloaded"):
        call()
    after = dispatched.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_models_on_several_devices_are_verified_without_a_second_copy(tmp_path):
    """save_checkpoint on a model spread over devices checks the saved files by a meta-device load (names and
    shapes against the config) instead of reloading a copy for logits; a mismatch is still caught."""
    from models import tiny_model

    from headlab.core.checkpoint import CheckpointMismatch, meta_load_check, save_checkpoint
    from headlab.kv import gqa

    model = tiny_model("llama")
    gqa.convert(from_model(model), 1)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}  # as accelerate records it
    check = save_checkpoint(model, None, tmp_path / "out")
    assert check.max_abs_diff is None and "device_map='meta'" in check.loader
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in model.state_dict().items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["num_key_value_heads"] = 2  # the weights hold 1
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatch):
        meta_load_check(tmp_path / "out")


def test_meta_load_check_of_a_non_uniform_pruned_checkpoint(tmp_path):
    from headlab.core.checkpoint import meta_load_check
    from headlab.core.errors import HeadlabError
    from headlab.pruning.prune import Selection, prune

    loaded = load_model(str(save_tiny("llama", tmp_path / "source")), device="cpu")
    # A whole KV group of layer 0: 2 heads there, 4 in layer 1, so the layout is recorded per layer.
    chosen = Selection(heads="0:0,1")
    prune(loaded, selection=chosen, mode="physical", out=tmp_path / "pruned", evaluate=False, progress=False)
    assert "load_pruned" in meta_load_check(tmp_path / "pruned")["loader"]
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    entry = config["headlab_head_layout"]["layers"][0]
    entry["heads"], entry["kv_heads"] = [0, 1, 2, 3], [0, 1]  # claims the pruned heads are still there
    (tmp_path / "pruned" / "config.json").write_text(json.dumps(config))
    # headlab.core.validate checks the record against the tensors first (issue 19) and names the contradiction.
    with pytest.raises(HeadlabError, match="does not load|do not fit|but the record lists"):
        meta_load_check(tmp_path / "pruned")


def test_device_cpu_keeps_a_device_map_on_the_cpu(tmp_path, monkeypatch):
    """`--device cpu --device-map auto` on a GPU machine must not let accelerate place layers on the GPUs."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny("llama", tmp_path / "model")
    seen = {}
    original = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        seen.update(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    loaded = load_model(str(directory), device="cpu", device_map="auto")
    assert seen["device_map"] == {"": "cpu"} and loaded.device == torch.device("cpu")


@pytest.mark.parametrize(
    "command",
    [
        ["convert-gqa", "--kv-heads", "1", "--no-eval"],
        ["prune", "--heads", "0:1", "--mode", "physical", "--max-tokens", "64"],
    ],
    ids=["convert-gqa", "prune"],
)
def test_cli_edits_with_device_map_auto_write_the_same_weights(models, tmp_path, capsys, command):
    """`--device-map auto` (here: everything on the CPU) through the commands that edit and save weights gives the
    checkpoint the plain load gives, tensor for tensor."""
    from safetensors.torch import load_file

    plain, _, corpus = models
    common = [*command, "--model", plain.source, "--data", corpus, "--seq-len", "32", "--device", "cpu"]
    outputs = {}
    for name, extra in (("plain", []), ("mapped", ["--device-map", "auto"])):
        code, _, err = run_cli([*common, *extra, "--out", tmp_path / name], capsys)
        assert code == 0, err
        outputs[name] = load_file(tmp_path / name / "model.safetensors")
    assert outputs["plain"].keys() == outputs["mapped"].keys()
    assert all(torch.equal(outputs["plain"][k], outputs["mapped"][k]) for k in outputs["plain"])


def test_offloading_keeps_the_stored_dtype(tmp_path):
    """A bf16 checkpoint offloaded under max_memory stays bf16 (a float32 load would convert every weight first, twice
    the checkpoint in memory); an explicit dtype still wins, and without offloading the CPU default is float32."""
    from models import tiny_model

    tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    offloaded = load_model(str(tmp_path / "model"), device="cpu", device_map="auto", max_memory=20_000)
    assert offloaded.dtype == torch.bfloat16
    asked = load_model(str(tmp_path / "model"), device="cpu", dtype="float32", device_map="auto", max_memory=20_000)
    assert asked.dtype == torch.float32
    assert load_model(str(tmp_path / "model"), device="cpu").dtype == torch.float32
