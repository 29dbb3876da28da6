"""Key routing: which rank owns which id of each tiered table, and the all-to-alls that send the ids of
a batch to their owners and the owners' slots back.

Ownership (:class:`Ownership`, the same rule on every rank): table-wise, every id of a table goes to the
one rank holding the table; row-wise with more than one rank, id ``x`` goes to ``owner_of_ids(x, W)``, a
64-bit mixing hash modulo the world size, so neighbouring popular ids spread over ranks; one rank owns
everything.

One batch on every rank (:class:`Router`):

1. :meth:`Router.route` deduplicates each table's ids (``torch.unique``, keeping the inverse), groups
   the unique ids by owner (a stable sort: ascending within one owner), and sends the counts (W, T), then
   the ids, peer-major and table-minor; each owner receives a table's ids from every peer in peer order
   (:attr:`RoutedIds.owner_ids`);
2. the owner gives every id it received a slot (the store's ``make_resident``), in the same order;
3. :meth:`Router.return_slots` sends the slots back the way the ids came, puts them in the order of the
   rank's unique ids and maps the batch's values through the inverse.

With one rank both all-to-alls are skipped. The collectives go through an :class:`Exchange`:
:class:`DistExchange` on a torch.distributed process group in training; tests simulate ranks in one
process. ``recsys.tune.replay`` replays the same rule without any collective.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.data.batch import Batch
from recsys.errors import UserError
from recsys.store_config import StoreSection

__all__ = [
    "DistExchange",
    "Exchange",
    "Ownership",
    "RoutedIds",
    "Router",
    "owner_of_ids",
    "tiered_features",
    "values_by_feature",
    "with_values",
]

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # as int64, for wrapping torch multiplies
_M2 = 0x94D049BB133111EB - (1 << 64)

T = TypeVar("T")


def owner_of_ids(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """Row-wise owner rank of each id: a mixing hash, so popular neighbouring ids spread over ranks.

    Args:
        ids: (n,) int64 ids >= 0.
        world_size: ranks of the job.

    Returns:
        (n,) int64 ranks in ``[0, world_size)``.
    """
    x = ids.clone()
    x ^= (x >> 31) & ((1 << 33) - 1)
    x *= _M1
    x ^= (x >> 29) & ((1 << 35) - 1)
    x *= _M2
    x ^= (x >> 32) & ((1 << 32) - 1)
    return torch.remainder(x, world_size)


def values_by_feature(kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """Each feature's values of a KeyedJaggedTensor, (n_f,) views in key order."""
    return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()), strict=True))


def with_values(batch: Batch, replaced: Mapping[str, torch.Tensor]) -> Batch:
    """``batch`` with the values of the features in ``replaced`` swapped for the given (n_f,) tensors
    (same lengths; the other features and the dense part unchanged)."""
    kjt = batch.sparse
    values = values_by_feature(kjt) | dict(replaced)
    sparse = KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat([values[k] for k in kjt.keys()]),
        lengths=kjt.lengths(),
        stride=kjt.stride(),
    )
    return Batch(dense=batch.dense, sparse=sparse, labels=batch.labels)


def tiered_features(store: StoreSection, features: Sequence[str]) -> list[str]:
    """The sparse features whose tables ``store`` tiers, in feature order (none when it tiers nothing).

    Raises:
        UserError: ``store.tables`` names a feature that does not exist.
    """
    if not store.tiered:
        return []
    unknown = sorted(set(store.tables) - set(features))
    if unknown:
        raise UserError(f"store.tables names unknown features {unknown}; features are {list(features)}")
    chosen = set(store.tables) or set(features)
    return [f for f in features if f in chosen]


class Exchange(Protocol):
    """The collectives of key routing among the ranks of one group, called by all of them in the same order."""

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send ``send_splits[d]`` values of the 1-D ``send`` (in rank order) to each rank ``d``; returns
        the ``recv_splits[s]`` values each rank ``s`` sent this one, concatenated in rank order."""
        ...

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's picklable ``obj``, in rank order."""
        ...


class DistExchange:
    """:class:`Exchange` on a torch.distributed process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """See :meth:`Exchange.all_to_all`."""
        recv = torch.empty(sum(recv_splits), dtype=send.dtype)  # (sum(recv_splits),)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        return recv

    def all_gather(self, obj: T) -> list[T]:
        """See :meth:`Exchange.all_gather`."""
        out: list[T] = [obj] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass(kw_only=True, frozen=True, slots=True)
class Ownership:
    """Which rank owns which id of each tiered table (the same on every rank).

    Attributes:
        world_size: ranks of the job.
        row_wise: whether the tables are sharded row-wise (ids hashed to owners when more than one rank).
        table_owner: table name -> the rank holding it, for table-wise routing (and one rank).
    """

    world_size: int
    row_wise: bool
    table_owner: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def agree(
        cls, held: Collection[str], *, world_size: int, row_wise: bool, exchange: Exchange
    ) -> Ownership:
        """Collective (unless one rank): every rank names the tables it holds (``held``), and every table
        goes to a rank that holds it (the last, where several do: row-wise, where no table-wise owner is
        used)."""
        names = sorted(held)
        owners = [names] if world_size == 1 else exchange.all_gather(names)
        table_owner = {name: r for r, tables in enumerate(owners) for name in tables}
        return cls(world_size=world_size, row_wise=row_wise, table_owner=table_owner)

    @property
    def hashed(self) -> bool:
        """Whether ids go to their owners by hash (row-wise on more than one rank)."""
        return self.row_wise and self.world_size > 1

    def owners(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 ids of table ``name`` -> (n,) int64 ranks that own them."""
        if self.hashed:
            return owner_of_ids(ids, self.world_size)
        return torch.full_like(ids, self.table_owner[name])

    def owns(self, name: str, ids: np.ndarray, rank: int) -> np.ndarray:
        """(n,) bool: which of the (n,) int64 ids of table ``name`` ``rank`` owns (a re-partition's keep)."""
        return (self.owners(name, torch.from_numpy(ids)) == rank).numpy()

    def send_order(
        self, name: str, uniq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Sorted unique ids (U,) of table ``name`` grouped by owner, ascending within each owner.

        Returns:
            the (U,) ids in that order; the (U,) permutation that took ``uniq`` there (None when one rank
            owns them all: already in order); the (W,) int64 number of ids for each owner.
        """
        if self.hashed:
            dest = owner_of_ids(uniq, self.world_size)
            order = torch.argsort(dest, stable=True)
            return uniq[order], order, torch.bincount(dest, minlength=self.world_size)
        counts = torch.zeros(self.world_size, dtype=torch.int64)
        counts[self.table_owner[name]] = uniq.shape[0]
        return uniq, None, counts

    def split(self, name: str, uniq: torch.Tensor) -> list[torch.Tensor]:
        """Sorted unique ids (U,) of table ``name`` -> the ids each rank owns, ascending, in rank order."""
        ordered, _, counts = self.send_order(name, uniq)
        return list(torch.split(ordered, counts.tolist()))


@dataclass
class RoutedIds:
    """One rank's routing of one batch, between the id and the slot all-to-all.

    Attributes:
        inverse: per table, (n_t,) the index of each value of the batch among its unique ids.
        perm: per table, the (U_t,) permutation that grouped the unique ids by owner (None: one owner,
            the sorted order is the send order).
        send_counts: (W, T) ids sent to each peer, per table.
        recv_counts: (W, T) ids received from each peer, per table.
        owner_ids: per table this rank holds, the (R_t,) ids it owns of the batch: every peer's (unique,
            ascending), in peer order.
        owner_counts: with ``route(..., counts=True)``: per table held, the (R_t,) occurrences of each of
            ``owner_ids[t]`` in its peer's batch (an id several peers sent appears once per peer); else None.
    """

    inverse: dict[str, torch.Tensor]
    perm: dict[str, torch.Tensor | None]
    send_counts: torch.Tensor
    recv_counts: torch.Tensor
    owner_ids: dict[str, torch.Tensor]
    owner_counts: dict[str, torch.Tensor] | None = None


class Router:
    """One rank's key routing of the tiered tables.

    Args:
        ownership: the job's ownership rule.
        names: the tiered tables in the same order on every rank (the T axis of the counts).
        held: the tables this rank holds: it receives their ids and returns their slots.
    """

    def __init__(self, ownership: Ownership, *, names: Sequence[str], held: Collection[str]) -> None:
        self.ownership = ownership
        self.names = list(names)
        self.held = frozenset(held)

    def route(
        self, ids: Mapping[str, torch.Tensor], exchange: Exchange, *, counts: bool = False
    ) -> RoutedIds:
        """Deduplicate each table's (n_t,) int64 ids of the batch and send every unique id to its owner;
        with ``counts``, each unique id's occurrences in the batch travel with it (bounded tables count
        them on the owner).

        Collective on ``exchange`` (two all-to-alls: counts, then ids), except on one rank.
        """
        w, n_tables = self.ownership.world_size, len(self.names)
        inverse: dict[str, torch.Tensor] = {}
        perm: dict[str, torch.Tensor | None] = {}
        uniques: list[torch.Tensor] = []
        occurrences: list[torch.Tensor] = []
        send_counts = torch.zeros(w, n_tables, dtype=torch.int64)  # (W, T)
        for t, name in enumerate(self.names):
            if counts:
                uniq, inverse[name], occ = torch.unique(ids[name], return_inverse=True, return_counts=True)
            else:
                uniq, inverse[name] = torch.unique(ids[name], return_inverse=True)
            uniq, perm[name], per_owner = self.ownership.send_order(name, uniq)
            if counts:
                occurrences.append(occ if perm[name] is None else occ[perm[name]])
            send_counts[:, t] = per_owner
            uniques.append(uniq)
        held = [(t, name) for t, name in enumerate(self.names) if name in self.held]
        if w == 1:
            owner_ids = {name: uniques[t] for t, name in held}
            owner_occ = {name: occurrences[t] for t, name in held} if counts else None
            return RoutedIds(inverse, perm, send_counts, send_counts, owner_ids, owner_occ)
        split = send_counts.numpy()
        # peer-major, table-minor: the ids for peer d are table 0's share for d, then table 1's, ...; with
        # counts, each peer's ids are followed by their occurrences in the same order
        parts = [torch.split(u, split[:, t].tolist()) for t, u in enumerate(uniques)]
        occ_parts = [torch.split(o, split[:, t].tolist()) for t, o in enumerate(occurrences)]
        per_dest = []
        for d in range(w):
            per_dest += [parts[t][d] for t in range(n_tables)]
            per_dest += [occ_parts[t][d] for t in range(n_tables)] if counts else []
        send = torch.cat(per_dest)
        per_peer = [n_tables] * w
        recv_counts = exchange.all_to_all(send_counts.reshape(-1), per_peer, per_peer).reshape(w, n_tables)
        factor = 2 if counts else 1
        recv = exchange.all_to_all(
            send, (send_counts.sum(1) * factor).tolist(), (recv_counts.sum(1) * factor).tolist()
        )
        # per peer s: its T tables' ids, then (with counts) their occurrences
        sizes = []
        for s in range(w):
            sizes += recv_counts[s].tolist() * factor
        pieces = torch.split(recv, sizes)
        stride = n_tables * factor
        owner_ids = {name: torch.cat([pieces[s * stride + t] for s in range(w)]) for t, name in held}
        owner_occ = None
        if counts:
            owner_occ = {
                name: torch.cat([pieces[s * stride + n_tables + t] for s in range(w)]) for t, name in held
            }
        return RoutedIds(inverse, perm, send_counts, recv_counts, owner_ids, owner_occ)

    def return_slots(
        self, routed: RoutedIds, slots: Mapping[str, torch.Tensor], exchange: Exchange
    ) -> dict[str, torch.Tensor]:
        """Send the owners' slots back to the ranks whose ids they are; the slot of every value.

        Collective on ``exchange`` (one all-to-all), except on one rank.

        Args:
            routed: this rank's routing of the batch.
            slots: per table held here, the (R_t,) int64 slot of each of ``routed.owner_ids[t]``.
            exchange: the collectives of this stage.

        Returns:
            per table, the (n_t,) slot of each value of this rank's batch.
        """
        uniq_slots = (
            dict(slots) if self.ownership.world_size == 1 else self._slots_of_uniques(routed, slots, exchange)
        )
        return {name: uniq_slots[name][routed.inverse[name]] for name in self.names}

    def _slots_of_uniques(
        self, routed: RoutedIds, slots: Mapping[str, torch.Tensor], exchange: Exchange
    ) -> dict[str, torch.Tensor]:
        """The slot all-to-all: per table, the (U_t,) slots of this rank's unique ids, in their order."""
        w, n_tables = self.ownership.world_size, len(self.names)
        recv = routed.recv_counts.numpy()  # (W, T)
        starts = np.cumsum(recv, axis=0) - recv  # where peer s's ids of table t start in owner_ids[t]
        back_parts = [
            slots[name][starts[s, t] : starts[s, t] + recv[s, t]]
            for s in range(w)
            for t, name in enumerate(self.names)
            if recv[s, t]
        ]
        back = torch.cat(back_parts) if back_parts else torch.empty(0, dtype=torch.int64)
        got = exchange.all_to_all(
            back, routed.recv_counts.sum(1).tolist(), routed.send_counts.sum(1).tolist()
        )
        pieces = torch.split(got, routed.send_counts.reshape(-1).tolist())  # dest-major, table-minor
        out = {}
        for t, name in enumerate(self.names):
            in_send_order = torch.cat([pieces[d * n_tables + t] for d in range(w)])
            order = routed.perm[name]
            if order is None:
                out[name] = in_send_order
            else:
                out[name] = torch.empty_like(in_send_order)
                out[name][order] = in_send_order
        return out
