"""How a table's bounds (:mod:`embedding_store.bounds`) are held: in memory, the ids grouped by step that
give expiry, the cap and the candidates' purge their order (:class:`StepGroups`); in a checkpoint, plain
arrays, checked on load, split by owner and merged, so that a checkpoint can be re-partitioned onto another
number of ranks.

A state is a ``dict[str, np.ndarray]`` of int64 arrays (safetensors stores them as they are)::

    row_ids              (R,)  ids holding a row, ascending
    row_last_use         (R,)  the step of each row's last training use
    candidate_ids        (Q,)  ids counted toward admission, ascending, none of them a row id
    candidate_count      (Q,)  their occurrences (>= 1) since their count last restarted
    candidate_last_seen  (Q,)  the step of their last occurrence
    last_step            (1,)  the last step decided (-1: none)
    totals               (5,)  admitted, expired, capped, default lookups, lookups (cumulative)

Every array is per id except ``last_step`` and ``totals``; nothing derived (the expiry and cap order, the
purge order) is stored: :meth:`TableBounds.from_state <embedding_store.bounds.TableBounds.from_state>`
rebuilds it from the per-id steps, so it cannot disagree with them. :func:`split_state` sends each id's
entries to its owner (``totals`` to part 0, zeros to the others) and :func:`merge_states` concatenates
parts (``totals`` summed), so admission and expiry, which are per id, continue exactly on any number of
ranks; the row cap, which ranks an owner's rows against each other, does not (see the bounds module).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["NUM_TOTALS", "STATE_KEYS", "StepGroups", "check_state", "merge_states", "split_state"]

PER_ID_KEYS = ("row_ids", "row_last_use", "candidate_ids", "candidate_count", "candidate_last_seen")
STATE_KEYS = (*PER_ID_KEYS, "last_step", "totals")
NUM_TOTALS = 5  # admitted, expired, capped, default lookups, lookups
COUNT_MAX = (1 << 31) - 1  # counts are held as int32 and saturate here (admit_after is at most this)
_NO_IDS = np.empty(0, dtype=np.int64)

LiveFn = Callable[[int, np.ndarray], np.ndarray]  # (step, ids) -> bool mask: the entry is current


def _array(state: dict[str, np.ndarray], key: str) -> np.ndarray:
    """``state[key]`` as a contiguous 1-D int64 array, refused if missing, not 1-D or not integers."""
    if key not in state:
        raise ValueError(f"bounds state lacks {key!r} (has {sorted(state)})")
    a = np.asarray(state[key])
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"bounds state {key!r} must be a 1-D integer array, got {a.dtype} of shape {a.shape}"
        )
    return np.ascontiguousarray(a, dtype=np.int64)


def _check_ids(ids: np.ndarray, key: str) -> None:
    if ids.size and int(ids[0]) < 0:
        raise ValueError(f"bounds state {key!r} holds a negative id {int(ids[0])}")
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        raise ValueError(f"bounds state {key!r} must be strictly ascending")


def check_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checked copy of ``state`` as contiguous int64 arrays; a one-line ValueError names what is wrong.

    Checked: every key present, 1-D integers, matching lengths, ids >= 0 strictly ascending, no id both a
    row and a candidate, counts in ``[1, COUNT_MAX]``, every step in ``[0, last_step]``.
    """
    out = {key: _array(state, key) for key in STATE_KEYS}
    if out["last_step"].shape != (1,) or out["totals"].shape != (NUM_TOTALS,):
        raise ValueError(
            f"bounds state 'last_step' and 'totals' must have shapes (1,) and ({NUM_TOTALS},), "
            f"got {out['last_step'].shape} and {out['totals'].shape}"
        )
    last = int(out["last_step"][0])
    for ids_key, value_keys in (("row_ids", ("row_last_use",)), ("candidate_ids", PER_ID_KEYS[3:])):
        _check_ids(out[ids_key], ids_key)
        for key in value_keys:
            if out[key].shape != out[ids_key].shape:
                raise ValueError(
                    f"bounds state {key!r} has {out[key].size} entries for {out[ids_key].size} {ids_key}"
                )
    for key in ("row_last_use", "candidate_last_seen"):
        steps = out[key]
        if steps.size and (int(steps.min()) < 0 or int(steps.max()) > last):
            raise ValueError(
                f"bounds state {key!r} must lie in [0, last_step={last}], "
                f"got [{int(steps.min())}, {int(steps.max())}]"
            )
    counts = out["candidate_count"]
    if counts.size and (int(counts.min()) < 1 or int(counts.max()) > COUNT_MAX):
        raise ValueError(
            f"bounds state 'candidate_count' must lie in [1, {COUNT_MAX}], "
            f"got [{int(counts.min())}, {int(counts.max())}]"
        )
    rows, cands = out["row_ids"], out["candidate_ids"]
    at = np.searchsorted(rows, cands)  # both ascending: no sort of their union
    both = cands[rows[np.minimum(at, rows.size - 1)] == cands] if rows.size else _NO_IDS
    if both.size:
        raise ValueError(f"bounds state holds {both.size} ids as both row and candidate, e.g. {int(both[0])}")
    return out


class StepGroups:
    """Ids grouped by a step (a row's last use, a candidate's last occurrence), oldest group first, each
    group ascending by id: the LRU order of rows (ties by id) and the age order of candidates.

    Lazy: when an id's step moves on, its old entry stays until a ``take`` or a ``sweep`` meets it and
    the caller's ``live(step, ids)`` says it is stale. ``forget`` is told the old steps, so the live
    entries per group are counted exactly (``live_since``: the protected rows of the cap). A sweep
    drops stale entries a bounded number per call (never a pass over every group in one step).
    """

    def __init__(self) -> None:
        self._steps: deque[int] = deque()
        self._ids: deque[np.ndarray] = deque()
        self._live: dict[int, int] = {}  # step -> live entries of its group
        self.live_total = 0
        self.entries = 0
        self._sweep_from: int | None = None  # the group step a sweep resumes at (None: no sweep)

    @classmethod
    def of(cls, steps: np.ndarray, ids: np.ndarray) -> StepGroups:
        """Groups of (N,) live ascending ids at their (N,) steps (a rebuild from per-id state)."""
        out = cls()
        if not steps.size:
            return out
        rel = steps - steps.min()
        if int(rel.max()) < 1 << 16:  # a stable sort of 16-bit keys is a radix sort: linear
            rel = rel.astype(np.uint16)
        order = np.argsort(rel, kind="stable")  # stable: ascending ids within a step
        steps, ids = steps[order], ids[order]
        edges = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1], True])  # group starts, then the end
        for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
            out.push(int(steps[lo]), ids[lo:hi])
        return out

    def push(self, step: int, ids: np.ndarray) -> None:
        """Add a group of ascending live ids at ``step``, later than every group held."""
        if ids.size:
            self._steps.append(step)
            self._ids.append(ids)
            self._live[step] = ids.size
            self.live_total += ids.size
            self.entries += ids.size

    def forget(self, steps: np.ndarray) -> None:
        """One entry at each of (N,) steps went stale (its id's step moved on)."""
        if steps.size:
            uniq, counts = np.unique(steps, return_counts=True)
            for step, n in zip(uniq.tolist(), counts.tolist(), strict=True):
                self._live[step] -= n
            self.live_total -= steps.size

    def live_since(self, step: int) -> int:
        """Live entries in the groups at ``step`` or later."""
        total, i = 0, len(self._steps) - 1
        while i >= 0 and self._steps[i] >= step:
            total += self._live[self._steps[i]]
            i -= 1
        return total

    def take(self, max_step: int, need: int | None, live: LiveFn) -> np.ndarray:
        """Remove and return up to ``need`` (None: all) live ids of the groups at ``max_step`` or earlier,
        oldest group first, ascending within a group."""
        out, got = [], 0
        while self._steps and self._steps[0] <= max_step and (need is None or got < need):
            step, ids = self._steps[0], self._ids[0]
            current = ids[live(step, ids)]
            assert current.size == self._live[step], "bounds: a group's live count drifted"
            k = current.size if need is None else min(current.size, need - got)
            out.append(current[:k])
            got += k
            self.live_total -= k
            if k == current.size:
                self._steps.popleft()
                self._ids.popleft()
                del self._live[step]
                self.entries -= ids.size
            else:
                self._ids[0] = current[k:]
                self._live[step] -= k
                self.entries -= ids.size - (current.size - k)
        return np.concatenate(out) if out else _NO_IDS

    def start_sweep(self) -> None:
        """Begin a sweep at the oldest group (unless one is under way)."""
        if self._sweep_from is None and self._steps:
            self._sweep_from = self._steps[0]

    def sweep(self, budget: int, live: LiveFn) -> None:
        """Drop the stale entries of the next groups of a sweep under way, about ``budget`` entries (at
        least one group) per call; the sweep ends after the newest group, dropping the groups it emptied
        (so the groups held never outnumber the steps with a live entry by more than one pass's worth)."""
        if self._sweep_from is None:
            return
        i = bisect.bisect_left(self._steps, self._sweep_from)  # its group may have been taken since
        done = 0
        while i < len(self._steps) and done < budget:
            step, ids = self._steps[i], self._ids[i]
            kept = ids[live(step, ids)]
            assert kept.size == self._live[step], "bounds: a group's live count drifted"
            self._ids[i] = kept if kept.size else _NO_IDS
            self.entries -= ids.size - kept.size
            done += ids.size
            i += 1
        if i < len(self._steps):
            self._sweep_from = self._steps[i]
            return
        self._sweep_from = None
        groups = list(zip(self._steps, self._ids, strict=True))
        for step, ids in groups:
            if not ids.size:
                del self._live[step]
        self._steps = deque(step for step, ids in groups if ids.size)
        self._ids = deque(ids for ids in self._ids if ids.size)

    def __len__(self) -> int:
        """Groups held."""
        return len(self._steps)

    def nbytes(self) -> int:
        """Memory of the grouped ids (the deques and the per-group counts: ~150 bytes a group)."""
        return sum(a.nbytes for a in self._ids) + 150 * len(self._steps)


def split_state(
    state: dict[str, np.ndarray], owner_of: Callable[[np.ndarray], np.ndarray], world: int
) -> list[dict[str, np.ndarray]]:
    """Split ``state`` into ``world`` states, each id's entries to ``owner_of(ids)``'s part.

    Args:
        state: a table's state (:meth:`TableBounds.state <embedding_store.bounds.TableBounds.state>`,
            or :func:`merge_states` of all ranks' states).
        owner_of: (N,) int64 ids -> (N,) integer owners in ``[0, world)``, e.g. ``lambda ids: ids % 2``.
        world: the number of parts.

    Returns:
        ``world`` states; ``last_step`` in each, ``totals`` in part 0 (zeros elsewhere, so their sum is
        kept by a later merge).

    Example::

        parts = split_state(merge_states(old_rank_states), lambda ids: ids % new_world, new_world)
        mine = TableBounds.from_state(rule, parts[rank])
    """
    if world < 1:
        raise ValueError(f"split_state needs world >= 1, got {world}")
    state = check_state(state)
    owners = {}
    for ids_key in ("row_ids", "candidate_ids"):
        owner = np.asarray(owner_of(state[ids_key]))
        if owner.shape != state[ids_key].shape:
            raise ValueError(f"owner_of returned shape {owner.shape} for {state[ids_key].shape} ids")
        if owner.size and (int(owner.min()) < 0 or int(owner.max()) >= world):
            raise ValueError(
                f"owner_of returned owners in [{int(owner.min())}, {int(owner.max())}], not [0, {world})"
            )
        owners[ids_key] = owner
    parts = []
    for rank in range(world):
        part = {}
        for key in PER_ID_KEYS:
            ids_key = "row_ids" if key.startswith("row") else "candidate_ids"
            part[key] = state[key][owners[ids_key] == rank]
        part["last_step"] = state["last_step"].copy()
        part["totals"] = state["totals"].copy() if rank == 0 else np.zeros(NUM_TOTALS, dtype=np.int64)
        parts.append(part)
    return parts


def merge_states(states: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One state holding the ids of all ``states`` (each id in at most one of them), ``totals`` summed and
    the latest ``last_step`` (ranks in lockstep all hold the same)."""
    if not states:
        raise ValueError("merge_states needs at least one state, got none")
    checked = [check_state(s) for s in states]
    out: dict[str, np.ndarray] = {}
    for ids_key, keys in (("row_ids", PER_ID_KEYS[:2]), ("candidate_ids", PER_ID_KEYS[2:])):
        ids = np.concatenate([s[ids_key] for s in checked])
        order = np.argsort(ids, kind="stable")
        for key in keys:
            out[key] = np.concatenate([s[key] for s in checked])[order]
    out["last_step"] = np.array([max(int(s["last_step"][0]) for s in checked)], dtype=np.int64)
    out["totals"] = np.stack([s["totals"] for s in checked]).sum(axis=0)
    return check_state(out)  # refuses an id held by two parts (not strictly ascending after the merge)
