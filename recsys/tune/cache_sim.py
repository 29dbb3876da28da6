"""The store's device tier without rows: what :func:`recsys.tune.trace.simulate` replays a trace through.

:class:`SimulatedTier` keeps the bookkeeping of ``embedding_store.tiers`` — the position of each id, the
id at each position, the stack of free positions and the store's own eviction policy
(``embedding_store.policies``: LRU, LFU, LOOKAHEAD) — and takes each batch the way
``TieredTable.make_resident`` does: hits are touched; the missing ids, in ascending order, take free
positions or evict the victims the policy picks among the occupied positions no batch in flight pins;
the filled positions are inserted into the policy, then the whole batch is touched. Positions, ticks and
the policy's tie-break by position are the store's, so a simulated run evicts the very rows the store
does (tests/recsys/test_tune_sim.py holds the two equal against a ``TieredStore``). Belady's MIN, the
tuner's upper bound, is one more policy class here: the furthest next use first.

Ids are the trace's compact ids ``[0, num_ids)``, so the id -> position map is a plain array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import numpy as np

from embedding_store import PolicyKind
from embedding_store.policies import EvictionPolicy, make_policy

__all__ = ["NO_USE", "BeladyPolicy", "Future", "SimulatedTier"]

NO_USE = 1 << 40  # a row's next use when no later batch uses it
Future: TypeAlias = Callable[[np.ndarray], np.ndarray]  # candidate positions -> what the policy reads


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN: the row whose next use (``future``: the batch index of each candidate's next use,
    ``NO_USE`` where none) is furthest goes first; ties by position, as every policy's."""

    needs_future = True

    def _sort_key(self, candidates: np.ndarray, future: np.ndarray | None) -> np.ndarray:
        assert future is not None, "Belady needs every candidate's next use"
        return NO_USE - future  # >= 0: the count-based selection of the n smallest keys expects that


class SimulatedTier:
    """A device tier of ``capacity`` positions over compact ids ``[0, num_ids)``, without rows."""

    def __init__(self, num_ids: int, capacity: int, policy: PolicyKind | None) -> None:
        """``policy`` None: Belady's MIN."""
        self.capacity = capacity
        self.slot_of = np.full(num_ids, -1, dtype=np.int64)  # (num_ids,) position of each id, -1 absent
        self.ids = np.full(capacity, -1, dtype=np.int64)  # (capacity,) id held by each position
        self.policy = BeladyPolicy(capacity) if policy is None else make_policy(policy, capacity)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # stack, pops from the end
        self.num_free = capacity

    def fill(
        self, ids: np.ndarray, pinned: list[np.ndarray], future: Future | None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Make (N,) distinct ids resident beside the rows at the ``pinned`` positions (the batches in
        flight). ``future``: the (K,) array the policy reads of (K,) candidate positions (LOOKAHEAD: the
        batches until each one's next announced use, -1 none; Belady: its next use), asked for only when
        the batch evicts; None: nothing announced.

        Returns (N,) positions, (N,) True where the id was resident, and the victims' count (-1: the
        batch does not fit, nothing changed).
        """
        slots = self.slot_of[ids]
        hit = slots >= 0
        if hit.all():
            self.policy.touch(slots)
            return slots, hit, 0
        new = np.sort(ids[~hit])  # the store fills a batch's missing ids in ascending order
        need = new.shape[0] - self.num_free
        if need > 0:
            mask = np.zeros(self.capacity, dtype=bool)
            mask[slots[hit]] = True
            for held in pinned:
                mask[held] = True
            candidates = (
                np.flatnonzero(~mask) if self.num_free == 0 else np.flatnonzero((self.ids >= 0) & ~mask)
            )
            if need > candidates.shape[0]:
                return slots, hit, -1
            victims = self.policy.victims(need, candidates, None if future is None else future(candidates))
            self.slot_of[self.ids[victims]] = -1
            self.ids[victims] = -1
            self.policy.remove(victims)
            self._free[self.num_free : self.num_free + need] = victims
            self.num_free += need
        n = new.shape[0]
        pos = self._free[self.num_free - n : self.num_free][::-1].copy()  # as the store's allocate
        self.num_free -= n
        self.ids[pos] = new
        self.slot_of[new] = pos
        self.policy.insert(pos)
        slots = self.slot_of[ids]
        self.policy.touch(slots)
        return slots, hit, max(need, 0)
