"""The SSD tier's storage backends, behind one protocol (:class:`~embedding_store.backends.base.RowBackend`).

:func:`open_backend` opens (or creates) the backend of a store directory, chosen by
``LmdbOptions.layout``: ``"log"`` (the default) and ``"btree"`` keep rows in LMDB; ``"memory"`` keeps
them in RAM and persists them to one file on ``sync``/``close``. An existing store keeps the layout
recorded in its metadata. :func:`open_snapshot` opens a closed store or a snapshot read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from embedding_store.backends.base import RowBackend, SnapshotReader, Writes
from embedding_store.config import LmdbOptions, TableSpec

__all__ = ["RowBackend", "SnapshotReader", "Writes", "open_backend"]


def open_backend(path: Path, *, options: LmdbOptions, seed: int, tables: Sequence[TableSpec]) -> RowBackend:
    """Open (or create) the backend of the store directory ``path`` (created if missing).

    Raises:
        StoreIncompatibleError: the directory holds a store of other tables, another seed, or a format
            this code cannot read.
        StoreCorruptError: the store is unreadable.
    """
    from embedding_store.lmdb_backend import LmdbBackend

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return LmdbBackend(path, options=options, seed=seed, tables=tables)  # type: ignore[return-value]
