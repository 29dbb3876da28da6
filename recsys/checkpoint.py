"""Checkpoints: every rank's dense parameters, optimizer state, embedding shards, data position and RNG.

Layout: ``DIR/checkpoints/step_00000100/{rank_0.pt, rank_1.pt, ..., store_rank_r/, meta.json}``. Each rank
writes its file atomically (temporary name, fsync, rename); rank 0 writes ``meta.json`` only after every
rank has finished, so a checkpoint without it is incomplete and never resumed from. ``meta.json`` is also
the manifest: the size and BLAKE2b checksum of every file of the checkpoint. :func:`resumable_checkpoint`
verifies the newest complete checkpoint against it and falls back to an older one, saying why, when a file
is missing, truncated or altered. Files load with ``torch.load(weights_only=True)``: no pickled code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recsys.errors import UserError

__all__ = [
    "CheckpointError",
    "checkpoint_world_size",
    "latest_checkpoint",
    "load_checkpoint",
    "resumable_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger("recsys")

META = "meta.json"
# Format 2 adds the manifest (``files``) to meta.json; format-1 checkpoints have none and are not verified.
FORMAT = 2
_HASH_CHUNK_BYTES = 1 << 20
# A checkpoint that failed verification is renamed with this prefix: kept for inspection, never resumed.
DAMAGED_PREFIX = "damaged_"


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


def _offsets(value: Any, where: str) -> dict[str, list[list[int]]]:
    """``{dotted path: [offsets of each local shard]}`` of every sharded tensor in a (nested) state dict."""
    if hasattr(value, "local_shards"):
        return {where: [list(s.metadata.shard_offsets) for s in value.local_shards()]}
    out: dict[str, list[list[int]]] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(_offsets(item, f"{where}.{key}"))
    return out


@torch.no_grad()
def _reshard_into(
    live: Any, saved: list[tuple[Any, dict[str, Any]]], where: str, skip: Callable[[str], bool]
) -> None:
    """Fill ``live`` (this rank's state under the new sharding) from every old rank's ``(state, offsets)``.

    A sharded tensor's local shard is assembled from the saved shards that overlap it (by their global
    offsets); anything else is replicated, and taken from old rank 0.
    """
    if skip(where):
        return
    if hasattr(live, "local_shards"):
        for shard in live.local_shards():
            lo = list(shard.metadata.shard_offsets)
            filled = 0
            for state, offsets in saved:
                for piece, off in zip(state, offsets.get(where, []), strict=True):
                    region = [
                        (max(a, b), min(a + n, b + m))
                        for a, n, b, m in zip(lo, shard.tensor.shape, off, piece.shape, strict=True)
                    ]
                    if any(start >= stop for start, stop in region):
                        continue
                    dst = tuple(
                        slice(start - a, stop - a) for (start, stop), a in zip(region, lo, strict=True)
                    )
                    src = tuple(
                        slice(start - b, stop - b) for (start, stop), b in zip(region, off, strict=True)
                    )
                    shard.tensor[dst] = piece[src]
                    filled += math.prod(stop - start for start, stop in region)
            if filled != shard.tensor.numel():
                raise CheckpointError(
                    f"checkpoint does not cover {where} at offsets {lo} under the new sharding"
                )
    elif isinstance(live, torch.Tensor):
        _copy_tensor(live, saved[0][0], where)
    elif isinstance(live, dict):
        for key, value in live.items():
            # Under table-wise sharding only the ranks that held a table saved its optimizer state.
            parts = [(state[key], offsets) for state, offsets in saved if key in state]
            if not parts:
                raise CheckpointError(f"checkpoint does not match the model: {where}.{key} is missing")
            _reshard_into(value, parts, f"{where}.{key}", skip)


def _copy_tensor(live: torch.Tensor, saved: torch.Tensor, where: str) -> None:
    if live.shape != saved.shape:
        raise CheckpointError(
            f"checkpoint does not match the model at {where}: shape {tuple(saved.shape)} vs {tuple(live.shape)}"
        )
    live.copy_(saved)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _file_digest(path: Path) -> str:
    """BLAKE2b of a file, read in chunks (a store snapshot may be large)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _describe(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{relative path: {bytes, blake2b}}`` of files and of every file under folders."""
    files: list[Path] = []
    for p in paths:
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return {str(f.relative_to(root)): {"bytes": f.stat().st_size, "blake2b": _file_digest(f)} for f in files}


def save_checkpoint(
    root: Path,
    *,
    step: int,
    dmp: Any,
    dense_optimizer: Any,
    keep: int,
    extra: Callable[[Path], list[Path]] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint after ``step`` steps; collective over all ranks.

    ``extra(path)`` writes more of this rank's state into the checkpoint directory (the tiered store's
    snapshot) before the checkpoint is marked complete, and returns the files or folders it wrote: the
    manifest records their sizes and checksums.
    """
    rank, world = _rank_world()
    path = _step_dir(root, step)
    if rank == 0 and path.exists():
        # Left by a run that was killed while writing it, or a damaged one: never mix old and new files.
        shutil.rmtree(path)
    if world > 1:
        dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    model_state, fused_state = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    payload = {
        "step": step,
        "world_size": world,
        "model": _leaves(model_state),
        "fused_optimizer": _leaves(fused_state),
        "dense_optimizer": _leaves(dense_optimizer.state_dict()),
        "rng": torch.get_rng_state(),
        # Where each local shard sits in its table: a checkpoint can be loaded by another number of ranks.
        "shard_offsets": _offsets(model_state, "model") | _offsets(fused_state, "fused_optimizer"),
    }
    tmp = path / f".rank_{rank}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / f"rank_{rank}.pt")
    del payload
    mine = [path / f"rank_{rank}.pt"]
    if extra is not None:
        mine += [p for p in extra(path) if p.exists()]
    files = [_describe(path, mine)]
    if world > 1:
        files = [{} for _ in range(world)]
        dist.all_gather_object(files, _describe(path, mine))
    if rank == 0:
        manifest = {k: v for part in files for k, v in part.items()}
        meta_tmp = path / f".{META}.tmp"
        with open(meta_tmp, "w") as f:
            json.dump({"format": FORMAT, "step": step, "world_size": world, "files": manifest}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, path / META)
        _fsync_dir(path)
        _prune(root, keep)
    if world > 1:
        dist.barrier()
    return path


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / META).is_file())


def _prune(root: Path, keep: int) -> None:
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (not verified), or None."""
    done = _complete(root)
    return done[-1] if done else None


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("no step")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({err})") from None
    return meta


def _check_file(path: Path, name: str, entry: Any) -> str | None:
    """Why ``path/name`` does not match its manifest entry, or None when it does."""
    file = path / name
    if not isinstance(entry, dict) or not {"bytes", "blake2b"} <= entry.keys():
        return f"{file}: bad manifest entry"
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != entry["bytes"]:
        return f"{file} is truncated or altered ({size} bytes, the manifest says {entry['bytes']})"
    if _file_digest(file) != entry["blake2b"]:
        return f"{file} is altered (checksum mismatch)"
    return None


def verify_checkpoint(path: Path) -> list[str]:
    """Problems of a complete checkpoint: files missing, truncated or altered against its manifest.

    Collective when a process group is initialised: rank r checks every r-th file and every rank gets
    the problems of all of them.
    """
    rank, world = _rank_world()
    problems: list[str] = []
    try:
        files = _read_meta(path).get("files")
    except CheckpointError as err:
        problems, files = [str(err)], None
    if isinstance(files, dict):
        for i, (name, entry) in enumerate(sorted(files.items())):
            if i % world == rank and (why := _check_file(path, name, entry)) is not None:
                problems.append(why)
    elif files is not None:
        problems.append(f"checkpoint {path}: bad manifest in {META}")
    if world > 1:
        parts: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(parts, problems)
        problems = sorted(set(sum(parts, [])))
    return problems


def resumable_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint that passes :func:`verify_checkpoint`, or None if there is none.

    A damaged checkpoint is reported (a warning naming the bad file), renamed ``damaged_step_...`` by
    rank 0 so that it is neither resumed from nor counted as one of the kept checkpoints, and the next
    older one is tried. Collective when a process group is initialised.
    """
    rank, world = _rank_world()
    for path in reversed(_complete(root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        if rank == 0:
            log.warning(
                "checkpoint %s is damaged: %s; moved to %s%s, trying the previous complete checkpoint",
                path,
                problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                DAMAGED_PREFIX,
                path.name,
            )
            target = path.with_name(DAMAGED_PREFIX + path.name)
            if target.exists():
                shutil.rmtree(target)
            path.rename(target)
        if world > 1:
            dist.barrier()
    return None


def load_checkpoint(path: Path, *, dmp: Any, dense_optimizer: Any, skip_tables: Collection[str] = ()) -> int:
    """Restore this rank's state from checkpoint ``path``; returns the step to continue from.

    A checkpoint written by another number of ranks is re-partitioned: every sharded tensor (embedding
    shards and their fused-optimizer state) is assembled from the old ranks' shards by global offsets;
    dense parameters and the dense optimizer are replicated and come from old rank 0. ``skip_tables``
    (tiered slot tables, whose rows the store restores) are left alone in that case.
    """
    rank, world = _rank_world()
    meta = _read_meta(path)
    old_world = int(meta["world_size"])
    if old_world == world:
        payload = torch.load(path / f"rank_{rank}.pt", weights_only=True)
        _copy_into(dmp.state_dict(), payload["model"], "model")
        _copy_into(dmp.fused_optimizer.state_dict()["state"], payload["fused_optimizer"], "fused_optimizer")
    else:
        # mmap: the old ranks' files are read piece by piece, never all in memory at once.
        payloads = [torch.load(path / f"rank_{q}.pt", weights_only=True, mmap=True) for q in range(old_world)]
        if any("shard_offsets" not in p for p in payloads):
            raise CheckpointError(
                f"checkpoint {path} was written by {old_world} ranks, this run has {world}, and it predates "
                "resharding (no shard offsets)"
            )

        def skip(where: str) -> bool:
            return any(f"embedding_bags.{name}." in where for name in skip_tables)

        for part in ("model", "fused_optimizer"):
            live = dmp.state_dict() if part == "model" else dmp.fused_optimizer.state_dict()["state"]
            _reshard_into(live, [(p[part], p["shard_offsets"]) for p in payloads], part, skip)
        payload = payloads[min(rank, old_world - 1)]
        payload["dense_optimizer"] = payloads[0]["dense_optimizer"]
    # Optimizers such as Adam create their state lazily on the first step; a zero-gradient step creates it
    # (leaving the parameters unchanged) so that the saved state can be loaded into it.
    dense_optimizer.init_state()
    dense_optimizer.load_state_dict(payload["dense_optimizer"])
    torch.set_rng_state(payload["rng"])
    return int(payload["step"])


def checkpoint_world_size(path: Path) -> int:
    """The number of ranks that wrote checkpoint ``path``."""
    return int(_read_meta(path)["world_size"])
