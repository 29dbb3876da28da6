"""Vectorised id -> value maps: ONE protocol, :class:`IdMap`, for every map of the store.

Its implementations, all free of per-id Python loops and held to one contract
(tests/embedding_store/test_id_maps.py, against a dict):

- here, the tiers' id -> position maps (slot of the device tier, arena row of the host tier), sized
  once for a tier's fixed capacity:

  - :class:`DenseIdMap` for bounded id spaces: an int32 array indexed by id (~2e8 lookups/s), read by
    compiled loops (numba) that produce the int64 positions, or mark them, in one pass.
  - :class:`HashIdMap` for unbounded 64-bit ids: open addressing with linear probing in numpy, every
    probe round handling all pending queries at once. Ids and positions sit side by side (one cache
    miss per probe); the table holds at most half its size in live entries, so a hit takes ~1.5
    probes; deletions leave tombstones and the table is rebuilt when they pile up.

- in :mod:`embedding_store.log_index`, the log layout's id -> sequence-number indexes
  (``DenseSeqIndex``, ``HashSeqIndex``, ``SortedSeqIndex``), which grow with the stored ids.

Why two hash tables (``HashIdMap`` and ``HashSeqIndex``) and two dense arrays: the roles pull apart.
A tier's map removes and inserts ids on every eviction, at a fixed capacity known up front, and is
read by every batch: ``HashIdMap`` preallocates it once (no reallocation on the fill path, a refusal
past the capacity) at a load of 1/2 with each id beside its int64 position (one cache miss a hit). The
log's index holds every stored id of a table, tens of millions, and must be small: ``HashSeqIndex``
grows, fills to 0.8 and keeps uint32 values (12 bytes a cell, two arrays), and is mostly the small
delta of ``SortedSeqIndex`` (~11 bytes an id). One table tuned for one role would cost the other
memory (the log) or a probe and a cache miss a hit (the tiers). Likewise ``DenseIdMap`` holds int32
positions (half the memory of ``DenseSeqIndex``'s int64 sequence numbers at 2^26 ids) and refuses a
lookup outside its id space (a tier is only asked for ids it was sized for), where the log answers -1.

Values are int64 >= 0 (a map documents a narrower range: ``DenseIdMap``'s positions fit int32); a
lookup returns -1 for an absent id.
"""

from __future__ import annotations

from typing import Protocol

import numba
import numpy as np

__all__ = ["DenseIdMap", "DenseSeqIndex", "HashIdMap", "IdMap", "make_id_map", "num_embeddings_for"]

_EMPTY = -1
_TOMB = -2
_MUL = np.uint64(0x9E3779B97F4A7C15)
_DENSE_MAX_IDS = 1 << 26  # dense maps up to 256 MiB of int32
_SLACK = 2  # table cells per live entry, rounded up to a power of two: load <= 1/2, ~1.5 probes per hit


# Signatures given: compiled (or loaded from numba's cache) on import, not in a stage's first call.
@numba.njit("int64[:](int32[:], int64[:])", nogil=True, cache=True)
def _dense_lookup(pos: np.ndarray, ids: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(ids.shape[0], dtype=np.int64)
    n = pos.shape[0]
    for i in range(ids.shape[0]):
        if not 0 <= ids[i] < n:
            raise IndexError("id outside the dense map")
        out[i] = pos[ids[i]]
    return out


@numba.njit("void(int32[:], int64[:], int64, int64[:])", nogil=True, cache=True)
def _dense_mark(pos: np.ndarray, ids: np.ndarray, value: int, out: np.ndarray) -> None:  # pragma: no cover
    n = pos.shape[0]
    for i in range(ids.shape[0]):
        if not 0 <= ids[i] < n:
            raise IndexError("id outside the dense map")
        p = pos[ids[i]]
        if p >= 0:
            out[p] = value


@numba.njit(
    ["int64(int32[:], int64[:], int64[:])", "int64(int64[:], int64[:], int64[:])"], nogil=True, cache=True
)
def _dense_remove(vals: np.ndarray, ids: np.ndarray, old: np.ndarray) -> int:  # pragma: no cover - compiled
    """Clear each id's value in one pass (``old``: its value, -1 where absent or outside the id space:
    never stored); returns how many were present."""
    removed = 0
    for i in range(ids.shape[0]):
        old[i] = vals[ids[i]] if 0 <= ids[i] < vals.shape[0] else _EMPTY
        if old[i] >= 0:
            vals[ids[i]] = _EMPTY
            removed += 1
    return removed


class IdMap(Protocol):
    """id -> value map (ids int64 >= 0, values int64 >= 0): the one contract of the store's maps.

    Implementations that subclass it explicitly inherit :meth:`insert` (an :meth:`upsert`) and
    :meth:`mark` (a :meth:`lookup`); the others implement every method.
    """

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(N,) int64 ids, duplicates allowed -> (N,) int64 values, -1 where absent."""

    def upsert(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Point (N,) unique ids at (N,) values; returns the (N,) previous values (-1: a new id)."""

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert (N,) unique ids that are absent, with their (N,) values."""
        self.upsert(ids, values)

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove (N,) unique ids; returns their (N,) previous values (-1: absent, nothing removed)."""

    def mark(self, ids: np.ndarray, value: int, out: np.ndarray) -> None:
        """``out[value of id] = value`` for each of the (N,) ids that is present (values as positions)."""
        pos = self.lookup(ids)
        out[pos[pos >= 0]] = value

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored id and its value, as two (len,) int64 arrays, in no order."""

    def nbytes(self) -> int:
        """Memory held by the map's arrays."""

    def __len__(self) -> int: ...


class _DenseMap(IdMap):
    """Bounded id space ``[0, num_ids)``: one value per possible id, -1 where absent."""

    _dtype: type = np.int64

    def __init__(self, num_ids: int) -> None:
        self._vals: np.ndarray = np.full(num_ids, _EMPTY, dtype=self._dtype)  # (num_ids,)
        self._len = 0

    def remove(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        old = np.empty(ids.shape[0], dtype=np.int64)
        self._len -= int(_dense_remove(self._vals, ids, old))
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self._vals >= 0)
        return ids, self._vals[ids].astype(np.int64, copy=False)

    def nbytes(self) -> int:
        return int(self._vals.nbytes)

    def __len__(self) -> int:
        return self._len


class DenseIdMap(_DenseMap):
    """A tier's map of bounded ids ``[0, num_ids)``: one int32 position per possible id; a lookup
    outside the id space raises IndexError."""

    _dtype = np.int32

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return _dense_lookup(self._vals, np.ascontiguousarray(ids, dtype=np.int64))

    def mark(self, ids: np.ndarray, value: int, out: np.ndarray) -> None:
        _dense_mark(self._vals, np.ascontiguousarray(ids, dtype=np.int64), value, out)

    def insert(self, ids: np.ndarray, positions: np.ndarray) -> None:
        self._vals[ids] = positions
        self._len += len(ids)

    def upsert(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        old = self.lookup(ids)
        self._vals[ids] = values
        self._len += int(np.count_nonzero(old < 0))
        return old


@numba.njit("void(int64[:], int64[:], int64, int64[:], int64[:])", nogil=True, cache=True)
def _dense_seq_upsert(vals, ids, n, seqs, old):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        if not 0 <= ids[i] < n:
            raise IndexError("id outside the table's id space")
        old[i] = vals[ids[i]]
        vals[ids[i]] = seqs[i]


@numba.njit("void(int64[:], int64[:], int64, int64[:])", nogil=True, cache=True)
def _dense_seq_lookup(vals, ids, n, out):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        out[i] = vals[ids[i]] if 0 <= ids[i] < n else _EMPTY


class DenseSeqIndex(_DenseMap):
    """The log's index of bounded ids ``[0, num_ids)`` (``embedding_store.log_index``): one int64
    sequence number per possible id; a lookup outside the id space answers -1 (never stored)."""

    _dtype = np.int64

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        _dense_seq_lookup(self._vals, ids, self._vals.shape[0], out)
        return out

    def upsert(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        old = np.empty(ids.shape[0], dtype=np.int64)
        _dense_seq_upsert(
            self._vals, ids, self._vals.shape[0], np.ascontiguousarray(seqs, dtype=np.int64), old
        )
        self._len += int(np.count_nonzero(old < 0))
        return old


def _next_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


class HashIdMap(IdMap):
    """Unbounded int64 ids in an open-addressing table sized for ``max_entries`` live entries."""

    def __init__(self, max_entries: int) -> None:
        self._size = _next_pow2(_SLACK * max(1, max_entries))
        self._mask = np.uint64(self._size - 1)
        # (size, 2): id (-1 empty, -2 tombstone) and position side by side, so the first probe of a
        # lookup fetches both with one cache miss.
        self._kv = np.zeros((self._size, 2), dtype=np.int64)
        self._keys = self._kv[:, 0]  # (size,) view
        self._vals = self._kv[:, 1]  # (size,) view
        self._keys.fill(_EMPTY)
        self._len = 0
        self._tombs = 0

    def _home(self, ids: np.ndarray) -> np.ndarray:
        # Fibonacci hashing: the top bits of id * golden ratio; ids that differ only in high bits
        # still spread, and sequential ids land far apart.
        shift = np.uint64(64 - (self._size.bit_length() - 1))
        return ((ids.view(np.uint64) * _MUL) >> shift).astype(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        # np.take is ~3x faster than fancy indexing for these random gathers.
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        pos = self._home(ids)  # (N,)
        kv = np.take(self._kv, pos, axis=0)  # (N, 2)
        keys = kv[:, 0]
        out = kv[:, 1].copy()
        miss = keys != ids
        if not miss.any():  # every query settled on its first probe
            return out
        out[miss] = _EMPTY
        active = np.flatnonzero(miss & (keys != _EMPTY))
        pos = (np.take(pos, active) + 1) & (self._size - 1)
        while active.size:
            kv = np.take(self._kv, pos, axis=0)  # (A, 2)
            keys = kv[:, 0]
            hit = keys == np.take(ids, active)
            out[active[hit]] = kv[hit, 1]
            go_on = ~hit & (keys != _EMPTY)
            active = active[go_on]
            pos = (pos[go_on] + 1) & (self._size - 1)
        return out

    def _find_slots(self, ids: np.ndarray) -> np.ndarray:
        """Table positions of present ids."""
        pos = self._home(ids)
        found = np.full(ids.shape[0], _EMPTY, dtype=np.int64)
        active = np.arange(ids.shape[0])
        mask = self._size - 1
        while active.size:
            keys = np.take(self._kv, pos, axis=0)[:, 0]
            hit = keys == ids[active]
            found[active[hit]] = pos[hit]
            go_on = ~hit & (keys != _EMPTY)
            active = active[go_on]
            pos = (pos[go_on] + 1) & mask
        return found

    def insert(self, ids: np.ndarray, positions: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if 2 * (self._len + ids.shape[0]) > self._size:
            raise ValueError(
                f"HashIdMap holds at most {self._size // 2} ids, inserting {ids.shape[0]} into {self._len}"
            )
        if 4 * (self._len + self._tombs + ids.shape[0]) > 3 * self._size:
            self._rebuild()
        self._place(ids, positions)
        self._len += ids.shape[0]

    def _place(self, ids: np.ndarray, positions: np.ndarray) -> None:
        pos = self._home(ids)
        active = np.arange(ids.shape[0])
        mask = self._size - 1
        while active.size:
            keys = np.take(self._kv, pos, axis=0)[:, 0]
            free = keys < 0
            # Claim free cells; when several ids hit one cell the last write wins and the others probe on.
            self._keys[pos[free]] = ids[active[free]]
            won = free & (self._keys[pos] == ids[active])
            self._tombs -= int(np.count_nonzero(keys[won] == _TOMB))
            self._vals[pos[won]] = positions[active[won]]
            lost = ~won
            active = active[lost]
            pos = (pos[lost] + 1) & mask

    def upsert(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.int64)
        cells = self._find_slots(ids)
        found = cells >= 0
        old = np.full(ids.shape[0], _EMPTY, dtype=np.int64)
        old[found] = self._vals[cells[found]]
        self._vals[cells[found]] = values[found]
        self.insert(ids[~found], values[~found])
        return old

    def remove(self, ids: np.ndarray) -> np.ndarray:
        cells = self._find_slots(np.ascontiguousarray(ids, dtype=np.int64))
        found = cells >= 0
        cells = cells[found]
        old = np.full(found.shape[0], _EMPTY, dtype=np.int64)
        old[found] = self._vals[cells]
        self._keys[cells] = _TOMB
        self._len -= cells.shape[0]
        self._tombs += cells.shape[0]
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self._keys >= 0
        return self._keys[live], self._vals[live]  # boolean indexing copies

    def nbytes(self) -> int:
        return int(self._kv.nbytes)

    def _rebuild(self) -> None:
        live = self._keys >= 0
        ids, vals = self._keys[live], self._vals[live]
        self._keys.fill(_EMPTY)
        self._tombs = 0
        self._place(ids, vals)

    def __len__(self) -> int:
        return self._len


def make_id_map(num_embeddings: int | None, max_entries: int) -> DenseIdMap | HashIdMap:
    """The cheaper map for an id space: dense when bounded and small, hashed otherwise."""
    if num_embeddings is not None and num_embeddings <= max(_DENSE_MAX_IDS, 4 * max_entries):
        return DenseIdMap(num_embeddings)
    return HashIdMap(max_entries)


def num_embeddings_for(id_space: int) -> int | None:
    """``TableSpec.num_embeddings`` for a table whose ids lie in ``[0, id_space)``.

    The id space itself while a dense index covers it (up to 2^26 ids: one gather per lookup, ids
    outside it refused), None above that: raw int64 ids in the hash index.
    """
    return id_space if id_space <= _DENSE_MAX_IDS else None
