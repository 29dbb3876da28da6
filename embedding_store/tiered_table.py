"""One tiered table: moves rows between the device slots, the host arena, the writer and LMDB.

Tiers are exclusive: a row moving up is *taken* from the host arena, and a row evicted from the device
goes down to the host arena (always dirty: the trainer may have updated it in place), whose dirty
victims go to the background writer, whose commits reach LMDB. Reads look top-down — device, host,
writer (pending), LMDB — and fall back to the lazy initialisation, so the first tier that holds a row
holds its latest value (docs/design.md, invariant 1). A delete removes an id from every tier at once: the
device and host drop its row, and the writer holds a delete of it, ordered after the rows queued before
it, that reads as "never seen" until it commits (docs/tiers.md, "Deleting rows"). Calls are serialised by
the store's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from embedding_store.backends.base import RowBackend
from embedding_store.config import StoreConfig, TableSpec, Tier, WeightsPrecision
from embedding_store.errors import IdOutOfRangeError, StoreCapacityError, StoreError
from embedding_store.init import init_rows
from embedding_store.rows import pack_weights
from embedding_store.stats import TierStats
from embedding_store.tiers import DeviceTier, FutureIds, HostTier
from embedding_store.writer import WriteBehind

__all__ = ["PrefetchPlan", "TieredTable"]


def _no_future() -> list[tuple[int, np.ndarray]]:
    return []


@dataclass(slots=True, eq=False)  # identity: finish_prefetch removes this very plan from the list
class PrefetchPlan:
    """Ids one prefetch reads from LMDB without the store lock, the rows it already found pending in the
    writer (or made: the init rows of ids with a pending delete), and the ids moved down or deleted
    meanwhile, whose rows it holds may be stale."""

    ids: np.ndarray  # (M,) sorted unique
    epoch: int  # the table's epoch when the plan was made
    # found in the writer's queue (disjoint from ids), with their latest rows
    pending_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # (P,)
    pending_rows: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.float32))  # (P, R)
    moved: list[np.ndarray] = field(default_factory=list)


class TieredTable:
    """Rows of one table across the tiers.

    Args:
        spec: the table.
        config: the store's configuration (seed, capacities, policy).
        backend: the SSD tier's backend (reads).
        writer: the background writer (writes and pending reads).
    """

    def __init__(
        self, spec: TableSpec, config: StoreConfig, backend: RowBackend, writer: WriteBehind
    ) -> None:
        self.spec = spec
        self._config = config
        self._backend = backend
        self._writer = writer  # submissions, and lookups of the rows it holds (indexed)
        self.host = HostTier(spec, config.host_rows(spec), config.policy)
        self.device: DeviceTier | None = None
        self.stats = {tier: TierStats() for tier in Tier}
        self._plans: list[PrefetchPlan] = []  # prefetches whose LMDB read runs unlocked
        self._epoch = 0  # bumped whenever rows enter the device or host tier

    # ------------------------------------------------------------------------------------- helpers
    def bind(self, weights: torch.Tensor, state: torch.Tensor | None) -> None:
        """Bind the device tier to the slot table's tensors (see ``TieredStore.bind``)."""
        if self.device is not None:
            raise ValueError(f"table {self.spec.name!r} is already bound to a slot table")
        want = self._config.device_rows(self.spec)
        if weights.shape[0] != want:
            raise ValueError(
                f"slot table of {self.spec.name!r} has {weights.shape[0]} rows, config says {want}"
            )
        self.device = DeviceTier(self.spec, weights, state, self._config.policy)

    def _bound(self) -> DeviceTier:
        if self.device is None:
            raise StoreError(f"table {self.spec.name!r} has no slot table bound; call bind() first")
        return self.device

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise IdOutOfRangeError for negative ids or ids outside a bounded table."""
        if ids.shape[0] == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise IdOutOfRangeError(f"table {self.spec.name!r}: negative id {low}")
        if self.spec.num_embeddings is not None and high >= self.spec.num_embeddings:
            raise IdOutOfRangeError(
                f"table {self.spec.name!r}: id {high} >= num_embeddings {self.spec.num_embeddings}"
            )

    def _init(self, ids: np.ndarray) -> np.ndarray:
        """(N,) never-seen ids -> (N, R) initial rows: init weights, zero optimizer state."""
        spec = self.spec
        weights = init_rows(ids, dim=spec.dim, seed=self._config.seed, table=spec.name, scale=spec.init_scale)
        if spec.state_floats == 0 and spec.weights_precision is WeightsPrecision.FP32:
            return weights.numpy()
        rows = np.zeros((ids.shape[0], spec.row_floats), dtype=np.float32)
        pack_weights(spec, weights.numpy(), rows[:, : spec.weight_words])  # fp16: rounded once, here
        return rows

    def _read_below_host(
        self, ids: np.ndarray, rows: np.ndarray, todo: np.ndarray, count: bool
    ) -> np.ndarray:
        """Fill ``rows[todo]`` for sorted ``ids[todo]`` from the writer, LMDB, then the lazy init.

        Returns:
            (K,) positions in ``ids`` that no tier holds, filled with their init rows (an id whose
            delete is pending among them, whatever LMDB still holds).
        """
        ssd = self.stats[Tier.SSD]
        sub = ids[todo]
        found, pending, deleted = self._writer.find(self.spec.name, sub)
        idx = np.flatnonzero(todo)
        if found.any():
            rows[idx[found]] = pending
        rest = idx[~(found | deleted)]
        start = time.perf_counter()
        on_disk, disk_rows = self._backend.get_rows(self.spec.name, ids[rest])
        rows[rest[on_disk]] = disk_rows
        fresh = rest[~on_disk]
        if deleted.any():
            fresh = np.concatenate([fresh, idx[deleted]])
        rows[fresh] = self._init(ids[fresh])
        if count:
            ssd.seconds += time.perf_counter() - start
            ssd.hits += int(found.sum()) + disk_rows.shape[0]
            ssd.misses += fresh.shape[0]
            ssd.add_out(int(found.sum()) + disk_rows.shape[0], self.spec.row_bytes)
        return fresh

    def _spill(self, ids: np.ndarray, rows: np.ndarray, *, indexed: bool = True) -> None:
        """Hand dirty rows to the writer, sorted by id (see ``WriteBehind.submit`` for ``indexed``)."""
        if ids.shape[0] == 0:
            return
        order = np.argsort(ids, kind="stable")
        self._writer.submit(self.spec.name, ids[order], rows[order], indexed=indexed)
        self.stats[Tier.SSD].add_in(ids.shape[0], self.spec.row_bytes)

    def _put_host(self, ids: np.ndarray, rows: np.ndarray, *, dirty: bool, future: FutureIds) -> None:
        self._epoch += 1
        host = self.stats[Tier.HOST]
        spill_ids, spill_rows, evicted = self.host.put(ids, rows, dirty=dirty, future=future)
        host.evictions += evicted
        host.add_in(min(ids.shape[0], self.host.capacity), self.spec.row_bytes)
        self._spill(spill_ids, spill_rows)

    # ------------------------------------------------------------------------------- batch path
    def make_resident(self, ids: np.ndarray, key: int, future: FutureIds) -> np.ndarray:
        """Make (N,) ids resident in the device tier and pin them for batch ``key``; returns (N,) slots."""
        device = self._bound()
        stats = self.stats[Tier.DEVICE]
        start = time.perf_counter()
        slots = device.lookup(ids)  # (N,)
        miss = slots < 0
        if not miss.any():
            device.pin(slots, key)
            device.policy.touch(slots)
            stats.hits += slots.shape[0]
            stats.seconds += time.perf_counter() - start
            return slots
        hits = slots[~miss]
        stats.hits += hits.shape[0]
        device.pin(hits, key)  # before evicting, so this batch's own rows stay
        missing = ids[miss]
        if (missing[1:] > missing[:-1]).all():  # sorted and unique already, as routed ids are
            miss_ids, inverse = missing, None
        else:
            miss_ids, inverse = np.unique(missing, return_inverse=True)  # (M,), (#miss,)
        need = miss_ids.shape[0] - device.num_free
        candidates = device.evictable() if need > 0 else np.empty(0, dtype=np.int64)
        if need > candidates.shape[0]:
            device.unpin(key)
            # Slots this batch cannot have: its own resident rows and those of the other batches in flight.
            pinned = device.capacity - device.num_free - candidates.shape[0]
            raise StoreCapacityError(
                f"table {self.spec.name!r}: batch needs {miss_ids.shape[0]} new slots, only "
                f"{device.num_free + candidates.shape[0]} free or evictable of {device.capacity}: with the "
                f"{pinned} pinned by it and the batches in flight it needs at least {pinned + miss_ids.shape[0]}"
            )
        rows = self._fetch_up(miss_ids, future)  # (M, R)
        if need > 0:
            victims = device.policy.victims(need, candidates, device.future_mask(candidates, future))
            self._evict_slots(victims, future)
        self._epoch += 1
        new_slots = device.allocate(miss_ids)
        device.write(new_slots, rows)
        stats.add_in(miss_ids.shape[0], self.spec.row_bytes)
        stats.misses += int(miss.sum())
        slots[miss] = new_slots if inverse is None else new_slots[inverse]
        device.pin(new_slots, key)
        device.policy.touch(slots)
        stats.seconds += time.perf_counter() - start
        return slots

    def _evict_slots(self, victims: np.ndarray, future: FutureIds) -> None:
        """Write (K,) unpinned slots back to the host tier (dirty) and free them."""
        device = self._bound()
        stats = self.stats[Tier.DEVICE]
        victim_ids = device.ids[victims]
        victim_rows = device.read(victims)
        device.deallocate(victims)
        for plan in self._plans:
            plan.moved.append(victim_ids)
        stats.evictions += victims.shape[0]
        stats.add_out(victims.shape[0], self.spec.row_bytes)
        self._put_host(victim_ids, victim_rows, dirty=True, future=future)

    def evict(self, ids: np.ndarray | None) -> int:
        """Write rows back from the device tier and free their slots: ``ids`` (absent ones are
        skipped), or every unpinned row when None. Returns the number of rows evicted."""
        device = self._bound()
        if ids is None:
            victims = device.evictable()
        else:
            slots = device.lookup(np.unique(ids))
            victims = slots[slots >= 0]
            if device.pinned_mask()[victims].any():
                raise ValueError(f"table {self.spec.name!r}: cannot evict rows pinned by an in-flight batch")
        self._evict_slots(victims, _no_future)
        return int(victims.shape[0])

    def _fetch_up(self, ids: np.ndarray, future: FutureIds) -> np.ndarray:
        """(M,) sorted unique ids absent from the device -> (M, R) latest rows, taken out of the host."""
        host = self.stats[Tier.HOST]
        rows = np.empty((ids.shape[0], self.spec.row_floats), dtype=np.float32)
        pos = self.host.lookup(ids)
        in_host = pos >= 0
        n_host = int(in_host.sum())
        if n_host:
            rows[in_host] = self.host.take(pos[in_host])
            host.add_out(n_host, self.spec.row_bytes)
        host.hits += n_host
        host.misses += ids.shape[0] - n_host
        if n_host < ids.shape[0]:
            self._read_below_host(ids, rows, ~in_host, count=True)
        return rows

    def release(self, key: int) -> None:
        """Drop the pins of batch ``key``."""
        if self.device is not None:
            self.device.unpin(key)

    # --------------------------------------------------------------------------------- prefetch
    def plan_prefetch(self, ids: np.ndarray, future: FutureIds) -> PrefetchPlan:
        """Step 1 (locked): the rows on no tier above the writer; those the writer still holds are taken
        from it now, the rest are left for an LMDB read. Both go to the host in step 3, in one put."""
        if self.host.capacity == 0:  # nowhere to park rows: the fill reads them itself, once
            plan = PrefetchPlan(ids=ids[:0], epoch=self._epoch)
            self._plans.append(plan)
            return plan
        todo = ids if self.device is None else ids[self.device.lookup(ids) < 0]
        todo = todo[self.host.lookup(todo) < 0]
        if todo.shape[0] == 0:  # all of them above LMDB already (every lookup hit)
            plan = PrefetchPlan(ids=todo, epoch=self._epoch)
            self._plans.append(plan)
            return plan
        found, pending, deleted = self._writer.find(self.spec.name, todo)
        self.stats[Tier.SSD].hits += int(found.sum())
        if deleted.any():  # read as never seen: their init rows, made now, not LMDB's stale ones
            self.stats[Tier.SSD].misses += int(deleted.sum())
            known = found | deleted
            made = np.empty((int(known.sum()), self.spec.row_floats), dtype=np.float32)
            if found.any():
                made[found[known]] = pending
            made[deleted[known]] = self._init(todo[deleted])
            found, pending = known, made
        if found.any():
            plan = PrefetchPlan(todo[~found], self._epoch, pending_ids=todo[found], pending_rows=pending)
        else:
            plan = PrefetchPlan(ids=todo, epoch=self._epoch)
        self._plans.append(plan)
        return plan

    def finish_prefetch(
        self, plan: PrefetchPlan, read: tuple[np.ndarray, np.ndarray] | None, future: FutureIds
    ) -> None:
        """Step 3 (locked): put the rows found in step 1 and read in step 2 into the host, unless a newer
        copy appeared meanwhile."""
        self._plans.remove(plan)
        if read is None:  # the read failed: nothing is lost, every row is still below the host
            return
        ids, (on_disk, rows) = plan.ids, read
        if not on_disk.all():  # the common case needs no copy of the rows read
            disk_rows, rows = rows, np.empty((ids.shape[0], self.spec.row_floats), dtype=np.float32)
            rows[on_disk] = disk_rows
            rows[~on_disk] = self._init(ids[~on_disk])
        ssd = self.stats[Tier.SSD]
        found = int(on_disk.sum())
        ssd.hits += found
        ssd.misses += ids.shape[0] - found
        ssd.add_out(found, self.spec.row_bytes)
        if plan.pending_ids.shape[0]:
            ids = np.concatenate([plan.pending_ids, ids])
            rows = np.concatenate([plan.pending_rows, rows])
        if ids.shape[0] == 0:
            return
        # Drop rows that another call brought up meanwhile, or that went down (the copy we hold may be
        # older than what the writer now holds), or that were deleted (the copy we hold is gone).
        # Unchanged epoch: nothing entered a tier since the plan, so every row is still absent.
        keep = np.ones(ids.shape[0], dtype=bool)
        if plan.epoch != self._epoch:
            keep &= self.host.lookup(ids) < 0
            if self.device is not None:
                keep &= self.device.lookup(ids) < 0
        if plan.moved:
            keep &= ~np.isin(ids, np.concatenate(plan.moved))
        if keep.all():
            self._put_host(ids, rows, dirty=False, future=future)
        else:
            self._put_host(ids[keep], rows[keep], dirty=False, future=future)

    def read_plan(self, plan: PrefetchPlan) -> tuple[np.ndarray, np.ndarray]:
        """Step 2 (unlocked): the LMDB read of a plan."""
        if plan.ids.shape[0] == 0:  # every row was above LMDB (the steady state of a cache that fits)
            return np.empty(0, dtype=bool), np.empty((0, self.spec.row_floats), dtype=np.float32)
        start = time.perf_counter()
        result = self._backend.get_rows(self.spec.name, plan.ids)
        self.stats[Tier.SSD].seconds += time.perf_counter() - start
        return result

    # ------------------------------------------------------------------------------ read-through
    def read_latest(self, ids: np.ndarray) -> np.ndarray:
        """(N,) ids (any order, duplicates allowed) -> (N, R) latest rows from the highest tier holding
        each; never-seen (and deleted) ids read as their lazy init. No side effects."""
        return self.read_existing(ids)[1]

    def read_existing(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`read_latest`, with (N,) bool: whether some tier holds the id's row (False for the
        ids read as their lazy init)."""
        exists = np.ones(ids.shape[0], dtype=bool)
        rows = np.empty((ids.shape[0], self.spec.row_floats), dtype=np.float32)
        todo = np.ones(ids.shape[0], dtype=bool)
        if self.device is not None and len(self.device):
            slots = self.device.lookup(ids)
            hit = slots >= 0
            if hit.any():
                rows[hit] = self.device.read(slots[hit])
            todo &= ~hit
        pos = self.host.lookup(ids)
        hit = todo & (pos >= 0)
        if hit.all():
            return exists, self.host.gather(pos)  # the common case of a warm host tier: one gather
        if hit.any():
            rows[hit] = self.host.gather(pos[hit])
        todo &= ~hit
        if todo.any():
            rest = np.flatnonzero(todo)
            uniq, inverse = np.unique(ids[rest], return_inverse=True)
            below = np.empty((uniq.shape[0], self.spec.row_floats), dtype=np.float32)
            fresh = self._read_below_host(uniq, below, np.ones(uniq.shape[0], dtype=bool), count=False)
            rows[rest] = below[inverse]
            if fresh.shape[0]:
                absent = np.zeros(uniq.shape[0], dtype=bool)
                absent[fresh] = True
                exists[rest] = ~absent[inverse]
        return exists, rows

    def delete(self, ids: np.ndarray) -> None:
        """Delete (N,) sorted unique ids from every tier (see ``TieredStore.delete``).

        Raises:
            ValueError: one of them is pinned by an in-flight batch (nothing is deleted).
        """
        device = self.device
        slots = np.empty(0, dtype=np.int64)
        if device is not None:
            slots = device.lookup(ids)
            slots = slots[slots >= 0]
            pinned = device.pinned_mask()[slots]
            if pinned.any():
                raise ValueError(
                    f"table {self.spec.name!r}: cannot delete ids pinned by an in-flight batch: "
                    f"{device.ids[slots[pinned]][:8].tolist()}"
                )
        # First the delete, ordered after every row the writer holds, then the copies above it. Until it
        # commits, the writer answers "deleted" for the ids, so no read reaches LMDB's stale rows.
        self._writer.submit_delete(self.spec.name, ids)
        if device is not None and slots.shape[0]:
            device.deallocate(slots)  # no write-back: the row is gone
            self.stats[Tier.DEVICE].deleted += slots.shape[0]
        pos = self.host.lookup(ids)
        pos = pos[pos >= 0]
        if pos.shape[0]:
            self.host.drop(pos)
            self.stats[Tier.HOST].deleted += pos.shape[0]
        for plan in self._plans:  # a prefetch reading without the lock must not bring them back
            plan.moved.append(ids)
        self.stats[Tier.SSD].deleted += ids.shape[0]

    def upper_ids(self) -> np.ndarray:
        """Sorted unique ids held above LMDB (device, host, writer queue: its deletes' ids included)."""
        parts = [self.host.resident_ids(), self._writer.pending_ids(self.spec.name)]
        if self.device is not None:
            parts.append(self.device.resident_ids())
        return np.unique(np.concatenate(parts))

    def flush_to_writer(self, chunk_rows: int, on_chunk: Callable[[], None]) -> None:
        """Queue every device row and every dirty host row for writing, in chunks (bounded memory).

        The caller drains the writer before it lets go of the store lock, so these submissions are not
        indexed (``WriteBehind.submit``): an index of every row the store holds would cost as much memory.
        """
        if self.device is not None:
            slots = self.device.occupied()
            for start in range(0, slots.shape[0], chunk_rows):
                part = slots[start : start + chunk_rows]
                self._spill(self.device.ids[part], self.device.read(part), indexed=False)
                on_chunk()
        pos = self.host.dirty_positions()
        for start in range(0, pos.shape[0], chunk_rows):
            part = pos[start : start + chunk_rows]
            self._spill(self.host.ids[part], self.host.gather(part), indexed=False)
            self.host.dirty[part] = False
            on_chunk()
