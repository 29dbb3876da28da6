"""Bounded tables in training: admission, expiry and a row cap (:mod:`embedding_store.bounds`) applied to
every batch's ids on their owner ranks, in tiered and in-memory runs alike.

Key routing (:mod:`recsys.routing`) already brings each unique id of a training batch to its owner; with
bounds the ids travel with their occurrences, and the owner's :class:`BoundedTables` decides, once per
step and table, which ids read their own row and which the table's shared, trainable **default row**,
and which rows leave the model. The owner answers :data:`DEFAULT` for an id that reads the default row,
and the sender puts the default row's slot there (in memory: its id; tiered: the slot its owner gave
the default row's id, which every batch routes once); the rows removed are deleted (tiered: from every tier of the store; in memory: reset to their
initial value with zero optimizer state, which is what a deleted row reads as when it comes back).

The default row of a table is one more row: the id ``default_id`` (the first id past the table's id
space; ``MAX_ID`` for raw 64-bit ids, which then share it). It is initialised, trained, checkpointed and
exported like any row, never counted, expired or capped.

Every decision is made in batch order on the routing stage and depends only on the step numbers and the
ids, so pipelined and sequential runs, tiered and untiered ones, make the same. Rows are removed only
once no batch in flight uses them (``embedding_store.bounds.PROTECT_STEPS``). Evaluation batches read
the tables as they are: an id without a row reads the default row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from embedding_store.bounds import TableBounds
from embedding_store.bounds_rule import BoundsRule
from embedding_store.bounds_state import merge_states, split_state
from embedding_store.config import MAX_ID

__all__ = ["DEFAULT", "BoundedStep", "BoundedTables", "default_id"]

DEFAULT = -1  # an owner's answer for an id that reads its table's default row
RECENT_STEPS = 64  # decisions kept for a checkpoint: more than a pipeline decides ahead of training
AHEAD = "~ahead/"  # checkpoint keys of the steps decided ahead of training
_NO_IDS = np.empty(0, dtype=np.int64)

_TOTALS = ("admitted_total", "expired_total", "capped_total", "default_lookups_total", "lookups_total")


def default_id(rows: int) -> int:
    """The default row's id of a bounded table whose ids lie in ``[0, rows)``: ``rows`` (the table
    grows by that one row), or ``MAX_ID`` for raw 64-bit ids."""
    return min(rows, MAX_ID)


@dataclass(frozen=True, slots=True)
class BoundedStep:
    """One batch's ids on their owner after the decisions.

    Attributes:
        owner_ids: per bounded table held here, the batch's owner ids (the Router's order) with every id
            that reads the default row replaced by :data:`DEFAULT`.
        removed: per bounded table, the (R,) ascending ids whose rows leave the model before the batch.
    """

    owner_ids: dict[str, torch.Tensor]
    removed: dict[str, np.ndarray]


class BoundedTables:
    """The bounds state of the tables one rank owns ids of, and the mapping of a batch's ids.

    Args:
        rules: table name -> its active rule (the bounded tables).
        default_ids: table name -> its default row's id.
        held: the bounded tables this rank owns ids of (it decides for them).
    """

    def __init__(
        self, rules: Mapping[str, BoundsRule], default_ids: Mapping[str, int], held: set[str] | frozenset[str]
    ) -> None:
        self.rules = dict(rules)
        self.default_ids = {name: int(default_ids[name]) for name in self.rules}
        self.tables = {name: TableBounds(rule) for name, rule in self.rules.items() if name in held}
        # step -> table -> (ids of the step with a row, ids removed): the last steps' decisions, which a
        # checkpoint taken while the pipeline has decided ahead of training saves; and those loaded from
        # one, replayed instead of decided again
        self._recent: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self._replay: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self._observers: list[Callable[[int], None]] = []

    def observe(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(step)`` after every step's decision (metrics read the counters then)."""
        self._observers.append(fn)

    def unobserve(self, fn: Callable[[int], None]) -> None:
        """Stop calling ``fn``, given to :meth:`observe` before."""
        self._observers.remove(fn)

    def decide(
        self, step: int, owner_ids: Mapping[str, torch.Tensor], owner_counts: Mapping[str, torch.Tensor]
    ) -> BoundedStep:
        """Decide training step ``step`` for the bounded tables held here.

        Args:
            step: the training step (increasing across calls).
            owner_ids: per table, the (R,) ids routed to this rank (an id may come from several peers).
            owner_counts: per table, the (R,) occurrences of each in its peer's batch.

        Returns:
            the owner ids with every one that reads the default row replaced by :data:`DEFAULT` (the
            sender puts the default row there: the owner of an id need not be the default row's), and
            the rows removed. The default row's own id passes through, never counted.
        """
        mapped: dict[str, torch.Tensor] = dict(owner_ids)
        removed: dict[str, np.ndarray] = {}
        replay = self._replay.pop(step, None)
        record: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, bounds in self.tables.items():
            ids = owner_ids[name].numpy()
            counted = ids != self.default_ids[name]
            uniq, inverse = np.unique(ids[counted], return_inverse=True)
            if replay is not None:  # decided before the checkpoint this run resumed from
                with_row, removed[name] = replay.get(name, (_NO_IDS, _NO_IDS))
                uniq_own = np.isin(uniq, with_row)
            else:
                occ = owner_counts[name].numpy()[counted]
                counts = np.bincount(inverse, weights=occ, minlength=uniq.shape[0]).astype(np.int64)
                decision = bounds.decide(step, uniq, counts)
                uniq_own, removed[name] = decision.own, decision.removed
            own = np.ones(ids.shape[0], dtype=bool)
            own[counted] = uniq_own[inverse]
            mapped[name] = torch.from_numpy(np.where(own, ids, DEFAULT))
            record[name] = (uniq[uniq_own], removed[name])
        self._recent[step] = record
        for old in [s for s in self._recent if s <= step - RECENT_STEPS]:
            del self._recent[old]
        for fn in self._observers:
            fn(step)
        return BoundedStep(mapped, removed)

    def lookup(self, owner_ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Evaluation: the ids with the ones that have no row replaced by :data:`DEFAULT`; no state
        changes."""
        mapped = dict(owner_ids)
        for name, bounds in self.tables.items():
            ids = owner_ids[name].numpy()
            own = bounds.lookup(ids) | (ids == self.default_ids[name])
            mapped[name] = torch.from_numpy(np.where(own, ids, DEFAULT))
        return mapped

    # -- checkpoints and counters ----------------------------------------------------------------------

    def state(self, trained: int | None = None) -> dict[str, np.ndarray]:
        """Every held table's state as flat arrays (``<table>/<key>``), for a checkpoint; with
        ``trained`` (the steps trained), also the decisions of the steps decided ahead of training
        (``~ahead/<step>/<table>/own`` and ``/removed``), which a resume replays instead of deciding them
        again: the state already holds them."""
        out = {f"{name}/{key}": arr for name, b in self.tables.items() for key, arr in b.state().items()}
        if trained is not None:
            if self._recent and trained < min(self._recent):
                raise RuntimeError(
                    f"bounds: steps from {trained} on were decided, but only the last {RECENT_STEPS} are kept"
                )
            for step, record in self._recent.items():
                if step >= trained:
                    for name, (own, gone) in record.items():
                        out[f"{AHEAD}{step}/{name}/own"] = own
                        out[f"{AHEAD}{step}/{name}/removed"] = gone
        return out

    def load(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` saved (tables it lacks start empty)."""
        for name, rule in self.rules.items():
            if name not in self.tables:
                continue
            prefix = f"{name}/"
            part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            self.tables[name] = TableBounds.from_state(rule, part) if part else TableBounds(rule)
        self._replay = _ahead(state)

    def restore(
        self,
        saved: list[Mapping[str, np.ndarray]],
        owns: Callable[[str, np.ndarray], np.ndarray],
        *,
        totals: bool = True,
    ) -> None:
        """Restore from every rank's saved :meth:`state` of a run on ``len(saved)`` ranks: on the same
        number this rank's own (``saved`` holds only it then), on another the per-id state re-partitioned
        by ``owns(table, ids)`` (this rank's ids), exactly for admission and expiry; the running totals
        then go to one rank (``totals``), so that their sum over ranks is kept.
        """
        if len(saved) == 1:
            self.load(saved[0])
            return
        # the steps decided ahead: every rank's decisions, re-partitioned by id like the state
        self._replay = {}
        for one in saved:
            for step, record in _ahead(one).items():
                for name, (own, gone) in record.items():
                    if name not in self.tables:
                        continue
                    have = self._replay.setdefault(step, {}).get(name, (_NO_IDS, _NO_IDS))
                    own = np.union1d(have[0], own)
                    gone = np.union1d(have[1], gone)
                    self._replay[step][name] = (own[owns(name, own)], gone[owns(name, gone)])
        for name, rule in self.rules.items():
            if name not in self.tables:
                continue
            prefix = f"{name}/"
            parts = [{k[len(prefix) :]: v for k, v in one.items() if k.startswith(prefix)} for one in saved]
            parts = [part for part in parts if part]
            if not parts:
                self.tables[name] = TableBounds(rule)
                continue
            merged = merge_states(parts)
            mine = split_state(merged, lambda ids, n=name: np.where(owns(n, ids), 0, 1), 2)[0]
            if not totals:
                mine["totals"] = np.zeros_like(mine["totals"])
            self.tables[name] = TableBounds.from_state(rule, mine)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per held table: rows, candidates and the running totals (admitted, expired, capped, default
        lookups, lookups)."""
        return {
            name: {"rows": b.rows, "candidates": b.candidates} | {k: int(getattr(b, k)) for k in _TOTALS}
            for name, b in self.tables.items()
        }


def _ahead(state: Mapping[str, np.ndarray]) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The steps decided ahead of training that a checkpoint holds: step -> table -> (own, removed)."""
    out: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for key, value in state.items():
        if not key.startswith(AHEAD) or not key.endswith("/own"):
            continue
        step_text, name = key[len(AHEAD) : -len("/own")].split("/", 1)
        gone = state.get(f"{AHEAD}{step_text}/{name}/removed", _NO_IDS)
        out.setdefault(int(step_text), {})[name] = (
            np.asarray(value, dtype=np.int64),
            np.asarray(gone, dtype=np.int64),
        )
    return out
