"""The checkpoint protocol: every part of a rank's training state saves itself into a checkpoint folder
and restores itself from one; :func:`save_checkpoint` writes them all and marks the checkpoint complete.

Parts are the dense model with the embedding shards and optimizers (:class:`ModelState`), the tiered
store, the run's record, the digest and the config (``recsys/checkpoint/parts.py``), and the data
position and evaluation record (``recsys/train_state.py``). A part writes
only this rank's files (rank 0 also the run-wide ones) and returns them; the manifest in ``meta.json``
lists every rank's with sizes and checksums. JSON-sized state goes into ``meta.json`` instead, through
``Checkpoint.meta`` (rank 0's is written).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from recsys.checkpoint import files as ckpt_files
from recsys.checkpoint.files import FORMAT, META, _describe, _prune, _rank_world, _step_dir

__all__ = ["Checkpoint", "Checkpointable", "save_checkpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder as a part sees it.

    Attributes:
        path: the folder (``.../checkpoints/step_NNNNNNNN``).
        step: the steps trained when it was written.
        rank, world_size: this rank and the number of ranks of the run that saves or restores.
        meta: when saving, entries a part adds to ``meta.json`` (rank 0's are written; JSON-safe); when
            restoring, the verified ``meta.json`` (:func:`~recsys.checkpoint.checkpoint_meta`).
    """

    path: Path
    step: int
    rank: int
    world_size: int
    meta: dict[str, Any] = field(default_factory=dict)


class Checkpointable(Protocol):
    """A part of the training state that checkpoints hold."""

    def save(self, into: Checkpoint) -> list[Path]:
        """Write this rank's part under ``into.path``; return the files and folders written."""

    def restore(self, source: Checkpoint) -> None:
        """Load this rank's part from a verified checkpoint (possibly of another world size)."""


def save_checkpoint(root: Path, *, step: int, parts: Mapping[str, Checkpointable], keep: int) -> Path:
    """Write every part of this rank's state after ``step`` steps under ``root``; collective.

    The checkpoint is complete, and may be resumed from, once rank 0 has written ``meta.json`` after every
    rank's parts are durable; then all but the newest ``keep`` complete checkpoints are removed.
    """
    rank, world = _rank_world()
    path = _step_dir(root, step)
    if rank == 0:
        if path.exists():
            # Left by a run that was killed while writing it, or a damaged one: never mix old and new files.
            shutil.rmtree(path)
        new_root = not root.exists()
        path.mkdir(parents=True)
        if new_root:
            ckpt_files._fsync_dir(root.parent)
        ckpt_files._fsync_dir(root)  # the step directory's entry survives a power loss
    if world > 1:
        dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    into = Checkpoint(path=path, step=step, rank=rank, world_size=world)
    mine = [p for part in parts.values() for p in part.save(into) if p.exists()]
    extra = json.loads(json.dumps(into.meta, allow_nan=False))  # JSON-safe, or fail before meta.json
    files = [_describe(path, mine)]
    if world > 1:
        files = [{} for _ in range(world)]
        dist.all_gather_object(files, _describe(path, mine))
    if rank == 0:
        manifest = {k: v for part in files for k, v in part.items()}
        meta = {"format": FORMAT, "step": step, "world_size": world, "files": manifest, **extra}
        ckpt_files._fsync_dir(
            path
        )  # every rank's renames are durable before the checkpoint is marked complete
        text = json.dumps(meta, indent=1).encode()
        ckpt_files.write_file_durably(path / META, lambda f: f.write(text))
        _prune(root, keep)
    if world > 1:
        dist.barrier()
    return path
