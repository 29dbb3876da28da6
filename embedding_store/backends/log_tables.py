"""The log layout of the SSD tier: rows placed by write time, an id -> record index in RAM, compaction.

In an id-keyed B-tree much larger than a transaction, every written-back row rewrites its own 4 KiB leaf
page (docs/tiers.md, "Write-back by write time"). In this layout a table's rows are records of a log:

- every write gives its rows the table's next *sequence numbers*; rows with consecutive numbers are
  packed into *blocks* of up to ``Geometry.block`` rows (as many as fit half a 4 KiB page when the table
  was made; the geometry is recorded in the store's metadata and read from there), each an LMDB
  value keyed by its 8-byte big-endian block number and appended (``putmulti(append=True)``) to the
  *segment* holding it: one LMDB sub-database per ``segment_rows`` numbers. Every write starts a block;
- the ids of each write go to the table's *runs* database (key: the run's first sequence number,
  value: up to ``RUN_IDS`` int64 ids, small enough to stay inside a page), in the same transaction;
- :mod:`embedding_store.log_index` maps each id to the sequence number of its newest record. It lives in
  RAM and is rebuilt on open from the runs (oldest first, so the newest record of an id wins;
  :mod:`~embedding_store.backends.log_records`). A delete writes *tombstone* runs, which hide the ids'
  older records;
- while the log's records are ``compact_at`` dead, its deadest sealed segment is compacted
  (:mod:`~embedding_store.backends.log_compact`).

Publication order keeps every read exact while the writer runs. The index moves to new records only
after their transaction committed, so a reader that looks up an id finds a committed record. A reader
looks ids up before it begins its transactions and holds the backend's shared lock across both; a
compacted segment is dropped under the exclusive lock, after the index has left it, so no reader can
still be on its way to it. A process killed anywhere leaves committed transactions only: a copy without
its drop is a newer record of the same row (same bytes), and its old segment is compacted again later.

Reads sort the ids' sequence numbers (a segment's blocks in file order) and read each block holding one
once, in runs over the backend's reader pool: a page read per cold row (blocks are leaf values, so LMDB
faults outside the interpreter lock and the runs' faults are in flight together). A run views its blocks
in the map and copies out only the rows asked for, inside its transaction. Compaction asks for a
segment's pages ahead of its reads (:mod:`~embedding_store.backends.readahead`). This module is handed
the environment; LMDB's errors are mapped by :mod:`~embedding_store.backends.log`.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embedding_store.backends.lmdb_threads import ReaderPool, SharedExclusiveLock
from embedding_store.backends.log_compact import LogCompaction
from embedding_store.backends.log_format import (
    RUN_IDS,
    Geometry,
    blocks_of,
    encode_keys,
    rows_of_blocks,
    runs_name,
    segment_name,
    split_segments,
)
from embedding_store.backends.log_records import (
    TOMB_IDS,
    LogIo,
    LogStats,
    Table,
    replay_runs,
    tomb_value,
)
from embedding_store.backends.readahead import PAGE, PROBE_EVERY, joined, page_runs, probed_pages
from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError, StoreSegmentsError

__all__ = ["LOG_MAX_SEGMENTS", "LogIo", "LogStats", "LogTables"]

# Segments of all tables of an environment at most (its named databases beyond two per table: one per
# ``log_segment_rows`` records; ~330 for 100 M live rows of one table at the default compaction point).
# A write that would need more raises StoreSegmentsError before anything is written.
LOG_MAX_SEGMENTS = 1024

# Run records between two read-ahead probes (a record takes at most half a page).
RUN_PROBE_EVERY = 8

# Blocks of a compaction's walk joined and unpacked at once (~1.8 MiB of copies at 1.8 KiB a block).
WALK_BLOCKS = 1024


_Staged = tuple[Table, np.ndarray, np.ndarray, np.ndarray]  # table, (N,) ids, (N, R) rows, (N,) seqs
_Tombs = tuple[Table, np.ndarray, np.ndarray]  # table, (N,) deleted ids, (N,) their tombstones' numbers


class LogTables(LogCompaction):
    """The tables of one LMDB environment in the log layout.

    Args:
        env: the open environment (``max_dbs`` large enough for ``LOG_MAX_SEGMENTS`` segments).
        tables: the tables.
        layout: (each table's geometry, as recorded in the store's metadata; ``compact_at``: dead share
            of the log at which its deadest sealed segment is compacted, in (0, 1)).
        locks: the backend's shared/exclusive lock (shared: reads and commits; exclusive: map resize,
            segment drops) and its reader pool.
        io: how it commits and reads (:class:`LogIo`).
    """

    def __init__(
        self,
        env: Any,
        tables: Sequence[TableSpec],
        *,
        layout: tuple[Mapping[str, Geometry], float],
        locks: tuple[SharedExclusiveLock, ReaderPool],
        io: LogIo,
    ) -> None:
        self._env = env
        self._geometry, self._compact_at = layout
        self._rw, self._readers = locks
        self._io = io
        self._index_lock = threading.Lock()  # index lookups and updates
        self._write_lock = threading.Lock()  # one writer at a time (appends and compactions)
        self.stats = LogStats()
        self._tables = {t.name: self._load(t) for t in tables}

    def _load(self, spec: TableSpec) -> Table:
        runs_db = self._env.open_db(runs_name(spec.name))
        t, records = replay_runs(self._env, runs_db, spec, self._geometry[spec.name])
        for seg in records:
            t.segs[seg] = self._env.open_db(segment_name(spec.name, seg), create=False)
        return t

    # ----------------------------------------------------------------------------------------- reads
    def num_rows(self, table: str) -> int:
        t = self._tables[table]
        return len(t.index) - t.deleted.hidden

    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (N,) ids: ((N,) found, (F, R) rows of the found ids in the order of ``ids``)."""
        t = self._tables[table]
        with self._rw.shared():
            with self._index_lock:
                seqs = t.index.lookup(ids)
                if len(t.deleted):
                    seqs[t.deleted.hides(ids, seqs)] = -1
            found = seqs >= 0
            want = seqs[found]
            order = np.argsort(want, kind="stable")
            ordered = want[order]  # ascending: each segment's blocks in file order
            rows = np.empty((want.shape[0], t.spec.row_floats), dtype=np.float32)
            if want.shape[0]:
                rows[order] = self._read(t, ordered)
        return found, rows

    def _read(self, t: Table, ordered: np.ndarray) -> np.ndarray:
        """Rows of ascending sequence numbers (the caller holds the shared lock)."""
        inverse, keys, seg_of, seg_bounds = t.geo.plan(ordered)
        out = np.empty((ordered.shape[0], t.spec.row_floats), dtype=np.float32)
        slots = ordered % t.geo.block
        step = max(1, self._io.unmap_every or len(keys))
        for lo in range(0, len(keys), step):  # the mapped pages are dropped between chunks (bounded RSS)
            hi = min(len(keys), lo + step)
            runs = self._readers.runs(hi - lo)
            bounds = sorted({b for b in seg_bounds if lo < b < hi} | {lo, hi} | {lo + r.start for r in runs})
            pieces = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
            read = functools.partial(self._read_blocks, t, (keys, seg_of, inverse, slots), out)
            self._readers.map(read, pieces)
            self._io.count_read(hi - lo)
        return out

    def _read_span(self, t: Table, seg: int, ordered: np.ndarray) -> np.ndarray:
        """Rows of ascending sequence numbers of segment ``seg`` (the caller holds the shared lock), read by
        walking the segment's blocks from the first one's block to the last one's.

        Compaction reads nearly every block of its segment (a block holds a live row unless all its rows
        died), and a cursor's walk costs less than a search for each block (``getmulti``). A segment's
        blocks have consecutive numbers (every write starts a block at the segment's next number) except
        where tombstones took sequence numbers without blocks, so the walk checks that it began on the
        first block and that each piece of it ended on the block it should; a span with such a gap is
        read again block by block (:meth:`_read_span_by_key`). The walk's block copies are joined and
        unpacked ``WALK_BLOCKS`` at a time: they stay in reused heap memory (a join of a whole span maps
        fresh pages and faults on each).
        """
        numbers, spec = ordered // t.geo.block, t.spec
        first, last = int(numbers[0]), int(numbers[-1])
        step = max(1, self._io.unmap_every or last - first + 1)
        out = np.empty((ordered.shape[0], spec.row_floats), dtype=np.float32)
        for lo in range(first, last + 1, step):  # the mapped pages are dropped between chunks (bounded RSS)
            count = min(step, last + 1 - lo)
            ends = encode_keys(np.array([lo]))
            missing = StoreCorruptError(
                f"table {spec.name!r}: blocks {lo}..{lo + count - 1} of log segment {seg} are not all there"
            )
            with self._env.begin(db=t.segs[seg]) as txn:
                cursor = txn.cursor()
                walked = cursor.set_key(ends[0])
                walk = cursor.iternext(keys=False)
                for a in range(lo, lo + count, WALK_BLOCKS) if walked else ():
                    n = min(WALK_BLOCKS, lo + count - a)
                    values = list(itertools.islice(walk, n))
                    # Keys ascend: a piece ends on block a + n - 1 only if none in it was missing.
                    if len(values) != n or cursor.key() != encode_keys(np.array([a + n - 1]))[0]:
                        walked = False
                        break
                    i, j = np.searchsorted(numbers, [a, a + n])
                    out[i:j] = rows_of_blocks(values, numbers[i:j] - a, ordered[i:j] % t.geo.block, spec)
                if not walked:
                    i, j = np.searchsorted(numbers, [lo, lo + count])
                    out[i:j] = self._read_span_by_key(txn, t, numbers[i:j], ordered[i:j], missing)
            self._io.count_read(count)
        return out

    @staticmethod
    def _read_span_by_key(
        txn: Any, t: Table, numbers: np.ndarray, ordered: np.ndarray, missing: StoreCorruptError
    ) -> np.ndarray:
        """Rows of ascending sequence numbers ``ordered`` (blocks ``numbers``) read block by block: a span
        whose block numbers have gaps (tombstones' sequence numbers hold no block). Every block holding
        one of the rows must be there."""
        need = np.unique(numbers)
        values = [txn.get(key) for key in encode_keys(need)]
        if any(v is None for v in values):
            raise missing
        return rows_of_blocks(values, np.searchsorted(need, numbers), ordered % t.geo.block, t.spec)

    def _read_blocks(
        self,
        t: Table,
        plan: tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray],
        out: np.ndarray,
        run: slice,
    ) -> None:
        """Rows of the blocks ``keys[run]`` (one segment's) into their rows of ``out``: a ``get`` per block
        in a ``buffers=True`` transaction, so a block is not copied out of the map before its rows are.
        (py-lmdb's getmulti also builds a (key, value) tuple and a key copy per key, and costs more than
        this loop.)"""
        keys, seg_of, inverse, slots = plan
        i, j = np.searchsorted(inverse, [run.start, run.stop])
        with self._env.begin(db=t.segs[int(seg_of[run.start])], buffers=True) as txn:
            get = txn.get
            values = [get(key) for key in keys[run]]  # views of the map: valid until the txn ends
            out[i:j] = rows_of_blocks(values, inverse[i:j] - run.start, slots[i:j], t.spec)

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` stored rows with id > ``after``, ascending ids: ((n,) ids, (n, R) rows)."""
        t = self._tables[table]
        while True:
            with self._index_lock:
                if t.sorted_ids is None or t.sorted_ids[0] != t.version:
                    t.sorted_ids = (t.version, np.sort(t.live_items()[0]))
                version, ids = t.sorted_ids
            start = int(np.searchsorted(ids, after, side="right"))
            chunk = ids[start : start + limit]
            found, rows = self.get_rows(table, chunk)
            if found.all():
                return chunk, rows
            with self._index_lock:
                if t.version == version:  # only a delete_rows (another thread's) removes ids
                    raise StoreCorruptError(f"table {table!r}: the log index lost rows during a scan")
            # a delete_rows committed between the listing and the read: list the ids again

    # ---------------------------------------------------------------------------------------- writes
    def put_rows(self, writes: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Append ``(table, (N,) unique ids, (N, R) rows)`` groups in one transaction, then compact."""
        with self._write_lock:
            staged: list[_Staged] = []
            next_seq: dict[str, int] = {}
            for table, ids, rows in writes:
                t = self._tables[table]
                first = next_seq.get(table, t.next_seq)
                n = ids.shape[0]
                staged.append((t, ids, rows, np.arange(first, first + n, dtype=np.int64)))
                next_seq[table] = first + -(-n // t.geo.block) * t.geo.block
            self._append(staged)
            self.stats.appended_rows += sum(s[1].shape[0] for s in staged)
            for table in dict.fromkeys(w[0] for w in writes):
                self._compact_while_needed(self._tables[table])

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        """Delete the rows of (N,) sorted unique ids (absent ones are skipped): tombstone runs, written in
        one transaction, hide the ids' records here and at the next open; the records die (compaction)."""
        with self._write_lock:
            t = self._tables[table]
            with self._index_lock:
                seqs = t.index.lookup(ids)
                stored = (seqs >= 0) & ~t.deleted.hides(ids, seqs)
            gone = np.ascontiguousarray(ids[stored], dtype=np.int64)
            if not gone.shape[0]:
                return
            self._append([], [(t, gone, np.arange(t.next_seq, t.next_seq + gone.shape[0], dtype=np.int64))])
            self.stats.deleted_rows += gone.shape[0]
            self._compact_while_needed(t)

    def _check_segments(self, spans: list[tuple[Table, np.ndarray]]) -> None:
        """Raise StoreSegmentsError, before anything is written, when ``spans`` (tables' new sequence
        numbers) would open more segments than ``LOG_MAX_SEGMENTS`` (all tables together)."""
        new: dict[tuple[str, int], Table] = {}
        for t, seqs in spans:  # consecutive numbers: the segments from the first's to the last's
            for seg in range(int(seqs[0]) // t.geo.segment, int(seqs[-1]) // t.geo.segment + 1):
                if seg not in t.segs:
                    new[(t.spec.name, seg)] = t
        total = sum(len(t.segs) for t in self._tables.values()) + len(new)
        if new and total > LOG_MAX_SEGMENTS:
            t = next(iter(new.values()))
            raise StoreSegmentsError(
                f"store {self._io.where}: a write needs log segments beyond the cap of {LOG_MAX_SEGMENTS} "
                f"(all tables; {total - len(new)} open) of the log layout; nothing was written. Table "
                f"{t.spec.name!r} has {t.geo.segment} rows a segment, recorded when the store was made "
                f"from store.lmdb.log_segment_rows: restore it into a store made with a larger value "
                "(restore_resharded) or compact it"
            )

    def _append(self, staged: list[_Staged], tombs: Sequence[_Tombs] = ()) -> None:
        """Write rows (``staged``) and tombstones in one transaction, then publish them."""
        staged = [
            (t, np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(rows, dtype=np.float32), seqs)
            for t, ids, rows, seqs in staged
            if ids.shape[0]
        ]
        if not staged and not tombs:
            return
        self._check_segments([(s[0], s[3]) for s in staged] + [(t, seqs) for t, _, seqs in tombs])
        opened: dict[tuple[str, int], Any] = {}

        def segment(txn: Any, t: Table, seg: int) -> Any:
            db = t.segs.get(seg) or opened.get((t.spec.name, seg))
            if db is None:  # a new segment: created in this transaction, usable after its commit
                db = self._env.open_db(segment_name(t.spec.name, seg), txn=txn, create=True)
                opened[(t.spec.name, seg)] = db
            return db

        def fill(txn: Any) -> None:
            opened.clear()  # a transaction run again after a map resize opens its new segments again
            for t, ids, rows, seqs in staged:
                seq_keys = encode_keys(seqs)
                for a, b in split_segments(seqs, t.geo.segment):
                    db = segment(txn, t, int(seqs[a]) // t.geo.segment)
                    txn.cursor(db=db).putmulti(blocks_of(rows[a:b], int(seqs[a]), t.geo.block), append=True)
                    for r in range(a, b, RUN_IDS):
                        value = ids[r : min(b, r + RUN_IDS)].astype("<i8").tobytes()
                        txn.put(seq_keys[r], value, db=t.runs_db, append=True)
            for t, ids, seqs in tombs:  # no blocks; the segment exists, as for every record
                seq_keys = encode_keys(seqs)
                for a, b in split_segments(seqs, t.geo.segment):
                    segment(txn, t, int(seqs[a]) // t.geo.segment)
                    for r in range(a, b, TOMB_IDS):
                        txn.put(
                            seq_keys[r], tomb_value(ids[r : min(b, r + TOMB_IDS)]), db=t.runs_db, append=True
                        )

        rows = sum(s[1].shape[0] for s in staged)
        need = sum(s[2].nbytes + 16 * s[1].shape[0] for s in staged) + sum(16 * s[1].shape[0] for s in tombs)
        self._io.commit(fill, need, rows)
        for (name, seg), db in opened.items():
            t = self._tables[name]
            t.segs[seg] = db
            t.alive.open(seg)
        self._publish(staged, tombs)
        self._note_pages(staged)

    def _note_pages(self, staged: list[_Staged]) -> None:
        """Note the pages of every ``PROBE_EVERY``-th block and ``RUN_PROBE_EVERY``-th run record just
        appended (read-ahead hints, :mod:`~embedding_store.backends.readahead`); they were just written: no faults."""
        base = None if self._io.mapped is None else self._io.mapped.base()
        if base is None:
            return
        probed = 0
        with self._rw.shared(), self._env.begin(buffers=True) as txn:
            for t, _, _, seqs in staged:
                for a, b in split_segments(seqs, t.geo.segment):
                    seg = int(seqs[a]) // t.geo.segment
                    first, count = int(seqs[a]) // t.geo.block, -(-(b - a) // t.geo.block)
                    blocks = first + np.arange(0, count, PROBE_EVERY)
                    runs = seqs[a : b : RUN_IDS * RUN_PROBE_EVERY]  # the keys of every 8th run record
                    # (kind, database, keys, numbering: blocks by number, run records by their ordinal)
                    for kind, db, keys, numbers in (
                        (0, t.segs[seg], blocks, blocks),
                        (1, t.runs_db, runs, runs // RUN_IDS),
                    ):
                        pages = probed_pages(txn.cursor(db=db), encode_keys(keys), base)
                        if pages is not None:
                            t.probes.setdefault((seg, kind), []).append((numbers, pages))
                    probed += blocks.shape[0] + runs.shape[0]
        self._io.count_read(probed)

    def _read_ahead(self, t: Table, seg: int) -> None:
        """Ask for the page runs of segment ``seg``'s appends (its blocks and its run records) ahead of
        compaction's reads, in the background."""
        per_page = max(1, PAGE // (t.geo.block * t.spec.row_bytes))
        runs: list[tuple[int, int]] = []
        for kind, pad in ((1, RUN_PROBE_EVERY), (0, PROBE_EVERY // per_page)):  # the run records first:
            probes = joined(t.probes.pop((seg, kind), []))  # compaction reads them before the blocks
            runs += [] if probes is None else page_runs(*probes, pad=pad)
        if self._io.mapped is not None:
            self.stats.readahead_bytes += self._io.mapped.willneed(runs)

    def _publish(self, staged: list[_Staged], tombs: Sequence[_Tombs] = ()) -> None:
        """Point the index at committed records (and hide deleted ids) and count live rows per segment."""
        with self._index_lock:
            for t, ids, _, seqs in staged:
                old = t.deleted.put(ids, t.index.upsert(ids, seqs))  # a deleted id's old record is dead
                t.version += 1
                t.next_seq = -(-(int(seqs[-1]) + 1) // t.geo.block) * t.geo.block
                t.alive.publish(old, seqs)
            for t, ids, seqs in tombs:
                old = t.deleted.mark(ids, seqs, t.index.lookup(ids))
                t.version += 1
                t.next_seq = -(-(int(seqs[-1]) + 1) // t.geo.block) * t.geo.block
                t.alive.publish(old, seqs[:0])
                t.alive.add_tombs(seqs)
