"""The log layout's run records and what is rebuilt from them at open: the id index, the deleted ids,
the records per segment (docs/tiers.md, "Write-back by write time"; :mod:`~embedding_store.backends.log_tables`).

A table's *runs* database maps the first sequence number of a run of records (8-byte big-endian key)
to the run's ids (little-endian int64, at most ``RUN_IDS``). A *tombstone* run (a delete) starts with the
marker ``-1`` (ids are >= 0) followed by up to ``RUN_IDS - 1`` deleted ids; it takes sequence numbers as
a write does (one per id) but has no blocks. Replaying the runs oldest first gives each id its newest
record: a put record, or a tombstone, which hides the id's older records (:class:`Deleted`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedding_store.backends.log_format import RUN_IDS, Geometry, encode_keys
from embedding_store.backends.log_live import Liveness
from embedding_store.backends.readahead import MappedFile
from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError, StoreIncompatibleError
from embedding_store.log_index import HashSeqIndex, SeqIndex, make_seq_index

__all__ = ["TOMB_IDS", "Deleted", "LogIo", "LogStats", "Table", "check_blocks", "replay_runs", "tomb_value"]

_TOMB = -1  # the first int64 of a tombstone run's value
TOMB_IDS = RUN_IDS - 1  # ids per tombstone run (the marker takes the place of one)

Commit = Callable[..., None]  # commit(fill(txn), need_bytes, num_rows, exclusive=False)


@dataclass(frozen=True, slots=True)
class LogIo:
    """How :class:`~embedding_store.backends.log_tables.LogTables` commits and reads through its backend.

    Attributes:
        commit: runs ``fill(txn)`` in one write transaction (``commit(fill, need_bytes, num_rows,
            exclusive=False)``; run again whole after a map resize, so ``fill`` opens again any handle
            that an aborted run opened or dropped; LMDB errors mapped to StoreErrors).
        count_read: told of every read (it drops the mapped pages every so many rows).
        mapped: the data file's map, for read-ahead of compacted segments (None: no read-ahead).
        unmap_every: blocks read between two ``count_read`` calls (``LmdbOptions.unmap_every_rows``;
            None: a read is one chunk), so a large read's mapped pages are dropped as it goes.
        where: the store, for messages.
    """

    commit: Commit
    count_read: Callable[[int], None]
    mapped: MappedFile | None = None
    unmap_every: int | None = None
    where: str = ""


@dataclass(slots=True)
class LogStats:
    """Counters of the log layout (all tables), for benchmarks and the write-amplification account."""

    appended_rows: int = 0  # rows written by put_rows
    copied_rows: int = 0  # rows copied by compaction
    compactions: int = 0  # segments dropped
    compact_s: float = 0.0  # wall time spent compacting
    readahead_bytes: int = 0  # bytes of compacted segments asked for ahead of their reads
    deleted_rows: int = 0  # rows removed by delete_rows
    forgotten_ids: int = 0  # deleted ids whose last record a compaction dropped (gone from the index)


class Deleted:
    """The ids whose newest record is a tombstone: id -> the tombstone's sequence number.

    A deleted id stays in the id index (:mod:`embedding_store.log_index`) while a record of it may be on
    disk; an id is stored when the index has it at a number above its tombstone's (a put after the delete
    gets a higher number). Compaction forgets an id (index and tombstone) once its last record is dropped.
    """

    def __init__(self) -> None:
        self._tombs = HashSeqIndex()
        self.hidden = 0  # ids of the index that a tombstone hides

    def __len__(self) -> int:
        return len(self._tombs)

    def hides(self, ids: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """(N,) bool: the index's ``seqs`` of ``ids`` are older than their tombstone."""
        if not len(self._tombs):
            return np.zeros(ids.shape[0], dtype=bool)
        return (seqs >= 0) & (self._tombs.lookup(ids) > seqs)

    def tomb_of(self, ids: np.ndarray) -> np.ndarray:
        """(N,) the newest tombstone's number of each id, -1 where none."""
        return self._tombs.lookup(ids) if len(self._tombs) else np.full(ids.shape[0], -1, dtype=np.int64)

    def mark(self, ids: np.ndarray, tombs: np.ndarray, old: np.ndarray) -> np.ndarray:
        """The tombstones ``tombs`` hide ``ids`` (``old``: their numbers in the index); returns ``old``
        with -1 for the ids that were not stored (absent, or hidden already): the rest's records die."""
        stored = (old >= 0) & ~self.hides(ids, old)
        has = old >= 0  # a tombstone of an id without a record hides nothing
        self._tombs.upsert(ids[has], tombs[has])
        self.hidden += int(stored.sum())
        return np.where(stored, old, -1)

    def forget(self, ids: np.ndarray) -> None:
        """Hidden ``ids`` left the index with their last records: their tombstones are no longer needed."""
        self._tombs.remove(ids)
        self.hidden -= ids.shape[0]

    def put(self, ids: np.ndarray, old: np.ndarray) -> np.ndarray:
        """``ids`` were just put (``old``: their previous numbers); returns ``old`` with -1 for the ids
        that a tombstone hid (their old records are dead already)."""
        if not len(self._tombs):
            return old
        revived = self.hides(ids, old)
        if revived.any():
            self.hidden -= int(revived.sum())
            old = np.where(revived, -1, old)
        return old


def tomb_value(ids: np.ndarray) -> bytes:
    """The value of a tombstone run of up to ``TOMB_IDS`` ids."""
    return np.concatenate([np.array([_TOMB], dtype="<i8"), ids.astype("<i8")]).tobytes()


def parse_run(key: bytes, value: bytes, damaged: str) -> tuple[int, np.ndarray, bool]:
    """(first sequence number, ids, whether a tombstone) of a run record."""
    if len(key) != 8 or len(value) % 8 or not value:
        raise StoreCorruptError(damaged)
    ids = np.frombuffer(value, dtype="<i8").astype(np.int64)
    tomb = bool(ids[0] == _TOMB)
    if tomb:
        ids = ids[1:]
    if not ids.shape[0] or ids.min() < 0:
        raise StoreCorruptError(damaged)
    return int.from_bytes(key, "big"), ids, tomb


@dataclass(slots=True)
class Table:
    spec: TableSpec
    geo: Geometry
    index: SeqIndex
    deleted: Deleted
    runs_db: Any
    alive: Liveness  # records written into each segment, and which of them the index points at
    segs: dict[int, Any] = field(default_factory=dict)  # segment -> LMDB database
    next_seq: int = 0  # block-aligned
    version: int = 0  # bumped at every publication (invalidates the sorted ids of scan)
    sorted_ids: tuple[int, np.ndarray] | None = None
    # (segment, 0) -> (probed block numbers, their pages in the data file) of each append into it;
    # (segment, 1) -> (probed run records' numbers, pages) of the segment's run records
    probes: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def live_items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored id and its record's number, in no order (ids a tombstone hides left out)."""
        ids, seqs = self.index.items()
        if len(self.deleted):
            keep = ~self.deleted.hides(ids, seqs)
            ids, seqs = ids[keep], seqs[keep]
        return ids, seqs


def replay_runs(env: Any, runs_db: Any, spec: TableSpec, geo: Geometry) -> tuple[Table, dict[int, int]]:
    """``spec``'s log rebuilt from its runs, oldest first (the newest record of an id wins).

    Returns:
        the table (``segs`` not opened yet, block-aligned ``next_seq``) and the records per segment.
    """
    index, deleted, end = make_seq_index(spec.num_embeddings), Deleted(), 0
    records: dict[int, int] = {}
    tombs: dict[int, int] = {}
    damaged = f"table {spec.name!r}: a damaged run record in the log"
    with env.begin(db=runs_db) as txn:
        for key, value in txn.cursor():
            first, ids, tomb = parse_run(key, value, damaged)
            if first < end:
                raise StoreCorruptError(damaged)
            end = first + ids.shape[0]
            seg = first // geo.segment
            if (end - 1) // geo.segment != seg:
                raise StoreCorruptError(damaged)
            seqs = np.arange(first, end, dtype=np.int64)
            try:
                if tomb:
                    deleted.mark(ids, seqs, index.lookup(ids))
                    tombs[seg] = tombs.get(seg, 0) + ids.shape[0]
                else:
                    deleted.put(ids, index.upsert(ids, seqs))
            except (IndexError, ValueError) as err:
                raise StoreCorruptError(
                    f"table {spec.name!r}: the log holds ids outside its id space"
                ) from err
            records[seg] = records.get(seg, 0) + ids.shape[0]
    t = Table(spec=spec, geo=geo, index=index, deleted=deleted, runs_db=runs_db, alive=None)  # type: ignore[arg-type]
    t.alive = Liveness(geo.segment, records, t.live_items()[1], tombs=tombs)
    t.next_seq = -(-end // geo.block) * geo.block
    return t, records


def check_blocks(env: Any, t: Table, where: str) -> None:
    """Refuse a recorded block size that the log's last block contradicts: the last row written must be
    in block ``seq // block_rows`` of its segment, which must be the segment's last (``t.segs`` open)."""
    with env.begin(db=t.runs_db) as txn:
        cursor = txn.cursor()
        found = cursor.last()
        while found:
            first, ids, tomb = parse_run(cursor.key(), cursor.value(), f"table {t.spec.name!r}: damaged runs")
            if not tomb:
                break
            found = cursor.prev()
        if not found:
            return
        last = first + ids.shape[0] - 1
        number = last // t.geo.block
        db = t.segs.get(last // t.geo.segment)
        keys = encode_keys(np.array([number, number + 1]))
        value = None if db is None else txn.get(keys[0], db=db)
        beyond = None if db is None else txn.get(keys[1], db=db)
    rows = -1 if value is None else len(value) // t.spec.row_bytes
    if value is None or len(value) % t.spec.row_bytes or rows <= last % t.geo.block or beyond is not None:
        raise StoreIncompatibleError(
            f"store {where}: table {t.spec.name!r} block_rows is recorded as {t.geo.block}, but the log's "
            f"blocks are not of that size (its last row, number {last}, is not in block {number})"
        )
