"""The SSD tier's storage backends, behind one protocol (:class:`~embedding_store.backends.base.RowBackend`).

:func:`open_backend` opens (or creates) the backend of a store directory, chosen by
``LmdbOptions.layout`` when the store is new: ``"log"`` (the default,
:class:`~embedding_store.backends.log.LogBackend`) and ``"btree"``
(:class:`~embedding_store.backends.btree.BTreeBackend`) keep rows in LMDB; ``"memory"``
(:class:`~embedding_store.backends.memory.MemoryBackend`) keeps them in RAM and persists them to one
file on ``sync``/``close``. An existing store keeps the layout recorded in its metadata
(:mod:`~embedding_store.backends.meta`). :func:`open_snapshot` opens a closed store or a snapshot
read-only, for restores, re-partitions and exports. Only the LMDB modules of this package import
``lmdb``, and this module loads them on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from embedding_store.backends.base import RowBackend, SnapshotReader, Writes
from embedding_store.config import LmdbOptions, TableSpec
from embedding_store.errors import StoreError, StoreIncompatibleError

__all__ = [
    "STORE_FILES",
    "RowBackend",
    "SnapshotReader",
    "Writes",
    "open_backend",
    "open_snapshot",
    "storage_error",
    "store_file",
]

# The file holding a store's rows, per kind of backend: LMDB's data file, the memory backend's file.
STORE_FILES = ("data.mdb", "memory.npz")


def store_file(path: str | os.PathLike[str]) -> Path | None:
    """The file of the store (or snapshot) in the directory ``path``, None when it holds none."""
    for name in STORE_FILES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def storage_error(err: BaseException, what: str, path: str | os.PathLike[str]) -> StoreError | None:
    """The StoreError (full, corrupt or plain) of an error a storage engine raised while writing ``path``,
    None when ``err`` did not come from one. Callers that write LMDB files of their own (the serving
    bundle) word their errors with it without importing ``lmdb``."""
    import sys

    lmdb = sys.modules.get("lmdb")  # an LMDB error exists only where lmdb was loaded
    if lmdb is None or not isinstance(err, lmdb.Error):
        return None
    from embedding_store.backends.lmdb_env import map_error

    return map_error(err, what, path)


def open_backend(path: Path, *, options: LmdbOptions, seed: int, tables: Sequence[TableSpec]) -> RowBackend:
    """Open (or create) the backend of the store directory ``path`` (created if missing).

    Raises:
        StoreIncompatibleError: the directory holds a store of other tables, another seed, or a format,
            layout or geometry this code cannot read (the field named).
        StoreCorruptError: the store is unreadable.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    found = store_file(path)
    if (found is None and options.layout == "memory") or (found is not None and found.name == "memory.npz"):
        from embedding_store.backends.memory import MemoryBackend

        return MemoryBackend(path, options=options, seed=seed, tables=tables)
    from embedding_store.backends.btree import BTreeBackend
    from embedding_store.backends.lmdb_env import open_env
    from embedding_store.backends.log import LogBackend

    options_ = options if options.layout != "memory" else _lmdb_options(options)
    opened = open_env(path, options_, len(tables))
    kind = LogBackend if opened.layout == "log" else BTreeBackend
    return kind(opened, options=options_, seed=seed, tables=tables)


def _lmdb_options(options: LmdbOptions) -> LmdbOptions:
    from dataclasses import replace

    return replace(options, layout="log")  # an LMDB store found where a memory one was asked for


def open_snapshot(
    path: str | os.PathLike[str], *, seed: int | None, tables: Sequence[TableSpec] | None = None
) -> SnapshotReader:
    """Open a closed store or a snapshot read-only (nothing is written to it).

    Args:
        path: the directory.
        seed: the seed the caller expects (None: any; the reader's ``seed`` says which).
        tables: tables to check against the recorded ones now (others are checked when read).

    Raises:
        StoreError: ``path`` holds no store.
        StoreIncompatibleError: another seed, a table of another description, or a format this code
            cannot read.
        StoreCorruptError: the store is unreadable.
    """
    found = store_file(path)
    if found is None:
        raise StoreError(f"{path} is not a store snapshot (no {' or '.join(STORE_FILES)})")
    reader: SnapshotReader
    if found.name == "memory.npz":
        from embedding_store.backends.memory import MemorySnapshot

        reader = MemorySnapshot(Path(path))
    else:
        from embedding_store.backends.lmdb_snapshot import LmdbSnapshot

        reader = LmdbSnapshot(Path(path))
    try:
        if seed is not None and reader.seed != seed:
            raise StoreIncompatibleError(f"snapshot {path} was written with seed {reader.seed!r}, not {seed}")
        for spec in tables or ():
            reader.check(spec)
    except BaseException:
        reader.close()
        raise
    return reader
