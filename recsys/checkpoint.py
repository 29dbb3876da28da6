"""Checkpoints: every rank's dense parameters, optimizer state, embedding shards, data position and RNG.

Layout: ``DIR/checkpoints/step_00000100/{rank_0.pt, rank_1.pt, ..., meta.json}``. Each rank writes its
file atomically (temporary name, fsync, rename); rank 0 writes ``meta.json`` only after every rank has
finished, so a checkpoint without it is incomplete and never resumed from. Files load with
``torch.load(weights_only=True)``: no pickled code.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recsys.errors import UserError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError"]

META = "meta.json"


class CheckpointError(UserError):
    """No usable checkpoint, or one that does not match this run."""


def _leaves(value: Any) -> Any:
    """A state dict with every tensor (or ShardedTensor's local shards) detached to CPU."""
    if hasattr(value, "local_shards"):
        return [s.tensor.detach().cpu().clone() for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _leaves(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_leaves(v) for v in value]
    return value


@torch.no_grad()
def _copy_into(live: Any, saved: Any, where: str) -> None:
    """Copy saved tensors into the live ones, in place (live storage is aliased by the kernels)."""
    if hasattr(live, "local_shards"):
        shards = live.local_shards()
        if len(shards) != len(saved):
            raise CheckpointError(f"checkpoint does not match the model at {where}: shard count differs")
        for shard, tensor in zip(shards, saved, strict=True):
            _copy_tensor(shard.tensor, tensor, where)
    elif isinstance(live, torch.Tensor):
        _copy_tensor(live, saved, where)
    elif isinstance(live, dict):
        for key, value in live.items():
            if key not in saved:
                raise CheckpointError(f"checkpoint does not match the model: {where}.{key} is missing")
            _copy_into(value, saved[key], f"{where}.{key}")


def _copy_tensor(live: torch.Tensor, saved: torch.Tensor, where: str) -> None:
    if live.shape != saved.shape:
        raise CheckpointError(
            f"checkpoint does not match the model at {where}: shape {tuple(saved.shape)} vs {tuple(live.shape)}"
        )
    live.copy_(saved)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def save_checkpoint(
    root: Path,
    *,
    step: int,
    dmp: Any,
    dense_optimizer: Any,
    keep: int,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint after ``step`` steps; collective over all ranks.

    ``extra(path)`` writes more of this rank's state into the checkpoint directory (the tiered store's
    snapshot) before the checkpoint is marked complete.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    path = _step_dir(root, step)
    path.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": step,
        "world_size": world,
        "model": _leaves(dmp.state_dict()),
        "fused_optimizer": _leaves(dmp.fused_optimizer.state_dict()["state"]),
        "dense_optimizer": _leaves(dense_optimizer.state_dict()),
        "rng": torch.get_rng_state(),
    }
    tmp = path / f".rank_{rank}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / f"rank_{rank}.pt")
    if extra is not None:
        extra(path)
    if world > 1:
        dist.barrier()
    if rank == 0:
        meta_tmp = path / f".{META}.tmp"
        meta_tmp.write_text(json.dumps({"step": step, "world_size": world}))
        os.replace(meta_tmp, path / META)
        _prune(root, keep)
    if world > 1:
        dist.barrier()
    return path


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / META).is_file())


def _prune(root: Path, keep: int) -> None:
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    done = _complete(root)
    return done[-1] if done else None


def load_checkpoint(path: Path, *, dmp: Any, dense_optimizer: Any) -> int:
    """Restore this rank's state from checkpoint ``path``; returns the step to continue from."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    meta = json.loads((path / META).read_text())
    if meta["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} ranks, this run has {world}"
        )
    payload = torch.load(path / f"rank_{rank}.pt", weights_only=True)
    _copy_into(dmp.state_dict(), payload["model"], "model")
    _copy_into(dmp.fused_optimizer.state_dict()["state"], payload["fused_optimizer"], "fused_optimizer")
    # Optimizers such as Adam create their state lazily on the first step; a zero-gradient step creates it
    # (leaving the parameters unchanged) so that the saved state can be loaded into it.
    dense_optimizer.init_state()
    dense_optimizer.load_state_dict(payload["dense_optimizer"])
    torch.set_rng_state(payload["rng"])
    return int(payload["step"])
