"""The log layout's id -> sequence-number index: which record of the log holds each id's live row.

Three implementations of the store's one map protocol, :class:`embedding_store.index.IdMap` (``SeqIndex``
here: values are sequence numbers), all compiled or vectorised (no per-id Python):

- :class:`DenseSeqIndex` for bounded id spaces up to ``DENSE_MAX_IDS`` ids: one int64 per possible id
  (defined in :mod:`embedding_store.index`, beside the tiers' dense map it shares its code with).
- :class:`SortedSeqIndex` for anything else (``make_seq_index``): packed sorted entries, ~11 bytes per
  stored id (6 of key, 4 of sequence number, a directory), with new ids gathered in a small
  :class:`HashSeqIndex` and merged in place. A removal closes the gaps in place: a pass over the index.
- :class:`HashSeqIndex`: open addressing with linear probing over two arrays (int64 ids; uint32
  sequence numbers until one passes 2^32 - 1, int64 from then on), at most ``MAX_LOAD`` full: 12 bytes a
  cell, 15-30 bytes per stored id; the table doubles when it would pass ``MAX_LOAD``. A removal shifts
  the entries after it back (backward-shift deletion), so there are no tombstones and a lookup's probe
  still ends at the first empty cell.

Why these and not the tiers' maps: see :mod:`embedding_store.index`.

The loops are numba functions that release the interpreter lock (``nogil``): the reader threads and the
writer thread look ids up while the training thread runs.
"""

from __future__ import annotations

import numba
import numpy as np

from embedding_store.index import DenseSeqIndex, IdMap

__all__ = ["DENSE_MAX_IDS", "DenseSeqIndex", "HashSeqIndex", "SeqIndex", "SortedSeqIndex", "make_seq_index"]

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
def _hash_sigs(ret: str, args: str = "int64[:], int64[:]") -> list[str]:
    """The signature for either dtype of the held sequence numbers."""
    return [f"{ret}(int64[:], {v}[:], int64, {args})" for v in ("uint32", "int64")]


@numba.njit(_hash_sigs("int64", "int64[:], int64[:], int64[:]"), nogil=True, cache=True)
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


@numba.njit(_hash_sigs("void"), nogil=True, cache=True)
def _hash_lookup(keys, vals, shift, ids, out):  # type: ignore[no-untyped-def] # pragma: no cover
    for i in range(ids.shape[0]):
        h = _cell(keys, shift, ids[i])
        out[i] = vals[h] if keys[h] == ids[i] else _EMPTY


@numba.njit(_hash_sigs("int64"), nogil=True, cache=True)
def _hash_remove(keys, vals, shift, ids, old):  # type: ignore[no-untyped-def] # pragma: no cover
    """Remove each present id (``old``: its number, -1 if absent); returns how many were removed. Each
    entry after the hole, up to the next empty cell, moves into it when the hole lies between that
    entry's home cell and its cell: every entry stays reachable from its home without tombstones."""
    mask = keys.shape[0] - 1
    removed = 0
    for i in range(ids.shape[0]):
        hole = _cell(keys, shift, ids[i])
        if keys[hole] != ids[i]:
            old[i] = _EMPTY
            continue
        old[i] = vals[hole]
        removed += 1
        j = (hole + 1) & mask
        while keys[j] != _EMPTY:
            home = np.int64((np.uint64(keys[j]) * _MUL) >> np.uint64(shift))
            if ((j - home) & mask) >= ((j - hole) & mask):
                keys[hole], vals[hole] = keys[j], vals[j]
                hole = j
            j = (j + 1) & mask
        keys[hole] = _EMPTY
    return removed


def _checked_ids(ids: np.ndarray, name: str) -> np.ndarray:
    """Contiguous int64 ids, refused unless >= 0 (-1 marks an empty cell)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.shape[0] and int(ids.min()) < 0:
        raise ValueError(f"{name} ids must be >= 0, got {int(ids.min())}")
    return ids


def _upsert_args(
    ids: np.ndarray, seqs: np.ndarray, held: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous int64 ``ids`` (checked >= 0) and ``seqs``, and the held sequence numbers widened to
    int64 once a number does not fit their uint32."""
    ids = _checked_ids(ids, name)
    seqs = np.ascontiguousarray(seqs, np.int64)
    if held.dtype == np.uint32 and seqs.shape[0] and int(seqs.max()) >= _U32_MAX:
        held = held.astype(np.int64)  # numbers this large: a long life of compactions
    return ids, seqs, held


SeqIndex = IdMap  # the name the log backend reads its index by (values: sequence numbers)


class HashSeqIndex(IdMap):
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
        ids, seqs, self._vals = _upsert_args(ids, seqs, self._vals, "HashSeqIndex")
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

    def remove(self, ids: np.ndarray) -> np.ndarray:
        ids = _checked_ids(ids, "HashSeqIndex")
        old = np.empty(ids.shape[0], dtype=np.int64)
        self._len -= int(_hash_remove(self._keys, self._vals, self._shift, ids, old))
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        full = self._keys >= 0
        return self._keys[full], self._vals[full].astype(np.int64)

    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    def __len__(self) -> int:
        return self._len


# ----------------------------------------------------------------------------- the packed sorted index
# Keys are ids mixed by an odd multiplier mod 2^64 (a bijection: hashed or sequential ids alike spread
# evenly). The top ``64 - shift`` bits of a key pick its bucket in a directory of offsets; only the other
# ``shift`` bits (32..48) are stored, as a uint32 and a uint16, so an id costs 6 bytes and its sequence
# number 4, plus the directory (<= 1 byte per id at 8 ids a bucket at least).
_MUL_INV = np.uint64(pow(int(_MUL), -1, 1 << 64))
_ONE = np.uint64(1)
_U32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)


@numba.njit(nogil=True, cache=True)
def _key_at(lo, hi, i):  # type: ignore[no-untyped-def] # pragma: no cover
    return (np.uint64(hi[i]) << _U32) | np.uint64(lo[i])


def _sigs(args: str, ret: str = "void") -> list[str]:
    """The signature for either dtype of the sequence numbers (``{s}``)."""
    return [f"{ret}(uint32[:], uint16[:], {s}[:], uint32[:], uint64, {args})" for s in ("uint32", "int64")]


_GROUP = 32  # ids located together by _find_group


@numba.njit(nogil=True, cache=True)
def _find_group(lo, hi, seqs, off, shift, ids, g, pos, scratch):  # type: ignore[no-untyped-def] # pragma: no cover
    """``pos[k]`` = the position of ``ids[g + k]`` among the sorted entries, or -1, for k < len(pos) (the
    caller trims the group at the end of ``ids``; ``scratch``: (3, >= len(pos)) uint64). Each id's mixed
    key picks a directory bucket and is searched for inside it by bisection, in three passes over the
    group: every id's bucket, then a load of each bucket's first and last entry in the three arrays
    (``seqs`` too: the caller reads or writes it next), then the searches, which find those lines
    cached. The loads of the first two passes do not depend on one another, so their cache misses
    overlap. An update at 40 M entries cost ~225 ns an id with neither pass and ~145 with the first; at
    50 M, 160-172 with the first and 108-116 with both (the directory and the entries are far larger
    than the caches; docs/performance.md)."""
    mask = (_ONE << shift) - _ONE
    rest, bound = scratch[0], scratch[1]
    for k in range(pos.shape[0]):
        m = np.uint64(ids[g + k]) * _MUL
        b = m >> shift
        rest[k] = m & mask
        pos[k] = np.int64(off[b])
        bound[k] = off[b + _ONE]
    touched = np.uint64(0)
    for k in range(pos.shape[0]):
        a, z = pos[k], np.int64(bound[k]) - 1
        if a <= z:
            touched += np.uint64(lo[a]) + np.uint64(lo[z]) + np.uint64(hi[a]) + np.uint64(hi[z])
            touched += np.uint64(seqs[a]) + np.uint64(seqs[z])
    scratch[2, 0] = touched  # kept, so that the compiler keeps the loads
    for k in range(pos.shape[0]):
        a, z, r = pos[k], np.int64(bound[k]), rest[k]
        while a < z:
            mid = (a + z) >> 1
            if _key_at(lo, hi, mid) < r:
                a = mid + 1
            else:
                z = mid
        pos[k] = a if a < np.int64(bound[k]) and _key_at(lo, hi, a) == r else -1


@numba.njit(_sigs("int64[:], int64[:]"), nogil=True, cache=True)
def _sorted_lookup(lo, hi, seqs, off, shift, ids, out):  # type: ignore[no-untyped-def] # pragma: no cover
    pos, scratch = np.empty(_GROUP, dtype=np.int64), np.empty((3, _GROUP), dtype=np.uint64)
    for g in range(0, ids.shape[0], _GROUP):
        n = min(_GROUP, ids.shape[0] - g)
        _find_group(lo, hi, seqs, off, shift, ids, g, pos[:n], scratch)
        for k in range(n):
            out[g + k] = np.int64(seqs[pos[k]]) if pos[k] >= 0 else _EMPTY


@numba.njit(_sigs("int64[:], int64[:], int64[:]"), nogil=True, cache=True)
def _sorted_update(lo, hi, seqs, off, shift, ids, new, old):  # type: ignore[no-untyped-def] # pragma: no cover
    """Ids found among the entries take their new number (``old``: the previous one); -2 for the others.
    A repeated id sees its earlier number, as in one pass in order (only ``seqs`` changes here)."""
    pos, scratch = np.empty(_GROUP, dtype=np.int64), np.empty((3, _GROUP), dtype=np.uint64)
    for g in range(0, ids.shape[0], _GROUP):
        n = min(_GROUP, ids.shape[0] - g)
        _find_group(lo, hi, seqs, off, shift, ids, g, pos[:n], scratch)
        for k in range(n):
            p = pos[k]
            if p >= 0:
                old[g + k] = np.int64(seqs[p])
                seqs[p] = new[g + k]
            else:
                old[g + k] = -2


@numba.njit(_sigs("int64, int64[:], int64[:]", "int64"), nogil=True, cache=True)
def _sorted_remove(lo, hi, seqs, off, shift, n, ids, old):  # type: ignore[no-untyped-def] # pragma: no cover
    """Remove the (unique) ids found among the n entries (``old``: their numbers; -2 for the others):
    one pass moves the entries after the first removed one down over the gaps, then the directory's
    offsets follow. Returns how many were removed."""
    pos, scratch = np.empty(_GROUP, dtype=np.int64), np.empty((3, _GROUP), dtype=np.uint64)
    gone = np.empty(ids.shape[0], dtype=np.int64)
    m = 0
    for g in range(0, ids.shape[0], _GROUP):
        size = min(_GROUP, ids.shape[0] - g)
        _find_group(lo, hi, seqs, off, shift, ids, g, pos[:size], scratch)
        for k in range(size):
            old[g + k] = np.int64(seqs[pos[k]]) if pos[k] >= 0 else -2
            if pos[k] >= 0:
                gone[m] = pos[k]
                m += 1
    if m == 0:
        return 0
    gone = np.sort(gone[:m])
    w, j = gone[0], 0
    for r in range(gone[0], n):
        if j < m and gone[j] == r:
            j += 1
        else:
            lo[w], hi[w], seqs[w] = lo[r], hi[r], seqs[r]
            w += 1
    j = 0
    for b in range(off.shape[0]):
        while j < m and gone[j] < np.int64(off[b]):
            j += 1
        off[b] = np.uint32(np.int64(off[b]) - j)
    return m


@numba.njit(_sigs("int64, uint64[:], int64[:]"), nogil=True, cache=True)
def _sorted_merge(lo, hi, seqs, off, shift, n, keys, new):  # type: ignore[no-untyped-def] # pragma: no cover
    """Merge sorted mixed ``keys`` (absent ones) with numbers ``new`` into the n entries, in place from the
    back (the arrays hold n + len(keys)), then move the directory's offsets."""
    mask = (_ONE << shift) - _ONE
    i, j, w = n - 1, keys.shape[0] - 1, n + keys.shape[0] - 1
    b = off.shape[0] - 2
    while j >= 0:
        take_base = False
        if i >= 0:
            while np.int64(off[b]) > i:
                b -= 1
            take_base = ((np.uint64(b) << shift) | _key_at(lo, hi, i)) > keys[j]
        if take_base:
            lo[w], hi[w], seqs[w] = lo[i], hi[i], seqs[i]
            i -= 1
        else:
            r = keys[j] & mask
            lo[w], hi[w], seqs[w] = r & _LOW32, r >> _U32, new[j]
            j -= 1
        w -= 1
    jj = 0
    for b in range(off.shape[0]):
        while jj < keys.shape[0] and np.int64(keys[jj] >> shift) < b:
            jj += 1
        off[b] += jj


@numba.njit("uint32[:](uint32[:], uint16[:], uint32[:], uint64, int64)", nogil=True, cache=True)
def _split_buckets(lo, hi, off, shift, n):  # type: ignore[no-untyped-def] # pragma: no cover
    """Double the directory: each key's top stored bit moves into its bucket number (in place)."""
    bit = shift - _ONE
    new_off = np.zeros(2 * (off.shape[0] - 1) + 1, dtype=np.uint32)
    b = 0
    for i in range(n):
        while np.int64(off[b + 1]) <= i:
            b += 1
        k = _key_at(lo, hi, i)
        top = (k >> bit) & _ONE
        k &= (_ONE << bit) - _ONE
        lo[i], hi[i] = k & _LOW32, k >> _U32
        new_off[2 * b + np.int64(top) + 1] += 1
    for c in range(1, new_off.shape[0]):
        new_off[c] += new_off[c - 1]
    return new_off


@numba.njit("void(uint32[:], uint16[:], uint32[:], uint64, int64, int64[:])", nogil=True, cache=True)
def _sorted_ids(lo, hi, off, shift, n, out):  # type: ignore[no-untyped-def] # pragma: no cover
    b = 0
    for i in range(n):
        while np.int64(off[b + 1]) <= i:
            b += 1
        out[i] = np.int64(((np.uint64(b) << shift) | _key_at(lo, hi, i)) * _MUL_INV)


class SortedSeqIndex(IdMap):
    """Any int64 ids >= 0 in ~11 bytes each: packed sorted entries and a small hash of recent new ids.

    The entries are sorted by mixed key (see above) and looked up by a directory bucket and a binary
    search inside it (~8 entries). A known id's number is updated in place; a new id goes to a
    :class:`HashSeqIndex` (the *delta*), which is merged into the entries, in place from the back,
    once it holds 1/32 of them. The arrays grow by an eighth at a time (``ndarray.resize``: a large
    block is remapped, not copied), and the directory doubles, in place, once it has fewer than an
    eighth as many buckets as entries: no step of the index holds two copies of it.
    """

    MIN_BITS = 16  # directory buckets 2^16 at least (256 KiB); stored key bits 48 at most

    def __init__(self, *, merge_min: int = 1 << 16) -> None:
        self._merge_min = merge_min  # new ids the delta holds before a merge, at least
        self._shift = np.uint64(64 - self.MIN_BITS)
        self._off = np.zeros((1 << self.MIN_BITS) + 1, dtype=np.uint32)
        self._lo = np.empty(0, dtype=np.uint32)
        self._hi = np.empty(0, dtype=np.uint16)
        self._seqs: np.ndarray = np.empty(0, dtype=np.uint32)
        self._n = 0  # sorted entries
        self._delta = HashSeqIndex(merge_min)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        _sorted_lookup(self._lo, self._hi, self._seqs, self._off, self._shift, ids, out)
        miss = np.flatnonzero(out < 0)
        if miss.shape[0] and len(self._delta):
            out[miss] = self._delta.lookup(ids[miss])
        return out

    def upsert(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        ids, seqs, self._seqs = _upsert_args(ids, seqs, self._seqs, "SortedSeqIndex")
        old = np.empty(ids.shape[0], dtype=np.int64)
        _sorted_update(self._lo, self._hi, self._seqs, self._off, self._shift, ids, seqs, old)
        miss = np.flatnonzero(old == -2)
        if miss.shape[0]:
            old[miss] = self._delta.upsert(ids[miss], seqs[miss])
            if len(self._delta) >= max(self._merge_min, self._n >> 5):
                self._merge()
        return old

    def _merge(self) -> None:
        ids, seqs = self._delta.items()
        keys = ids.astype(np.uint64) * _MUL
        order = np.argsort(keys)
        keys, seqs = keys[order], seqs[order]
        need = self._n + keys.shape[0]
        if need > 0xFFFFFFFF:
            raise ValueError("SortedSeqIndex holds at most 2^32 - 1 ids")
        if need > self._lo.shape[0]:
            cap = need + need // 8
            for a in (self._lo, self._hi, self._seqs):
                a.resize(cap, refcheck=False)  # private arrays, no views: realloc (remap) in place
        _sorted_merge(self._lo, self._hi, self._seqs, self._off, self._shift, self._n, keys, seqs)
        self._n = need
        while self._n > 8 * (self._off.shape[0] - 1) and self._shift > 32:
            self._off = _split_buckets(self._lo, self._hi, self._off, self._shift, self._n)
            self._shift -= np.uint64(1)
        self._delta = HashSeqIndex(max(self._merge_min, self._n >> 5))

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """As :meth:`IdMap.remove`; an id is in the entries or in the delta, never both. Removing from
        the entries moves every entry after the first removed one: a pass over the index per call, for
        batched, rare removals (a table's deleted rows), not for every batch."""
        ids = _checked_ids(ids, "SortedSeqIndex")
        old = np.empty(ids.shape[0], dtype=np.int64)
        args = (self._lo, self._hi, self._seqs, self._off, self._shift, self._n)
        self._n -= int(_sorted_remove(*args, ids, old))
        miss = np.flatnonzero(old == -2)
        if miss.shape[0]:
            old[miss] = self._delta.remove(ids[miss])
        return old

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty(self._n, dtype=np.int64)
        _sorted_ids(self._lo, self._hi, self._off, self._shift, self._n, ids)
        more_ids, more_seqs = self._delta.items()
        return np.concatenate([ids, more_ids]), np.concatenate(
            [self._seqs[: self._n].astype(np.int64), more_seqs]
        )

    def nbytes(self) -> int:
        arrays = (self._lo, self._hi, self._seqs, self._off)
        return int(sum(a.nbytes for a in arrays)) + self._delta.nbytes()

    def __len__(self) -> int:
        return self._n + len(self._delta)


def make_seq_index(num_embeddings: int | None) -> SeqIndex:
    """The dense index for a small bounded id space, the packed sorted index otherwise."""
    if num_embeddings is not None and num_embeddings <= DENSE_MAX_IDS:
        return DenseSeqIndex(num_embeddings)
    return SortedSeqIndex()
