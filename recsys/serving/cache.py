"""Tiered rows at serving time: a read-only LMDB of a bundle and an LRU host-DRAM cache over it.

:class:`LmdbRows` reads the rows of sorted ids from the bundle's ``tiered/data.mdb`` (opened read-only and
without a lock file, so a bundle on a read-only file system serves). :class:`RowCache` keeps up to
``capacity`` rows of one table in a preallocated arena: lookups are vectorised (an id -> position map
from the store), eviction is least-recently-used by batch, so a table larger than RAM is served with
the hot rows in memory. Rows never stored get ``fill(ids)`` (the deterministic initial rows, or zeros;
a bounded table's default row), and the lookups they answer are counted (``filled``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch

from embedding_store.config import WeightsPrecision
from embedding_store.index import DenseIdMap, HashIdMap
from recsys.serving.bundle import BundleError, FeatureSpec

__all__ = ["CacheStats", "LmdbRows", "RowCache", "open_rows"]

# Bounded id spaces up to this size get a dense id -> position array (4 bytes per possible id).
_DENSE_MAP_MAX_IDS = 1 << 22
# When the arena is full, eviction frees this share of it at once: one partial sort per many misses.
_EVICT_FRACTION = 16


def _keys(ids: np.ndarray) -> list[bytes]:
    """(N,) int64 ids >= 0 -> 8-byte big-endian keys (LMDB's byte order is then ascending id order)."""
    return np.ascontiguousarray(ids, dtype=">u8").view("V8").tolist()


class LmdbRows:
    """Read-only access to the tiered tables of a bundle (thread-safe: a read transaction per call).

    Args:
        path: the bundle's ``tiered`` folder.
        tables: the tables' names (the LMDB named databases).
        row_floats: 4-byte words per stored row; the leading ones hold the weights (fp32: ``dim`` words;
            fp16: two weights a word), then the optimizer state when the bundle kept it.
        weights_precision: the weights' precision; :meth:`read` returns them as float32 either way.
    """

    def __init__(
        self,
        path: Path,
        *,
        tables: list[str],
        row_floats: int,
        weights_precision: WeightsPrecision = WeightsPrecision.FP32,
    ) -> None:
        self._where = f"bundle {path.parent}: {path.name}/data.mdb"
        # lock=False: nothing ever writes this environment, so readers need no lock table (and no
        # lock.mdb appears in the bundle). readahead=False: lookups are random.
        try:
            self._env = lmdb.open(
                str(path), readonly=True, lock=False, subdir=True, max_dbs=len(tables) + 1, readahead=False
            )
        except lmdb.Error as err:
            raise BundleError(f"{self._where} is not a readable LMDB environment (damaged?): {err}") from None
        self._dbs = {}
        try:
            for t in tables:
                try:
                    self._dbs[t] = self._env.open_db(t.encode(), create=False)
                except lmdb.NotFoundError:
                    raise BundleError(f"{self._where} holds no table {t} (damaged?)") from None
        except BaseException as err:
            self._env.close()
            if isinstance(err, lmdb.Error):
                raise BundleError(f"{self._where} is damaged: {err}") from None
            raise
        self.row_floats = row_floats
        self.weights_precision = weights_precision

    def check(self, table: str, rows: int) -> None:
        """Refuse, before any lookup, a table that does not hold ``rows`` rows of ``row_floats`` floats
        (its entry count, and the size of its first and last rows: the export writes one size)."""
        try:
            with self._env.begin(db=self._dbs[table], buffers=False) as txn:
                entries = txn.stat(self._dbs[table])["entries"]
                cursor = txn.cursor()
                sizes = {len(cursor.value()) for more in (cursor.first(), cursor.last()) if more}
        except lmdb.Error as err:
            raise BundleError(f"{self._where} is damaged: {err}") from None
        if entries != rows:
            raise BundleError(f"{self._where}: table {table} holds {entries} rows, model.json says {rows}")
        bad = sorted(n for n in sizes if n != 4 * self.row_floats)
        if bad:
            raise BundleError(
                f"{self._where}: table {table} holds rows of {bad[0]} bytes ({bad[0] / 4:g} floats), "
                f"model.json says {self.row_floats} floats (rows of another model?)"
            )

    def read(self, table: str, ids: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """Weights of (N,) sorted unique ids: ``(found (N,) bool, rows (F, dim))`` for the F found ids."""
        found = np.zeros(ids.shape[0], dtype=bool)
        if ids.shape[0] == 0:
            return found, np.empty((0, dim), dtype=np.float32)
        try:
            with self._env.begin(db=self._dbs[table], buffers=False) as txn:
                pairs = txn.cursor().getmulti(_keys(ids))
        except lmdb.Error as err:
            raise BundleError(f"{self._where} is damaged: {err}") from None
        if len(pairs) == ids.shape[0]:
            found[:] = True
        elif pairs:
            found_ids = np.frombuffer(b"".join(k for k, _ in pairs), dtype=">u8").astype(np.int64)
            found[np.searchsorted(ids, found_ids)] = True
        values = b"".join(v for _, v in pairs)
        if len(values) != 4 * self.row_floats * len(pairs):
            raise BundleError(
                f"{self._where}: table {table} holds rows of another size than model.json's "
                f"{self.row_floats} floats"
            )
        rows = np.frombuffer(values, dtype=np.float32).reshape(len(pairs), self.row_floats)
        return found, self.weights(rows, dim).astype(np.float32)

    def weights(self, rows: np.ndarray, dim: int) -> np.ndarray:
        """The (n, dim) weights of (n, row_floats) stored rows, in the bundle's precision (a view)."""
        if self.weights_precision is WeightsPrecision.FP16:
            return rows.view(np.float16)[:, :dim]
        return rows[:, :dim]

    def scan(self, table: str, *, chunk_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every stored row of ``table`` in ascending id order: ``((n,) ids, (n, row_floats) rows)`` chunks."""
        with self._env.begin(db=self._dbs[table]) as txn:
            cursor = txn.cursor()
            more = cursor.first()
            while more:
                keys, values = [], []
                while more and len(keys) < chunk_rows:
                    keys.append(cursor.key())
                    values.append(cursor.value())
                    more = cursor.next()
                ids = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.int64)
                yield (
                    ids,
                    np.frombuffer(b"".join(values), dtype=np.float32).reshape(len(keys), self.row_floats),
                )

    def close(self) -> None:
        """Close the environment (for a reader opened directly, not through :func:`open_rows`)."""
        self._env.close()


# LMDB allows one open handle per environment file and process (its locks belong to the process and
# file), so scorers of one bundle share its reader; it closes when the last of them is gone.
_READERS: weakref.WeakValueDictionary[tuple[int, int], LmdbRows] = weakref.WeakValueDictionary()
_READERS_LOCK = threading.Lock()


def open_rows(
    path: Path,
    *,
    tables: list[str],
    row_floats: int,
    weights_precision: WeightsPrecision = WeightsPrecision.FP32,
) -> LmdbRows:
    """This process's reader of the LMDB in folder ``path`` (shared by everyone who opens that file)."""
    st = os.stat(path / "data.mdb")
    with _READERS_LOCK:
        rows = _READERS.get((st.st_dev, st.st_ino))
        if rows is None:
            rows = LmdbRows(path, tables=tables, row_floats=row_floats, weights_precision=weights_precision)
            _READERS[(st.st_dev, st.st_ino)] = rows
        return rows


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of one table's cache.

    ``hits`` and ``misses``: ids looked up (each occurrence) found in the cache or not; of the distinct
    ids missed by a lookup, ``stored`` were read from LMDB and ``unseen`` (never stored) got their
    initial or zero rows (a bounded table's: its default row); ``rows``: rows held now, of ``capacity``;
    ``filled``: the lookups (each occurrence, cached or not) answered with such a row.
    """

    hits: int
    misses: int
    stored: int
    unseen: int
    rows: int
    capacity: int
    filled: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class RowCache:
    """LRU cache of one tiered table's weights over the bundle's LMDB; thread-safe.

    Args:
        source: the bundle's tiered rows.
        feature: the tiered feature (its table's name, dimension and id space).
        capacity: rows held at most (0: no cache, every lookup reads LMDB).
        fill: ``ids -> (n, dim) float32`` rows of ids that were never stored.

    ``lookup(ids)`` returns exactly the rows an uncached read returns, whatever the capacity.
    """

    def __init__(
        self,
        source: LmdbRows,
        feature: FeatureSpec,
        *,
        capacity: int,
        fill: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0 rows, got {capacity}")
        self._source, self._fill = source, fill
        self.table, self.dim, self.capacity = feature.table, feature.dim, capacity
        id_space = feature.id_space
        self._lock = threading.Lock()
        self._arena = np.zeros((capacity, self.dim), dtype=np.float32)
        self._id_at = np.full(capacity, -1, dtype=np.int64)  # the id held at each position, -1 free
        self._last_use = np.zeros(capacity, dtype=np.int64)  # tick of the last lookup that used it
        self._filled_at = np.zeros(capacity, dtype=bool)  # the row held there is a fill row (never stored)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack of free positions
        self._num_free = capacity
        self._tick = 0
        dense = id_space is not None and id_space <= max(_DENSE_MAP_MAX_IDS, 4 * capacity)
        self._map = DenseIdMap(id_space) if dense else HashIdMap(max(1, capacity))
        self._hits = self._misses = self._stored = self._unseen = self._filled = 0

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        """Rows of (N,) int64 ids (any order, repeats allowed) as a (N, dim) float32 tensor."""
        with self._lock:
            self._tick += 1
            if self.capacity:
                pos = self._map.lookup(ids)
                hit = pos >= 0
                if hit.all():  # the hot path: no copy of masks, one gather
                    self._last_use[pos] = self._tick
                    self._hits += int(ids.shape[0])
                    self._filled += int(np.count_nonzero(self._filled_at[pos]))
                    return torch.from_numpy(np.take(self._arena, pos, axis=0))
                held = pos[hit]
                self._last_use[held] = self._tick
                out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
                out[hit] = self._arena[held]
                self._hits += int(held.shape[0])
                self._filled += int(np.count_nonzero(self._filled_at[held]))
            else:
                hit = np.zeros(ids.shape[0], dtype=bool)
                out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        missing = np.flatnonzero(~hit)
        # LMDB and the initialisation run without the lock, so that threads overlap their reads.
        miss_ids, inverse = np.unique(ids[missing], return_inverse=True)
        found, rows = self._source.read(self.table, miss_ids, self.dim)
        fetched = np.empty((miss_ids.shape[0], self.dim), dtype=np.float32)
        fetched[found] = rows
        if not found.all():
            fetched[~found] = self._fill(miss_ids[~found])
        inverse = inverse.reshape(-1)
        out[missing] = fetched[inverse]
        with self._lock:
            self._misses += int(missing.shape[0])
            self._stored += int(found.sum())
            self._unseen += int((~found).sum())
            self._filled += int(missing.shape[0] - np.count_nonzero(found[inverse]))
            if self.capacity:
                self._insert(miss_ids, fetched, ~found)
        return torch.from_numpy(out)

    def _insert(self, ids: np.ndarray, rows: np.ndarray, filled: np.ndarray) -> None:
        """Cache rows just read (``filled``: which are fill rows), under the lock; another thread may
        have cached some meanwhile."""
        new = self._map.lookup(ids) < 0
        ids, rows = ids[new][: self.capacity], rows[new][: self.capacity]
        filled = filled[new][: self.capacity]
        n = ids.shape[0]
        if n > self._num_free:
            self._evict(max(n - self._num_free, self.capacity // _EVICT_FRACTION))
        positions = self._free[self._num_free - n : self._num_free].copy()
        self._num_free -= n
        self._arena[positions] = rows
        self._id_at[positions] = ids
        self._filled_at[positions] = filled
        self._last_use[positions] = self._tick
        self._map.insert(ids, positions)

    def _evict(self, n: int) -> None:
        """Free the ``n`` least recently used positions."""
        held = np.flatnonzero(self._id_at >= 0)
        n = min(n, held.shape[0])
        victims = held[np.argpartition(self._last_use[held], n - 1)[:n]] if n < held.shape[0] else held
        self._map.remove(self._id_at[victims])
        self._id_at[victims] = -1
        self._free[self._num_free : self._num_free + victims.shape[0]] = victims
        self._num_free += victims.shape[0]

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                stored=self._stored,
                unseen=self._unseen,
                rows=self.capacity - self._num_free,
                capacity=self.capacity,
                filled=self._filled,
            )
