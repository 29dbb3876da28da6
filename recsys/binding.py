"""How a run's embedding tables are bound to training: one protocol over one owner-routing part.

A :class:`TableBinding` is what the trainer, the loop, evaluation and the checkpoint parts talk to,
whichever tables the run holds: :class:`~recsys.tiered.TieredTables` (rows in the three-tier store) or
:class:`~recsys.bounded_memory.InMemoryTables` (the model's own tables, bounded or not). Both route a
batch's ids to their owners through :class:`OwnerRouting` — the job's ownership rule, the key-routing
all-to-alls on their own process groups, and the bounded tables' decisions — so the rule is written once.

The owner of each id publishes what training does to its rows as a stream of :class:`RowChange` records
(:class:`RowChanges`): per training batch and table held, the rows deleted before the batch (a bounded
table's expired or capped rows) and the rows the batch may write. A record is emitted once the batch's
optimizer step is done (:meth:`OwnerRouting.finish`, called by the binding's ``release``), in batch
order, so a reader that copies the rows it names then sees them as training left them. The stream covers
the routed tables: tiered ones and bounded in-memory ones. Plain in-memory tables are looked up by
TorchRec directly, without owner routing, and emit nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from embedding_store.bounds_rule import BoundsRule
from recsys.bounded import DEFAULT, BoundedTables
from recsys.distributed import collective_timeout
from recsys.routing import DistExchange, Exchange, Ownership, RoutedIds, Router

if TYPE_CHECKING:
    from pipelines import StagedPipeline
    from recsys.capacities import Capacities
    from recsys.data.batch import Batch
    from recsys.pipeline_config import PipelineSection
    from recsys.tier_metrics import TierMetrics

__all__ = ["EVAL", "TRAIN", "OwnerRouting", "RowChange", "RowChanges", "TableBinding"]

TRAIN, EVAL = "train", "eval"  # the two channels: each has its own process groups
_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class RowChange:
    """What one training batch did to the rows of one table on their owner.

    Attributes:
        batch_id: the training step.
        table: the table's name (``t_<feature>``).
        deleted: (D,) ascending ids whose rows left the model before the batch (a bounded table's
            expired and capped rows); applied before ``put``: an id in both was removed, then read again
            from its initial value.
        put: (P,) ascending unique ids whose rows the batch read and its optimizer step may have written
            (a bounded table's default row is among them on its owner; ids that read the default row are
            not).
    """

    batch_id: int
    table: str
    deleted: np.ndarray
    put: np.ndarray


class RowChanges:
    """The owner's stream of row changes: readers subscribe; nothing is kept while nobody listens."""

    def __init__(self) -> None:
        self._readers: list[Callable[[RowChange], None]] = []

    def subscribe(self, fn: Callable[[RowChange], None]) -> Callable[[], None]:
        """Call ``fn(change)`` for every change from now on, in batch order; returns the unsubscribe."""
        self._readers.append(fn)
        return lambda: self._readers.remove(fn)

    @property
    def listened(self) -> bool:
        """Whether any reader is subscribed (the routing part skips the work otherwise)."""
        return bool(self._readers)

    def emit(self, change: RowChange) -> None:
        for fn in list(self._readers):
            fn(change)


class OwnerRouting:
    """One rank's routing of the routed tables: who owns which id, the key-routing exchanges, the bounded
    tables' decisions and the row-change stream.

    Collective to construct: the ranks agree on the ownership rule (on the default group), then, on more
    than one rank, create the process groups of the training stages and of evaluation, in that order.

    Args:
        shards: the tables of ``names`` this rank holds a shard of.
        names: the routed tables, in the same order on every rank.
        row_wise: the tables are sharded row-wise (ids hashed to owners on more than one rank).
        bounds: the bounded tables' rules and default row ids (``({}, {})``: none).
        train_stages: how many pipeline stages exchange a training batch's ids, each on its own process
            group and thread (tiered: 2, routing and fill; in memory: 1).
    """

    def __init__(
        self,
        shards: Collection[str],
        *,
        names: Sequence[str],
        row_wise: bool,
        bounds: tuple[Mapping[str, BoundsRule], Mapping[str, int]] = ({}, {}),
        train_stages: int = 1,
    ) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.names = list(names)
        self.world = DistExchange()  # the default group, for agreements outside the batch stages
        self.ownership = Ownership.agree(
            shards, world_size=self.world_size, row_wise=row_wise, exchange=self.world
        )
        # the tables this rank receives ids of: every one when hashed, else the ones it holds
        held = set(self.names) if self.ownership.hashed else {n for n in self.names if n in shards}
        self.router = Router(self.ownership, names=self.names, held=held)
        rules, default_ids = bounds
        self.bounded = BoundedTables(rules, default_ids, {n for n in held if n in rules}) if rules else None
        # the default rows this rank owns: every batch may train them (the row-change stream puts them)
        self._own_defaults = {
            name: d
            for name, d in (self.bounded.default_ids.items() if self.bounded is not None else ())
            if name in held and self.owns(name, np.array([d], dtype=np.int64))[0]
        }
        self.changes = RowChanges()
        self._pending: dict[int, list[RowChange]] = {}
        self._lock = threading.Lock()
        # One rank routes without collectives: its exchanges are never called.
        world: Exchange = self.world
        self._exchanges: dict[str, tuple[Exchange, ...]] = {
            TRAIN: (world,) * train_stages,
            EVAL: (world,),
        }
        if self.world_size > 1:
            # Own groups: collectives of key routing never interleave with TorchRec's; each training stage
            # runs on its own thread, and evaluation batches are remapped on the main thread while those
            # threads may be busy with later training batches.
            groups = [
                DistExchange(dist.new_group(backend="gloo", timeout=collective_timeout()))
                for _ in range(train_stages + 1)
            ]
            self._exchanges = {TRAIN: tuple(groups[:train_stages]), EVAL: (groups[-1],)}

    def exchange(self, channel: str, *, last: bool = False) -> Exchange:
        """The exchange of ``channel``'s first collective stage, or of its ``last`` (the same one when the
        channel has one stage)."""
        stages = self._exchanges[channel]
        return stages[-1] if last else stages[0]

    def owns(self, name: str, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids of table ``name`` this rank owns."""
        return self.ownership.owns(name, ids, self.rank)

    def route(
        self, batch_id: int, ids: Mapping[str, torch.Tensor], *, channel: str
    ) -> tuple[RoutedIds, dict[str, np.ndarray]]:
        """Send each table's unique ids of the batch to their owners (collective on ``channel``'s first
        stage); with bounded tables, decide a training batch (in batch order) or look an evaluation batch
        up. Returns the routing, whose ``owner_ids`` are decided (:data:`~recsys.bounded.DEFAULT` where an
        id reads the default row), and per bounded table the rows removed before the batch (empty for an
        evaluation batch)."""
        train = channel == TRAIN
        bounded = self.bounded
        routed = self.router.route(ids, self.exchange(channel), counts=bounded is not None and train)
        removed: dict[str, np.ndarray] = {}
        if bounded is not None and train:
            assert routed.owner_counts is not None
            decided = bounded.decide(batch_id, routed.owner_ids, routed.owner_counts)
            routed.owner_ids, removed = decided.owner_ids, decided.removed
        elif bounded is not None:
            routed.owner_ids = bounded.lookup(routed.owner_ids)
            removed = {name: _NO_IDS for name in bounded.tables}
        if train and self.changes.listened:
            self._record(batch_id, routed.owner_ids, removed)
        return routed, removed

    def return_slots(
        self, routed: RoutedIds, slots: Mapping[str, torch.Tensor], *, channel: str
    ) -> dict[str, torch.Tensor]:
        """The owners' answers back to the ranks whose ids they are (collective on ``channel``'s last
        stage): per table, one for each value of this rank's batch."""
        return self.router.return_slots(routed, slots, self.exchange(channel, last=True))

    def _record(
        self, batch_id: int, owner_ids: Mapping[str, torch.Tensor], removed: Mapping[str, np.ndarray]
    ) -> None:
        changes = []
        for name in self.names:
            if name not in owner_ids:
                continue
            ids = owner_ids[name].numpy()
            ids = ids[ids != DEFAULT]
            if name in self._own_defaults:
                ids = np.append(ids, self._own_defaults[name])
            # the removed ids come ascending from the bounds' decision
            changes.append(RowChange(batch_id, name, removed.get(name, _NO_IDS), np.unique(ids)))
        with self._lock:
            self._pending[batch_id] = changes

    def finish(self, batch_id: int) -> None:
        """The batch's optimizer step is done: emit its row changes (training batches, when listened)."""
        with self._lock:
            changes = self._pending.pop(batch_id, None)
        for change in changes or ():
            self.changes.emit(change)

    def forget(self) -> None:
        """Drop the changes of batches routed but not finished (the tables close, or a run failed)."""
        with self._lock:
            self._pending.clear()


class TableBinding(Protocol):
    """What a run's tables give the trainer, the loop, evaluation and the checkpoint parts.

    Attributes:
        store_tables: the tables whose rows live in the tiered store (sorted; empty in memory).
        bounded: the bounded tables' state this rank decides for (None: no table is bounded).
        changes: the owner's row-change stream of the routed tables.
    """

    @property
    def store_tables(self) -> list[str]: ...

    @property
    def bounded(self) -> BoundedTables | None: ...

    @property
    def changes(self) -> RowChanges: ...

    def feed(
        self,
        source: Iterable[tuple[int, Batch]],
        *,
        section: PipelineSection,
        device: torch.device,
        rank: int,
    ) -> tuple[Iterator[Batch], StagedPipeline]:
        """The training batches over ``(step, batch)`` items, remapped for the tables, and the pipeline
        that yields them (for its statistics and trace)."""
        ...

    def remap(self, batch_id: int, batch: Batch, *, channel: str = TRAIN) -> Batch:
        """Every stage of one batch in sequence: the batch as TorchRec should see it."""
        ...

    def release(self, batch_id: int) -> None:
        """The batch's backward and optimizer step are done (tiered: unpin its rows; both: emit its
        row changes)."""
        ...

    def owns(self, name: str, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids of table ``name`` this rank owns."""
        ...

    def slot_ids(self, name: str, slots: np.ndarray) -> np.ndarray:
        """(N,) ids held by the local slots of store table ``name`` that the batch in training read."""
        ...

    def open(self, *, snapshot: Path | None = None, reshard_from: list[Path] | None = None) -> None:
        """Make the tables ready to train: fresh, or (tiered) from a checkpoint's snapshot(s)."""
        ...

    def close(self, *, flush: bool = True) -> None:
        """Give back what the tables hold outside the model (idempotent)."""
        ...

    def tier_metrics(self, capacities: Capacities, world_size: int) -> TierMetrics | None:
        """The tiers' hit rates and sizes (None: no table is tiered)."""
        ...

    def checkpoint_parts(self) -> dict[str, Any]:
        """The checkpoint parts of the tables beyond the model's state (``store``, ``bounds``), in
        meta.json's order."""
        ...

    def digest_rows(self, checkpoint: Path | None, rank: int) -> list[tuple[str, Any]]:
        """The rows of the store tables this rank holds, for the model digest: ``(table, block)`` pairs
        read live, or from ``checkpoint``'s snapshot of this rank."""
        ...
