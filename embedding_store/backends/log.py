"""The log layout's backend: :class:`LogBackend`, an LMDB environment whose tables are logs
(:mod:`~embedding_store.backends.log_tables`: rows placed by write time, an id index in RAM).

Each table's geometry (rows per block, rows per segment) is read from the store's metadata, never from
this code's constants, and checked against the log's last block at open: a store is never read with
another geometry than the one it was written with (that would return another id's row).
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb
import numpy as np

from embedding_store.backends.base import Writes
from embedding_store.backends.lmdb_env import LmdbRows, map_error
from embedding_store.backends.log_format import Geometry
from embedding_store.backends.log_records import LogIo, check_blocks
from embedding_store.backends.log_tables import LogTables
from embedding_store.backends.meta import max_block_bytes
from embedding_store.config import TableSpec

__all__ = ["LogBackend"]


class LogBackend(LmdbRows):
    """Packed rows of several tables in one LMDB environment in the log layout (see the module).

    Attributes:
        log: the tables (their ``stats``, ``space`` and ``compact``, for benchmarks and tests).
    """

    def _geometry(self, spec: TableSpec) -> tuple[int, int]:
        """A new table's: ``BLOCK_BYTES`` a block, at most what fits a leaf page of this environment."""
        geo, rows = Geometry.of(spec, self._options.log_segment_rows), self._options.log_segment_rows
        page = int(self._env.stat()["psize"])
        if spec.expected_max_rows is not None:  # a row cap: packed for space
            geo = Geometry.capped(spec, rows, page, max_block_bytes(page))
            return geo.block, geo.segment
        limit = max(1, max_block_bytes(page) // spec.row_bytes)
        if geo.block > limit:
            geo = Geometry(block=limit, segment=limit * max(1, rows // limit))
        return geo.block, geo.segment

    def _open_tables(self, tables: Sequence[TableSpec]) -> None:
        recorded = self.meta["tables"]
        geometry = {
            t.name: Geometry(block=recorded[t.name]["block_rows"], segment=recorded[t.name]["segment_rows"])
            for t in tables
        }
        self.log = LogTables(
            self._env,
            tables,
            layout=(geometry, self._options.log_compact_at),
            locks=(self._rw, self._readers),
            io=LogIo(
                self._commit, self._count_read, self._mapped, self._options.unmap_every_rows, str(self._path)
            ),
        )
        for t in self.log._tables.values():
            check_blocks(self._env, t, str(self._path))

    # ----------------------------------------------------------------------------------------- reads
    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read rows of (N,) sorted unique ids: ((N,) found, (F, R) float32 rows of the found ids)."""
        try:
            return self.log.get_rows(table, ids)
        except lmdb.Error as err:
            raise map_error(err, f"read of table {table!r} failed") from err

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` rows with id > ``after`` in ascending id order: ((n,) ids, (n, R) rows)."""
        try:
            return self.log.scan(table, after=after, limit=limit)
        except lmdb.Error as err:
            raise map_error(err, f"scan of table {table!r} failed") from err

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""
        return self.log.num_rows(table)

    # ---------------------------------------------------------------------------------------- writes
    def put_rows(self, writes: Writes) -> None:
        """Write ``(table, (N,) sorted unique ids, (N, R) float32 rows)`` groups in ONE transaction.

        Raises:
            StoreFullError: the map hit its cap or the disk is full. Nothing of ``writes`` was applied,
                except when the compaction that follows the append is what failed: the append was
                committed and is read back (the store is full either way).
            StoreSegmentsError: the write needs more log segments than the cap; nothing was applied.
        """
        try:
            self.log.put_rows(writes)
        except lmdb.Error as err:
            raise map_error(err, "write of the log failed", self._path) from err

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        """Delete the rows of (N,) sorted unique ids in one transaction (absent ids are skipped)."""
        try:
            self.log.delete_rows(table, ids)
        except lmdb.Error as err:
            raise map_error(err, "delete from the log failed", self._path) from err
