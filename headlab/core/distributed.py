"""Data parallelism under torchrun: each process takes a share of the windows, sums are all-reduced.

Started with `torchrun --nproc-per-node N -m headlab COMMAND ...`, every process loads the model, runs the windows
`shard()` gives it, and `all_reduce_sum()` adds the accumulators, so the numbers equal one process's (up to
floating-point summation order). Without torchrun everything here is a no-op. FSDP2 uptraining (headlab.recovery.fsdp)
joins a group even of one process (`init(even_alone=True)`), and `lockstep()` tells code that runs forwards per rank
that a sharded model needs every rank in each of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def launched() -> bool:
    """True when started by torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun() -> bool:
    """True under torchrun (or any env:// launcher: RANK, WORLD_SIZE and MASTER_ADDR set), also with one process."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launched_world() -> int:
    """The number of processes the launcher started (WORLD_SIZE), readable before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1")) if torchrun() else 1


def init(device: torch.device | None = None, *, even_alone: bool = False) -> None:
    """Join the process group once: NCCL for CUDA devices, gloo otherwise. even_alone: also in a torchrun world of
    one process (FSDP2 shards over a process group, even a group of one)."""
    if not (launched() or (even_alone and torchrun())) or (dist.is_available() and dist.is_initialized()):
        return
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    if backend == "nccl" and device.index is not None:
        torch.cuda.set_device(device)  # NCCL's collectives (broadcast_object_list too) run on the current device


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Only rank 0 writes files and prints results."""
    return rank() == 0


def shard(items: list[T]) -> list[T]:
    """Rank r takes items r, r + N, r + 2N, ... (interleaved, so window lengths stay balanced)."""
    return items[rank() :: world_size()] if active() else list(items)


def lockstep(model: torch.nn.Module) -> bool:
    """True for a model sharded with FSDP2 (fully_shard): its forward all-gathers parameters, so every rank must run
    it as often as the others, and it reduces its own gradients."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported yet: no model can have been sharded with it
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over processes, in place, and return it (float64 stays float64)."""
    if active():
        device_tensor = tensor
        if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
            device_tensor = tensor.cuda()
        dist.all_reduce(device_tensor, op=dist.ReduceOp.SUM)
        if device_tensor is not tensor:
            tensor.copy_(device_tensor.cpu())
    return tensor


def from_rank0(compute: Callable[[], T]) -> T:
    """compute() on rank 0, its result sent to every rank (pickled: small values); compute() itself alone."""
    if not active():
        return compute()
    box = [compute() if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_max(value: float) -> float:
    if not active():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)
