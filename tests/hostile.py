"""Hostile inputs for the bad-input table and the reliability tests: damaged weight files, configs whose head
arithmetic does not work, contradicting head-layout records, score runs of another model, non-text corpus cells.

Each is derived from a healthy tiny checkpoint by one edit, so a test failing on it names exactly one defect.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def _copy(healthy: Path, target: Path) -> Path:
    shutil.copytree(healthy, target)
    return target


def _edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    for name, value in fields.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})


class _Unsafe:
    """Unpickling this would call print: torch.load(weights_only=True) must refuse the file."""

    def __reduce__(self):
        return (print, ("unpickled",))


def damaged_checkpoints(healthy: Path, root: Path) -> dict[str, Path]:
    """Copies of `healthy` (a tiny llama: 4 query heads, 2 KV heads, hidden 64, head_dim 16) with one defect each."""
    made = {}
    raw = (healthy / WEIGHTS).read_bytes()
    made["truncated"] = _copy(healthy, root / "truncated")
    (made["truncated"] / WEIGHTS).write_bytes(raw[: len(raw) // 2])
    made["emptyweights"] = _copy(healthy, root / "emptyweights")
    (made["emptyweights"] / WEIGHTS).write_bytes(b"")
    made["badheader"] = _copy(healthy, root / "badheader")
    (made["badheader"] / WEIGHTS).write_bytes(raw[:8] + b"{not json" + raw[17:])
    made["nanweight"] = _copy(healthy, root / "nanweight")
    _edit_weights(made["nanweight"], lambda t: t["model.layers.1.mlp.up_proj.weight"].__setitem__((3, 5), float("inf")))
    made["missingweight"] = _copy(healthy, root / "missingweight")
    _edit_weights(made["missingweight"], lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
    made["unsafepickle"] = _copy(healthy, root / "unsafepickle")
    tensors = load_file(healthy / WEIGHTS)
    os.remove(made["unsafepickle"] / WEIGHTS)
    torch.save({**tensors, "payload": _Unsafe()}, made["unsafepickle"] / "pytorch_model.bin")
    made["kvnotdividing"] = _copy(healthy, root / "kvnotdividing")
    _edit_config(made["kvnotdividing"], num_key_value_heads=3)
    made["zeroheads"] = _copy(healthy, root / "zeroheads")
    _edit_config(made["zeroheads"], num_attention_heads=0)
    made["zerolayers"] = _copy(healthy, root / "zerolayers")
    _edit_config(made["zerolayers"], num_hidden_layers=0)
    made["hiddennotdividing"] = _copy(healthy, root / "hiddennotdividing")
    _edit_config(made["hiddennotdividing"], num_attention_heads=5, num_key_value_heads=5, head_dim=None)
    made.update(contradicting_checkpoints(healthy, root))
    return made


def contradicting_checkpoints(healthy: Path, root: Path) -> dict[str, Path]:
    """Copies of `healthy` (2 layers, intermediate 128, vocabulary 128) whose config or tokenizer contradicts the
    tensors, or names what transformers does not know: each loaded silently wrong or failed with a traceback."""
    made = {}
    for name, fields in (
        ("fewerlayers", {"num_hidden_layers": 1}),  # transformers loaded the first layer only
        ("morelayers", {"num_hidden_layers": 3}),
        ("wrongshape", {"intermediate_size": 96}),  # "look at the above report", a report never shown
        ("unknownact", {"hidden_act": "swishy"}),
        ("unknownrope", {"rope_parameters": {"rope_type": "wobbly", "rope_theta": 10000.0}}),
    ):
        made[name] = _copy(healthy, root / name)
        _edit_config(made[name], **fields)
    # a tokenizer whose ids run past the 128 embedding rows (the first forward pass: "index out of range")
    made["bigtokenizer"] = _copy(healthy, root / "bigtokenizer")
    tokenizer = json.loads((healthy / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {
        token: i + 200 if len(token) == 1 else i for token, i in tokenizer["model"]["vocab"].items()
    }
    (made["bigtokenizer"] / "tokenizer.json").write_text(json.dumps(tokenizer))
    made["brokentokenizer"] = _copy(healthy, root / "brokentokenizer")
    (made["brokentokenizer"] / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vo')
    return made


def layout_variants(pruned: Path, root: Path) -> dict[str, Path]:
    """Copies of a physically pruned checkpoint with a per-layer head layout, each record contradicting itself or
    the tensors in one way."""
    from headlab.core.layout import HEAD_LAYOUT_KEY

    def variant(name, edit):
        target = _copy(pruned, root / name)
        config = json.loads((target / "config.json").read_text())
        edit(config[HEAD_LAYOUT_KEY]["layers"])
        (target / "config.json").write_text(json.dumps(config, indent=2))
        return target

    def first(layers, key, value):
        layers[0][key] = value

    return {
        "layout_count": variant("layout_count", lambda layers: first(layers, "num_heads", layers[0]["num_heads"] + 1)),
        "layout_range": variant("layout_range", lambda layers: first(layers, "heads", [*layers[0]["heads"][:-1], 7])),
        "layout_duplicate": variant(
            "layout_duplicate", lambda layers: first(layers, "heads", [layers[0]["heads"][0]] * len(layers[0]["heads"]))
        ),
        "layout_layers": variant("layout_layers", lambda layers: layers.append(dict(layers[0], layer=5))),
    }


def foreign_run(root: Path, layers: int = 2, heads: int = 4) -> Path:
    """An importance run with the right (layer, head) pairs whose meta.json names another model."""
    run = root / "foreign-run"
    run.mkdir()
    rows = [{"layer": a, "head": b, "importance": 0.1 * (a * heads + b)} for a in range(layers) for b in range(heads)]
    pd.DataFrame(rows).to_csv(run / "importance.csv", index=False)
    meta = {"model": "org/another-model", "source": "org/another-model", "fingerprint": "0" * 64}
    (run / "meta.json").write_text(json.dumps(meta))
    return run


def duplicate_scores(root: Path, layers: int = 2, heads: int = 4) -> Path:
    rows = [{"layer": a, "head": b, "importance": 0.5} for a in range(layers) for b in range(heads)]
    rows[-1] = {"layer": 0, "head": 1, "importance": 0.5}  # (0, 1) twice, (layers-1, heads-1) missing
    path = root / "duplicates.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def corpora(root: Path, text: str) -> dict[str, Path]:
    """Corpus files whose text column holds a non-string, and a FIFO where a corpus file should be."""
    made = {"numbercells": root / "numbers.jsonl", "listcells": root / "lists.jsonl", "fifo": root / "fifo.txt"}
    made["numbercells"].write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": 1984}) + "\n")
    made["listcells"].write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": ["a", "b"]}) + "\n")
    os.mkfifo(made["fifo"])
    return made


def plot_runs(root: Path, layers: int = 2, heads: int = 4) -> dict[str, Path]:
    """Run folders `plot` must refuse: a header-only table, text where numbers belong, a file where the figures
    folder goes, and a (layer, head) listed twice with other values (prune refuses the same table)."""
    good = "layer,head,importance\n" + "".join(f"{a},{b},{a + b}\n" for a in range(layers) for b in range(heads))
    contents = {
        "headeronly": "layer,head,importance\n",
        "textcolumn": "layer,head,importance\n"
        + "".join(f"{a},{b},{'abcdefgh'[a * heads + b]}\n" for a in range(layers) for b in range(heads)),
        "figuresfile": good,
        "duprun": good + "0,1,9\n",
    }
    made = {}
    for name, table in contents.items():
        made[name] = root / f"plot-{name}"
        made[name].mkdir()
        (made[name] / "importance.csv").write_text(table)
    (made["figuresfile"] / "figures").write_text("a file where plot writes its figures")
    return made


def infinite_run(root: Path, layers: int = 2, heads: int = 4) -> Path:
    """A run directory whose importance table holds only inf: nothing to draw."""
    run = root / "inf-run"
    run.mkdir()
    rows = [{"layer": a, "head": b, "importance": float("inf")} for a in range(layers) for b in range(heads)]
    pd.DataFrame(rows).to_csv(run / "importance.csv", index=False)
    return run
