"""What the tiered store needs from its SSD tier: :class:`RowBackend`, and :class:`SnapshotReader` for
the read-only side (restore, reshard, export).

A leaf module: no LMDB, no torch. Rows are packed float32 vectors of ``TableSpec.row_floats`` values
(``embedding_store.config``); ids are int64 >= 0. The backends are in :mod:`embedding_store.backends`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from embedding_store.config import TableSpec

__all__ = ["RowBackend", "SnapshotReader", "Writes"]

# (table, (N,) sorted unique int64 ids, (N, R) float32 rows) groups of one atomic commit.
Writes = Sequence[tuple[str, np.ndarray, np.ndarray]]


class RowBackend(Protocol):
    """Packed rows of several tables, by id: the SSD tier of a :class:`~embedding_store.TieredStore`.

    Threading: reads (``get_rows``, ``scan``, ``num_rows``) may run in any thread while one thread (the
    store's background writer) writes; writes come from one thread at a time.
    """

    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (N,) sorted unique ids: ((N,) bool found, (F, R) float32 rows of the found ids, in id
        order)."""

    def put_rows(self, writes: Writes) -> None:
        """Write ``(table, ids, rows)`` groups in one atomic commit (a later put of an id replaces it).

        Raises:
            StoreFullError: no room; nothing of ``writes`` was applied.
        """

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        """Remove the rows of (N,) sorted unique ids in one atomic commit; absent ids are skipped. After
        it, ``get_rows`` does not find them, ``scan`` skips them and ``num_rows`` no longer counts them."""

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` stored rows with id > ``after``, ascending ids: ((n,) ids, (n, R) rows)."""

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""

    def sync(self) -> None:
        """Make every commit so far durable."""

    def snapshot(self, dest: Path) -> None:
        """Write a consistent copy into the empty directory ``dest`` (files fsynced by the caller's
        ``publish_snapshot``); :func:`embedding_store.backends.open_snapshot` reads it."""

    def used_bytes(self) -> int:
        """Bytes of storage in use."""

    def map_size_bytes(self) -> int:
        """Bytes the backend may use before it must grow (LMDB's map size; the memory backend's cap)."""

    def close(self) -> None:
        """Release everything (idempotent); persists what the backend keeps in memory."""


class SnapshotReader(Protocol):
    """A closed store or a snapshot, opened read-only (nothing is written to its directory).

    Attributes:
        seed: the store's init seed.
        layout: ``"log"``, ``"btree"`` or ``"memory"``.
        tables: table name -> its recorded description (``dim``, ``optimizer``, ``num_embeddings``,
            ``init_scale``, ``dtype``, ``row_bytes`` and the layout's geometry).
    """

    seed: int
    layout: str
    tables: dict[str, dict[str, object]]

    def chunks(
        self, spec: TableSpec, *, chunk_rows: int = 1 << 16
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``spec``'s rows in ascending id order: ``((n,) int64 ids, (n, R) float32 rows)`` with n <=
        ``chunk_rows`` (memory near one chunk). A table the snapshot lacks yields nothing.

        Raises:
            StoreIncompatibleError: the snapshot holds the table with another description.
        """

    def check(self, spec: TableSpec) -> None:
        """Raise StoreIncompatibleError when the snapshot holds ``spec``'s table with another description
        (a table it lacks passes)."""

    def close(self) -> None: ...
