"""Process-group setup and device choice: gloo on CPU, NCCL on CUDA; torchrun or self-spawned workers."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recsys.local_env import free_port, launched_by_torchrun, set_local_rank_env

__all__ = [
    "DistEnv",
    "launched_by_torchrun",
    "free_port",
    "init_distributed",
    "compute_device",
    "set_local_rank_env",
    "collective_timeout",
]

# The process groups' collective timeout (init_distributed sets it; every group of the job uses it).
_timeout = datetime.timedelta(minutes=30)


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def compute_device(local_rank: int) -> torch.device:
    """The compute device of a local rank: its own GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def collective_timeout() -> datetime.timedelta:
    """The timeout for collectives of every process group of this job (pass it to ``dist.new_group``)."""
    return _timeout


def init_distributed(*, threads_per_rank: int = 0, timeout_s: float = 1800.0) -> DistEnv:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    A collective that waits longer than ``timeout_s`` for a peer (a rank that died or hangs) fails with
    an error instead of blocking forever; the groups created later use the same timeout.
    """
    global _timeout
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise RuntimeError("MASTER_PORT is not set for a multi-process run")
        os.environ["MASTER_PORT"] = str(free_port())
    device = compute_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    _timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized() and world_size == 1:
        # One rank needs no rendezvous: an in-process store, so no TCP port can be taken from under it.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_timeout
        )
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=_timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend)
