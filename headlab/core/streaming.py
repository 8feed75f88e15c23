"""Editing a safetensors checkpoint one attention module at a time, for models larger than memory.

The model's skeleton is built on the meta device (no storage) only to learn names and layouts. Every tensor outside
the attention modules (embeddings, MLPs or experts, norms) is copied through as stored; each attention module is
materialised from the files, edited through its adapter (`LayerEditor`'s `edit`: KV pooling, head slicing), written
out and dropped. Output shards are cut at `max_shard_bytes` and written in place (each tensor's bytes as they come,
the header into room left before them), so peak memory is about one attention module or the largest single
tensor, whatever the model's or the shard's size. Users: `headlab.kv.streaming` (convert-gqa / expand-kv
--streaming), `headlab.pruning.streaming` (prune --streaming).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from headlab.core.arch import AttentionLayer, adapter_for
from headlab.core.checkpoint import META_FILE, check_checkpoint_out, meta_load_check
from headlab.core.errors import HeadlabError
from headlab.core.layout import model_class
from headlab.core.validate import check_config_file, check_config_heads

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# transformers' own default shard size is 50 GB; 5 GB keeps the peak memory of a conversion near 5 GB + one layer.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# safetensors' dtype codes -> torch dtype names (for KV-cache arithmetic in the stored dtype).
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_files(source: Path) -> list[str]:
    """The safetensors files of a checkpoint directory, in index order (or the single model.safetensors)."""
    index = source / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise HeadlabError(f"{index} is not a safetensors index (no weight_map)") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in files if not (source / name).is_file()]
        if missing:
            raise HeadlabError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return files
    if (source / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise HeadlabError(
        f"{source} has no {SINGLE_FILE} or {INDEX_FILE}; layer-by-layer conversion reads safetensors checkpoints "
        "(convert others without streaming, on the loaded model)"
    )


def skeleton(config):
    """The model class for `config`, built on the meta device: names, shapes and adapters, no storage."""
    adapter = adapter_for(config)
    with torch.device("meta"):
        model = model_class(config, adapter)(config)
    return model, adapter


# safetensors' dtype names (the format's header), for the tensors a checkpoint holds.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
COPY_CHUNK = 64 * 2**20  # bytes moved at a time when a header outgrows its room and the data must move
# Room left for a shard's JSON header before its data: the data are written in place as they arrive, and the header,
# known only when the shard is full, is written into the room afterwards, padded with spaces (safetensors pads its
# header the same way). About 150 bytes a tensor, so 1 MiB holds the header of a shard of about 7,000 tensors (a
# 405B checkpoint has about 1,100 in all); a larger header moves the data once (COPY_CHUNK at a time).
HEADER_ROOM = 2**20


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` without holding a shard in memory: each tensor's
    bytes go straight into the shard file after HEADER_ROOM bytes left for its header, and when the shard is full the
    8-byte header length and the JSON header (every tensor's dtype, shape and data offsets, padded with spaces) are
    written into that room. Every byte is written once and never read back, so the disk traffic is the output's own
    size. `finish` names the shards model-0000i-of-0000n.safetensors (or model.safetensors when one suffices) and
    writes the index."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.shard = None  # the open shard file, its data starting at HEADER_ROOM + 8
        self.pending: list[tuple[str, str, list[int], int]] = []  # (name, dtype, shape, bytes), in file order
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary name, keys)
        self.total_bytes = 0

    def _part(self, index: int) -> Path:
        return self.directory / f"part-{index:05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise HeadlabError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        if self.shard is None:
            self.shard = open(self._part(len(self.shards)), "wb")  # closed by flush, once the shard is full
            self.shard.seek(8 + HEADER_ROOM)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.shard.write(memoryview(data.view(torch.uint8).numpy()) if size else b"")
        self.pending.append((name, SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), size))
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        header, offset = {}, 0
        for key, dtype, shape, size in self.pending:
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        path = self._part(len(self.shards))
        if len(encoded) <= HEADER_ROOM:
            self.shard.seek(0)
            self.shard.write(HEADER_ROOM.to_bytes(8, "little"))
            self.shard.write(encoded + b" " * (HEADER_ROOM - len(encoded)))  # the data start where they were written
            self.shard.close()
        else:
            self.shard.close()
            _move_data(path, encoded)
        self.shard = None
        self.shards.append((path.name, [entry[0] for entry in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> list[str]:
        self.flush()
        count = len(self.shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (temporary, keys), name in zip(self.shards, names):
            (self.directory / temporary).rename(self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def _move_data(path: Path, encoded: bytes) -> None:
    """Rewrite the shard at `path` with a header larger than HEADER_ROOM: the data, copied from after the room,
    follow the 8-byte-aligned header in a new file that replaces it."""
    encoded += b" " * (-len(encoded) % 8)  # the data start 8-byte aligned, as safetensors writes them
    moved = path.with_suffix(".moving")
    with open(path, "rb") as old, open(moved, "wb") as new:
        new.write(len(encoded).to_bytes(8, "little"))
        new.write(encoded)
        old.seek(8 + HEADER_ROOM)
        shutil.copyfileobj(old, new, COPY_CHUNK)
    moved.replace(path)


def saved_name(model, name: str, tensor: torch.Tensor) -> str | None:
    """The name save_pretrained writes for `model`'s tensor `name` (transformers 5 renames some keys on save and back
    on load, e.g. multimodal wrappers' "model.language_model." <-> "language_model.model."), or None where this
    transformers cannot say (an older or newer one without the conversion API)."""
    try:
        # Deferred for start-up time (core_model_loading pulls in transformers' modeling code), and inside the try
        # so that a transformers without it falls back to the plain names.
        from transformers.core_model_loading import revert_weight_conversion

        (saved,) = revert_weight_conversion(model, {name: tensor})  # a meta tensor: renaming reads no data
    except (ImportError, ValueError, TypeError, KeyError):
        return None
    return saved


def stored_names(model, module, stored: Iterable[str]) -> dict[str, str]:
    """Where each tensor of `module` (a submodule of `model`) is stored: every one under its state-dict name, or
    every one under the name save_pretrained writes for it (saved_name). Raises HeadlabError if neither is there."""
    prefix = next(name for name, m in model.named_modules() if m is module) + "."
    tensors = module.state_dict()
    candidates = [{k: prefix + k for k in tensors}]
    renamed = {k: saved_name(model, prefix + k, t) for k, t in tensors.items()}
    if None not in renamed.values():
        candidates.append(renamed)
    stored = set(stored)
    for names in candidates:
        if set(names.values()) <= stored:
            return names
    raise HeadlabError(
        f"the checkpoint does not hold {prefix}* under the names {type(model).__name__} uses or saves (renamed "
        "keys in an older checkpoint?); convert it without streaming, on the loaded model"
    )


def stored_name(model, name: str, tensor: torch.Tensor, stored: set[str]) -> str | None:
    """Where the checkpoint holds `model`'s tensor `name`: under that name, or under its saved_name; None if under
    neither (a tied weight saved once)."""
    if name in stored:
        return name
    saved = saved_name(model, name, tensor)
    return saved if saved in stored else None


def verify_streamed(out: Path, source_keys: set[str]) -> dict:
    """The vanilla meta-device load of `checkpoint.meta_load_check`, and no tensor name of the source lost or added."""
    result = meta_load_check(out, tolerated=source_keys)  # names the source held pass through as they were
    stored = set()
    for name in checkpoint_files(out):
        with safe_open(str(out / name), "pt") as handle:
            stored.update(handle.keys())
    if stored != source_keys:
        raise HeadlabError(
            f"the written checkpoint changed tensor names: {sorted(stored ^ source_keys)[:3]}; nothing was written"
        )
    return {**result, "tensors": len(stored)}


def read_source_config(source: Path, out: Path, overwrite: bool, max_shard_bytes: int):
    """Refuse a request in one line before anything is read in bulk; returns the checkpoint's files and config."""
    # Deferred for start-up time: AutoConfig loads transformers' model registries, which `--help` does not need.
    from transformers import AutoConfig

    if not (source / "config.json").is_file():
        raise HeadlabError(f"{source} is not a checkpoint directory with config.json")
    check_checkpoint_out(out, overwrite, source)
    if max_shard_bytes < 1:
        raise HeadlabError("the shard size must be positive")
    files = checkpoint_files(source)
    check_config_file(source / "config.json", str(source))
    config = AutoConfig.from_pretrained(source)
    check_config_heads(config, adapter_for(config), str(source))
    return files, config


class TensorReader:
    """The source's tensors by name: which file holds each (first file wins, in index order), its stored dtype and
    shape (read from the headers once)."""

    def __init__(self, source: Path, files: list[str]):
        self.source = source
        self.where: dict[str, str] = {}  # tensor name -> file holding it
        self.dtypes: dict[str, str] = {}  # tensor name -> safetensors dtype code
        self.shapes: dict[str, list[int]] = {}  # tensor name -> shape as stored
        for name in files:
            with safe_open(str(source / name), "pt") as handle:
                for key in handle.keys():
                    if key in self.where:
                        continue
                    stored = handle.get_slice(key)
                    self.where[key], self.dtypes[key], self.shapes[key] = (
                        name,
                        stored.get_dtype(),
                        list(stored.get_shape()),
                    )

    def read(self, key: str) -> torch.Tensor:
        # One open per tensor: the file is unmapped again at once, so its pages do not pile up in the process's
        # resident set while the rest of the checkpoint streams through (headers are small; opening is cheap).
        with safe_open(str(self.source / self.where[key]), "pt") as handle:
            return handle.get_tensor(key)

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of `key` along dim 0, reading only those bytes (a sharded load's own chunk)."""
        with safe_open(str(self.source / self.where[key]), "pt") as handle:
            return handle.get_slice(key)[start:stop]

    def torch_dtype(self, key: str) -> torch.dtype:
        """The torch dtype `key` is stored in (float32 for a code outside _SAFETENSORS_DTYPES)."""
        return getattr(torch, _SAFETENSORS_DTYPES.get(self.dtypes[key], "float32"))


class LayerEditor:
    """Edits one attention module at a time: materialised from the files, `edit(layer)` rewrites it through its
    adapter (in place, under no_grad), its new tensors are returned under their stored names, its storage dropped."""

    def __init__(self, model, layers, reader: TensorReader, edit: Callable[[AttentionLayer], None]):
        self.model, self.reader, self.edit = model, reader, edit
        # layer index -> (module key -> file key)
        self.file_keys = {layer.index: stored_names(model, layer.module, reader.where) for layer in layers}
        # file key -> index of the layer whose attention module holds it
        self.owner = {file_key: index for index, names in self.file_keys.items() for file_key in names.values()}

    def convert(self, layer) -> dict[str, torch.Tensor]:
        """Materialise one attention module from the files, edit it, return its new tensors, free it."""
        names = self.file_keys[layer.index]
        state = {key: self.reader.read(stored) for key, stored in names.items()}
        layer.module.load_state_dict(state, strict=True, assign=True)
        outside_before = self._outside(layer)
        with torch.no_grad():
            self.edit(layer)
        converted = {names[k]: t for k, t in layer.module.state_dict().items()}
        outside_after = self._outside(layer)
        if outside_after.keys() != outside_before.keys() or any(
            outside_after[n] is not p for n, p in outside_before.items()
        ):
            # The adapter rewrote weights outside the attention module (BERT-style output projections), which this
            # path copies through unread: refuse rather than write a half-edited layer.
            raise HeadlabError(
                f"{type(self.model).__name__} keeps attention weights outside its attention module; edit it "
                "without streaming, on the loaded model"
            )
        layer.module.to("meta")  # drop the storage before the next layer
        return converted

    @staticmethod
    def _outside(layer) -> dict:
        """The block's parameters that are not the attention module's, by name."""
        inside = {id(p) for p in layer.module.parameters()}
        return {n: p for n, p in layer.block_module.named_parameters() if id(p) not in inside}


def stream_tensors(reader: TensorReader, editor, layers, writer: ShardWriter, progress: bool, desc: str = "converting"):
    """Every source tensor in file order into `writer`: copied through as stored, or, for an attention module,
    the whole edited module where its first tensor appears. `editor`: a LayerEditor, or anything with its `owner`
    (file key -> layer index) and `convert(layer)` (the layer's new tensors by name)."""
    emitted: set[int] = set()  # layers already written
    by_index = {layer.index: layer for layer in layers}  # a hybrid's attention layers are not every block
    bar = tqdm(total=len(reader.where), desc=desc, unit="tensor", disable=not progress)
    for key in reader.where:
        i = editor.owner.get(key)
        if i is None:
            writer.add(key, reader.read(key))
        elif i not in emitted:
            for name, tensor in editor.convert(by_index[i]).items():
                writer.add(name, tensor)
            emitted.add(i)
        bar.update()
    bar.close()


def copy_side_files(source: Path, tmp: Path) -> None:
    """Tokenizer files, generation config and the like, copied as they are (not the weights, config or record)."""
    for item in source.iterdir():
        skip = item.name in ("config.json", INDEX_FILE, META_FILE) or item.name.endswith(".safetensors")
        if item.is_file() and not skip:
            shutil.copy2(item, tmp / item.name)
