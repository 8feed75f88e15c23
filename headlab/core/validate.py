"""Validation of what headlab loads, before it is used: config head arithmetic, weight files, finite weights, head
layout records, and where a score or mask table came from. Every check raises HeadlabError with one line naming
the file, the config field, the tensor or the row at fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from pathlib import Path

from headlab.core.errors import HeadlabError

# torch and headlab.core.arch (transformers) are imported inside the checks that need them: `headlab plot` uses
# check_unique_heads and reads saved tables only, without seconds of torch import.

# safetensors element sizes by dtype tag (https://github.com/huggingface/safetensors, "Format")
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F4": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
MAX_SAFETENSORS_HEADER = 100_000_000  # the format's own limit on the JSON header (bytes)
FINGERPRINT_CACHE_ENTRIES = 256  # weight files whose sha256 the fingerprint cache keeps (the most recent)
FINGERPRINT_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "vocab.txt", "added_tokens.json",
)  # fmt: skip


# ---- config ---------------------------------------------------------------------------------------------------


def _field(config, name: str) -> str:
    """The name a config.json uses for a standard attribute (GPT-2 stores num_attention_heads as n_head)."""
    reverse = {standard: stored for standard, stored in getattr(config, "attribute_map", {}).items()}
    return reverse.get(name, name)


def _positive_int(config, name: str, where: str, required: bool = True) -> int | None:
    value = getattr(config, name, None)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HeadlabError(f"{where}: config field {_field(config, name)} must be a positive integer, got {value!r}")
    return value


def check_config_heads(config, adapter, where: str) -> None:
    """Head arithmetic of a config, checked before transformers builds a model from it: positive counts (and layers),
    num_attention_heads a multiple of num_key_value_heads (repeat_kv's equal groups), and hidden_size divisible by the
    heads where the family derives head_dim = hidden_size // heads (adapter.free_head_dim False or head_dim unset)."""
    text = config.get_text_config()
    heads = _positive_int(text, "num_attention_heads", where)
    hidden = _positive_int(text, "hidden_size", where)
    _positive_int(text, "num_hidden_layers", where, required=False)  # 0 blocks: weights silently unused
    if adapter.supports_gqa:
        kv_heads = _positive_int(text, "num_key_value_heads", where, required=False)
        if kv_heads is not None and heads % kv_heads:
            raise HeadlabError(
                f"{where}: config field {_field(text, 'num_attention_heads')} = {heads} is not a multiple of "
                f"{_field(text, 'num_key_value_heads')} = {kv_heads} (each KV head serves an equal group of query heads)"
            )
    head_dim = _positive_int(text, "head_dim", where, required=False) if adapter.free_head_dim else None
    if head_dim is None and hidden % heads:
        raise HeadlabError(
            f"{where}: config field {_field(text, 'hidden_size')} = {hidden} is not divisible by "
            f"{_field(text, 'num_attention_heads')} = {heads} (head_dim is hidden_size // heads here)"
        )


class _RawConfig:
    """A config.json dict read like a transformers config (attribute_map aliases, get_text_config), so the head
    arithmetic is checked before transformers parses it: its own validators fail on a zero head count with
    "integer modulo by zero", which names no field."""

    def __init__(self, raw: dict, attribute_map: dict):
        self._raw, self.attribute_map = raw, attribute_map

    def __getattr__(self, name):
        return self._raw.get(self.attribute_map.get(name, name))

    def get_text_config(self):
        text = self._raw.get("text_config")
        return _RawConfig(text, {}) if isinstance(text, dict) else self


def check_config_file(path, where: str) -> None:
    """check_config_heads on a checkpoint's config.json as stored, for model types headlab has an adapter for."""
    from transformers import CONFIG_MAPPING  # here, not at the top: importing transformers costs start-up time

    from headlab.core.arch import ADAPTERS  # start-up: the adapters import transformers' model classes

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return  # transformers' own parser reports unreadable JSON
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in ADAPTERS or model_type not in CONFIG_MAPPING:
        return
    attribute_map = getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {}
    check_config_heads(_RawConfig(raw, dict(attribute_map)), ADAPTERS[model_type], where)


# ---- weight files ---------------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file: 8-byte little-endian length N, N bytes of
    JSON, then tensor data whose `data_offsets` must lie inside the file and match dtype x shape. Reads no tensor."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise HeadlabError(f"damaged weight file {path}: it is empty")
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise HeadlabError(f"damaged weight file {path}: {size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
                raise HeadlabError(f"damaged weight file {path}: header length {length} does not fit the file")
            header = json.loads(handle.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HeadlabError(f"damaged weight file {path}: its safetensors header is not valid JSON") from None
    except OSError as error:
        raise HeadlabError(f"cannot read weight file {path}: {error.strerror or error}") from None
    if not isinstance(header, dict):
        raise HeadlabError(f"damaged weight file {path}: its safetensors header is not a JSON object")
    data_size = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        _check_tensor_entry(path, name, entry, data_size)
    return header


def _check_tensor_entry(path: Path, name: str, entry, data_size: int) -> None:
    try:
        dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        itemsize = SAFETENSORS_DTYPE_BYTES[dtype]
        numel = math.prod(int(d) for d in shape)
    except (KeyError, TypeError, ValueError):
        raise HeadlabError(f"damaged weight file {path}: bad header entry for tensor {name}") from None
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size):
        raise HeadlabError(
            f"damaged weight file {path}: tensor {name} lies outside the file (truncated? {data_size} data bytes)"
        )
    if dtype != "F4" and end - begin != numel * itemsize:  # F4 packs two values per byte
        raise HeadlabError(f"damaged weight file {path}: tensor {name} has {end - begin} bytes for shape {shape}")


def check_weight_files(directory) -> None:
    """Every safetensors file of a checkpoint directory has a sound header, the files its index names exist, and each
    holds exactly the tensors the index puts in it (a shard left by another run, of another depth or layout, does
    not: its tensors would be loaded in place of the missing ones, or beside them)."""
    directory = Path(directory)
    expected: dict[str, set[str]] = {}
    for index in sorted(directory.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            for name, shard in weight_map.items():
                expected.setdefault(shard, set()).add(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HeadlabError(f"damaged index file {index}: no weight_map") from None
        missing = sorted(s for s in set(weight_map.values()) if not (directory / s).is_file())
        if missing:
            raise HeadlabError(f"{index} names {len(missing)} missing weight file(s): {', '.join(missing[:3])}")
    owner = {name: shard for shard, names in expected.items() for name in names}
    for path in sorted(directory.glob("*.safetensors")):
        held = set(read_safetensors_header(path)) - {"__metadata__"}
        lacking = sorted(expected.get(path.name, set()) - held)  # the index's tensors the file does not hold
        elsewhere = sorted(n for n in held if owner.get(n, path.name) != path.name)  # the index puts them elsewhere
        if lacking or elsewhere:
            what = f"lacks {lacking[0]}, which" if lacking else f"holds {elsewhere[0]}, which"
            where = "its index puts there" if lacking else f"its index puts in {owner[elsewhere[0]]}"
            raise HeadlabError(
                f"{path} {what} {where} ({len(lacking) + len(elsewhere)} such tensors): a shard from another "
                "checkpoint or run; save or copy the checkpoint again"
            )


def pickle_refusal(directory, error: BaseException) -> HeadlabError:
    """One line for a .bin checkpoint that torch.load(weights_only=True) refused (it holds more than tensors)."""
    files = sorted(p.name for p in Path(directory).glob("*.bin")) if Path(directory).is_dir() else []
    name = f"{Path(directory) / files[0]}" if files else str(directory)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    what = f"it calls {found.group(1)}" if found else "it holds more than plain tensors"
    return HeadlabError(
        f"refused to unpickle {name}: {what}, which torch.load(weights_only=True) does not run; convert it to "
        "safetensors with a tool you trust"
    )


def error_line(error: BaseException) -> str:
    """A library exception as one line: its first non-empty line, with the next one when the first only introduces
    it (huggingface_hub's "Class validation error for validator 'x':" puts the reason on line two)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


FINITE_BLOCK = 1 << 24  # elements summed at a time: a float64 copy of a block, not of an 8B model's 2 GiB embedding


def finite_sum(tensor) -> bool:
    """Whether every element is finite, by float64 sums of FINITE_BLOCK elements at a time (a nan/inf makes its
    block's sum non-finite; finite float32/bf16 values cannot overflow a float64 sum)."""
    import torch  # start-up: the file validators run before torch is needed (CLI checks)

    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part.sum(dtype=torch.float64))) for part in flat.split(FINITE_BLOCK))


def _non_finite(where: str, name: str, tensor) -> HeadlabError:
    """The one-line refusal of a weight holding nan or inf, with their count."""
    import torch  # start-up: the file validators run before torch is needed (CLI checks)

    bad = int((~torch.isfinite(tensor)).sum())
    return HeadlabError(
        f"{where}: weight {name} holds {bad} non-finite value(s) (nan or inf) of {tensor.numel()}; "
        "the checkpoint is damaged (check_weights=False loads it anyway)"
    )


def check_finite_files(directory, where: str) -> None:
    """check_finite_weights on a checkpoint's safetensors files, one tensor in memory at a time (load_structure)."""
    import torch  # start-up: the file validators run before torch is needed (CLI checks)
    from safetensors import safe_open

    with torch.no_grad():
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    if tensor.is_floating_point() and not finite_sum(tensor):
                        raise _non_finite(where, name, tensor)


def check_finite_weights(model, where: str) -> None:
    """Every floating-point parameter is finite; the first that is not is named with its count of nan/inf.
    One read of each weight, summed a block at a time (finite_sum): a nan/inf anywhere makes its float64 sum
    non-finite, and only then are the elements counted."""
    import torch  # start-up: the file validators run before torch is needed (CLI checks)

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not parameter.is_floating_point() or parameter.device.type == "meta":
                continue
            if finite_sum(parameter):
                continue
            raise _non_finite(where, name, parameter)


def config_fields_holding(raw, value, prefix: str = "") -> list[str]:
    """Dotted paths of the config.json fields (nested dicts included) whose value is `value`: which field a value
    transformers failed on came from (a KeyError 'wobbly' -> rope_parameters.rope_type)."""
    found = []
    for name, item in raw.items() if isinstance(raw, dict) else ():
        path = f"{prefix}{name}"
        if isinstance(item, dict):
            found += config_fields_holding(item, value, f"{path}.")
        elif type(item) is type(value) and item == value:
            found.append(path)
    return found


def unknown_config_value(raw: dict, error: KeyError, where: str) -> HeadlabError | None:
    """One line for a KeyError transformers raised while building a model from a config: a config value it has no
    implementation for (an activation in ACT2FN, a RoPE type in ROPE_INIT_FUNCTIONS), named by its field; None when
    the missing key is no config value (then it is not the user's config and stays a bug)."""
    if len(error.args) != 1 or not isinstance(error.args[0], str):
        return None
    value = error.args[0]
    fields = config_fields_holding(raw, value)
    if not fields:
        return None
    field = fields[0]
    known = ""
    try:  # the registries transformers looks these values up in, for the list of what it knows
        if field.endswith(("rope_type", ".type")):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # start-up: only for a RoPE field

            known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
        elif "act" in field.rsplit(".", 1)[-1]:
            from transformers.activations import ACT2FN  # start-up: only for an activation field

            known = ", ".join(sorted(ACT2FN))
    except ImportError:
        pass
    from transformers import __version__ as transformers_version  # start-up: transformers loads with the model

    return HeadlabError(
        f"{where}: config field {field} = {value!r} is not known to transformers {transformers_version}"
        + (f" (known: {known})" if known else "")
    )


_INDEX = re.compile(r"\.(\d+)\.")


def _blocks(names, model_names: set[str]) -> dict[str, set[int]]:
    """Indexed containers (`model.layers`) -> indices, for names whose index position holds a real block of the
    model, recognised by the same name with index 0 being one of the model's own tensors."""
    found: dict[str, set[int]] = {}
    for name in names:
        for match in _INDEX.finditer(name):
            if f"{name[: match.start()]}.0.{name[match.end() :]}" in model_names:
                found.setdefault(name[: match.start()], set()).add(int(match.group(1)))
                break
    return found


def _count_field(config, container: str, blocks_path) -> str:
    """How the config sets the size of an indexed container: num_hidden_layers (as config.json spells it) for the
    blocks, else the container itself."""
    if container.rsplit(".", 1)[-1] in blocks_path:
        text = config.get_text_config()
        return f"config field {_field(text, 'num_hidden_layers')} = {getattr(text, 'num_hidden_layers', None)}"
    return f"the config's {container}"


def check_load_report(model, info: dict, config, where: str, blocks_path=("layers",)) -> None:
    """transformers' loading info (from_pretrained(output_loading_info=True, ignore_mismatched_sizes=True)) as one
    line: a tensor whose shape the config does not give it, layers the checkpoint holds beyond the config's count
    (transformers would drop them: the first layers of a deeper model would load as if whole), layers the config
    has that the checkpoint lacks, and any other missing weight (transformers would initialise it at random)."""
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    if mismatched:
        name, stored, expected = mismatched[0]
        stored, expected = tuple(int(d) for d in stored), tuple(int(d) for d in expected)
        text = config.get_text_config()
        # config fields equal to a dimension that differs: e.g. intermediate_size = 96 for a 128-row weight
        hints = sorted(
            {
                f"{_field(text, k)} = {v}"
                for a, b in zip(stored, expected)
                if a != b
                for k, v in vars(text).items()
                if isinstance(v, int) and not isinstance(v, bool) and v == b and not k.startswith("_")
            }
        )
        hint = f" (config field {', '.join(hints)})" if hints else ""
        more = f"; {len(mismatched) - 1} more tensor(s) disagree" if len(mismatched) > 1 else ""
        raise HeadlabError(
            f"{where}: tensor {name} has shape {list(stored)} in the checkpoint, the config makes it "
            f"{list(expected)}{hint}{more}"
        )
    model_names = set(model.state_dict())
    extra = _blocks(info.get("unexpected_keys") or (), model_names)
    for container, indices in sorted(extra.items()):
        try:
            built = len(model.get_submodule(container))
        except (AttributeError, TypeError):
            built = "fewer"
        raise HeadlabError(
            f"{where}: the checkpoint holds {container}.0 to {container}.{max(indices)}, "
            f"{_count_field(config, container, blocks_path)} builds {built}; the other weights would be ignored"
        )
    missing = sorted(info.get("missing_keys") or ())
    absent = _blocks(missing, model_names)
    for container, indices in sorted(absent.items()):
        # blocks none of whose tensors the checkpoint holds: the config asks for more than there is
        loaded = model_names - set(missing)
        whole = sorted(i for i in indices if not any(n.startswith(f"{container}.{i}.") for n in loaded))
        if whole:
            raise HeadlabError(
                f"{where}: {_count_field(config, container, blocks_path)} builds {container}.0 to "
                f"{container}.{max(indices)}, the checkpoint has no {container}.{whole[0]}"
                + (f" onwards ({len(whole)} missing)" if len(whole) > 1 else "")
            )
    if missing:
        raise HeadlabError(
            f"cannot load {where!r}: {len(missing)} weight(s) missing from the checkpoint would be random "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )


def check_tokenizer_fits(model, tokenizer, where: str) -> None:
    """Every token id the tokenizer can produce has a row in the input embeddings: an id beyond them fails inside
    the embedding lookup ("index out of range") at the first forward pass."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    rows = getattr(embeddings, "num_embeddings", None)
    if not isinstance(rows, int) or tokenizer is None:
        return
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    top = max(vocab.values(), default=-1)
    if top >= rows:
        token = next(t for t, i in vocab.items() if i == top)
        raise HeadlabError(
            f"{where}: the tokenizer has token id {top} ({token!r}), the model's input embeddings have {rows} rows "
            f"(ids 0..{rows - 1}); the tokenizer does not belong to this model"
        )


# ---- head layout records --------------------------------------------------------------------------------------


def _id_list(value, what: str, limit: int, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise HeadlabError(f"{where}: {what} must be a list of integers, got {value!r}")
    if any(not 0 <= v < limit for v in value):
        raise HeadlabError(f"{where}: {what} {value} has an id outside 0..{limit - 1}")
    duplicates = sorted({v for v in value if value.count(v) > 1})
    if duplicates:
        raise HeadlabError(f"{where}: {what} lists id(s) {duplicates} more than once")
    return value


def check_layout_entry(entry, where: str) -> None:
    """One layer of a saved head layout (prune.LayerLayout.to_dict): original counts positive, kept query and KV
    head ids in range and distinct, recorded counts equal to the lists, query heads an equal multiple of KV heads,
    padding among the kept heads."""
    if not isinstance(entry, dict):
        raise HeadlabError(f"{where}: a layer entry must be an object, got {entry!r}")
    where = f"{where}, layer {entry.get('layer')!r}"
    original_heads, original_kv = entry.get("original_heads"), entry.get("original_kv_heads")
    for name, value in (("original_heads", original_heads), ("original_kv_heads", original_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HeadlabError(f"{where}: {name} must be a positive integer, got {value!r}")
    heads = _id_list(entry.get("heads"), "heads", original_heads, where)
    kv_heads = _id_list(entry.get("kv_heads"), "kv_heads", original_kv, where)
    if not heads or not kv_heads or len(heads) % len(kv_heads):
        raise HeadlabError(f"{where}: {len(heads)} query heads cannot be split evenly over {len(kv_heads)} KV heads")
    for name, actual in (("num_heads", len(heads)), ("num_kv_heads", len(kv_heads))):
        if name in entry and entry[name] != actual:
            raise HeadlabError(f"{where}: {name} is {entry[name]!r} but the record lists {actual}")
    padding = _id_list(entry.get("padding_heads", []), "padding_heads", original_heads, where)
    if not set(padding) <= set(heads):
        raise HeadlabError(f"{where}: padding_heads {padding} are not among the kept heads {heads}")


def check_layout_record(record, where: str, num_layers: int | None = None) -> None:
    """A whole saved layout: valid entries, no layer twice, and (num_layers given) one per attention layer."""
    layers = record.get("layers") if isinstance(record, dict) else None
    if not isinstance(layers, list):
        raise HeadlabError(f"{where}: the head layout record has no list of layers")
    for entry in layers:
        check_layout_entry(entry, where)
    indices = [entry.get("layer") for entry in layers]
    duplicates = sorted({i for i in indices if indices.count(i) > 1}, key=str)
    if duplicates:
        raise HeadlabError(f"{where}: the head layout lists layer(s) {duplicates} more than once")
    if num_layers is not None and sorted(indices, key=str) != sorted(range(num_layers), key=str):
        raise HeadlabError(
            f"{where}: the head layout covers layers {sorted(indices, key=str)}, the model has {num_layers} attention "
            "layers"
        )


# ---- where a table came from ----------------------------------------------------------------------------------


def check_unique_heads(pairs, what: str) -> None:
    """A per-head table lists each (layer, head) once: of two rows for one head neither can be chosen silently
    (plot would draw the first, a score reader keep the last). `what` names the table ("score table scores.csv");
    the message is the one headlab.pruning.scores.read_scores gives."""
    pairs = [tuple(pair) for pair in pairs]
    seen, twice = set(), set()
    for pair in pairs:
        (twice if pair in seen else seen).add(pair)
    if twice:
        listed = ", ".join(f"layer {a} head {b}" for a, b in sorted(twice, key=str)[:3])
        raise HeadlabError(f"{what} lists {listed}{', ...' if len(twice) > 3 else ''} more than once")


def _file_key(path: Path) -> dict:
    """What identifies one version of a file without reading it: an in-place edit changes size, mtime or ctime (ctime
    cannot be set back by a user), a copy has another inode."""
    info = path.stat()
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "ctime_ns": info.st_ctime_ns, "inode": info.st_ino,
            "device": info.st_dev}  # fmt: skip


def _read_fingerprint_cache(cache: Path | None) -> dict:
    if cache is None or not cache.is_file():
        return {}
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}  # a damaged cache only costs a recomputation
    return entries if isinstance(entries, dict) else {}


def _write_fingerprint_cache(cache: Path | None, entries: dict) -> None:
    """Best effort: the cache saves a full read of the weights next time, and a cache that cannot be written (read-only
    home, full disk) must not fail a run that has everything it needs."""
    from headlab.core.fsio import atomic_write_bytes  # start-up: fsio is not needed by the other validators

    if cache is None:
        return
    live = {name: entry for name, entry in entries.items() if Path(name).is_file()}  # forget deleted checkpoints
    try:
        atomic_write_bytes(cache, json.dumps(dict(list(live.items())[-FINGERPRINT_CACHE_ENTRIES:])).encode())
    except (HeadlabError, OSError):
        pass


def file_sha256(path: Path, cache: dict | None = None) -> str:
    """sha256 of every byte of a file, reused from `cache` (resolved path -> _file_key + sha256) while the file's
    size, mtime, ctime and inode are unchanged; the cache is updated in place."""
    path = Path(path)
    name, key = str(path.resolve()), _file_key(path)
    entry = (cache or {}).get(name)
    if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if cache is not None:
        cache.pop(name, None)  # re-inserted last: the newest entries survive the size bound
        cache[name] = {**key, "sha256": digest}
    return digest


def model_fingerprint(directory, cache: Path | None = None) -> str | None:
    """sha256 over config.json, headlab.json, the tokenizer files and every byte of every weight file: two
    checkpoints share it only if they hold the same model, so a score table of a model edited in place (one weight
    changed, same size) is not taken for the edited one. None for a non-directory (a hub id); a single file (GGUF) is
    fingerprinted as its own weight file.

    Reading the weights costs about a second per 500 MB (docs/reliability.md): `cache`, a JSON file, keeps each weight
    file's sha256 with its size, mtime, ctime and inode, so a model loaded again unchanged is not read again."""
    directory = Path(directory)
    if directory.is_file():
        files = [directory]
    elif (directory / "config.json").is_file():
        files = sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin"))
    else:
        return None
    digest = hashlib.sha256()
    if directory.is_dir():
        # the tokenizer decides which tokens a score run saw: part of what a score table depends on
        for name in ("config.json", "headlab.json", *FINGERPRINT_TOKENIZER_FILES):
            if (directory / name).is_file():
                digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
    entries = _read_fingerprint_cache(cache)
    before = json.dumps(entries)
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0{file_sha256(path, entries)}\0".encode())
    if json.dumps(entries) != before:
        _write_fingerprint_cache(cache, entries)
    return digest.hexdigest()


def _run_meta(source) -> tuple[dict, Path | None]:
    """meta.json of the run directory a table came from (the directory itself, or the table file's folder)."""
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return {}, None
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, OSError, UnicodeDecodeError):
        raise HeadlabError(f"cannot read {meta_path}: not valid JSON") from None
    return (meta if isinstance(meta, dict) else {}), meta_path


def _same_source(recorded, current) -> bool:
    def norm(value):
        path = Path(str(value)).expanduser()
        return str(path.resolve()) if path.exists() else str(value)

    return norm(recorded) == norm(current)


def check_table_origin(source, loaded, option: str, allow_foreign: bool = False) -> None:
    """Refuse a score or mask table whose run metadata names another model or head layout than `loaded`.

    Same model: equal fingerprints where both runs recorded one; else the same resolved source and, where recorded,
    the same query heads per layer. A bare table with no meta.json beside it is checked by its reader only.
    """
    if source is None or allow_foreign or not isinstance(source, (str, Path)):
        return
    meta, meta_path = _run_meta(source)
    if meta_path is None or "source" not in meta:
        return
    current = loaded.describe()
    theirs, ours = meta.get("fingerprint"), current.get("fingerprint")
    same_model = theirs == ours if theirs and ours else _same_source(meta["source"], current["source"])
    if not same_model:
        raise HeadlabError(
            f"{option} {source} was computed on {meta.get('model', meta['source'])!r} ({meta_path} says so), not "
            f"on {current['model']!r}; pass allow_foreign=True to use it anyway"
        )
    recorded = meta.get("heads_per_layer")
    # Equal fingerprints settle it (a prune run records its layout after pruning, while its mask.csv is in the
    # original model's indices); by path alone, a checkpoint replaced in place would still show its other layout.
    if not (theirs and ours) and recorded is not None and recorded != current.get("heads_per_layer"):
        raise HeadlabError(
            f"{option} {source} was computed on a layout with heads per layer {recorded}, this model has "
            f"{current.get('heads_per_layer')}; pass allow_foreign=True to use it anyway"
        )
