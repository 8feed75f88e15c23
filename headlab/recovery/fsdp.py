"""Sharded uptraining with torch's FSDP2 (`headlab uptrain --parallel fsdp` under torchrun).

Each decoder layer (the classes transformers names in `_no_split_modules`, the blocks it never splits over devices),
then the root, is `fully_shard`ed (Zhao et al. 2023, PyTorch FSDP; torch.distributed.fsdp.fully_shard): every rank
keeps 1/N of each parameter (dim-0 shards), of its gradient and of the AdamW state built on it, and all-gathers a
layer's parameters only while that layer runs. The teacher is sharded the same way, without an optimiser: streaming
its logits from one rank would need that rank to hold the whole teacher, the memory FSDP is chosen to avoid.

The model that uptraining shards is a structural copy of the caller's, built on the meta device and sharded there;
rank 0 alone supplies the values, scattered to every rank in FSDP's own shards one tensor at a time, so the other
ranks may load only the structure. When no rank holds the values (every rank passes a skeleton of a safetensors
checkpoint, as the CLI does), each rank reads its own dim-0 rows of every parameter from the files instead
(`checkpoint_shards`: safetensors slices, so no process ever holds the model whole, rank 0 included). The caller's own
model gives up its tensors for the run (meta placeholders) and gets the trained values back at the end, gathered whole
(`get_model_state_dict(full_state_dict=True)`) on every rank or on rank 0's host alone, the same module objects as
before.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from headlab.core import cpu_matmul, distributed
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel
from headlab.core.streaming import TensorReader, checkpoint_files, stored_name
from headlab.recovery.choices import WHOLE_AFTER


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: modules whose class the model names in `_no_split_modules` (transformers' unit of device
    placement, one per layer), in model order; none for a model that names none (then only the root is sharded)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if module is not model and type(module).__name__ in names]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters, gradients and AdamW state); an ordinary tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (clip_grad_norm_'s total norm over shards: a collective every rank runs)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_bytes(*modules: nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this process holds of the modules' distinct parameters (local shards under FSDP) and of the optimiser's
    state tensors (AdamW: exp_avg, exp_avg_sq, step): {"parameters", "optimiser_state", "total"}. FSDP modules are
    resharded first: FSDP2 leaves the root's parameters (embeddings, final norm, LM head) gathered after a forward,
    for the backward that usually follows, and parameters() would then count them whole."""
    seen, parameters = set(), 0
    for module in modules:
        for sub in module.modules() if module is not None else ():
            if isinstance(sub, FSDPModule):
                sub.reshard()  # frees the gathered copy; local, no collective
        for param in module.parameters() if module is not None else ():
            if id(param) not in seen:
                seen.add(id(param))
                shard = local(param)
                parameters += shard.numel() * shard.element_size()
    state = 0
    for values in optimizer.state.values() if optimizer is not None else ():
        for value in values.values():
            if isinstance(value, torch.Tensor):
                shard = local(value)
                state += shard.numel() * shard.element_size()
    return {"parameters": parameters, "optimiser_state": state, "total": parameters + state}


def _placeholders(model: nn.Module) -> dict[int, nn.Parameter]:
    """Put a meta tensor of the same shape, dtype and requires_grad in place of every parameter of `model` (one per
    parameter object, so tied parameters stay tied); returns id(original) -> placeholder."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
                )
            module._parameters[name] = made[id(param)]
    return made


def _fill(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give `model` (its parameters meta placeholders) the gathered values, keeping tied parameters one object."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    model.load_state_dict(state, strict=False, assign=True)  # assign: the values become the parameters, no copy
    for names in aliases.values():
        loaded = [model.get_parameter(n) for n in names if not model.get_parameter(n).is_meta]
        for name in names if loaded else ():  # a tied parameter the state dict named once: every alias gets it
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, loaded[0])
    empty = [name for name, param in model.named_parameters() if param.is_meta]
    if empty:
        raise RuntimeError(f"the gathered FSDP state dict lacks {', '.join(empty[:3])}")


def _values_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of every distinct parameter (tied ones under their first name, as named_parameters gives them)
    and buffer, non-persistent buffers included (rotary frequencies: no state dict carries them)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@torch.no_grad()
def _distribute(work: nn.Module, source: dict[str, torch.Tensor], mesh) -> None:
    """Give the sharded, empty `work` rank 0's values: each parameter scattered from rank 0 in FSDP's dim-0 shards
    (distribute_tensor, Shard(0): the chunks FSDP2 keeps), one whole tensor at a time on the other ranks; each buffer
    broadcast whole. `source` is rank 0's name -> tensor (empty on the other ranks), in work's own names."""
    main = distributed.rank() == 0
    for name, param in work.named_parameters():
        value = source[name].to(mesh.device_type) if main else torch.empty(param.shape, dtype=param.dtype,
                                                                             device=mesh.device_type)  # fmt: skip
        local(param).copy_(distribute_tensor(value.to(param.dtype), mesh, [Shard(0)], src_data_rank=0).to_local())
    for name, buffer in work.named_buffers():
        if main:
            buffer.copy_(source[name])
        if distributed.world_size() > 1:
            torch.distributed.broadcast(buffer, src=0)


@dataclass
class CheckpointShards:
    """A safetensors checkpoint each rank reads its own shards from: the stored name of every distinct parameter, and
    every buffer's value (persistent ones as stored; the others, rotary frequencies, as the model class computes them
    from the config)."""

    reader: TensorReader
    names: dict[str, str]  # parameter name (named_parameters: tied ones once) -> stored name
    buffers: dict[str, torch.Tensor]


def is_skeleton(model: nn.Module) -> bool:
    """Every parameter on the meta device: the structure alone (headlab.core.loading.load_structure)."""
    return all(param.is_meta for param in model.parameters())


def checkpoint_shards(loaded: LoadedModel) -> CheckpointShards | None:
    """Where each rank can read its shards of loaded.model: its checkpoint directory (loaded.source), when every
    distinct parameter is stored there under the name the model uses or the one save_pretrained writes, in the same
    shape, and every buffer is stored or computed by the model class; else None (a GGUF file, a hub id, weights that
    transformers converts on load), and the values must come from rank 0."""
    reader = checkpoint_reader(loaded)
    if reader is None:
        return None
    model, stored = loaded.model, set(reader.where)
    names = {}
    for name, param in model.named_parameters():
        key = stored_name(model, name, param, stored)
        if key is None or reader.shapes[key] != list(param.shape):
            return None
        names[name] = key
    computed, buffers = _constructed_buffers(model), {}
    for name, buffer in model.named_buffers():
        key = stored_name(model, name, buffer, stored)
        if key is not None and reader.shapes[key] == list(buffer.shape):
            buffers[name] = reader.read(key).to(buffer.dtype)
        elif name in computed and computed[name].shape == buffer.shape:
            buffers[name] = computed[name].to(buffer.dtype)
        else:
            return None
    return CheckpointShards(reader, names, buffers)


def checkpoint_reader(loaded: LoadedModel) -> TensorReader | None:
    """A reader of loaded.source's safetensors files (a directory, or a hub id's cached snapshot), or None."""
    source = _local_directory(loaded.source)
    if source is None:
        return None
    try:
        return TensorReader(source, checkpoint_files(source))
    except HeadlabError:  # no safetensors there
        return None


def _local_directory(source: str) -> Path | None:
    """A checkpoint directory, or a hub id's snapshot in the local cache (a directory too); None otherwise."""
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download  # start-up: the hub client loads for an FSDP run alone
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        return Path(snapshot_download(source, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, OSError, ValueError):
        return None


def _constructed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers model's class computes from its config when built (rotary frequencies): the class built again with
    its parameters on the meta device (accelerate's init_empty_weights), so this costs the buffers alone."""
    from accelerate import init_empty_weights  # start-up: accelerate is imported only by an FSDP run

    try:
        with init_empty_weights(include_buffers=False):
            fresh = type(model)(model.config)
    except (TypeError, ValueError, RuntimeError):  # a class that needs more than its config: rank 0 sends the values
        return {}
    return {name: buffer for name, buffer in fresh.named_buffers() if not buffer.is_meta}


def _give_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put `buffers` (name -> value) in place of a skeleton's meta buffers, keeping each one's persistence."""
    for name, value in buffers.items():
        parent, _, attribute = name.rpartition(".")
        model.get_submodule(parent)._buffers[attribute] = value


@torch.no_grad()
def _read_shards(work: nn.Module, shards: CheckpointShards) -> None:
    """Fill the sharded, empty `work` from the files: each rank reads rows [r c, r c + its rows) of every parameter,
    c = ceil(rows / world) (FSDP2's dim-0 chunks, torch.chunk's), and every buffer whole; no collective."""
    rank, world = distributed.rank(), distributed.world_size()
    for name, param in work.named_parameters():
        shard, key = local(param), shards.names[name]
        if param.dim() == 0:
            shard.copy_(shards.reader.read(key))
        elif shard.shape[0]:
            start = rank * -(-param.shape[0] // world)
            shard.copy_(shards.reader.read_rows(key, start, start + shard.shape[0]))
    for name, buffer in work.named_buffers():
        buffer.copy_(shards.buffers[name])


def bytes_held(model: nn.Module) -> int:
    """Bytes of the distinct parameters that hold storage (meta placeholders hold none)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


@contextlib.contextmanager
def sharded(
    loaded: LoadedModel,
    trained: set[str] | None = None,
    *,
    device: torch.device | None = None,
    whole_after: str = "every rank",
    frozen: bool = False,
) -> Iterator[LoadedModel]:
    """Yields a LoadedModel of a copy of loaded.model sharded with FSDP2 over the torchrun world (decoder layers,
    then the root) on `device` (default: loaded.device); `trained`: names of the parameters to train (requires_grad
    set before sharding, so FSDP reduces gradients for those alone), None to keep the flags.

    The values come from rank 0: the other ranks may pass a skeleton (the same modules on the meta device,
    `headlab.core.loading.load_structure`), so only rank 0 ever holds the whole model, and on the host if it was
    loaded there; each rank receives its shards one tensor at a time. When every rank passes a skeleton, each reads its
    own shards from loaded.source (`checkpoint_shards`; refused in one line where that cannot be done), and the
    skeletons get the model's buffers, so rank 0 never holds more than its shards. On a normal exit loaded.model gets the sharded
    copy's trained values gathered whole: on every rank (`whole_after="every rank"`, on `device`) or on rank 0
    alone, in host memory (`"rank 0"`: the other ranks keep meta placeholders). After an error it is left without
    them (the command stops). `frozen`: the run does not change the values (a teacher); when every rank read them
    from the files, nothing is gathered at the end (the files still hold them) and the caller's skeleton stays one,
    so rank 0's host never holds the teacher. Every rank must enter and leave together (collectives)."""
    if whole_after not in WHOLE_AFTER:
        raise ValueError(f"whole_after={whole_after!r}: one of {WHOLE_AFTER}")
    device = device or loaded.device
    distributed.init(device, even_alone=True)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the mesh's device is the current one: this rank's GPU
    model = loaded.model
    shards = None
    if distributed.all_reduce_max(0.0 if is_skeleton(model) else 1.0) == 0.0:  # no rank holds the values
        shards = checkpoint_shards(loaded)
        if shards is None:
            raise HeadlabError(
                f"{loaded.spec}: no process holds its weights and its checkpoint cannot be read in shards (a safetensors "
                "directory whose tensors the model names); load the weights on rank 0"
            )
        _give_buffers(model, shards.buffers)  # small, and the caller's model needs them after the run
    source = _values_of(model) if distributed.rank() == 0 and shards is None else {}
    _placeholders(model)  # the caller's model lets go of its weights (rank 0 keeps them in `source` until sent)
    work = copy.deepcopy(model)  # the same modules again, every parameter a meta placeholder: nothing copied
    if trained is not None:
        for name, param in work.named_parameters():
            param.requires_grad_(name in trained)
    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    for block in blocks(work):
        fully_shard(block, mesh=mesh)
    fully_shard(work, mesh=mesh)
    work.to_empty(device=device)  # this rank's shards (and whole buffers), allocated, not yet filled
    if cpu_matmul.needs_float32_products(device, loaded.dtype):
        cpu_matmul.install(work)  # every rank computes as rank 0's model did (a skeleton was loaded without hooks)
    if shards is None:
        _distribute(work, source, mesh)
    else:
        _read_shards(work, shards)
    del source
    yield replace(loaded, model=work, device=device)
    if frozen and shards is not None:  # the same decision on every rank: no rank enters the gather
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=whole_after == "rank 0")
    full = get_model_state_dict(work, options=options)  # whole tensors: every rank, or rank 0 on the host
    del work
    if full:
        _fill(model, full)


__all__ = [
    "CheckpointShards",
    "blocks",
    "bytes_held",
    "checkpoint_reader",
    "checkpoint_shards",
    "full_value",
    "is_skeleton",
    "local",
    "local_bytes",
    "sharded",
]
