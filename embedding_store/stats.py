"""Counters of the store, per table and tier."""

from __future__ import annotations

from dataclasses import dataclass, field

from embedding_store.config import Tier

__all__ = ["StoreStats", "TierStats"]


@dataclass(slots=True)
class TierStats:
    """Counters of one tier of one table (monotonic since the store was opened).

    Attributes:
        hits: requests this tier answered. Device: id occurrences of make_resident batches found
            resident; host and ssd: unique rows served (ssd includes rows still queued in the writer).
        misses: requests it could not answer (device: id occurrences; ssd: rows lazily initialised).
        rows_in: rows written into this tier; bytes_in the same in bytes.
        rows_out: rows read out of it, upwards or downwards; bytes_out the same in bytes.
        evictions: rows this tier evicted to make room.
        deleted: rows deleted from the model (``TieredStore.delete``) that this tier held: device and
            host the rows they dropped; ssd every distinct id of each delete, as each one reaches the
            SSD tier whether or not it held the row, so the table's count of deleted ids.
        seconds: wall time spent in this tier's operations.
    """

    hits: int = 0
    misses: int = 0
    rows_in: int = 0
    rows_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    deleted: int = 0
    seconds: float = 0.0

    def add_in(self, rows: int, row_bytes: int) -> None:
        """Count ``rows`` written into the tier."""
        self.rows_in += rows
        self.bytes_in += rows * row_bytes

    def add_out(self, rows: int, row_bytes: int) -> None:
        """Count ``rows`` read out of the tier."""
        self.rows_out += rows
        self.bytes_out += rows * row_bytes


@dataclass(slots=True)
class StoreStats:
    """A copy of the store's counters.

    Attributes:
        tables: ``tables[name][tier]`` counters.
        resident_rows: ``resident_rows[name][tier]`` rows the tier holds now (ssd: rows in LMDB).
        writer_pending_rows: rows waiting for the background writer (its queue depth).
        writer_commits: LMDB transactions the writer committed.
        writer_seconds: time the writer spent committing.
        map_size_bytes: current LMDB map size.
    """

    tables: dict[str, dict[Tier, TierStats]] = field(default_factory=dict)
    resident_rows: dict[str, dict[Tier, int]] = field(default_factory=dict)
    writer_pending_rows: int = 0
    writer_commits: int = 0
    writer_seconds: float = 0.0
    map_size_bytes: int = 0
