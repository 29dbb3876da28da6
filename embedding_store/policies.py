"""Eviction policies: small objects over position indices, free of I/O.

A tier owns ``capacity`` positions (device slots or host arena rows). The base class keeps the
accounting every policy needs (the batch tick of the last use and the number of batches that used each
position); a policy only says which of the candidate positions goes first. All operations are
vectorised over arrays of positions; duplicates in a ``touch`` count once (one use per batch).

Contract (tests/embedding_store/test_store_policies.py runs it against every policy): ``victims(n, ...)``
returns ``n`` distinct members of ``candidates``, deterministically, and raises ValueError when
``n > len(candidates)``; pinned positions are simply never passed as candidates.
"""

from __future__ import annotations

import numba
import numpy as np

from embedding_store.config import PolicyKind

__all__ = ["EvictionPolicy", "LfuPolicy", "LookaheadPolicy", "LruPolicy", "make_policy"]

_TICK_BITS = 40  # 1e12 batches; the rest of an int64 sort key holds the policy's primary key
_LEXSORT_MAX = 4096  # up to this many candidates the victims are the n smallest (key, position) pairs


# Signatures given: compiled (or loaded from the cache) on import, never in a stage's first call.
@numba.njit("int64(int64[:], int64)", nogil=True, cache=True)
def _kth(key: np.ndarray, n: int) -> int:  # pragma: no cover - compiled
    """The n-th smallest of the keys (1 <= n <= len). Eviction keys are batch ticks, and the n smallest
    usually lie within ~2 K ticks of the least: then a count of the keys in that range finds it in
    three passes without moving a key, ~1/4 of the CPU of ``np.partition`` (an introselect over a
    copy) for 8,192 keys; otherwise the partition does."""
    least = key[0]
    for i in range(1, key.shape[0]):
        least = min(least, key[i])
    width = 2 * key.shape[0] + 64
    count = np.zeros(width, dtype=np.int32)
    inside = 0
    for i in range(key.shape[0]):
        d = key[i] - least  # >= 0; an int64 wrap is impossible for keys in [0, 2^62)
        if d < width:
            count[d] += 1
            inside += 1
    if inside >= n:
        seen = 0
        for d in range(width):
            seen += count[d]
            if seen >= n:
                return least + d
    return np.partition(key, n - 1)[n - 1]


@numba.njit("int64[:](int64[:], int64)", nogil=True, cache=True)
def _at_most_kth(key: np.ndarray, n: int) -> np.ndarray:  # pragma: no cover - compiled
    """Indices, ascending, of the keys <= the n-th smallest key: the n smallest and their ties."""
    kth = _kth(key, n)
    return np.flatnonzero(key <= kth)


@numba.njit("int64[:](int64[:], int64)", nogil=True, cache=True)
def _first_n(key: np.ndarray, n: int) -> np.ndarray:  # pragma: no cover - compiled
    """Indices of the n smallest keys, ties at the n-th broken by index: those below the n-th key, then
    the ties, each in ascending index order. What ``np.argpartition(key, n - 1)[:n]`` selects up to its
    arbitrary choice among ties, at ~1/3 of its CPU for 8,192 keys (benchmarks/bench_stage_cpu.py)."""
    kth = _kth(key, n)
    out = np.empty(n, dtype=np.int64)
    j = 0
    for i in range(key.shape[0]):
        if key[i] < kth:
            out[j] = i
            j += 1
    for i in range(key.shape[0]):
        if j == n:
            break
        if key[i] == kth:
            out[j] = i
            j += 1
    return out


def _smallest(key: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """The n (key, candidate) pairs that sort first, their candidates in that order: for distinct
    candidates and 0 < n < K, ``candidates[np.lexsort((candidates, key))[:n]]``, sorting only the
    n smallest keys and their ties."""
    sel = _at_most_kth(key, n)
    cand = candidates[sel]
    return cand[np.lexsort((cand, key[sel]))[:n]]


class EvictionPolicy:
    """Base accounting; subclasses override :meth:`_sort_key` only."""

    kind: PolicyKind = PolicyKind.LRU
    needs_future: bool = False  # whether victims() uses the ``future`` mask
    counts_uses: bool = False  # whether touch() must maintain use_count (LFU)

    def __init__(self, capacity: int) -> None:
        self._tick = 0
        self.last_use = np.zeros(capacity, dtype=np.int64)  # (capacity,) tick of the last batch
        # (capacity,) batches that used it: kept only by the policies that read it (8 bytes a position)
        self.use_count = np.zeros(capacity if self.counts_uses else 0, dtype=np.int64)

    def touch(self, positions: np.ndarray) -> None:
        """Record one batch's use of (N,) positions (duplicates allowed)."""
        self._tick += 1
        self.last_use[positions] = self._tick
        if self.counts_uses:
            self.use_count[positions] += 1

    def insert(self, positions: np.ndarray) -> None:
        """(N,) positions now hold new rows: reset their history to "just used once"."""
        self._tick += 1
        self.last_use[positions] = self._tick
        if self.counts_uses:
            self.use_count[positions] = 1

    def remove(self, positions: np.ndarray) -> None:
        """(N,) positions were emptied."""
        self.last_use[positions] = 0
        if self.counts_uses:
            self.use_count[positions] = 0

    def _sort_key(self, candidates: np.ndarray, future: np.ndarray | None) -> np.ndarray:
        return self.last_use[candidates]

    def victims(self, n: int, candidates: np.ndarray, future: np.ndarray | None = None) -> np.ndarray:
        """Choose ``n`` positions to evict.

        Args:
            n: how many.
            candidates: (K,) int64 distinct evictable positions (occupied and unpinned).
            future: (K,) int64 batches until an announced upcoming batch next uses the candidate's
                row, -1 where none does (a bool mask also works: True = needed, distance unknown);
                only LOOKAHEAD reads it.

        Returns:
            (n,) int64 distinct positions taken from ``candidates``.
        """
        if n > candidates.shape[0]:
            raise ValueError(f"cannot evict {n} positions out of {candidates.shape[0]} candidates")
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        key = self._sort_key(candidates, future)  # (K,) smaller goes first
        if n == candidates.shape[0]:
            return candidates.copy()
        # A composite key with the position as tie-breaker makes the choice deterministic.
        if candidates.shape[0] <= _LEXSORT_MAX:
            if 2 * n > candidates.shape[0]:  # most of them: one sort of all
                return candidates[np.lexsort((candidates, key))[:n]]
            return _smallest(key, np.asarray(candidates, dtype=np.int64), n)
        return candidates[_first_n(np.asarray(key, dtype=np.int64), n)]


class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    kind = PolicyKind.LRU


class LfuPolicy(EvictionPolicy):
    """Fewest using batches first, least recently used among equals."""

    kind = PolicyKind.LFU
    counts_uses = True

    def _sort_key(self, candidates: np.ndarray, future: np.ndarray | None) -> np.ndarray:
        count = np.minimum(self.use_count[candidates], (1 << (62 - _TICK_BITS)) - 1)
        return (count << _TICK_BITS) | self.last_use[candidates]


_DIST_BITS = 20  # next-use distances above 2^20 - 1 batches tie
_FAR = (1 << _DIST_BITS) - 1


@numba.njit("int64[:](int64[:], int64[:], int64[:])", nogil=True, cache=True)
def _lookahead_key(
    last_use: np.ndarray, candidates: np.ndarray, future: np.ndarray
) -> np.ndarray:  # pragma: no cover
    """LOOKAHEAD's sort key of each candidate (see ``LookaheadPolicy``), in one pass."""
    out = np.empty(candidates.shape[0], dtype=np.int64)
    for i in range(candidates.shape[0]):
        key = last_use[candidates[i]]
        if future[i] >= 0:  # needed: above every unneeded row (bit 61), nearer uses higher
            key |= ((_FAR - min(future[i], _FAR)) << _TICK_BITS) | (1 << 61)
        out[i] = key
    return out


class LookaheadPolicy(EvictionPolicy):
    """Window-limited Belady: rows none of the next L announced batches uses go first, least recently
    used among them; then the announced rows whose next use is furthest away (LRU among equals)."""

    kind = PolicyKind.LOOKAHEAD
    needs_future = True

    def _sort_key(self, candidates: np.ndarray, future: np.ndarray | None) -> np.ndarray:
        if future is None:
            return self.last_use[candidates]
        if future.dtype == np.bool_:
            future = np.where(future, 0, -1)
        return _lookahead_key(
            self.last_use, np.asarray(candidates, dtype=np.int64), np.asarray(future, dtype=np.int64)
        )


# The class of each PolicyKind, keyed by the kind the class names (the tests make every kind's policy).
_POLICIES: dict[PolicyKind, type[EvictionPolicy]] = {
    p.kind: p for p in (LruPolicy, LfuPolicy, LookaheadPolicy)
}


def make_policy(kind: PolicyKind, capacity: int) -> EvictionPolicy:
    """A fresh policy of ``kind`` over ``capacity`` positions."""
    return _POLICIES[kind](capacity)
