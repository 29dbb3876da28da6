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
        for name, bounds in self.tables.items():
            ids = owner_ids[name].numpy()
            counted = ids != self.default_ids[name]
            uniq, inverse = np.unique(ids[counted], return_inverse=True)
            occ = owner_counts[name].numpy()[counted]
            counts = np.bincount(inverse, weights=occ, minlength=uniq.shape[0]).astype(np.int64)
            decision = bounds.decide(step, uniq, counts)
            own = np.ones(ids.shape[0], dtype=bool)
            own[counted] = decision.own[inverse]
            mapped[name] = torch.from_numpy(np.where(own, ids, DEFAULT))
            removed[name] = decision.removed
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

    def state(self) -> dict[str, np.ndarray]:
        """Every held table's state as flat arrays (``<table>/<key>``), for a checkpoint."""
        return {f"{name}/{key}": arr for name, b in self.tables.items() for key, arr in b.state().items()}

    def load(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` saved (tables it lacks start empty)."""
        for name, rule in self.rules.items():
            if name not in self.tables:
                continue
            prefix = f"{name}/"
            part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            self.tables[name] = TableBounds.from_state(rule, part) if part else TableBounds(rule)

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
        for name, rule in self.rules.items():
            if name not in self.tables:
                continue
            prefix = f"{name}/"
            parts = [{k[len(prefix) :]: v for k, v in s.items() if k.startswith(prefix)} for s in saved]
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
