"""Store snapshots: durable publication, read-only streaming, and restores into a new store directory.

A snapshot (written by :meth:`embedding_store.TieredStore.snapshot`) is a directory holding the store's
file (a compacted ``data.mdb``, or the memory backend's ``memory.npz``); it is read through
:func:`embedding_store.backends.open_snapshot`. It is restored as it is (:func:`restore_snapshot`), or re-partitioned: every snapshot of
another partition of the rows streamed into a new store that keeps the rows its owner accepts
(:func:`restore_resharded`). Both write into a directory that holds no store yet; to replace a live one
under its lock, use :class:`embedding_store.ShardDirectory`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from embedding_store.backends import STORE_FILES, open_backend, open_snapshot, store_file
from embedding_store.config import StoreConfig, TableSpec
from embedding_store.errors import StoreError
from embedding_store.rows import RowChunk, row_chunk

__all__ = [
    "fsync",
    "publish",
    "publish_snapshot",
    "restore_resharded",
    "restore_snapshot",
    "scan_snapshot",
    "snapshot_chunks",
]


def scan_snapshot(
    path: Path, spec: TableSpec, *, seed: int, chunk_rows: int = 1 << 16
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Rows of ``spec``'s table in a closed store or snapshot, read-only, ascending ids, in chunks.

    Yields ``((n,) int64 ids, (n, R) float32 rows)`` with n <= ``chunk_rows``; memory stays near one chunk
    whatever the table's size. Nothing is written to ``path`` (no lock file). A snapshot without the
    table yields nothing.

    Raises:
        StoreIncompatibleError: the snapshot holds the table with another description, or another seed.
        StoreCorruptError: the snapshot is unreadable.
    """
    reader = open_snapshot(path, seed=seed)
    try:
        yield from reader.chunks(spec, chunk_rows=chunk_rows)
    finally:
        reader.close()


def snapshot_chunks(path: str | os.PathLike[str], spec: TableSpec, *, seed: int) -> Iterator[RowChunk]:
    """``spec``'s rows in a store snapshot, read-only, ascending ids, as RowChunks (weights, state)."""
    for ids, rows in scan_snapshot(Path(path), spec, seed=seed):
        yield row_chunk(spec, ids, rows)


def fsync(path: Path) -> None:
    """fsync a file, or a folder (which makes the renames and new entries inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """fsync ``tmp`` (a file, or a folder whose files are fsynced), rename it to ``final``, fsync the parent."""
    fsync(tmp)
    tmp.rename(final)
    fsync(final.parent)


def publish_snapshot(tmp: Path, dest: Path) -> None:
    """Make the snapshot copied into the folder ``tmp`` durable and publish it as ``dest``."""
    for name in STORE_FILES:
        if (tmp / name).is_file():
            fsync(tmp / name)
    publish(tmp, dest)


def restore_snapshot(snapshot: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Copy a snapshot written by ``TieredStore.snapshot`` into ``path``, which must hold no store.

    The copy is written under a temporary name, fsynced and renamed: no partial ``data.mdb`` ever opens.
    """
    src, dst = Path(snapshot), Path(path)
    found = store_file(src)
    if found is None:
        raise StoreError(f"{src} is not a store snapshot (no {' or '.join(STORE_FILES)})")
    _check_empty(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".{found.name}.tmp"
    try:
        shutil.copyfile(found, tmp)
        publish(tmp, dst / found.name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def restore_resharded(
    snapshots: Sequence[str | os.PathLike[str]],
    path: str | os.PathLike[str],
    *,
    config: StoreConfig,
    tables: Sequence[TableSpec],
    keep: Callable[[str, np.ndarray], np.ndarray],
    chunk_rows: int = 1 << 16,
) -> int:
    """Build a store in ``path`` (which must hold none) from the snapshots of another partition of the rows.

    Every snapshot is streamed table by table in chunks of ``chunk_rows`` (read-only); the rows of
    ``tables`` whose ids ``keep(table, ids)`` ((n,) int64 -> (n,) bool) accepts are written to the new
    store. Memory stays near one chunk. Open the result with ``TieredStore(path, config=config,
    tables=tables)``. Returns the number of rows written.
    """
    dst = Path(path)
    _check_empty(dst)
    backend = open_backend(dst, options=config.lmdb, seed=config.seed, tables=tables)
    written = 0
    try:
        for snapshot in snapshots:
            reader = open_snapshot(snapshot, seed=config.seed, tables=tables)
            try:
                for spec in tables:
                    for ids, rows in reader.chunks(spec, chunk_rows=chunk_rows):
                        mask = keep(spec.name, ids)
                        if mask.any():
                            backend.put_rows([(spec.name, ids[mask], rows[mask])])
                            written += int(mask.sum())
            finally:
                reader.close()
        backend.sync()
    finally:
        backend.close()
    return written


def _check_empty(dst: Path) -> None:
    if store_file(dst) is not None or (dst / "data.mdb").exists():
        raise StoreError(f"{dst} already holds a store; restore into an empty directory")
