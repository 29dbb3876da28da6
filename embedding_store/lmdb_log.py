"""The log layout of the SSD tier: rows placed by write time, an id -> record index in RAM, compaction.

In an id-keyed B-tree much larger than a transaction, every written-back row rewrites its own 4 KiB leaf
page (docs/tiers.md, "Write-back by write time"). In this layout a table's rows are records of a log:

- every write gives its rows the table's next *sequence numbers*; rows with consecutive numbers are
  packed into *blocks* of up to ``Geometry.block`` rows (as many as fit half a 4 KiB page), each an LMDB
  value keyed by its 8-byte big-endian block number and appended (``putmulti(append=True)``) to the
  *segment* holding it: one LMDB sub-database per ``segment_rows`` numbers. Every write starts a block;
- the ids of each write go to the table's *runs* database (key: the run's first sequence number,
  value: up to ``RUN_IDS`` int64 ids, small enough to stay inside a page), in the same transaction;
- :mod:`embedding_store.log_index` maps each id to the sequence number of its newest record. It lives in
  RAM and is rebuilt on open from the runs (oldest first, so the newest record of an id wins);
- while the log's records are ``compact_at`` dead, its deadest sealed segment (not the one appended to)
  is compacted: its live rows are copied to the head (new numbers), then the segment and its runs are
  dropped. Compaction is driven by the space, not by each segment's own dead share: under uniform
  updates the segments of one fill all reach any per-segment threshold at once (a burst of copies),
  while the log as a whole dies steadily, and a segment compacted later is deader (cheaper).

Publication order keeps every read exact while the writer runs. The index moves to new records only
after their transaction committed, so a reader that looks up an id finds a committed record. A reader
looks ids up before it begins its transactions and holds the backend's shared lock across both; a
compacted segment is dropped under the exclusive lock, after the index has left it, so no reader can
still be on its way to it. A process killed anywhere leaves committed transactions only: a copy without
its drop is a newer record of the same row (same bytes), and its old segment is compacted again later.

Reads sort the ids' sequence numbers (a segment's blocks in file order) and read each block holding one
once, in runs over the backend's reader pool: a page read per cold row (blocks are leaf values, so LMDB
faults outside the interpreter lock and the runs' faults are in flight together). Compaction asks for a
segment's pages ahead of its reads (:mod:`embedding_store.readahead`). Only ``lmdb_backend`` and
``lmdb_scan`` import ``lmdb``; this module is handed the environment, and LMDB's errors are mapped there.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError
from embedding_store.lmdb_threads import ReaderPool, SharedExclusiveLock
from embedding_store.log_format import (
    RUN_IDS,
    Geometry,
    blocks_of,
    encode_keys,
    rows_of_blocks,
    runs_name,
    segment_name,
    split_segments,
)
from embedding_store.log_index import SeqIndex, make_seq_index
from embedding_store.log_live import Liveness
from embedding_store.readahead import (
    PAGE,
    PROBE_EVERY,
    MappedFile,
    joined,
    page_runs,
    probed_pages,
)

__all__ = ["LogIo", "LogStats", "LogTables", "replay_runs"]

# Run records between two read-ahead probes (a record takes at most half a page).
RUN_PROBE_EVERY = 8

# Blocks of a compaction's walk joined and unpacked at once (~1.8 MiB of copies at 1.8 KiB a block).
WALK_BLOCKS = 1024

# Live rows of a compaction's copy per transaction (bounds the dirty pages and the blocks held).
COPY_ROWS = 1 << 16


Commit = Callable[..., None]  # commit(fill(txn), need_bytes, num_rows, exclusive=False)


@dataclass(frozen=True, slots=True)
class LogIo:
    """How :class:`LogTables` commits and reads through its backend.

    Attributes:
        commit: runs ``fill(txn)`` in one write transaction (``commit(fill, need_bytes, num_rows,
            exclusive=False)``; run again whole after a map resize, so ``fill`` opens again any handle
            that an aborted run opened or dropped; LMDB errors mapped to StoreErrors).
        count_read: told of every read (it drops the mapped pages every so many rows).
        mapped: the data file's map, for read-ahead of compacted segments (None: no read-ahead).
        unmap_every: blocks read between two ``count_read`` calls (``LmdbOptions.unmap_every_rows``;
            None: a read is one chunk), so a large read's mapped pages are dropped as it goes.
    """

    commit: Commit
    count_read: Callable[[int], None]
    mapped: MappedFile | None = None
    unmap_every: int | None = None


_Staged = tuple["_Table", np.ndarray, np.ndarray, np.ndarray]  # table, (N,) ids, (N, R) rows, (N,) seqs


def replay_runs(
    env: Any, runs_db: Any, spec: TableSpec, geo: Geometry
) -> tuple[SeqIndex, dict[int, int], int]:
    """The index of ``spec``'s log rebuilt from its runs, oldest first (the newest record of an id wins).

    Returns:
        the index, rows per segment, and the next sequence number (block-aligned).
    """
    index, end = make_seq_index(spec.num_embeddings), 0
    records: dict[int, int] = {}
    damaged = f"table {spec.name!r}: a damaged run record in the log"
    with env.begin(db=runs_db) as txn:
        for key, value in txn.cursor():
            first = int.from_bytes(key, "big")
            if len(key) != 8 or len(value) % 8 or not value or first < end:
                raise StoreCorruptError(damaged)
            ids = np.frombuffer(value, dtype="<i8").astype(np.int64)
            end = first + ids.shape[0]
            seg = first // geo.segment
            if (end - 1) // geo.segment != seg or ids.min() < 0:
                raise StoreCorruptError(damaged)
            try:
                index.upsert(ids, np.arange(first, end, dtype=np.int64))
            except IndexError as err:
                raise StoreCorruptError(
                    f"table {spec.name!r}: the log holds ids outside its id space"
                ) from err
            records[seg] = records.get(seg, 0) + ids.shape[0]
    return index, records, -(-end // geo.block) * geo.block


@dataclass(slots=True)
class LogStats:
    """Counters of the log layout (all tables), for benchmarks and the write-amplification account."""

    appended_rows: int = 0  # rows written by put_rows
    copied_rows: int = 0  # rows copied by compaction
    compactions: int = 0  # segments dropped
    compact_s: float = 0.0  # wall time spent compacting
    readahead_bytes: int = 0  # bytes of compacted segments asked for ahead of their reads


@dataclass(slots=True)
class _Table:
    spec: TableSpec
    geo: Geometry
    index: SeqIndex
    runs_db: Any
    alive: Liveness  # records written into each segment, and which of them the index points at
    segs: dict[int, Any] = field(default_factory=dict)  # segment -> LMDB database
    next_seq: int = 0  # block-aligned
    version: int = 0  # bumped at every publication (invalidates the sorted ids of scan)
    sorted_ids: tuple[int, np.ndarray] | None = None
    # (segment, 0) -> (probed block numbers, their pages in the data file) of each append into it;
    # (segment, 1) -> (probed run records' numbers, pages) of the segment's run records
    probes: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)


class LogTables:
    """The tables of one LMDB environment in the log layout.

    Args:
        env: the open environment (``max_dbs`` large enough for every table's segments).
        tables: the tables.
        layout: (segment rows of the store, ``compact_at``: dead share of the log at which its deadest
            sealed segment is compacted, in (0, 1)).
        locks: the backend's shared/exclusive lock (shared: reads and commits; exclusive: map resize,
            segment drops) and its reader pool.
        io: how it commits and reads (:class:`LogIo`).
    """

    def __init__(
        self,
        env: Any,
        tables: Sequence[TableSpec],
        *,
        layout: tuple[int, float],
        locks: tuple[SharedExclusiveLock, ReaderPool],
        io: LogIo,
    ) -> None:
        self._env = env
        self._segment_rows, self._compact_at = layout
        self._rw, self._readers = locks
        self._io = io
        self._index_lock = threading.Lock()  # index lookups and updates
        self._write_lock = threading.Lock()  # one writer at a time (appends and compactions)
        self.stats = LogStats()
        self._tables = {t.name: self._load(t) for t in tables}

    def _load(self, spec: TableSpec) -> _Table:
        geo = Geometry.of(spec, self._segment_rows)
        runs_db = self._env.open_db(runs_name(spec.name))
        index, records, end = replay_runs(self._env, runs_db, spec, geo)
        alive = Liveness(geo.segment, records, index.items()[1])
        t = _Table(spec=spec, geo=geo, index=index, runs_db=runs_db, alive=alive, next_seq=end)
        for seg in records:
            t.segs[seg] = self._env.open_db(segment_name(spec.name, seg), create=False)
        return t

    # ----------------------------------------------------------------------------------------- reads
    def num_rows(self, table: str) -> int:
        return len(self._tables[table].index)

    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (N,) ids: ((N,) found, (F, R) rows of the found ids in the order of ``ids``)."""
        t = self._tables[table]
        with self._rw.shared():
            with self._index_lock:
                seqs = t.index.lookup(ids)
            found = seqs >= 0
            want = seqs[found]
            order = np.argsort(want, kind="stable")
            ordered = want[order]  # ascending: each segment's blocks in file order
            rows = np.empty((want.shape[0], t.spec.row_floats), dtype=np.float32)
            if want.shape[0]:
                rows[order] = self._read(t, ordered)
        return found, rows

    def _read(self, t: _Table, ordered: np.ndarray) -> np.ndarray:
        """Rows of ascending sequence numbers (the caller holds the shared lock)."""
        inverse, keys, seg_of, seg_bounds = t.geo.plan(ordered)
        values: list[bytes | None] = []
        step = max(1, self._io.unmap_every or len(keys))
        for lo in range(0, len(keys), step):  # the mapped pages are dropped between chunks (bounded RSS)
            hi = min(len(keys), lo + step)
            runs = self._readers.runs(hi - lo)
            bounds = sorted({b for b in seg_bounds if lo < b < hi} | {lo, hi} | {lo + r.start for r in runs})
            pieces = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
            got = self._readers.map(functools.partial(self._read_blocks, t, keys, seg_of), pieces)
            self._io.count_read(hi - lo)
            values.extend(v for run in got for v in run)
        return rows_of_blocks(values, inverse, ordered % t.geo.block, t.spec)

    def _read_span(self, t: _Table, seg: int, ordered: np.ndarray) -> np.ndarray:
        """Rows of ascending sequence numbers of segment ``seg`` (the caller holds the shared lock), read by
        walking the segment's blocks from the first one's block to the last one's.

        Compaction reads nearly every block of its segment (a block holds a live row unless all its rows
        died), and a cursor's walk costs less than a search for each block (``getmulti``). A segment's
        blocks have consecutive numbers (every write starts a block at the segment's next number), so
        the walk checks only that it began on the first block, that no piece came up short and that it
        ended on the last. The walk's block copies are joined and unpacked ``WALK_BLOCKS`` at a time:
        they stay in reused heap memory (a join of a whole span maps fresh pages and faults on each).
        """
        numbers, spec = ordered // t.geo.block, t.spec
        first, last = int(numbers[0]), int(numbers[-1])
        step = max(1, self._io.unmap_every or last - first + 1)
        out = np.empty((ordered.shape[0], spec.row_floats), dtype=np.float32)
        for lo in range(first, last + 1, step):  # the mapped pages are dropped between chunks (bounded RSS)
            count = min(step, last + 1 - lo)
            ends = encode_keys(np.array([lo, lo + count - 1]))
            missing = StoreCorruptError(
                f"table {spec.name!r}: blocks {lo}..{lo + count - 1} of log segment {seg} are not all there"
            )
            with self._env.begin(db=t.segs[seg]) as txn:
                cursor = txn.cursor()
                if not cursor.set_key(ends[0]):
                    raise missing
                walk = cursor.iternext(keys=False)
                for a in range(lo, lo + count, WALK_BLOCKS):
                    n = min(WALK_BLOCKS, lo + count - a)
                    values = list(itertools.islice(walk, n))
                    if len(values) != n:
                        raise missing
                    i, j = np.searchsorted(numbers, [a, a + n])
                    out[i:j] = rows_of_blocks(values, numbers[i:j] - a, ordered[i:j] % t.geo.block, spec)
                # Keys ascend: the walk ends on block lo + count - 1 only if none between was missing.
                if cursor.key() != ends[1]:
                    raise missing
            self._io.count_read(count)
        return out

    def _read_blocks(
        self, t: _Table, keys: list[bytes], seg_of: np.ndarray, run: slice
    ) -> list[bytes | None]:
        # A get per key: py-lmdb's getmulti also builds a (key, value) tuple and a key copy per key, and
        # costs more than this loop.
        with self._env.begin(db=t.segs[int(seg_of[run.start])]) as txn:
            get = txn.get
            return [get(key) for key in keys[run]]

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` stored rows with id > ``after``, ascending ids: ((n,) ids, (n, R) rows)."""
        t = self._tables[table]
        with self._index_lock:
            if t.sorted_ids is None or t.sorted_ids[0] != t.version:
                t.sorted_ids = (t.version, np.sort(t.index.items()[0]))
            ids = t.sorted_ids[1]
        start = int(np.searchsorted(ids, after, side="right"))
        chunk = ids[start : start + limit]
        found, rows = self.get_rows(table, chunk)
        if not found.all():  # ids are never removed
            raise StoreCorruptError(f"table {table!r}: the log index lost rows during a scan")
        return chunk, rows

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

    def _append(self, staged: list[_Staged]) -> None:
        staged = [
            (t, np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(rows, dtype=np.float32), seqs)
            for t, ids, rows, seqs in staged
            if ids.shape[0]
        ]
        if not staged:
            return
        opened: dict[tuple[str, int], Any] = {}

        def fill(txn: Any) -> None:
            opened.clear()  # a transaction run again after a map resize opens its new segments again
            for t, ids, rows, seqs in staged:
                seq_keys = encode_keys(seqs)
                for a, b in split_segments(seqs, t.geo.segment):
                    seg = int(seqs[a]) // t.geo.segment
                    db = t.segs.get(seg) or opened.get((t.spec.name, seg))
                    if db is None:  # a new segment: created in this transaction, usable after its commit
                        db = self._env.open_db(segment_name(t.spec.name, seg), txn=txn, create=True)
                        opened[(t.spec.name, seg)] = db
                    txn.cursor(db=db).putmulti(blocks_of(rows[a:b], int(seqs[a]), t.geo.block), append=True)
                    for r in range(a, b, RUN_IDS):
                        txn.put(
                            seq_keys[r],
                            ids[r : min(b, r + RUN_IDS)].astype("<i8").tobytes(),
                            db=t.runs_db,
                            append=True,
                        )

        rows = sum(s[1].shape[0] for s in staged)
        self._io.commit(fill, sum(s[2].nbytes + 16 * s[1].shape[0] for s in staged), rows)
        for (name, seg), db in opened.items():
            t = self._tables[name]
            t.segs[seg] = db
            t.alive.open(seg)
        self._publish(staged)
        self._note_pages(staged)

    def _note_pages(self, staged: list[_Staged]) -> None:
        """Note the pages of every ``PROBE_EVERY``-th block and ``RUN_PROBE_EVERY``-th run record just
        appended (read-ahead hints, :mod:`embedding_store.readahead`); they were just written: no faults."""
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

    def _read_ahead(self, t: _Table, seg: int) -> None:
        """Ask for the page runs of segment ``seg``'s appends (its blocks and its run records) ahead of
        compaction's reads, in the background."""
        per_page = max(1, PAGE // (t.geo.block * t.spec.row_bytes))
        runs: list[tuple[int, int]] = []
        for kind, pad in ((1, RUN_PROBE_EVERY), (0, PROBE_EVERY // per_page)):  # the run records first:
            probes = joined(t.probes.pop((seg, kind), []))  # compaction reads them before the blocks
            runs += [] if probes is None else page_runs(*probes, pad=pad)
        if self._io.mapped is not None:
            self.stats.readahead_bytes += self._io.mapped.willneed(runs)

    def _publish(self, staged: list[_Staged]) -> None:
        """Point the index at committed records and count live rows per segment."""
        with self._index_lock:
            for t, ids, _, seqs in staged:
                old = t.index.upsert(ids, seqs)
                t.version += 1
                t.next_seq = -(-(int(seqs[-1]) + 1) // t.geo.block) * t.geo.block
                t.alive.publish(old, seqs)

    # ------------------------------------------------------------------------------------ compaction
    def _victim(self, t: _Table) -> int | None:
        """The sealed segment to compact now (the deadest, while the log is ``compact_at`` dead), or None."""
        head, records, live = t.next_seq // t.geo.segment, t.alive.records, t.alive.live
        total = sum(records.values())
        if total - len(t.index) < self._compact_at * total:
            return None
        sealed = [seg for seg in records if seg < head and records[seg] > live[seg]]
        return min(sealed, key=lambda s: live[s] / records[s]) if sealed else None

    def _compact_while_needed(self, t: _Table) -> None:
        while (seg := self._victim(t)) is not None:
            start = time.perf_counter()
            self.compact(t.spec.name, seg)
            self.stats.compact_s += time.perf_counter() - start

    def compact(self, table: str, seg: int) -> None:
        """Copy segment ``seg``'s live rows to the head, then drop it with its runs."""
        t = self._tables[table]
        self._read_ahead(t, seg)
        run_keys, ids, seqs = self._runs_of(t, seg)
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
        self.stats.compactions += 1

    def _runs_of(self, t: _Table, seg: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """The run keys, ids and sequence numbers (ascending) of segment ``seg``."""
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
        if (counts % 8).any() or any(len(key) != 8 for key in run_keys):
            raise StoreCorruptError(f"table {t.spec.name!r}: a damaged run record in log segment {seg}")
        counts //= 8
        firsts = np.frombuffer(b"".join(run_keys), dtype=">u8").astype(np.int64)
        ids = np.frombuffer(b"".join(values), dtype="<i8").astype(np.int64)
        starts = np.cumsum(counts) - counts  # where each record's ids begin in ``ids``
        seqs = np.arange(ids.shape[0], dtype=np.int64) + np.repeat(firsts - starts, counts)
        return run_keys, ids, seqs

    def space(self, table: str) -> tuple[int, int]:
        """(rows in the log, live rows) of ``table``."""
        t = self._tables[table]
        return t.alive.totals()[0], len(t.index)
