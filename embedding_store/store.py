"""The tiered store: the batch-level API the training pipeline drives.

Threading contract: every public method may be called from any thread. Calls are serialised by one
re-entrant store lock, except that :meth:`TieredStore.prefetch` releases it during its LMDB read, so a
prefetch for batch i+2 overlaps ``make_resident``/``release`` of batches i and i+1, and that
:meth:`TieredStore.release` never waits for it: it queues the unpin under a small lock of its own, and
the next call that takes the store lock applies the queued unpins before anything else (so the training
thread does not wait for a fill or a prefetch in progress to release its batch). A background writer
thread commits evicted rows; it never takes the store lock, and its failure is raised by the next call.
The bound slot-table tensors are read and written only inside ``make_resident`` (victims and fills,
never a pinned slot), ``flush``, ``snapshot``, ``read_rows`` and ``iter_rows``; run the last four
between steps, when no backward is updating the slot table.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from embedding_store.backends import RowBackend, open_backend
from embedding_store.config import MAX_ID, StoreConfig, TableSpec, Tier
from embedding_store.errors import StoreClosedError
from embedding_store.lockfile import DirectoryLock
from embedding_store.rows import RowChunk, row_chunk
from embedding_store.snapshot import publish_snapshot
from embedding_store.stats import StoreStats, TierStats
from embedding_store.tiered_table import PrefetchPlan, TieredTable
from embedding_store.tiers import FutureIds
from embedding_store.writer import WriteBehind, WriterSettings

__all__ = ["TieredStore"]

IdsLike = torch.Tensor | np.ndarray


def _as_ids(ids: IdsLike) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ids must be an integer tensor, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def _strictly_increasing(ids: np.ndarray) -> bool:
    """Whether (N,) ids are sorted and unique already (the key routing hands over such arrays)."""
    return bool((ids[1:] > ids[:-1]).all())


class TieredStore:
    """Embedding rows of several tables on three tiers: device slots, host DRAM, the SSD backend.

    Args:
        path: the store directory of this rank shard (created if missing). Holds the LMDB environment and
            ``tierrec.lock``, which one process at a time may hold.
        config: seed, capacities, policy, LMDB options.
        tables: the tiered tables of this shard.
        lock: a lock the caller holds that already guards ``path`` (a :class:`ShardDirectory`'s, beside
            the directory); the store then takes no ``tierrec.lock`` and leaves this one to its holder.
        backend: the SSD tier's backend, opened by the caller on ``path`` for ``config.seed`` and
            ``tables`` (the store closes it); None opens ``open_backend(path, options=config.lmdb, ...)``,
            whose layout ``config.lmdb.layout`` chooses for a new store.

    Raises:
        StoreLockedError: another process (or handle) has the store open.
        StoreIncompatibleError: the directory holds a store of other tables or another seed.

    Example:
        >>> cfg = StoreConfig(seed=0, device_capacity_rows=1024, host_capacity_rows=4096)
        >>> spec = TableSpec(name="t0", dim=16, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
        >>> with TieredStore("/tmp/store", config=cfg, tables=[spec]) as store:
        ...     store.bind("t0", weights=torch.empty(1024, 16), state=torch.empty(1024))
        ...     store.lookahead(0, {"t0": ids})
        ...     store.prefetch(0)
        ...     slots = store.make_resident(0, {"t0": ids})["t0"]  # same shape as ids
        ...     ...  # lookup/backward on the slot table with `slots`
        ...     store.release(0)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        config: StoreConfig,
        tables: Sequence[TableSpec],
        lock: DirectoryLock | None = None,
        backend: RowBackend | None = None,
    ) -> None:
        names = [t.name for t in tables]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"tables must be a non-empty list of distinct names, got {names}")
        if lock is not None and not lock.held:
            raise ValueError("lock must be held by the caller (it was released)")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = config
        # Only a lock of its own is the store's to release; a caller's covers more than the store's life.
        self._dir_lock = DirectoryLock(self.path) if lock is None else None
        try:
            self._backend = (
                backend
                if backend is not None
                else open_backend(self.path, options=config.lmdb, seed=config.seed, tables=tables)
            )
        except BaseException:
            self._release_dir_lock()
            raise
        lmdb = config.lmdb
        writer = WriterSettings(
            batch_rows=lmdb.writer_batch_rows,
            max_pending_rows=lmdb.writer_max_pending_rows,
            min_batch_rows=lmdb.writer_min_batch_rows or max(1, lmdb.writer_batch_rows // 2),
            linger_s=lmdb.writer_linger_s,
            nice=lmdb.writer_nice,
        )
        self._writer = WriteBehind(self._backend, writer)
        self._tables = {t.name: TieredTable(t, config, self._backend, self._writer) for t in tables}
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._unlocked_reads = 0
        self._announced: dict[int, dict[str, np.ndarray]] = {}
        # batch -> tables it pinned; with _unpin (released batches whose pins are still to drop), guarded by
        # _release_lock, which is never held while waiting for anything else
        self._in_flight: dict[int, list[str]] = {}
        self._unpin: list[tuple[int, list[str]]] = []
        self._release_lock = threading.Lock()
        self._closed = False

    # --------------------------------------------------------------------------------- plumbing
    @property
    def tables(self) -> dict[str, TableSpec]:
        """The tables by name."""
        return {name: t.spec for name, t in self._tables.items()}

    def _check(self) -> None:
        """Under the store lock, first thing: raise if the store is closed or its writer failed, then drop
        the pins of the batches released since the last call."""
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        self._writer.check()
        if self._unpin:
            with self._release_lock:
                released, self._unpin = self._unpin, []
            for batch_id, pinned in released:
                for name in pinned:
                    self._tables[name].release(batch_id)
                self._announced.pop(batch_id, None)

    def _table(self, name: str) -> TieredTable:
        try:
            return self._tables[name]
        except KeyError:
            raise ValueError(f"unknown table {name!r}; tables are {sorted(self._tables)}") from None

    def _future(self, name: str, batch_id: int) -> FutureIds:
        """Lazily: the sorted ids of ``name`` that the batch and the next L announced batches use, each
        batch's with its distance in batches from ``batch_id``, nearest first.

        Asked for only when a LOOKAHEAD tier must evict; the tier marks the rows of each batch in turn.
        """

        def future() -> list[tuple[int, np.ndarray]]:
            window = sorted(b for b in self._announced if b >= batch_id)[: self.config.lookahead_batches + 1]
            return [(b - batch_id, self._announced[b][name]) for b in window if name in self._announced[b]]

        return future

    # ------------------------------------------------------------------------------- batch API
    def bind(self, table: str, *, weights: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """Bind ``table``'s device tier to the slot table's live tensors (written in place).

        Args:
            table: table name.
            weights: (S, D) slot-table weights of the table's precision, S = the table's device capacity;
                e.g. FBGEMM's ``split_embedding_weights()[t]``; an fp16 table's may be float32 holding
                float16 values (rounded by the trainer after each update). Its current contents are ignored.
            state: optimizer state aliasing the slot table's: (S,) or (S, 1) for EXACT_ROWWISE_ADAGRAD,
                (S, D) for EXACT_ADAGRAD, None for EXACT_SGD; e.g. ``split_optimizer_states()[t][0]``.
        """
        with self._lock:
            self._check()
            self._table(table).bind(weights, state)

    def lookahead(self, batch_id: int, ids_per_table: Mapping[str, IdsLike]) -> None:
        """Announce a future batch's ids: LOOKAHEAD protects them, ``prefetch(batch_id)`` reads them."""
        with self._lock:
            self._check()
            announced = {}
            for name, ids in ids_per_table.items():
                table = self._table(name)
                arr = _as_ids(ids)
                table.check_ids(arr)
                # a copy: the caller may reuse its array
                announced[name] = arr.copy() if _strictly_increasing(arr) else np.unique(arr)
            self._announced[batch_id] = announced

    def prefetch(self, batch_id: int) -> None:
        """Read an announced batch's rows that are on no tier above LMDB into the host arena.

        The LMDB read runs without the store lock. Rows that another call moves meanwhile are not
        overwritten (the newer copy wins).
        """
        with self._lock:
            self._check()
            if batch_id not in self._announced:
                raise ValueError(f"batch {batch_id} was not announced with lookahead()")
            plans: dict[str, PrefetchPlan] = {}
            for name, ids in self._announced[batch_id].items():
                plans[name] = self._tables[name].plan_prefetch(ids, self._future(name, batch_id))
            self._unlocked_reads += 1
        reads: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        try:
            for name, plan in plans.items():
                reads[name] = self._tables[name].read_plan(plan)
        finally:
            with self._lock:
                self._unlocked_reads -= 1
                self._idle.notify_all()
                for name, plan in plans.items():
                    if not self._closed:
                        self._tables[name].finish_prefetch(
                            plan, reads.get(name), self._future(name, batch_id)
                        )

    def make_resident(self, batch_id: int, ids_per_table: Mapping[str, IdsLike]) -> dict[str, torch.Tensor]:
        """Bring a batch's rows into their slots, pin them until ``release(batch_id)``, map ids to slots.

        Victims (unpinned slots chosen by the policy) are written back to the host tier first.

        Args:
            batch_id: the batch; unique among batches in flight.
            ids_per_table: raw ids per table, any shape, duplicates allowed.

        Returns:
            slots per table: int64 tensors of the same shapes as the ids.

        Raises:
            StoreCapacityError: the batch's distinct ids exceed the free and unpinned slots.
            IdOutOfRangeError: a negative id, or one outside a bounded table.
        """
        with self._lock:
            self._check()
            with self._release_lock:
                if batch_id in self._in_flight:
                    raise ValueError(f"batch {batch_id} is already resident; release() it first")
            pinned: list[str] = []
            out: dict[str, torch.Tensor] = {}
            try:
                for name, ids in ids_per_table.items():
                    table = self._table(name)
                    arr = _as_ids(ids)
                    table.check_ids(arr)
                    pinned.append(name)
                    slots = table.make_resident(arr, batch_id, self._future(name, batch_id))
                    out[name] = torch.from_numpy(slots.copy()).view(tuple(ids.shape))  # caller may edit it
            except BaseException:
                for name in pinned:
                    self._tables[name].release(batch_id)
                raise
            with self._release_lock:
                self._in_flight[batch_id] = pinned
            return out

    def release(self, batch_id: int) -> None:
        """Unpin a batch's slots after its backward has updated them; forget its announcement.

        Does not wait for the store lock: the unpin is queued and applied by the next call that takes it
        (before that call does anything else), so no later call can see the batch's slots pinned.
        """
        with self._release_lock:
            if self._closed:
                raise StoreClosedError(f"store {self.path} is closed")
            pinned = self._in_flight.pop(batch_id, None)
            if pinned is None:
                raise ValueError(f"batch {batch_id} is not resident")
            self._unpin.append((batch_id, pinned))

    def slot_ids(self, table: str, slots: np.ndarray) -> np.ndarray:
        """(N,) ids held by (N,) slots of ``table``'s slot table, slots an in-flight batch pinned.

        Does not take the store lock: a pinned slot's id cannot change until the batch is released.
        """
        return self._table(table)._bound().ids[slots]

    def evict(self, table: str, ids: IdsLike | None = None) -> int:
        """Write rows back from the device tier (to the host tier, whose dirty victims go to the
        writer) and free their slots: the given ids, or every unpinned row when ``ids`` is None.

        Returns:
            the number of rows evicted.

        Raises:
            ValueError: one of ``ids`` is pinned by an in-flight batch.
        """
        with self._lock:
            self._check()
            t = self._table(table)
            return t.evict(None if ids is None else _as_ids(ids))

    def delete(self, table: str, ids: IdsLike) -> None:
        """Delete rows from the model: from every tier, with their optimizer state.

        Afterwards each id is exactly an id never seen: ``read_rows`` and ``make_resident`` give its lazy
        init row (zero optimizer state), ``iter_rows``, ``flush`` and ``snapshot`` skip it, and a row of it
        written later (the id trained again) is a new row. Its device slot and host row are freed with no
        write-back, and the background writer commits the delete (the backend's ``delete_rows``) after
        the rows queued before it; until then its queue answers "deleted" for the ids, so no read finds
        a stale row there or in LMDB. A prefetch reading LMDB without the lock meanwhile keeps none of
        them. Details: docs/tiers.md, "Deleting rows".

        Args:
            table: table name.
            ids: int64 ids, any shape; duplicates allowed, ids that have no row are skipped.

        Returns:
            None: whether an id had a row in LMDB is known only by reading it (a cold read per row),
            so the count is not taken; ``stats()`` counts the ids deleted (``Tier.SSD``'s ``deleted``).

        Raises:
            ValueError: an id is pinned by an in-flight batch (between ``make_resident`` and
                ``release``); nothing is deleted.
            IdOutOfRangeError: a negative id, or one outside a bounded table.
        """
        with self._lock:
            self._check()
            t = self._table(table)
            arr = _as_ids(ids)
            t.check_ids(arr)
            t.delete(arr if _strictly_increasing(arr) else np.unique(arr))

    def wait_for_writes(self) -> None:
        """Block until every row handed to the background writer so far is committed (no fsync)."""
        with self._lock:
            self._check()
            self._writer.drain()

    # ---------------------------------------------------------------------------- read-through
    def read_rows(self, table: str, ids: IdsLike) -> RowChunk:
        """Latest rows of arbitrary ids (never-seen ids read as their lazy init); changes nothing.

        Returns:
            a RowChunk in the order of ``ids`` (flattened).
        """
        with self._lock:
            self._check()
            t = self._table(table)
            arr = _as_ids(ids)
            t.check_ids(arr)
            return row_chunk(t.spec, arr, t.read_latest(arr))

    def iter_rows(self, table: str, *, chunk_rows: int = 1 << 16) -> Iterator[RowChunk]:
        """Stream every row that exists on any tier of ``table``, ascending ids, at most ``chunk_rows``
        ids per chunk, each with its latest value (deleted ids are skipped). Memory is bounded by the
        chunk plus the ids held above LMDB. Rows first created or deleted while the iteration runs may or
        may not appear.
        """
        if chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        t = self._table(table)
        with self._lock:
            self._check()
            upper = t.upper_ids()  # (U,) sorted
        last, u_pos = -1, 0
        while True:
            with self._lock:
                self._check()
                disk_ids, disk_rows = self._backend.scan(table, after=last, limit=chunk_rows)
                disk_done = disk_ids.shape[0] < chunk_rows
                high = MAX_ID if disk_done else int(disk_ids[-1])
                u_end = int(np.searchsorted(upper, high, side="right"))
                if u_end - u_pos > chunk_rows:
                    u_end = u_pos + chunk_rows
                    high = int(upper[u_end - 1])
                    cut = int(np.searchsorted(disk_ids, high, side="right"))
                    disk_done = False
                    disk_ids, disk_rows = disk_ids[:cut], disk_rows[:cut]
                up = upper[u_pos:u_end]
                ids = np.union1d(disk_ids, up)
                rows = np.empty((ids.shape[0], t.spec.row_floats), dtype=np.float32)
                rows[np.searchsorted(ids, disk_ids)] = disk_rows
                if up.shape[0]:
                    exists, up_rows = t.read_existing(up)
                    rows[np.searchsorted(ids, up)] = up_rows
                    if not exists.all():  # deleted: LMDB's row, if any, is stale
                        keep = ~np.isin(ids, up[~exists])
                        ids, rows = ids[keep], rows[keep]
            if ids.shape[0]:
                yield row_chunk(t.spec, ids, rows)
            if disk_done and u_end == upper.shape[0]:
                return
            last, u_pos = high, u_end

    # -------------------------------------------------------------------------------- lifetime
    def flush(self) -> None:
        """Write every row held above LMDB (device rows included) to LMDB and sync it to disk."""
        with self._lock:
            self._check()
            for t in self._tables.values():
                t.flush_to_writer(self.config.lmdb.writer_batch_rows, self._writer.check)
            self._writer.drain()
            self._backend.sync()

    def snapshot(self, dest: str | os.PathLike[str]) -> None:
        """Flush, then write a compacted copy of the store into the new directory ``dest``.

        The copy is written into the sibling ``.{name}.tmp``, fsynced, renamed to ``dest`` and the parent
        fsynced: ``dest`` exists only once it is complete and durable. Open it with
        ``restore_snapshot(dest, path)`` followed by ``TieredStore(path, ...)``.

        Raises:
            FileExistsError: ``dest`` exists.
        """
        dest = Path(dest)
        if os.path.lexists(dest):
            raise FileExistsError(f"snapshot destination {dest} exists")
        tmp = dest.with_name(f".{dest.name}.tmp")
        with self._lock:
            self.flush()
            shutil.rmtree(tmp, ignore_errors=True)  # left by a snapshot that was killed
            tmp.mkdir(parents=True)
            try:
                self._backend.snapshot(tmp)
                publish_snapshot(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    def counters(self) -> dict[str, dict[Tier, TierStats]]:
        """A copy of the per-table, per-tier counters, taken without waiting for the store lock.

        For a reader that polls while other threads work (the training thread every ``log_every``
        steps, as the pipeline's stages hold the lock for milliseconds at a time). A copy taken meanwhile
        may show one call's update half-applied (its hits counted, its misses not yet); counters only
        grow, so windows between successive copies still add up. ``stats()`` is exact.
        """
        return {name: {tier: replace(s) for tier, s in t.stats.items()} for name, t in self._tables.items()}

    def stats(self) -> StoreStats:
        """A copy of the counters, per table and tier (waits for the store lock: a consistent picture)."""
        with self._lock:
            out = StoreStats(
                writer_pending_rows=self._writer.pending_rows,
                writer_commits=self._writer.commits,
                writer_seconds=self._writer.seconds,
                map_size_bytes=0 if self._closed else self._backend.map_size_bytes(),
                tables=self.counters(),  # under the lock: no update is half-applied
            )
            for name, t in self._tables.items():
                out.resident_rows[name] = {
                    Tier.DEVICE: 0 if t.device is None else len(t.device),
                    Tier.HOST: len(t.host),
                    Tier.SSD: 0 if self._closed else self._backend.num_rows(name),
                }
                out.tables[name][Tier.SSD].seconds += self._writer.seconds / len(self._tables)
            return out

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless ``flush=False``: then rows held above LMDB are dropped), stop the writer,
        close LMDB and release the lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._idle.wait_for(lambda: self._unlocked_reads == 0)
            try:
                if flush:
                    self.flush()
            finally:
                self._closed = True
                try:
                    self._writer.close()
                finally:
                    self._backend.close()
                    self._release_dir_lock()

    def _release_dir_lock(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush=exc_type is None)
