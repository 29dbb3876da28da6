"""The B-tree layout of the SSD tier: one LMDB named database per table, keyed by id.

Keys are 8-byte big-endian ids, so LMDB's byte order is ascending id order; values are packed float32
rows (see ``config``). Reads and writes are batched over sorted keys (``getmulti``/``putmulti``). A
bounded table (``num_embeddings`` up to 2^26) that is empty when the environment opens keeps one flag
per id, set for every id a write carries, and reads look up only flagged ids: the rest were never
written, so they cannot be found (a delete leaves the flag: a flag says "may be stored").

A read of many keys is split into runs of consecutive keys, each read in its own transaction by one of
``read_threads`` threads (``lmdb_threads.ReaderPool``), so that many page faults of a cold file are in
flight at once. The runs' rows are joined in id order: one transaction's result, except that a commit
landing during the read may show in some runs and not in others (no row is older than one transaction
begun at the call would return).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import lmdb
import numpy as np

from embedding_store.backends.base import Writes
from embedding_store.backends.lmdb_env import LmdbRows, map_error
from embedding_store.backends.log_format import encode_keys
from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError

__all__ = ["BTreeBackend"]

# Bounded tables up to this many ids that start empty keep a "may be stored" flag per id (1 byte each).
_FILTER_MAX_IDS = 1 << 26
_KEY, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def _row_values(rows: np.ndarray, row_bytes: int) -> list[bytes]:
    """(N, R) float32 rows -> N values of ``row_bytes`` bytes each (made in numpy's C loop)."""
    flat = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    return flat.view(f"V{row_bytes}").tolist() if flat.size else []


def rows_of(
    table: str, keys: list[bytes], vals: list[bytes], row_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """((n,) ids, (n, R) rows) of a B-tree table's (key, value) lists; StoreCorruptError on a bad size."""
    val_buf = b"".join(vals)
    if len(val_buf) != len(vals) * row_bytes:
        raise StoreCorruptError(f"table {table!r}: rows of unexpected size (want {row_bytes} bytes each)")
    ids = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.int64)
    return ids, np.frombuffer(val_buf, dtype=np.float32).reshape(len(vals), row_bytes // 4)


class BTreeBackend(LmdbRows):
    """Packed rows of several tables in one LMDB environment, one B-tree per table (see the module)."""

    def _open_tables(self, tables: Sequence[TableSpec]) -> None:
        self._row_bytes = {t.name: t.row_bytes for t in tables}
        self._dbs = {t.name: self._env.open_db(t.name.encode(), create=True) for t in tables}
        # A table that starts empty knows which ids it may hold: the ones ever handed to put_rows.
        # Reads skip the others (first touches of never-written rows are most reads of a first pass).
        self._maybe_stored: dict[str, np.ndarray] = {
            t.name: np.zeros(t.num_embeddings, dtype=bool)
            for t in tables
            if t.num_embeddings is not None
            and t.num_embeddings <= _FILTER_MAX_IDS
            and not self.num_rows(t.name)
        }

    # ----------------------------------------------------------------------------------------- reads
    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read rows of (N,) sorted unique ids: ((N,) found, (F, R) float32 rows of the found ids)."""
        maybe = self._maybe_stored.get(table)
        if maybe is not None and ids.shape[0]:
            stored = maybe[ids]
            if not stored.all():
                at = np.flatnonzero(stored)
                found_stored, rows = self._get_rows(table, ids[at])
                found = np.zeros(ids.shape[0], dtype=bool)
                found[at[found_stored]] = True  # a subsequence of sorted ids: rows keep their order
                return found, rows
        return self._get_rows(table, ids)

    def _get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row_bytes = self._row_bytes[table]
        step = self._options.unmap_every_rows or max(1, ids.shape[0])
        if ids.shape[0] <= step:
            return self._get_chunk(table, ids)
        # Large reads go in chunks so that the mapped pages are dropped between them (bounded RSS).
        parts = [self._get_chunk(table, ids[i : i + step]) for i in range(0, ids.shape[0], step)]
        found = np.concatenate([f for f, _ in parts])
        rows = np.concatenate([r for _, r in parts]) if parts else np.empty((0, row_bytes // 4), np.float32)
        return found, rows

    def _get_chunk(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row_bytes = self._row_bytes[table]
        found = np.zeros(ids.shape[0], dtype=bool)
        if ids.shape[0] == 0:
            return found, np.empty((0, row_bytes // 4), dtype=np.float32)
        keys = encode_keys(ids)
        db = self._dbs[table]

        def read(run: slice) -> list[tuple[bytes, bytes]]:
            # buffers=False: py-lmdb's zero-copy buffers make getmulti ~10x slower every other call.
            with self._env.begin(db=db) as txn:
                return txn.cursor().getmulti(keys[run])

        try:
            # Every run's transaction ends inside the shared hold: no resize while one is open.
            with self._rw.shared():
                runs = self._readers.map(read, self._readers.runs(len(keys)))
        except lmdb.Error as err:
            raise map_error(err, f"read of table {table!r} failed") from err
        pairs = runs[0] if len(runs) == 1 else list(itertools.chain.from_iterable(runs))
        val_buf = b"".join(map(_VALUE, pairs))
        if len(val_buf) != len(pairs) * row_bytes:
            raise StoreCorruptError(f"table {table!r}: rows of unexpected size (want {row_bytes} bytes each)")
        self._count_read(ids.shape[0])
        if len(pairs) == ids.shape[0]:
            found[:] = True
        else:
            found_ids = np.frombuffer(b"".join(map(_KEY, pairs)), dtype=">u8").astype(np.int64)  # (F,)
            found[np.searchsorted(ids, found_ids)] = True
        return found, np.frombuffer(val_buf, dtype=np.float32).reshape(len(pairs), row_bytes // 4)

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` rows with id > ``after`` in ascending id order: ((n,) ids, (n, R) rows)."""
        keys: list[bytes] = []
        vals: list[bytes] = []
        try:
            with self._rw.shared(), self._env.begin(db=self._dbs[table]) as txn:
                cursor = txn.cursor()
                start = encode_keys(np.array([after + 1], dtype=np.int64))[0] if after >= 0 else b""
                if cursor.set_range(start):
                    for key, val in cursor:
                        keys.append(key)
                        vals.append(val)
                        if len(keys) >= limit:
                            break
        except lmdb.Error as err:
            raise map_error(err, f"scan of table {table!r} failed") from err
        self._count_read(len(keys))
        return rows_of(table, keys, vals, self._row_bytes[table])

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""
        with self._rw.shared(), self._env.begin() as txn:
            return int(txn.stat(self._dbs[table])["entries"])

    # ---------------------------------------------------------------------------------------- writes
    def put_rows(self, writes: Writes) -> None:
        """Write ``(table, (N,) sorted unique ids, (N, R) float32 rows)`` groups in ONE transaction.

        Raises:
            StoreFullError: the map hit its cap or the disk is full; nothing of ``writes`` was applied.
        """
        items = []
        need_bytes = 0  # keys and values of this write, before LMDB's page overhead
        for table, ids, rows in writes:
            maybe = self._maybe_stored.get(table)
            if maybe is not None:  # before the commit: a reader that sees the row committed sees the flag
                maybe[ids] = True
            row_bytes = self._row_bytes[table]
            need_bytes += ids.shape[0] * (8 + row_bytes)
            values = _row_values(rows, row_bytes)
            items.append((self._dbs[table], list(zip(encode_keys(ids), values, strict=True))))

        def fill(txn: Any) -> None:
            for db, pairs in items:
                txn.cursor(db=db).putmulti(pairs)

        self._commit(fill, need_bytes, sum(len(pairs) for _, pairs in items))

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        """Delete the rows of (N,) sorted unique ids in one transaction (absent ids are skipped)."""
        if ids.shape[0] == 0:
            return
        keys, db = encode_keys(ids), self._dbs[table]

        def fill(txn: Any) -> None:
            cursor = txn.cursor(db=db)
            for key in keys:
                if cursor.set_key(key):
                    cursor.delete()

        self._commit(fill, 0, len(keys))
