"""embedding_store: embedding rows on three tiers — device slots, host DRAM, LMDB on SSD.

A *row* is the persistent record of one id of a table: ``dim`` float32 weights followed by that id's
optimizer state (EXACT_SGD: none, EXACT_ROWWISE_ADAGRAD: 1 float, EXACT_ADAGRAD: ``dim`` floats).
A *slot* is a position in the device slot table that the model looks up. Never-seen ids are lazily
initialised by :func:`init_rows` (a pure function of seed, table, id) with zero optimizer state, so the
same function initialises an untiered reference table.

Tiers (highest first; the highest tier holding a row holds its latest value, tiers are exclusive):

- device: binds to the slot table's *externally owned* weight (S, D) and optimizer-state tensors
  (e.g. FBGEMM ``split_embedding_weights()`` / ``split_optimizer_states()``, which alias live storage)
  and reads/writes rows there in place; one pin bit per in-flight batch.
- host: a preallocated arena (pinned when CUDA is present) with dirty bits; dirty victims go to a
  background writer that batches LMDB transactions; reads see rows still queued (read-your-writes).
- ssd: a backend per rank shard (``path``, :mod:`embedding_store.backends`): LMDB in the ``"log"``
  layout (the default: rows placed by write time, an id index in RAM) or the ``"btree"`` layout (one
  B-tree per table keyed by id), or ``"memory"`` (rows in RAM, persisted to one file). The store records
  its format, seed, layout and tables, and is read with what it recorded. A full map/disk raises
  StoreFullError with nothing half-written; ``tierrec.lock`` (flock) refuses a second opener with
  StoreLockedError. ``TieredStore(..., backend=...)`` takes a backend opened by the caller.

Lifecycle of a job's shard (:class:`ShardDirectory`): one lock beside the directory (``rank_r.lock`` for
``rank_r/``), taken before the directory is deleted and held until close, covers opening it fresh, from a
snapshot or re-partitioned (``open_fresh`` / ``open_snapshot`` / ``open_resharded``); the store opened
there takes no ``tierrec.lock``. Snapshots are written by ``TieredStore.snapshot`` and read or restored
by :mod:`embedding_store.snapshot`. :func:`num_embeddings_for` picks a table's index from its id space
(dense up to 2^26 ids, hashed above).

Batch API. Threading contract: every method may be called from any thread; calls serialise on one
store lock, except that ``prefetch`` drops it during its LMDB read (so batch i+2's SSD read overlaps
batch i's step); a background writer thread commits evicted rows and never takes the store lock; its
failure is raised (as the same StoreError kind, chained) by the next call instead of hanging. The
store touches the bound slot tensors only inside ``make_resident`` (unpinned victims and free slots),
``evict``, ``flush``/``snapshot``/``close`` and ``read_rows``/``iter_rows``; call the latter between
steps, when no backward is updating the slot table::

    store = TieredStore(path, config=StoreConfig(seed=0, device_capacity_rows=S, host_capacity_rows=H),
                        tables=[TableSpec(name="t0", dim=D, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)])
    store.bind("t0", weights=w, state=m)      # w: (S, D), m: (S,) — the slot table's live tensors
    store.lookahead(i + 2, {"t0": ids_i2})    # announce future batches (LOOKAHEAD protects their rows)
    store.prefetch(i + 2)                     # SSD -> host for an announced batch
    slots = store.make_resident(i, {"t0": ids_i})["t0"]  # evict, fill, pin; int64, same shape as ids
    ...                                       # forward/backward on the slot table with `slots`
    store.release(i)                          # unpin after the batch's backward (any number in flight)
    store.flush(); store.snapshot(dir); store.close()   # or `with TieredStore(...) as store:`
    for chunk in store.iter_rows("t0"): ...   # RowChunk(ids (n,), weights (n, D), state) ascending ids
    store.read_rows("t0", ids); store.evict("t0"); store.wait_for_writes(); store.stats()

Building blocks: :class:`~embedding_store.index.HashIdMap` / ``DenseIdMap`` (vectorised id -> position
maps), eviction policies (``LRU``, ``LFU``, ``LOOKAHEAD``) in :mod:`embedding_store.policies`, the
SplitMix64 hash in :mod:`embedding_store.hashing` (numpy only), and the backends in
:mod:`embedding_store.backends` (``open_backend``, ``open_snapshot``; its LMDB modules are the only ones
that import ``lmdb``). Bounded tables (admission, expiry, a row cap): one
:class:`~embedding_store.bounds.TableBounds` per table and owner, its checkpoint state split and merged
by :mod:`embedding_store.bounds_state`. The store, the backends and ``init_rows`` load on first use:
importing the config, the errors or the hashing leaf loads neither torch nor LMDB.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from embedding_store.config import (
    LmdbOptions,
    OptimizerKind,
    PolicyKind,
    StoreConfig,
    TableSpec,
    Tier,
    WeightsPrecision,
)
from embedding_store.errors import (
    IdOutOfRangeError,
    StoreCapacityError,
    StoreClosedError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreIncompatibleError,
    StoreLockedError,
    StoreSegmentsError,
)
from embedding_store.lockfile import DirectoryLock
from embedding_store.stats import StoreStats, TierStats

if TYPE_CHECKING:
    from embedding_store.bounds import Decision, TableBounds
    from embedding_store.bounds_rule import BoundsRule
    from embedding_store.bounds_state import merge_states, split_state
    from embedding_store.index import num_embeddings_for
    from embedding_store.init import init_rows
    from embedding_store.rows import RowChunk
    from embedding_store.shard import ShardDirectory
    from embedding_store.snapshot import restore_resharded, restore_snapshot, scan_snapshot, snapshot_chunks
    from embedding_store.store import TieredStore

# Loaded on first use, so that importing a light module of the package (its config, errors or the
# hashing leaf) does not load torch and LMDB: name -> the module that defines it.
_LAZY = {
    "BoundsRule": "embedding_store.bounds_rule",
    **dict.fromkeys(("Decision", "TableBounds"), "embedding_store.bounds"),
    **dict.fromkeys(("merge_states", "split_state"), "embedding_store.bounds_state"),
    "init_rows": "embedding_store.init",
    "num_embeddings_for": "embedding_store.index",
    "RowChunk": "embedding_store.rows",
    "ShardDirectory": "embedding_store.shard",
    **dict.fromkeys(
        ("restore_resharded", "restore_snapshot", "scan_snapshot", "snapshot_chunks"),
        "embedding_store.snapshot",
    ),
    "TieredStore": "embedding_store.store",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BoundsRule",
    "Decision",
    "DirectoryLock",
    "IdOutOfRangeError",
    "LmdbOptions",
    "OptimizerKind",
    "PolicyKind",
    "RowChunk",
    "ShardDirectory",
    "StoreCapacityError",
    "StoreClosedError",
    "StoreConfig",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreIncompatibleError",
    "StoreLockedError",
    "StoreSegmentsError",
    "StoreStats",
    "TableBounds",
    "TableSpec",
    "Tier",
    "TierStats",
    "TieredStore",
    "WeightsPrecision",
    "init_rows",
    "merge_states",
    "num_embeddings_for",
    "restore_resharded",
    "restore_snapshot",
    "scan_snapshot",
    "snapshot_chunks",
    "split_state",
]
