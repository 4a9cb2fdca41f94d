"""torch.distributed helpers: join the process group torchrun (or submitit on Slurm) describes.

Launch ``torchrun --nproc_per_node=N -m med_ddpm.train ...``: torchrun exports ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address, and :func:`init_from_env` joins the
group (NCCL on CUDA, gloo on CPU). Under Hydra's submitit launcher with ``tasks_per_node > 1``
the same variables are exported from Slurm's by :class:`submitit.helpers.TorchDistributedEnvironment`.
A plain ``python -m ...`` sets none of them: every helper then answers as a world of one
(rank 0, main, barrier a no-op), so single-process code needs no branches.

Randomness that must not depend on how work is split across ranks (the t/ε of a training
sample, the x_T of a sampled mask) comes from :func:`keyed_generator`: a generator seeded
by (seed, global index) instead of one stream per process.

Example:
    >>> device = init_from_env("auto")        # cuda:LOCAL_RANK under torchrun on GPUs
    >>> mine = shard(masks)                   # rank r takes masks[r::world_size]
    >>> if is_main(): save(...)
    >>> barrier(); cleanup()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from med_ddpm.utils import resolve_device

T = TypeVar("T")


def _export_submitit_env() -> None:
    """Slurm tasks started by submitit (Hydra's launcher) get torchrun's variables."""
    if "WORLD_SIZE" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:  # one GPU per task; devices are picked by LOCAL_RANK below
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def launched() -> bool:
    """True when a launcher (torchrun, submitit) asked for a process group."""
    return "WORLD_SIZE" in os.environ


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda`` becomes ``cuda:LOCAL_RANK`` (modulo visible GPUs) under a launcher."""
    if device.type != "cuda" or device.index is not None or not launched():
        return device
    return torch.device("cuda", local_rank() % torch.cuda.device_count())


def init_from_env(device: str | torch.device = "auto") -> torch.device:
    """Join the launcher's process group (idempotent; a no-op without one); return this rank's device.

    The backend follows the device: NCCL for CUDA tensors, gloo for CPU ones.
    """
    _export_submitit_env()
    device = local_device(resolve_device(str(device)))
    if not launched() or dist.is_initialized():
        return device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and all_gather_object use the current device
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0 owns the side effects: EMA, logs, checkpoints, previews."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()


def shard(items: Sequence[T]) -> Sequence[T]:
    """Rank r's share: ``items[r::world_size]`` (round-robin, so shares differ by at most one)."""
    return items[rank() :: world_size()]


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (e.g. a Hydra output directory whose timestamp differs per rank)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a list of one without a process group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The all-reduced mean of a per-rank 0-d tensor (a NaN on any rank makes it NaN everywhere).

    Stays on the device (NCCL queues the all-reduce on the stream): no host sync.
    """
    if not is_distributed():
        return value
    t = value.detach().to(torch.float64, copy=True).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.reshape(()) / world_size()


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel`` around the prepared model when a process group exists.

    DDP broadcasts rank 0's parameters at construction and averages gradients in backward,
    so every rank holds the same weights after each optimizer step.
    """
    if not is_distributed():
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` on the micro-steps that must not all-reduce yet (gradient accumulation)."""
    if sync or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def derived_seed(*keys: int) -> int:
    """A 63-bit seed mixed from integer keys (NumPy's SeedSequence hash, as the phantoms use)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0]) & (2**63 - 1)


def keyed_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator seeded by ``keys`` (e.g. seed, global sample index): the same draws on any rank."""
    return torch.Generator(device).manual_seed(derived_seed(*keys))
