"""Configuration and row layout of the store.

A *row* is the persistent record of one id: ``dim`` weights followed by the optimizer state of that id
(EXACT_SGD: none, EXACT_ROWWISE_ADAGRAD: 1 float, EXACT_ADAGRAD: ``dim`` floats), stored as one packed
float32 vector of ``row_floats`` values on every tier below the device.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

__all__ = [
    "LOOKAHEAD_BATCHES",
    "LmdbOptions",
    "OptimizerKind",
    "PolicyKind",
    "StoreConfig",
    "TableSpec",
    "Tier",
    "WeightsPrecision",
]

MAX_ID = (1 << 63) - 1  # ids are int64 >= 0


class OptimizerKind(enum.Enum):
    """Fused optimizer of a table; decides how much optimizer state travels with a row."""

    EXACT_SGD = "exact_sgd"  # no state
    EXACT_ADAGRAD = "exact_adagrad"  # one accumulator per weight: (D,)
    EXACT_ROWWISE_ADAGRAD = "exact_rowwise_adagrad"  # one accumulator per row: (1,)

    def state_floats(self, dim: int) -> int:
        """Number of optimizer-state floats per row for a table of dimension ``dim``."""
        if self is OptimizerKind.EXACT_SGD:
            return 0
        if self is OptimizerKind.EXACT_ROWWISE_ADAGRAD:
            return 1
        return dim


class WeightsPrecision(enum.Enum):
    """How a table's weights are stored on every tier (optimizer state is float32 always)."""

    FP32 = "fp32"
    FP16 = "fp16"  # IEEE half; rounded to nearest even, as FBGEMM's CPU kernels round their updates

    @property
    def dtype(self) -> str:
        """The numpy / torch name of the stored weights' type (and the store's recorded ``dtype``)."""
        return "float32" if self is WeightsPrecision.FP32 else "float16"


# Announced batches LOOKAHEAD protects and the prefetcher reads ahead, by default (recsys's store.lookahead).
LOOKAHEAD_BATCHES = 4


class PolicyKind(enum.Enum):
    """Eviction policy of the device and host tiers."""

    LRU = "lru"  # least recently used batch first
    LFU = "lfu"  # fewest batches that used the row first, LRU among equals
    LOOKAHEAD = "lookahead"  # rows no announced batch of the next L uses first (LRU), then furthest next use


class Tier(enum.Enum):
    """Where a row can live, highest first."""

    DEVICE = "device"  # slots of the bound slot table
    HOST = "host"  # DRAM arena
    SSD = "ssd"  # LMDB


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name.startswith("__") or "/" in name:
        raise ValueError(f"TableSpec.name must be a non-empty str without '/' or leading '__', got {name!r}")


@dataclass(kw_only=True, frozen=True, slots=True)
class TableSpec:
    """One tiered table.

    Attributes:
        name: table name; also the LMDB sub-database name and part of the init stream key.
        dim: embedding dimension D.
        optimizer: fused optimizer whose per-id state is stored with the row.
        num_embeddings: size of a bounded id space ``[0, num_embeddings)``, or None for raw int64 ids >= 0.
        init_scale: never-seen rows are ``init_rows(..., scale=init_scale)``: uniform in [-s, s).
        device_capacity_rows: slots of this table's device tier; None takes ``StoreConfig``'s value.
        host_capacity_rows: rows of this table's host arena; None takes ``StoreConfig``'s value.
        weights_precision: how the weights are stored on every tier (``FP16``: two to a 4-byte word of
            the packed row, the state after them in float32).
        expected_max_rows: the most rows the caller will keep stored (it deletes beyond them, as a
            bounded table's row cap does; the store does not enforce it), or None. The log layout then
            packs the table for space: a new store's segments are about a 32nd of it and its blocks
            the rows a page holds most of, and compaction keeps the table's rows at most
            ``CAPPED_COMPACT_AT`` dead (docs/store-format.md, "A table with a row cap").
    """

    name: str
    dim: int
    optimizer: OptimizerKind = OptimizerKind.EXACT_ROWWISE_ADAGRAD
    num_embeddings: int | None = None
    init_scale: float = 0.01
    device_capacity_rows: int | None = None
    host_capacity_rows: int | None = None
    weights_precision: WeightsPrecision = WeightsPrecision.FP32
    expected_max_rows: int | None = None

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.dim, int) or self.dim <= 0:
            raise ValueError(f"TableSpec.dim must be a positive int, got {self.dim!r}")
        if not isinstance(self.optimizer, OptimizerKind):
            raise ValueError(f"TableSpec.optimizer must be an OptimizerKind, got {self.optimizer!r}")
        if self.num_embeddings is not None and (
            not isinstance(self.num_embeddings, int) or not 0 < self.num_embeddings <= MAX_ID
        ):
            raise ValueError(
                f"TableSpec.num_embeddings must be None or an int in [1, 2**63), got {self.num_embeddings!r}"
            )
        if not math.isfinite(self.init_scale) or self.init_scale < 0:
            raise ValueError(f"TableSpec.init_scale must be finite and >= 0, got {self.init_scale!r}")
        if not isinstance(self.weights_precision, WeightsPrecision):
            raise ValueError(
                f"TableSpec.weights_precision must be a WeightsPrecision, got {self.weights_precision!r}"
            )
        if self.expected_max_rows is not None and (
            not isinstance(self.expected_max_rows, int)
            or isinstance(self.expected_max_rows, bool)
            or self.expected_max_rows < 1
        ):
            raise ValueError(
                f"TableSpec.expected_max_rows must be None or an int >= 1, got {self.expected_max_rows!r}"
            )
        for name in ("device_capacity_rows", "host_capacity_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"TableSpec.{name} must be None or an int >= 0, got {value!r}")

    @property
    def state_floats(self) -> int:
        """Optimizer-state floats per row."""
        return self.optimizer.state_floats(self.dim)

    @property
    def weight_words(self) -> int:
        """4-byte words of a packed row's weights: D float32, or D float16 two to a word (the last
        half-word of an odd D is zero)."""
        return self.dim if self.weights_precision is WeightsPrecision.FP32 else (self.dim + 1) // 2

    @property
    def row_floats(self) -> int:
        """4-byte words in one packed row (a float32 array's width): weights, then optimizer state."""
        return self.weight_words + self.state_floats

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed row."""
        return 4 * self.row_floats


# When a read is split over the reader threads: "auto" while reads fault pages in from the disk, "always"
# whenever it is large enough (``LmdbOptions.read_split``, ``embedding_store.backends.lmdb_threads.ReaderPool``).
READ_SPLITS = ("auto", "always")


@dataclass(kw_only=True, frozen=True, slots=True)
class LmdbOptions:
    """Options of the SSD tier's LMDB environment.

    Attributes:
        initial_map_size_bytes: first map size. LMDB does not preallocate on Linux, so a large value
            costs only address space; the map doubles on demand when full.
        max_map_size_bytes: hard cap on the map size; None = grow until the disk is full. Reaching it
            raises StoreFullError (used to test the full-disk path).
        sync: fsync every background commit. False is faster (docs/design.md: 1.1e5 vs 3.8e4 rows/s) and a
            killed process loses nothing already committed; an OS crash may lose or damage commits
            after the last ``flush()``, which always forces a sync.
        readahead: OS readahead on the data file; off suits random row reads.
        writer_batch_rows: most rows the background writer puts in one transaction. A write
            transaction holds every page it dirties in memory until commit — up to one 4 KiB page per
            row for random keys — so this bounds the writer's memory (32k rows: <= 128 MiB).
        writer_max_pending_rows: rows that may wait for the writer before callers block (memory bound).
        writer_min_batch_rows: rows the writer gathers before it starts a transaction (default: half of
            ``writer_batch_rows``). Random-key transactions cost mostly the B-tree pages they copy, so
            gathering several steps' evictions into one costs ~3x less CPU per row than one per step.
            Rows waiting stay readable; ``flush()`` and checkpoints commit them at once.
        writer_linger_s: the longest an evicted row waits for others before a transaction starts.
        writer_nice: how much lower than the training thread's the OS scheduling priority of the writer
            thread is (nice 0..19, per thread; Linux only): its work is never on the training step's
            path, so where threads share too few cores the step is preempted less for it. 0: the same.
        unmap_every_rows: LMDB reads through a read-only mmap, so every page it touches counts toward
            this process's RSS (as page cache, reclaimable, but visible). After this many rows read or
            written, the backend drops the mapping's page-table entries (``MADV_DONTNEED``; the page
            cache stays) and reads go in chunks of this many rows, so mapped file pages stay near
            ``unmap_every_rows`` x the kernel's fault-around window (~128 KiB per random row on Linux
            6.18) instead of growing to the file's size. Pair it with a ``writer_batch_rows`` of the same
            order. None (the default) keeps every touched page mapped: fastest when the file fits in
            memory. ``benchmarks/bench_store.py --scale`` uses 2048.
        read_threads: how many runs of one read are in flight at once: a read of 128 keys or more is
            split into up to this many runs of consecutive keys, each read by its own thread in its own
            transaction (docs/tiers.md, "Parallel cold reads"). Rows not in the page cache cost a page
            fault each, which one thread takes one at a time: ``benchmarks/bench_ssd.py`` read cold rows
            at 1.3e4 rows/s with 1 thread and 5.0e4 with 16 (0.95 of the disk's 4 KiB random reads at
            depth 32); where the pages are cached the split costs (warm reads at 0.82 of one thread's
            speed). 1: every read in the calling thread, in one transaction.
        read_split: when a read is split over ``read_threads``: ``"auto"`` (the default) only while reads
            take major page faults, i.e. wait for the disk (a read of cached pages runs in the calling
            thread, and hands its remaining runs to the pool once one of them faulted;
            ``embedding_store.backends.lmdb_threads``); ``"always"``: every read of 128 keys or more.
        layout: how a new store places its rows (an existing store keeps the layout it was created with):
            ``"log"`` appends every write-back as records numbered by write time, with an id index in RAM
            (~20-40 bytes per stored id of an unbounded table, 8 per possible id of a bounded one up to
            2^22 ids) and compaction of dead versions (``embedding_store.backends.log``); ``"btree"`` keys
            rows by id, which rewrites a 4 KiB page per written-back row once the store is much larger than
            a transaction (docs/tiers.md, "Write-back by write time"); ``"memory"`` keeps the rows in RAM
            and writes them all to one file at every flush (``embedding_store.backends.memory``; small
            tables, and tests), its rows' bytes capped by ``max_map_size_bytes``.
        log_segment_rows: records per segment of a new log-layout store, the unit that compaction copies
            and drops.
        log_compact_at: dead share of the whole log at which compaction runs: the deadest sealed
            segment's live rows are copied to the head and it is dropped, until the log is less dead. The
            log then holds at most 1 / (1 - log_compact_at) x the live rows (1.67x at the default 0.4).
            Higher: less copying per written row, more disk.
    """

    initial_map_size_bytes: int = 1 << 30
    max_map_size_bytes: int | None = None
    sync: bool = False
    readahead: bool = False
    writer_batch_rows: int = 1 << 15
    writer_max_pending_rows: int = 1 << 19
    writer_min_batch_rows: int | None = None
    writer_linger_s: float = 0.5
    writer_nice: int = 10
    unmap_every_rows: int | None = None
    read_threads: int = 16
    read_split: str = "auto"
    layout: str = "log"
    log_segment_rows: int = 1 << 20
    log_compact_at: float = 0.4

    def __post_init__(self) -> None:
        if not isinstance(self.initial_map_size_bytes, int) or self.initial_map_size_bytes < 1 << 16:
            raise ValueError(
                f"LmdbOptions.initial_map_size_bytes must be an int >= 65536, got {self.initial_map_size_bytes!r}"
            )
        if self.max_map_size_bytes is not None and (
            not isinstance(self.max_map_size_bytes, int)
            or self.max_map_size_bytes < self.initial_map_size_bytes
        ):
            raise ValueError(
                "LmdbOptions.max_map_size_bytes must be None or >= initial_map_size_bytes, "
                f"got {self.max_map_size_bytes!r}"
            )
        for name in ("writer_batch_rows", "writer_max_pending_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LmdbOptions.{name} must be a positive int, got {value!r}")
        if self.writer_min_batch_rows is not None and (
            not isinstance(self.writer_min_batch_rows, int) or self.writer_min_batch_rows <= 0
        ):
            raise ValueError(
                f"LmdbOptions.writer_min_batch_rows must be None or a positive int, got {self.writer_min_batch_rows!r}"
            )
        if not isinstance(self.writer_linger_s, int | float) or not 0 <= self.writer_linger_s <= 60:
            raise ValueError(
                f"LmdbOptions.writer_linger_s must be in [0, 60] seconds, got {self.writer_linger_s!r}"
            )
        if (
            not isinstance(self.writer_nice, int)
            or isinstance(self.writer_nice, bool)
            or not 0 <= self.writer_nice <= 19
        ):
            raise ValueError(f"LmdbOptions.writer_nice must be an int in 0..19, got {self.writer_nice!r}")
        if self.unmap_every_rows is not None and (
            not isinstance(self.unmap_every_rows, int) or self.unmap_every_rows <= 0
        ):
            raise ValueError(
                f"LmdbOptions.unmap_every_rows must be None or a positive int, got {self.unmap_every_rows!r}"
            )
        if (
            not isinstance(self.read_threads, int)
            or isinstance(self.read_threads, bool)
            or not 1 <= self.read_threads <= 256
        ):
            raise ValueError(f"LmdbOptions.read_threads must be an int in 1..256, got {self.read_threads!r}")
        if self.read_split not in READ_SPLITS:
            raise ValueError(f"LmdbOptions.read_split must be 'auto' or 'always', got {self.read_split!r}")
        if self.layout not in ("log", "btree", "memory"):
            raise ValueError(f"LmdbOptions.layout must be 'log', 'btree' or 'memory', got {self.layout!r}")
        if (
            not isinstance(self.log_segment_rows, int)
            or isinstance(self.log_segment_rows, bool)
            or not 1 <= self.log_segment_rows <= 1 << 30
        ):
            raise ValueError(
                f"LmdbOptions.log_segment_rows must be an int in 1..2**30, got {self.log_segment_rows!r}"
            )
        if (
            not isinstance(self.log_compact_at, int | float)
            or isinstance(self.log_compact_at, bool)
            or not 0.05 <= self.log_compact_at <= 0.95
        ):
            raise ValueError(
                f"LmdbOptions.log_compact_at must be in [0.05, 0.95], got {self.log_compact_at!r}"
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class StoreConfig:
    """Configuration of a store (all tables of one rank shard).

    Attributes:
        seed: seed of the lazy initialisation; part of the on-disk identity of the store.
        device_capacity_rows: default slots per table (the bound slot table must have this many rows).
        host_capacity_rows: default host-arena rows per table (0 = no host tier).
        policy: eviction policy of both tiers.
        lookahead_batches: L, how many announced batches LOOKAHEAD protects.
        lmdb: SSD-tier options.
    """

    seed: int
    device_capacity_rows: int
    host_capacity_rows: int
    policy: PolicyKind = PolicyKind.LOOKAHEAD
    lookahead_batches: int = LOOKAHEAD_BATCHES
    lmdb: LmdbOptions = field(default_factory=LmdbOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 32:
            raise ValueError(f"StoreConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.device_capacity_rows, int) or self.device_capacity_rows <= 0:
            raise ValueError(
                f"StoreConfig.device_capacity_rows must be a positive int, got {self.device_capacity_rows!r}"
            )
        if not isinstance(self.host_capacity_rows, int) or self.host_capacity_rows < 0:
            raise ValueError(
                f"StoreConfig.host_capacity_rows must be an int >= 0, got {self.host_capacity_rows!r}"
            )
        if not isinstance(self.policy, PolicyKind):
            raise ValueError(f"StoreConfig.policy must be a PolicyKind, got {self.policy!r}")
        if not isinstance(self.lookahead_batches, int) or self.lookahead_batches < 0:
            raise ValueError(
                f"StoreConfig.lookahead_batches must be an int >= 0, got {self.lookahead_batches!r}"
            )
        if not isinstance(self.lmdb, LmdbOptions):
            raise ValueError(f"StoreConfig.lmdb must be an LmdbOptions, got {self.lmdb!r}")

    def device_rows(self, spec: TableSpec) -> int:
        """Slots of ``spec``'s device tier."""
        return self.device_capacity_rows if spec.device_capacity_rows is None else spec.device_capacity_rows

    def host_rows(self, spec: TableSpec) -> int:
        """Rows of ``spec``'s host arena."""
        return self.host_capacity_rows if spec.host_capacity_rows is None else spec.host_capacity_rows
