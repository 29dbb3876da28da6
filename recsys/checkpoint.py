"""Checkpoints: every rank's dense parameters, optimizer state, embedding shards, data position and RNG.

Layout: ``DIR/checkpoints/step_00000100/{rank_0.pt, rank_1.pt, ..., store_rank_r/, meta.json}``. Each rank
writes its file atomically (temporary name, fsync, rename, fsync of the folder); rank 0 writes ``meta.json``
only after every rank has finished, so a checkpoint without it is incomplete and never resumed from.
``meta.json`` is also the manifest: the size and BLAKE2b checksum of every file of the checkpoint.
:func:`resumable_checkpoint` verifies the newest complete checkpoint against it and falls back to an older
one, saying why, when a file is missing, truncated, altered or not listed, or ``meta.json`` itself does not
hold up (see :func:`checkpoint_meta`). Files load with ``torch.load(weights_only=True)``: no pickled code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from recsys.config import RunConfig, config_to_dict
from recsys.errors import UserError

__all__ = [
    "CheckpointError",
    "checkpoint_meta",
    "checkpoint_world_size",
    "fingerprint_mismatch",
    "latest_checkpoint",
    "load_checkpoint",
    "model_fingerprint",
    "resumable_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger("recsys")

META = "meta.json"
# Format 2 added the manifest (``files``) to meta.json; format-1 checkpoints cannot be verified and are not read.
FORMAT = 2
_STEP_DIR = re.compile(r"step_(\d{8,})")
_RANK_FILE = re.compile(r"rank_(\d+)\.pt")
_STORE_DIR = re.compile(r"store_rank_(\d+)")
# Our temporary names (``.rank_0.pt.tmp``, ``.meta.json.tmp``, a store snapshot's ``.store_rank_0.tmp/``):
# left only by a writer that was killed, never part of a checkpoint.
_TEMP = re.compile(r"\..+\.tmp")
_DIGEST = re.compile(r"[0-9a-f]{32}")
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


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file (O_NONBLOCK: a FIFO in its place never blocks)."""
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise ValueError("not a regular file")
    return f


def _digest(f: BinaryIO) -> str:
    """BLAKE2b of an open file, read in chunks (a store snapshot may be large)."""
    h = hashlib.blake2b(digest_size=16)
    while chunk := f.read(_HASH_CHUNK_BYTES):
        h.update(chunk)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    with _open_regular(path) as f:
        return _digest(f)


def _tree(path: Path) -> Iterator[str]:
    """Relative names of everything under ``path`` that is not a folder (symlinks included, not followed),
    except our temporary names."""
    for here, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not _TEMP.fullmatch(d)]
        rel = PurePosixPath(Path(here).relative_to(path))
        for name in [*names, *(d for d in dirs if os.path.islink(os.path.join(here, d)))]:
            if not _TEMP.fullmatch(name):
                yield str(rel / name)


def _describe(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{relative path: {bytes, blake2b}}`` of files and of every file under folders."""
    files = [q for p in paths for q in ([p / n for n in sorted(_tree(p))] if p.is_dir() else [p])]
    return {str(f.relative_to(root)): {"bytes": f.stat().st_size, "blake2b": _file_digest(f)} for f in files}


def save_checkpoint(
    root: Path,
    *,
    step: int,
    dmp: Any,
    dense_optimizer: Any,
    keep: int,
    extra: Callable[[Path], list[Path]] | None = None,
    fingerprint: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint after ``step`` steps; collective over all ranks.

    ``extra(path)`` writes more of this rank's state into the checkpoint directory (the tiered store's
    snapshot) before the checkpoint is marked complete, and returns the files or folders it wrote: the
    manifest records their sizes and checksums. ``fingerprint`` (:func:`model_fingerprint`, JSON-safe) is
    recorded in ``meta.json`` for :func:`fingerprint_mismatch` on resume; ``trainer_state`` (JSON-safe: the
    best evaluation so far, early-stopping counters) is recorded there for the trainer to restore.
    """
    rank, world = _rank_world()
    path = _step_dir(root, step)
    if fingerprint is not None:
        fingerprint = json.loads(json.dumps(fingerprint))  # not JSON-safe: fail before writing anything
    if trainer_state is not None:
        trainer_state = json.loads(json.dumps(trainer_state, allow_nan=False))
    if rank == 0:
        if path.exists():
            # Left by a run that was killed while writing it, or a damaged one: never mix old and new files.
            shutil.rmtree(path)
        new_root = not root.exists()
        path.mkdir(parents=True)
        if new_root:
            _fsync_dir(root.parent)
        _fsync_dir(root)  # the step directory's entry survives a power loss
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
    _fsync_dir(path)
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
        meta = {"format": FORMAT, "step": step, "world_size": world, "files": manifest}
        if fingerprint is not None:
            meta["fingerprint"] = fingerprint
        if trainer_state is not None:
            meta["trainer"] = trainer_state
        _fsync_dir(path)  # every rank's renames are durable before the checkpoint is marked complete
        meta_tmp = path / f".{META}.tmp"
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, path / META)
        _fsync_dir(path)
        _prune(root, keep)
    if world > 1:
        dist.barrier()
    return path


def _fsync_dir(path: Path) -> None:
    """Make the renames and new entries inside folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(root: Path) -> list[Path]:
    """Checkpoint directories (``step_NNNNNNNN``) that have a ``meta.json``, oldest step first."""
    if not root.is_dir():
        return []
    steps = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(steps) if (p / META).is_file()]


def _prune(root: Path, keep: int) -> None:
    old = _complete(root)[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    if old:
        _fsync_dir(root)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (not verified), or None."""
    done = _complete(root)
    return done[-1] if done else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """``repr`` of a value read from a file, cut to keep the message one short line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _outside(path: Path, name: str) -> str | None:
    """Why ``path/name`` is not confined to checkpoint ``path`` (symlinks resolved), or None."""
    try:
        resolved = (path / name).resolve()
        base = path.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop
        return f"cannot be resolved ({err})"
    return (
        None if resolved.is_relative_to(base) and resolved != base else f"resolves to {resolved}, outside it"
    )


def _entry_problem(path: Path, name: Any, entry: Any, world: int) -> str | None:
    """Why manifest entry ``name`` of a checkpoint of ``world`` ranks is unacceptable, or None.

    Only the name is looked at, and where it resolves: nothing is opened.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        return f"manifest entry {_short(name)} is not a file name"
    pure = PurePosixPath(name)
    if pure.is_absolute():
        return f"manifest entry {_short(name)} is an absolute path"
    if ".." in pure.parts:
        return f"manifest entry {_short(name)} contains '..'"
    if str(pure) != name or name == ".":
        return f"manifest entry {_short(name)} is not a normalised relative path"
    for pattern, part, form in (
        (_RANK_FILE, name, "rank_{}.pt"),
        (_STORE_DIR, pure.parts[0], "store_rank_{}"),
    ):
        if (m := pattern.fullmatch(part)) and part != form.format(int(m[1])):
            return f"manifest entry {_short(name)} is not a rank's name (that would be {form.format(int(m[1]))!r})"
        if m and int(m[1]) >= world:
            return f"manifest entry {_short(name)} is of rank {int(m[1])}, but world_size is {world}"
    if (why := _outside(path, name)) is not None:
        return f"manifest entry {_short(name)} {why}"
    if not (
        isinstance(entry, dict)
        and _is_int(entry.get("bytes"))
        and entry["bytes"] >= 0
        and isinstance(entry.get("blake2b"), str)
        and _DIGEST.fullmatch(entry["blake2b"])
    ):
        return f"bad manifest entry for {_short(name)}: {_short(entry)}"
    return None


def _meta_problem(path: Path, meta: Any) -> str | None:
    """Why a parsed ``meta.json`` of checkpoint ``path`` is unacceptable, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    fmt, step, world, files = (meta.get(k) for k in ("format", "step", "world_size", "files"))
    if not _is_int(fmt) or fmt != FORMAT:
        return f"format {_short(fmt)} is not {FORMAT}, the format this version reads"
    if not _is_int(step) or step < 0:
        return f"step must be an integer >= 0, got {_short(step)}"
    if path.name != f"step_{step:08d}":
        return f"step {step} does not match the directory name {path.name}"
    if not _is_int(world) or world < 1:
        return f"world_size must be an integer >= 1, got {_short(world)}"
    if meta.get("fingerprint") is not None and not isinstance(meta["fingerprint"], dict):
        return f"fingerprint must be an object, got {_short(meta['fingerprint'])}"
    if not isinstance(files, dict):
        return f"the manifest (files) must be an object, got {type(files).__name__}"
    ranks = set()
    for name, entry in files.items():
        if (why := _entry_problem(path, name, entry, world)) is not None:
            return why
        if m := _RANK_FILE.fullmatch(name):
            ranks.add(int(m[1]))
    if len(ranks) != world:  # every listed rank is below world: one of the first len(ranks) + 1 is missing
        missing = next(r for r in range(world) if r not in ranks)
        return f"world_size is {world} but the manifest lists no rank_{missing}.pt"
    return None


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """The validated ``meta.json`` of complete checkpoint ``path``.

    Checks what it says, not the files it lists (that is :func:`verify_checkpoint`): ``format`` is
    ``FORMAT``; ``step`` an integer >= 0 that matches the directory name; ``world_size`` an integer >= 1;
    the manifest lists exactly ``rank_0.pt`` .. ``rank_{W-1}.pt``, store folders of ranks below W, and names
    that are relative, normalised, without ``..`` and resolve (symlinks included) inside ``path``; each
    entry has its size and checksum. Nothing outside ``path`` is opened.

    Returns:
        ``{"format", "step", "world_size", "files", "fingerprint", "trainer"}``; ``fingerprint`` and
        ``trainer`` are None when the checkpoint was saved without them.

    Raises:
        CheckpointError: one line naming the problem and the offending value.
    """
    try:
        if (why := _outside(path, META)) is not None:
            raise ValueError(why)
        with _open_regular(path / META) as f:
            meta = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({err})") from None
    if (problem := _meta_problem(path, meta)) is not None:
        raise CheckpointError(f"{path / META}: {problem}")
    return {key: meta.get(key) for key in ("format", "step", "world_size", "files", "fingerprint", "trainer")}


def _check_file(path: Path, name: str, entry: dict[str, Any]) -> str | None:
    """Why ``path/name`` does not match its (validated) manifest entry, or None when it does."""
    file = path / name
    try:
        with _open_regular(file) as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:
                return f"{file} is truncated or altered ({size} bytes, the manifest says {entry['bytes']})"
            if _digest(f) != entry["blake2b"]:
                return f"{file} is altered (checksum mismatch)"
    except FileNotFoundError:
        return f"{file} is missing"
    except (OSError, ValueError) as err:
        return f"{file} is unreadable ({err})"
    return None


def verify_checkpoint(path: Path) -> list[str]:
    """Problems of a complete checkpoint: a ``meta.json`` that :func:`checkpoint_meta` refuses, files
    missing, truncated or altered against the manifest, or files it does not list (anything but
    ``meta.json`` and temporary names left by a killed writer).

    Collective when a process group is initialised: rank r checks every r-th file and every rank gets
    the problems of all of them.
    """
    rank, world = _rank_world()
    problems: list[str] = []
    try:
        files = checkpoint_meta(path)["files"]
    except CheckpointError as err:
        problems = [str(err)]
    else:
        if rank == 0:
            unlisted = sorted(n for n in _tree(path) if n not in files and n != META)
            problems += [f"{path / name} is not listed in the manifest" for name in unlisted]
        for i, (name, entry) in enumerate(sorted(files.items())):
            if i % world == rank and (why := _check_file(path, name, entry)) is not None:
                problems.append(why)
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
            _fsync_dir(root)
        if world > 1:
            dist.barrier()
    return None


# What a rank file must hold (``shard_offsets`` is checked where it is needed: older files lack it).
_PAYLOAD_KEYS = ("step", "world_size", "model", "fused_optimizer", "dense_optimizer", "rng")
# What torch.load and restoring a state raise for a file that is damaged or does not fit the model.
_LOAD_ERRORS = (
    OSError,
    RuntimeError,
    EOFError,
    pickle.UnpicklingError,
    KeyError,
    IndexError,
    TypeError,
    ValueError,
    AttributeError,
)


def _one_line(err: BaseException) -> str:
    """The error's type and first sentence (torch's messages go on with advice, such as loading the file
    with ``weights_only=False``, that does not apply to a damaged checkpoint)."""
    lines = str(err).strip().splitlines()
    first = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _load_rank_file(path: Path, rank: int, meta: dict[str, Any], *, mmap: bool = False) -> dict[str, Any]:
    """The payload of ``rank_{rank}.pt``, checked against ``meta.json``."""
    file = path / f"rank_{rank}.pt"
    try:
        payload = torch.load(file, weights_only=True, mmap=mmap)
    except _LOAD_ERRORS as err:
        raise CheckpointError(f"checkpoint file {file} cannot be loaded ({_one_line(err)})") from None
    if not isinstance(payload, dict) or not set(_PAYLOAD_KEYS) <= payload.keys():
        raise CheckpointError(
            f"checkpoint file {file} is not a rank file (it lacks {', '.join(_PAYLOAD_KEYS)})"
        )
    for key in ("step", "world_size"):
        if payload[key] != meta[key]:
            raise CheckpointError(
                f"checkpoint file {file} has {key} {_short(payload[key])}, {META} says {meta[key]}"
            )
    return payload


def load_checkpoint(path: Path, *, dmp: Any, dense_optimizer: Any, skip_tables: Collection[str] = ()) -> int:
    """Restore this rank's state from checkpoint ``path``; returns the step to continue from.

    A checkpoint written by another number of ranks is re-partitioned: every sharded tensor (embedding
    shards and their fused-optimizer state) is assembled from the old ranks' shards by global offsets;
    dense parameters and the dense optimizer are replicated and come from old rank 0. ``skip_tables``
    (tiered slot tables, whose rows the store restores) are left alone in that case.

    Raises:
        CheckpointError: ``meta.json`` is refused by :func:`checkpoint_meta`, a rank file does not load,
            or its contents do not fit the model (one line, naming the file).
    """
    rank, world = _rank_world()
    meta = checkpoint_meta(path)
    old_world = meta["world_size"]
    try:
        if old_world == world:
            payload = _load_rank_file(path, rank, meta)
            _copy_into(dmp.state_dict(), payload["model"], "model")
            fused = dmp.fused_optimizer.state_dict()["state"]
            _copy_into(fused, payload["fused_optimizer"], "fused_optimizer")
        else:
            # mmap: the old ranks' files are read piece by piece, never all in memory at once.
            payloads = [_load_rank_file(path, q, meta, mmap=True) for q in range(old_world)]
            if any("shard_offsets" not in p for p in payloads):
                raise CheckpointError(
                    f"checkpoint {path} was written by {old_world} ranks, this run has {world}, and it "
                    "predates resharding (no shard offsets)"
                )

            def skip(where: str) -> bool:
                return any(f"embedding_bags.{name}." in where for name in skip_tables)

            for part in ("model", "fused_optimizer"):
                live = dmp.state_dict() if part == "model" else dmp.fused_optimizer.state_dict()["state"]
                _reshard_into(live, [(p[part], p["shard_offsets"]) for p in payloads], part, skip)
            payload = payloads[min(rank, old_world - 1)]
            payload["dense_optimizer"] = payloads[0]["dense_optimizer"]
        # Optimizers such as Adam create their state lazily on the first step; a zero-gradient step creates
        # it (leaving the parameters unchanged) so that the saved state can be loaded into it.
        dense_optimizer.init_state()
        dense_optimizer.load_state_dict(payload["dense_optimizer"])
        torch.set_rng_state(payload["rng"])
    except CheckpointError:  # a UserError, hence a ValueError: already says what does not fit
        raise
    except _LOAD_ERRORS as err:  # a file that verified but whose contents do not fit
        raise CheckpointError(f"checkpoint {path} does not fit this run ({_one_line(err)})") from None
    return int(meta["step"])


def checkpoint_world_size(path: Path) -> int:
    """The number of ranks that wrote checkpoint ``path`` (from :func:`checkpoint_meta`)."""
    return int(checkpoint_meta(path)["world_size"])


# Per section of RunConfig, the keys that do not change the trained model; sections not named here
# (store, pipeline, eval) change none. Every other key does, including keys added later.
_NOT_MODEL: dict[str, frozenset[str]] = {
    "train": frozenset(
        {"steps", "nproc", "log_every", "checkpoint_every", "keep_checkpoints", "threads_per_rank"}
        | {"collective_timeout_s"}
    ),
    "model": frozenset(),
    "sparse": frozenset(),
    "data": frozenset({"path", "cache_dir", "on_error"}),
    "synthetic": frozenset({"eval_samples"}),
}


def model_fingerprint(config: RunConfig) -> dict[str, Any]:
    """The settings of ``config`` that change the trained model, as flat ``{"section.key": value}``.

    The rule: a key is in when resuming under another value would silently train another model than the
    one the checkpoint continues. In: every key of ``[model]`` and ``[sparse]``; ``train.seed``,
    ``train.batch_size`` (global), ``train.dense_optimizer`` and ``train.dense_learning_rate``;
    ``data.source``; and, when it is ``synthetic``, every key of ``[synthetic]`` but ``eval_samples``.
    Out: ``train.steps`` (a run may be extended on resume), ``train.nproc`` (resuming on another number of
    ranks re-partitions), the logging, checkpointing, threading and timeout keys; where the data lives
    (``data.path``, ``data.cache_dir``) and ``data.on_error`` (switching to ``skip`` after a run stopped at
    a bad line trains on the same rows so far); ``[store]`` and ``[pipeline]`` (where rows live and how
    batches are fed: tiered tables train the same model as in-memory tables that hold every id, and
    ``pipeline.frozen_windows`` changes rounding only) and ``[eval]`` (evaluation never updates the
    model). Keys added to a section later are in unless listed in ``_NOT_MODEL``. Values are JSON-safe:
    enums as their values, tuples as lists.
    """
    tree = config_to_dict(config)
    out: dict[str, Any] = {}
    for section, excluded in _NOT_MODEL.items():
        if section == "synthetic" and config.data.source != "synthetic":
            continue  # the dataset spec, not this section, describes the data
        out |= {f"{section}.{key}": v for key, v in tree[section].items() if key not in excluded}
    return out


def fingerprint_mismatch(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """One ``"key: saved X, now Y"`` line per key whose value differs (values as JSON; a key only one
    side has shows ``(none)`` on the other). A checkpoint saved without a fingerprint (None) matches."""
    if saved is None:
        return []

    def shown(side: dict[str, Any], key: str) -> str:
        return json.dumps(side[key], sort_keys=True) if key in side else "(none)"

    now = json.loads(json.dumps(current))  # compared as stored: tuples as lists
    return [
        f"{key}: saved {shown(saved, key)}, now {shown(now, key)}"
        for key in sorted(saved.keys() | now.keys())
        if shown(saved, key) != shown(now, key)
    ]
