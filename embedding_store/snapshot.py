"""Store snapshots: durable publication, read-only streaming, and restores into a new store directory.

A snapshot (written by :meth:`embedding_store.TieredStore.snapshot`) is a directory holding one compacted
``data.mdb``. It is restored as it is (:func:`restore_snapshot`), or re-partitioned: every snapshot of
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

from embedding_store.config import StoreConfig, TableSpec
from embedding_store.errors import StoreError
from embedding_store.lmdb_backend import LmdbBackend
from embedding_store.lmdb_scan import scan_snapshot
from embedding_store.rows import RowChunk, row_chunk

__all__ = ["fsync", "publish", "publish_snapshot", "restore_resharded", "restore_snapshot", "snapshot_chunks"]


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
    fsync(tmp / "data.mdb")
    publish(tmp, dest)


def restore_snapshot(snapshot: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Copy a snapshot written by ``TieredStore.snapshot`` into ``path``, which must hold no store.

    The copy is written under a temporary name, fsynced and renamed: no partial ``data.mdb`` ever opens.
    """
    src, dst = Path(snapshot), Path(path)
    if not (src / "data.mdb").is_file():
        raise StoreError(f"{src} is not a store snapshot (no data.mdb)")
    if (dst / "data.mdb").exists():
        raise StoreError(f"{dst} already holds a store; restore into an empty directory")
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / ".data.mdb.tmp"
    try:
        shutil.copyfile(src / "data.mdb", tmp)
        publish(tmp, dst / "data.mdb")
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
    if (dst / "data.mdb").exists():
        raise StoreError(f"{dst} already holds a store; restore into an empty directory")
    dst.mkdir(parents=True, exist_ok=True)
    backend = LmdbBackend(dst, options=config.lmdb, seed=config.seed, tables=tables)
    written = 0
    try:
        for snapshot in snapshots:
            for spec in tables:
                for ids, rows in scan_snapshot(Path(snapshot), spec, seed=config.seed, chunk_rows=chunk_rows):
                    mask = keep(spec.name, ids)
                    if mask.any():
                        backend.put_rows([(spec.name, ids[mask], rows[mask])])
                        written += int(mask.sum())
        backend.sync()
    finally:
        backend.close()
    return written
