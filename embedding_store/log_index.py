"""The log layout's id -> sequence-number index: which record of the log holds each id's live row.

Two maps with one contract, both compiled or vectorised (no per-id Python):

- :class:`DenseSeqIndex` for bounded id spaces up to ``DENSE_MAX_IDS`` ids: one int64 per possible id.
- :class:`HashSeqIndex` for anything else: open addressing with linear probing over two arrays (int64
  ids; uint32 sequence numbers until one passes 2^32 - 1, int64 from then on), at most ``MAX_LOAD``
  full: 12 bytes a cell, 15-30 bytes per stored id. Ids are
  never removed (a row, once stored, stays stored), so there are no tombstones; the table doubles when
  it would pass ``MAX_LOAD``.

The loops are numba functions that release the interpreter lock (``nogil``): the reader threads and the
writer thread look ids up while the training thread runs.
"""

from __future__ import annotations

from typing import Protocol

import numba
import numpy as np

__all__ = ["DENSE_MAX_IDS", "DenseSeqIndex", "HashSeqIndex", "SeqIndex", "make_seq_index"]

DENSE_MAX_IDS = 1 << 22  # 32 MiB of int64 at most; the hash index costs 20-40 bytes per stored id
MAX_LOAD = 0.8
_EMPTY = -1
_MUL = np.uint64(0x9E3779B97F4A7C15)
_U32_MAX = (1 << 32) - 1


@numba.njit("int64(int64[:], int64, int64)", nogil=True, cache=True)
def _cell(keys, shift, key):  # type: ignore[no-untyped-def] # pragma: no cover
    """The cell holding ``key``, or the empty cell where it would go (linear probing)."""
    mask = keys.shape[0] - 1
    h = np.int64((np.uint64(key) * _MUL) >> np.uint64(shift))
    while keys[h] != key and keys[h] != _EMPTY:
        h = (h + 1) & mask
    return h


# Sequence numbers are held as uint32 until one does not fit (then int64): 12 bytes a cell, not 16.
@numba.njit(
    [
        "int64(int64[:], uint32[:], int64, int64[:], int64[:], int64[:])",
        "int64(int64[:], int64[:], int64, int64[:], int64[:], int64[:])",
    ],
    nogil=True,
    cache=True,
)
def _hash_upsert(keys, vals, shift, ids, seqs, old):  # type: ignore[no-untyped-def] # pragma: no cover
    added = 0
    for i in range(ids.shape[0]):
        h = _cell(keys, shift, ids[i])
        if keys[h] == ids[i]:
            old[i] = vals[h]
        else:
            keys[h] = ids[i]
            old[i] = _EMPTY
            added += 1
        vals[h] = seqs[i]
    return added


@numba.njit(
    [
        "void(int64[:], uint32[:], int64, int64[:], int64[:])",
        "void(int64[:], int64[:], int64, int64[:], int64[:])",
    ],
    nogil=True,
    cache=True,
)
def _hash_lookup(keys, vals, shift, ids, out):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        h = _cell(keys, shift, ids[i])
        out[i] = vals[h] if keys[h] == ids[i] else _EMPTY


@numba.njit("void(int64[:], int64[:], int64, int64[:], int64[:])", nogil=True, cache=True)
def _dense_upsert(vals, ids, n, seqs, old):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        if not 0 <= ids[i] < n:
            raise IndexError("id outside the table's id space")
        old[i] = vals[ids[i]]
        vals[ids[i]] = seqs[i]


@numba.njit("void(int64[:], int64[:], int64, int64[:])", nogil=True, cache=True)
def _dense_lookup(vals, ids, n, out):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        out[i] = vals[ids[i]] if 0 <= ids[i] < n else _EMPTY


class SeqIndex(Protocol):
    """id -> sequence number of its live record (ids int64 >= 0, sequence numbers int64 >= 0)."""

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(N,) ids -> (N,) sequence numbers, -1 where the id is not stored."""

    def upsert(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """Point (N,) unique ids at (N,) sequence numbers; returns the (N,) previous ones (-1: new id)."""

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored id and its sequence number, in no order."""

    def nbytes(self) -> int:
        """Memory held by the index."""

    def __len__(self) -> int: ...


class DenseSeqIndex:
    """Bounded ids ``[0, num_ids)``: one int64 per possible id."""

    def __init__(self, num_ids: int) -> None:
        self._vals = np.full(num_ids, _EMPTY, dtype=np.int64)
        self._len = 0

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        _dense_lookup(self._vals, ids, self._vals.shape[0], out)
        return out

    def upsert(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        old = np.empty(ids.shape[0], dtype=np.int64)
        _dense_upsert(self._vals, ids, self._vals.shape[0], np.ascontiguousarray(seqs, dtype=np.int64), old)
        self._len += int(np.count_nonzero(old < 0))
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self._vals >= 0)
        return ids, self._vals[ids]

    def nbytes(self) -> int:
        return int(self._vals.nbytes)

    def __len__(self) -> int:
        return self._len


class HashSeqIndex:
    """Any int64 ids >= 0, in an open-addressing table that doubles as it fills."""

    def __init__(self, expected: int = 0) -> None:
        self._alloc(1 << max(10, int(max(1, expected) / MAX_LOAD).bit_length()))
        self._len = 0

    def _alloc(self, size: int, dtype: type = np.uint32) -> None:
        self._keys = np.full(size, _EMPTY, dtype=np.int64)
        self._vals: np.ndarray = np.empty(size, dtype=dtype)
        self._shift = 64 - (size.bit_length() - 1)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        _hash_lookup(self._keys, self._vals, self._shift, ids, out)
        return out

    def upsert(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.shape[0] and int(ids.min()) < 0:
            raise ValueError("HashSeqIndex ids must be >= 0")
        seqs = np.ascontiguousarray(seqs, np.int64)
        if self._vals.dtype == np.uint32 and seqs.shape[0] and int(seqs.max()) >= _U32_MAX:
            self._vals = self._vals.astype(np.int64)  # numbers this large: a long life of compactions
        if self._len + ids.shape[0] > MAX_LOAD * self._keys.shape[0]:
            self._grow(self._len + ids.shape[0])
        old = np.empty(ids.shape[0], dtype=np.int64)
        self._len += int(_hash_upsert(self._keys, self._vals, self._shift, ids, seqs, old))
        return old

    def _grow(self, need: int) -> None:
        ids, seqs = self.items()
        size = self._keys.shape[0]
        while need > MAX_LOAD * size:
            size *= 2
        dtype = self._vals.dtype.type
        del self._keys, self._vals  # the old table goes before the new one fills: peak = old + new
        self._alloc(size, dtype)
        _hash_upsert(self._keys, self._vals, self._shift, ids, seqs, np.empty(ids.shape[0], dtype=np.int64))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        full = self._keys >= 0
        return self._keys[full], self._vals[full].astype(np.int64)

    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    def __len__(self) -> int:
        return self._len


def make_seq_index(num_embeddings: int | None) -> SeqIndex:
    """The dense index for a small bounded id space, the hash index otherwise."""
    if num_embeddings is not None and num_embeddings <= DENSE_MAX_IDS:
        return DenseSeqIndex(num_embeddings)
    return HashSeqIndex()
