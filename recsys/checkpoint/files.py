"""Checkpoint files on disk: names, atomic writes, checksums, listing and pruning."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch.distributed as dist

from embedding_store.snapshot import fsync as _fsync_dir  # a folder's renames made durable
from recsys.errors import UserError

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
# LMDB's lock file: any LMDB tool that opens a store snapshot, even read-only (``mdb_stat``, ``lmdb.open(path,
# readonly=True)``), creates it beside ``data.mdb``. It holds the reader table, no data, and nothing of a
# checkpoint reads it: a restore copies ``data.mdb`` alone and every read of a snapshot opens it with
# ``lock=False`` (embedding_store.snapshot, embedding_store.backends.lmdb_snapshot).
_LMDB_LOCK = "lock.mdb"
_HASH_CHUNK_BYTES = 1 << 20
# A checkpoint that failed verification is renamed with this prefix: kept for inspection, never resumed.
DAMAGED_PREFIX = "damaged_"


class CheckpointError(UserError):
    """No usable checkpoint, or one that does not match this run."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write_file_durably(path: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write one checkpoint file: ``write(f)`` into ``.<name>.tmp`` beside ``path``, fsync it, rename it to
    ``path`` and fsync the folder; returns ``path``.

    Every file of a checkpoint goes this way (docs/reliability.md): a crash or a full disk never leaves a
    half-written file under its final name, nor an earlier file at that name replaced by a partial one,
    and the rename survives a power loss. On any error the temporary file is removed and the error
    propagates as raised (a full disk stays an OSError with ``errno.ENOSPC``, which
    :func:`recsys.writing.writing` turns into one line).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return path


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


def _lmdb_lock(path: Path, name: str, files: dict[str, Any]) -> bool:
    """Whether ``path/name`` is LMDB's lock file beside a store snapshot's listed ``data.mdb``: a regular
    file (not a link), unlisted and harmless (see ``_LMDB_LOCK``)."""
    parts = PurePosixPath(name).parts
    if len(parts) != 2 or parts[1] != _LMDB_LOCK or not _STORE_DIR.fullmatch(parts[0]):
        return False
    if f"{parts[0]}/data.mdb" not in files:
        return False
    try:
        return stat.S_ISREG(os.lstat(path / name).st_mode)
    except OSError:
        return False


def _describe(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{relative path: {bytes, blake2b}}`` of files and of every file under folders."""
    files = [q for p in paths for q in ([p / n for n in sorted(_tree(p))] if p.is_dir() else [p])]
    return {str(f.relative_to(root)): {"bytes": f.stat().st_size, "blake2b": _file_digest(f)} for f in files}


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
