"""Compaction of the log layout (:class:`LogCompaction`, a part of
:class:`~embedding_store.backends.log_tables.LogTables`).

While the log's records are ``compact_at`` dead, its deadest sealed segment (not the one appended to) is
compacted: its live rows are copied to the head (new numbers), then the segment and its runs are
dropped. Compaction is driven by the space, not by each segment's own dead share: under uniform updates
the segments of one fill all reach any per-segment threshold at once (a burst of copies), while the log
as a whole dies steadily, and a segment compacted later is deader (cheaper).

Tombstones (deletes, :mod:`~embedding_store.backends.log_records`) are dead records, but one must stay
on disk while an older segment may hold a record of its id, or the id would come back at the next
open: a compaction copies the tombstones of ids still deleted to the head with the live rows, except
from the oldest segment (nothing older holds a record). A segment's tombstones count as reclaimable
only in the oldest segment, so every compaction frees records and compaction ends.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any

import numpy as np

from embedding_store.backends.lmdb_threads import SharedExclusiveLock
from embedding_store.backends.log_format import encode_keys, segment_name
from embedding_store.backends.log_records import LogIo, LogStats, Table
from embedding_store.errors import StoreCorruptError

__all__ = ["CAPPED_COMPACT_AT", "COPY_ROWS", "LogCompaction"]

# Live rows of a compaction's copy per transaction (bounds the dirty pages and the blocks held).
COPY_ROWS = 1 << 16
# The dead share of a table with a row cap (TableSpec.expected_max_rows) at which it is compacted, when
# ``log_compact_at`` is higher: its file stays near 1.5x the cap's bytes (docs/store-format.md).
CAPPED_COMPACT_AT = 0.2


class LogCompaction(abc.ABC):
    """Compaction of the tables of a :class:`~embedding_store.backends.log_tables.LogTables`."""

    _env: Any
    _rw: SharedExclusiveLock
    _io: LogIo
    _index_lock: threading.Lock
    _compact_at: float
    _tables: dict[str, Table]
    stats: LogStats

    # Provided by LogTables.
    @abc.abstractmethod
    def _append(self, staged: list[Any], tombs: Any = ()) -> None:
        """Append staged rows (and tombstones) to the log in one transaction."""

    @abc.abstractmethod
    def _read_span(self, t: Table, seg: int, ordered: np.ndarray) -> np.ndarray:
        """The rows of ``ordered`` positions of segment ``seg`` of table ``t``."""

    @abc.abstractmethod
    def _read_ahead(self, t: Table, seg: int) -> None:
        """Hint the kernel to read segment ``seg`` of table ``t`` ahead."""

    def _reclaimable(self, t: Table, seg: int, oldest: int) -> int:
        alive = t.alive
        return alive.records[seg] - alive.live[seg] - (0 if seg == oldest else alive.tombs[seg])

    def _victim(self, t: Table) -> int | None:
        """The sealed segment to compact now (the deadest, while the log's rows are ``compact_at`` dead),
        or None."""
        head, alive = t.next_seq // t.geo.segment, t.alive
        records = alive.records
        if not records:
            return None
        oldest = min(records)
        # rows, not records: a tombstone holds no row (a few bytes of its run), and tombstones counted
        # in the total would let the rows' dead share grow past compact_at
        rows = sum(records.values()) - sum(alive.tombs.values())
        at = (
            self._compact_at if t.spec.expected_max_rows is None else min(self._compact_at, CAPPED_COMPACT_AT)
        )
        if rows - sum(alive.live.values()) < at * rows:
            return None
        sealed = [seg for seg in records if seg < head and self._reclaimable(t, seg, oldest) > 0]
        # the deadest: the least kept (live rows, and tombstones to copy) per record
        return min(sealed, key=lambda s: 1 - self._reclaimable(t, s, oldest) / records[s]) if sealed else None

    def _compact_while_needed(self, t: Table) -> None:
        while (seg := self._victim(t)) is not None:
            start = time.perf_counter()
            self.compact(t.spec.name, seg)
            self.stats.compact_s += time.perf_counter() - start

    def compact(self, table: str, seg: int) -> None:
        """Copy segment ``seg``'s live rows (and the tombstones still needed) to the head, then drop it
        with its runs."""
        t = self._tables[table]
        self._read_ahead(t, seg)
        run_keys, (ids, seqs), (tomb_ids, tomb_seqs) = self._runs_of(t, seg)
        live = t.alive.live_seqs(seg)  # the writer's own account: no index lookups
        at = np.minimum(np.searchsorted(seqs, live), max(0, seqs.shape[0] - 1))
        if live.shape[0] and not np.array_equal(seqs[at], live):
            raise StoreCorruptError(f"table {table!r}: live records of log segment {seg} have no run")
        ids, seqs = ids[at], live
        for a in range(0, ids.shape[0], COPY_ROWS):
            with self._rw.shared():
                rows = self._read_span(t, seg, seqs[a : a + COPY_ROWS])
            first = t.next_seq
            self._append(
                [(t, ids[a : a + COPY_ROWS], rows, np.arange(first, first + rows.shape[0], dtype=np.int64))]
            )
            self.stats.copied_rows += rows.shape[0]
        forget = np.zeros(0, dtype=np.int64)
        if tomb_ids.shape[0]:
            later = [s for s in t.alive.records if s != seg]
            floor = min(later) * t.geo.segment if later else t.next_seq  # the oldest record left
            with self._index_lock:  # the tombstones that still hide their ids: the newest of each
                puts = t.index.lookup(tomb_ids)
                keep = (t.deleted.tomb_of(tomb_ids) == tomb_seqs) & t.deleted.hides(tomb_ids, puts)
            # an id whose newest put is older than every record left has no record left: the index
            # forgets it with its tombstone; the others' tombstones go to the head
            gone = keep & (puts < floor)
            forget = np.sort(tomb_ids[gone])
            carry = np.sort(tomb_ids[keep & ~gone])
            if carry.shape[0]:
                first = t.next_seq
                self._append([], [(t, carry, np.arange(first, first + carry.shape[0], dtype=np.int64))])
        name = segment_name(t.spec.name, seg)

        def drop(txn: Any) -> None:
            # Every run opens the segment by name: LMDB closes a handle for the whole environment when it
            # drops it (delete=True), also when the transaction then aborts (a full map, met by the
            # deletes or by the commit's free list) and is run again after a resize; a handle opened by an
            # aborted transaction is closed too. The name is there until a drop commits.
            txn.drop(self._env.open_db(name, txn=txn, create=False), delete=True)
            for key in run_keys:
                txn.delete(key, db=t.runs_db)

        try:
            self._io.commit(drop, 0, 0, exclusive=True)  # no reader is on its way to the dropped segment
        except BaseException:
            # Nothing was applied, but the segment's handle may be closed, and its slot given to a segment
            # opened later: it is forgotten. Nothing reads the segment (the index left it, it has no live
            # rows to copy) until a later compaction drops it, again by name.
            with self._index_lock:
                t.segs.pop(seg, None)
            raise
        with self._index_lock:
            t.segs.pop(seg, None)
            t.alive.drop(seg)
            if forget.shape[0]:
                t.index.remove(forget)
                t.deleted.forget(forget)
                t.version += 1
        self.stats.compactions += 1
        self.stats.forgotten_ids += forget.shape[0]

    def _runs_of(
        self, t: Table, seg: int
    ) -> tuple[list[bytes], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """The run keys of segment ``seg``, the ids and sequence numbers (ascending) of its put records,
        and those of its tombstones."""
        lo, hi = encode_keys(np.array([seg * t.geo.segment, (seg + 1) * t.geo.segment]))
        run_keys: list[bytes] = []
        values: list[bytes] = []
        with self._rw.shared(), self._env.begin(db=t.runs_db) as txn:
            cursor = txn.cursor()
            if cursor.set_range(lo):
                for key, value in cursor:
                    if key >= hi:  # 8-byte big-endian keys: byte order is number order
                        break
                    run_keys.append(key)
                    values.append(value)
        counts = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        if (counts % 8).any() or not counts.all() or any(len(key) != 8 for key in run_keys):
            raise StoreCorruptError(f"table {t.spec.name!r}: a damaged run record in log segment {seg}")
        counts //= 8
        firsts = np.frombuffer(b"".join(run_keys), dtype=">u8").astype(np.int64)
        ids = np.frombuffer(b"".join(values), dtype="<i8").astype(np.int64)
        starts = np.cumsum(counts) - counts  # where each record's ids begin in ``ids``
        tomb = ids[starts] == -1 if starts.shape[0] else np.zeros(0, dtype=bool)  # a tombstone's marker
        # a tombstone's ids are numbered from its key after the marker
        seqs = np.arange(ids.shape[0], dtype=np.int64) + np.repeat(firsts - starts - tomb, counts)
        is_tomb = np.repeat(tomb, counts)
        is_tomb_id = is_tomb.copy()
        is_tomb_id[starts[tomb]] = False
        put = ~is_tomb
        return run_keys, (ids[put], seqs[put]), (ids[is_tomb_id], seqs[is_tomb_id])

    def space(self, table: str) -> tuple[int, int]:
        """(rows in the log, live rows) of ``table``."""
        t = self._tables[table]
        return t.alive.totals()[0], len(t.index) - t.deleted.hidden
