"""Bounded tables: admission, expiry and a row cap per table, as one deterministic state machine.

Every decision is a function of the step numbers and the ids (with their occurrence counts) of the steps
so far — never of wall-clock time, random draws or threads — so a tiered run, where the rules run on
each id's owner rank, and the in-memory reference decide the same, bit for bit. One
:class:`TableBounds` per table and owner; :meth:`TableBounds.decide` once per training step.

The rules (:class:`BoundsRule`; ``A = admit_after``, ``W = admit_window_steps``,
``E = expire_after_steps``, ``C = max_rows``). An id either has a *row* (it reads and trains its own) or
not (it reads the table's shared default row); an id without a row may be a *candidate*, with a count
of its occurrences and the step of its last occurrence. Steps are increasing integers, gaps allowed.
Step ``s``, with the step's ids and their occurrence counts, runs in this order:

1. Expiry (``E > 0``): every id with a row whose last use ``u`` satisfies ``s - u > E`` loses it
   (*expired*); it starts over as a candidate with count 0.
2. Counting: for each id of the step without a row: if its last occurrence is more than ``W`` steps
   before ``s`` its count restarts at 0; count += its occurrences; last occurrence = ``s``. It
   *qualifies* when count >= ``A`` (``A = 1``: every id qualifies at once, no admission).
3. Cap (``C > 0``): a row is *protected* when its id occurs in this step or its last use ``u`` satisfies
   ``s - u < PROTECT_STEPS`` (the rows of batches a pipeline holds in flight are never removed under
   them). With ``K`` the protected rows and ``N`` the qualifying ids in ascending order, only the first
   ``max(C - K, 0)`` of ``N`` are admitted when ``|N|`` is larger; the rest stay candidates and keep
   their counts. Then, while more than ``C`` ids have a row, the unprotected row used least recently
   (ties: the smaller id) is removed (*capped*); a capped id, like an expired one, starts over as a
   candidate with count 0. The cap is hard: with at most ``C`` rows before the step, ``K <= C`` and
   the step ends with at most ``C``. A state loaded with more (from another rule or partition) admits
   nothing while ``K >= C`` and falls to ``C`` as its rows' protection lapses.
4. Every qualifying id admitted in 3 (all of them without a cap) gets a row (*admitted*: the caller
   inserts it fresh); the last use of every id of the step with a row, old or new, is ``s``.

An id expired in step ``s`` and qualifying again in it is both removed and admitted: its old row goes
(with its optimizer state) and a fresh one is inserted. ``E`` must be 0 or >= ``PROTECT_STEPS`` so that
expiry never removes a row in flight either.

Memory: one record per id with a row or a candidate. A candidate whose last occurrence is ``W`` or more
steps before the last decided step can never count again (any later step restarts it), so it is purged
at the end of each step: the candidates held after step ``s`` are at most the distinct ids without a
row in steps ``(s - W, s]``. The purge changes no decision. Per-step work is proportional to the step's
ids plus the ids it expires, caps or purges: the expiry and cap order and the purge order are kept as
ids grouped by step (lazily: an entry goes stale when its id's step moves on, and the groups are
swept, a bounded number of entries per step, once stale entries outnumber live ones), never found by
scanning the table.

Resharding: the per-id state (counts, last occurrence, last use) moves with its id
(:func:`~embedding_store.bounds_state.split_state`, :func:`~embedding_store.bounds_state.merge_states`),
so admission and expiry continue exactly on another number of ranks. The cap is per owner: it ranks an
owner's rows against each other, so after resharding it removes other rows than the old partition
would have (an owner above ``C`` is brought under it by its next step's cap).

Example::

    bounds = TableBounds(BoundsRule(admit_after=2, expire_after_steps=10_000, max_rows=1 << 24))
    ids, counts = np.unique(batch_ids, return_counts=True)   # this owner's ids of the step's batch
    d = bounds.decide(step, ids, counts)
    # before the step runs: delete d.removed's rows from every tier (with their optimizer state) and
    # insert d.admitted's rows fresh; ids[d.own] read their own rows, the others the default row.

Decisions depend on ids only, never on weights, so a pipeline may decide a step before the earlier
steps have trained: up to ``PROTECT_STEPS - 1`` steps ahead of the oldest batch still in flight, whose
rows are then still protected. A :class:`TableBounds` is not thread-safe: one caller drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding_store.bounds_rule import DEFAULT_ADMIT_WINDOW_STEPS, PROTECT_STEPS, BoundsRule
from embedding_store.bounds_state import COUNT_MAX, NUM_TOTALS, StepGroups, check_state
from embedding_store.log_index import HashSeqIndex

__all__ = ["DEFAULT_ADMIT_WINDOW_STEPS", "PROTECT_STEPS", "BoundsRule", "Decision", "TableBounds"]

_ROW = -1  # a record's count while its id has a row
_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one step of :meth:`TableBounds.decide` decided.

    Attributes:
        own: (N,) bool per id of the step: True reads its own row this step, False the default row.
        admitted: (A,) int64 ascending: ids that got a row this step; the caller inserts them fresh.
        removed: (R,) int64 ascending: ids whose rows (and optimizer state) are deleted before the step
            runs, expired and capped together; an expired id may be admitted again in the same step.
        expired: how many of ``removed`` expired.
        capped: how many of ``removed`` the cap removed.
        default_lookups: occurrences of the step's ids that read the default row.
    """

    own: np.ndarray
    admitted: np.ndarray
    removed: np.ndarray
    expired: int
    capped: int
    default_lookups: int


class TableBounds:
    """The bounds state of one table on its owner, and the rules that move it (module docstring).

    Args:
        rule: the table's rule.

    Example::

        bounds = TableBounds(BoundsRule(admit_after=2))
        d = bounds.decide(0, np.array([3, 7]), np.array([2, 1]))   # d.own == [True, False]
        bounds.lookup(np.array([3, 7, 9]))                         # [True, False, False]
    """

    _SWEEP_MIN = 1 << 16  # stale entries tolerated beside the live ones before a sweep starts
    _SWEEP_BATCH = 1024  # entries swept per step beyond twice the step's ids
    _purge = True  # tests turn it off to show that the purge changes no decision

    def __init__(self, rule: BoundsRule) -> None:
        self.rule = rule
        self._map = HashSeqIndex()  # id -> record
        self._cnt = np.zeros(1024, dtype=np.int32)  # (records,) count of a candidate, _ROW for a row
        self._step = np.zeros(1024, dtype=np.int64)  # (records,) last occurrence / last use
        self._top = 0  # records handed out so far (the high-water mark)
        self._free = np.empty(1024, dtype=np.int64)  # a stack of released records
        self._nfree = 0
        self._row_groups = StepGroups()  # rows by last use (kept while expiry or a cap is on)
        self._cand_groups = StepGroups()  # candidates by last occurrence
        self._track_rows = rule.expire_after_steps > 0 or rule.max_rows > 0
        self._last_step = -1
        self._rows = 0
        self._candidates = 0
        self._totals = np.zeros(NUM_TOTALS, dtype=np.int64)

    # ------------------------------------------------------------------ counters
    @property
    def rows(self) -> int:
        """Ids with a row."""
        return self._rows

    @property
    def candidates(self) -> int:
        """Ids held as candidates (a count and a last occurrence)."""
        return self._candidates

    @property
    def last_step(self) -> int:
        """The last step decided (-1: none)."""
        return self._last_step

    @property
    def admitted_total(self) -> int:
        """Rows created, over every step."""
        return int(self._totals[0])

    @property
    def expired_total(self) -> int:
        """Rows expired, over every step."""
        return int(self._totals[1])

    @property
    def capped_total(self) -> int:
        """Rows removed by the cap, over every step."""
        return int(self._totals[2])

    @property
    def default_lookups_total(self) -> int:
        """Lookups that read the default row, over every step."""
        return int(self._totals[3])

    @property
    def lookups_total(self) -> int:
        """Lookups, over every step."""
        return int(self._totals[4])

    def nbytes(self) -> int:
        """Memory held by the state: the id map, the per-record arrays and the step groups."""
        arrays = self._map.nbytes() + self._cnt.nbytes + self._step.nbytes + self._free.nbytes
        return int(arrays + self._row_groups.nbytes() + self._cand_groups.nbytes())

    # ------------------------------------------------------------------ reads
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """(N,) int64 ids >= 0, duplicates allowed -> (N,) bool: which have a row now (no state change),
        for evaluation and serving: the others read the default row."""
        ids = _ids_arg(ids, "lookup")
        rec = self._map.lookup(ids)
        own = rec >= 0
        own[own] = self._cnt[rec[own]] == _ROW
        return own

    def _row_live(self, step: int, ids: np.ndarray) -> np.ndarray:
        return self._live(step, ids, rows=True)

    def _cand_live(self, step: int, ids: np.ndarray) -> np.ndarray:
        return self._live(step, ids, rows=False)

    def _live(self, step: int, ids: np.ndarray, *, rows: bool) -> np.ndarray:
        rec = self._map.lookup(ids)
        ok = rec >= 0
        r = rec[ok]
        is_row = self._cnt[r] == _ROW
        ok[ok] = (is_row if rows else ~is_row) & (self._step[r] == step)
        return ok

    # ------------------------------------------------------------------ records
    def _alloc(self, n: int) -> np.ndarray:
        """``n`` free records: released ones first, then new ones (the arrays double when full)."""
        reused = min(n, self._nfree)
        self._nfree -= reused
        fresh = n - reused
        if self._top + fresh > self._cnt.size:
            size = max(2 * self._cnt.size, self._top + fresh)
            self._cnt, self._step = _grown(self._cnt, size), _grown(self._step, size)
        out = np.concatenate(
            [self._free[self._nfree : self._nfree + reused], np.arange(self._top, self._top + fresh)]
        )
        self._top += fresh
        return out

    def _drop(self, ids: np.ndarray) -> None:
        """Forget ``ids`` entirely (their records go back to the free stack)."""
        if not ids.size:
            return
        recs = self._map.remove(ids)
        assert bool(np.all(recs >= 0)), "bounds: dropping an id without a record"
        if self._nfree + recs.size > self._free.size:
            self._free = _grown(self._free, max(2 * self._free.size, self._nfree + recs.size))
        self._free[self._nfree : self._nfree + recs.size] = recs
        self._nfree += recs.size

    # ------------------------------------------------------------------ the step
    def decide(self, step: int, ids: np.ndarray, counts: np.ndarray) -> Decision:
        """Apply the rules for one training step (module docstring) and return what they decided.

        Args:
            step: the step number, greater than every step decided before (gaps allowed).
            ids: (N,) int64 ascending unique ids of the step that this owner holds.
            counts: (N,) int64 >= 1: each id's occurrences in the step's (global) batch.
        """
        s, ids, counts = self._step_args(step, ids, counts)
        rule = self.rule
        expired = _NO_IDS
        if rule.expire_after_steps:  # 1. expiry
            expired = np.sort(self._row_groups.take(s - rule.expire_after_steps - 1, None, self._row_live))
            self._drop(expired)
            self._rows -= expired.size

        rec = self._map.lookup(ids)  # 2. counting
        known = rec >= 0
        cnt = np.zeros(ids.size, dtype=np.int64)
        cnt[known] = self._cnt[rec[known]]
        has_row = cnt == _ROW
        was_cand = known & ~has_row
        recent = np.zeros(ids.size, dtype=bool)
        recent[was_cand] = s - self._step[rec[was_cand]] <= rule.admit_window_steps
        new_cnt = np.minimum(np.where(recent, cnt, 0) + np.minimum(counts, COUNT_MAX), COUNT_MAX)
        qualifies = ~has_row & (new_cnt >= rule.admit_after)

        used = rec[has_row]  # 4. (early for old rows: then they are stale in the LRU groups of 3.)
        self._cand_groups.forget(self._step[rec[was_cand]])
        if self._track_rows:
            self._row_groups.forget(self._step[used])
        self._step[used] = s

        admit, capped = qualifies, _NO_IDS  # 3. cap
        if rule.max_rows:
            room = max(rule.max_rows - self._row_groups.live_since(s - PROTECT_STEPS + 1) - used.size, 0)
            which = np.flatnonzero(qualifies)
            if which.size > room:
                admit = np.zeros(ids.size, dtype=bool)
                admit[which[:room]] = True
            excess = self._rows + int(np.count_nonzero(admit)) - rule.max_rows
            if excess > 0:
                capped = np.sort(self._row_groups.take(s - PROTECT_STEPS, excess, self._row_live))
                self._drop(capped)
                self._rows -= capped.size

        new = ~known  # 4. the step's ids take their new state
        rec[new] = self._alloc(int(np.count_nonzero(new)))
        self._map.upsert(ids[new], rec[new])
        own = has_row | admit
        stays = ~own
        self._cnt[rec[admit]] = _ROW
        self._cnt[rec[stays]] = new_cnt[stays]
        self._step[rec[~has_row]] = s
        if self._track_rows:
            self._row_groups.push(s, ids[own])
        self._cand_groups.push(s, ids[stays])
        admitted = ids[admit]
        self._rows += admitted.size
        self._candidates += int(np.count_nonzero(stays)) - int(np.count_nonzero(was_cand))

        if self._purge:  # candidates that can never count again (module docstring: memory)
            purged = self._cand_groups.take(s - rule.admit_window_steps, None, self._cand_live)
            self._drop(purged)
            self._candidates -= purged.size
        for groups, live in ((self._row_groups, self._row_live), (self._cand_groups, self._cand_live)):
            if groups.entries > 2 * groups.live_total + self._SWEEP_MIN:
                groups.start_sweep()
            groups.sweep(2 * ids.size + self._SWEEP_BATCH, live)  # > the step makes stale: entries shrink

        default_lookups = int(counts[stays].sum())
        self._totals += (admitted.size, expired.size, capped.size, default_lookups, int(counts.sum()))
        self._last_step = s
        removed = np.union1d(expired, capped) if capped.size else expired
        return Decision(own, admitted, removed, expired.size, capped.size, default_lookups)

    def _step_args(
        self, step: int, ids: np.ndarray, counts: np.ndarray
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """decide's arguments checked: a later step, ascending unique ids >= 0, counts >= 1 per id."""
        s = int(step)
        if s <= self._last_step:
            raise ValueError(f"decide's step must be greater than the last step {self._last_step}, got {s}")
        ids = _ids_arg(ids, "decide")
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if counts.shape != ids.shape:
            raise ValueError(f"decide's counts have shape {counts.shape} for ids of shape {ids.shape}")
        if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise ValueError("decide's ids must be strictly ascending (the step's unique ids, sorted)")
        if counts.size and int(counts.min()) < 1:
            raise ValueError(f"decide's counts must be >= 1, got {int(counts.min())}")
        return s, ids, counts

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, np.ndarray]:
        """The per-id state and counters as plain int64 arrays (:mod:`embedding_store.bounds_state`)."""
        ids, recs = self._map.items()
        order = np.argsort(ids)
        ids, recs = ids[order], recs[order]
        cnt, steps = self._cnt[recs].astype(np.int64), self._step[recs]
        row = cnt == _ROW
        return {
            "row_ids": ids[row],
            "row_last_use": steps[row],
            "candidate_ids": ids[~row],
            "candidate_count": cnt[~row],
            "candidate_last_seen": steps[~row],
            "last_step": np.array([self._last_step], dtype=np.int64),
            "totals": self._totals.copy(),
        }

    @classmethod
    def from_state(cls, rule: BoundsRule, state: dict[str, np.ndarray]) -> TableBounds:
        """A table's bounds rebuilt from :meth:`state` (or a part of :func:`split_state`): later decisions
        equal those of the table that wrote it; the step groups are rebuilt from the per-id steps."""
        st = check_state(state)
        out = cls(rule)
        row_ids, cand_ids = st["row_ids"], st["candidate_ids"]
        n_rows, n = row_ids.size, row_ids.size + cand_ids.size
        out._map = HashSeqIndex(n)
        recs = out._alloc(n)
        out._map.upsert(np.concatenate([row_ids, cand_ids]), recs)
        out._cnt[recs] = np.concatenate([np.full(n_rows, _ROW), st["candidate_count"]])
        out._step[recs] = np.concatenate([st["row_last_use"], st["candidate_last_seen"]])
        if out._track_rows:
            out._row_groups = StepGroups.of(st["row_last_use"], row_ids)
        out._cand_groups = StepGroups.of(st["candidate_last_seen"], cand_ids)
        out._rows, out._candidates = n_rows, cand_ids.size
        out._last_step = int(st["last_step"][0])
        out._totals = st["totals"].copy()
        return out


def _grown(a: np.ndarray, size: int) -> np.ndarray:
    """``a``'s values in a new array of ``size`` (the rest uninitialised)."""
    out = np.empty(size, dtype=a.dtype)
    out[: a.size] = a
    return out


def _ids_arg(ids: np.ndarray, name: str) -> np.ndarray:
    """Contiguous 1-D int64 ids, refused when negative (the id map reserves -1)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"{name}'s ids must be 1-D, got shape {ids.shape}")
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"{name}'s ids must be >= 0, got {int(ids.min())}")
    return ids
