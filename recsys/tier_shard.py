"""One rank's shard of the tiered store: claimed, opened (fresh, from a snapshot or re-partitioned), read
through and closed.

:func:`claim_shard` takes the shard's lock before anything touches its directory (collective: every rank
fails with the first refusal). :class:`TierShard` is then complete: it knows the slot tables this rank
holds (none is a valid answer: with table-wise sharding another rank may hold every tiered table, and
this rank's store is never opened) and opens, snapshots and closes the store over them. A store that was
opened but could not be bound to the slot tables is closed again before the error goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from embedding_store import (
    ShardDirectory,
    StoreConfig,
    StoreLockedError,
    TableSpec,
    TieredStore,
    snapshot_chunks,
)
from recsys.errors import UserError
from recsys.routing import Exchange
from recsys.sharding import LocalShard

__all__ = ["Rows", "TierShard", "claim_shard"]

# Row chunks of one table: ids (n,), weights (n, D), optimizer state (or None), ascending ids.
Rows = Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def claim_shard(path: Path, *, exchange: Exchange, world_size: int) -> ShardDirectory:
    """Claim the shard directory ``path`` (its lock) before anything touches it (collective).

    Opening a store replaces the rank's directory, so a second job pointed at a store in use must be
    refused before that: every rank claims its shard and all of them fail with the first refusal (a
    rank that got its lock releases it).

    Raises:
        UserError: a shard is held by another process, or its parent cannot be created.
    """
    shard: ShardDirectory | None = None
    refusal = None
    try:
        shard = ShardDirectory(path)
    except StoreLockedError as err:
        refusal = (
            f"store {path} is in use by process {err.holder} (another training run?); "
            "stop it or set store.path to another directory"
        )
    except OSError as err:
        refusal = f"cannot create store directory {path.parent}: {err.strerror}"
    refusals = [refusal] if world_size == 1 else exchange.all_gather(refusal)
    first = next((r for r in refusals if r is not None), None)
    if first is not None:
        if shard is not None:
            shard.close()
        raise UserError(first)
    assert shard is not None
    return shard


class TierShard:
    """The lifecycle of one rank's store over the slot tables it holds.

    Args:
        directory: the claimed shard directory (:func:`claim_shard`); :meth:`close` releases it.
        config: the store's settings (seed, capacities, policy, LMDB options).
        tables: the specs of the tiered tables this rank holds a slot shard of (empty: none, and the
            store is never opened).
        slots: per table of ``tables``, this rank's local shard of its slot table (bound to the store).
        owns: ``owns(table, ids)`` -> (n,) bool: the ids this rank owns, kept by a re-partitioning restore.

    Raises:
        ValueError: ``slots`` does not name exactly the tables of ``tables``.
    """

    def __init__(
        self,
        directory: ShardDirectory,
        *,
        config: StoreConfig,
        tables: list[TableSpec],
        slots: dict[str, LocalShard],
        owns: Callable[[str, np.ndarray], np.ndarray],
    ) -> None:
        if sorted(slots) != sorted(t.name for t in tables):
            raise ValueError(f"slots: {sorted(slots)} are not the tables {sorted(t.name for t in tables)}")
        self.directory = directory
        self.config = config
        self.tables = list(tables)
        self.slots = dict(slots)
        self._owns = owns
        self.store: TieredStore | None = None

    @property
    def path(self) -> Path:
        """The shard's store directory (``<store.path>/rank_r``)."""
        return self.directory.path

    @property
    def holds_tables(self) -> bool:
        """Whether this rank holds a slot shard of any tiered table (else it never opens a store)."""
        return bool(self.tables)

    def open(self, *, snapshot: Path | None = None, reshard_from: list[Path] | None = None) -> None:
        """Open the store: empty for a fresh run, restored from this rank's ``snapshot`` in a checkpoint,
        or (``reshard_from``: every snapshot of a checkpoint written by another number of ranks) rebuilt
        from the rows this rank owns now, streamed in chunks; then bind it to the slot tables."""
        if not self.holds_tables:
            return
        config, tables = self.config, self.tables
        if snapshot is not None:
            store = self.directory.open_snapshot(snapshot, config=config, tables=tables)
        elif reshard_from is not None:
            store = self.directory.open_resharded(reshard_from, config=config, tables=tables, keep=self._owns)
        else:
            store = self.directory.open_fresh(config=config, tables=tables)
        try:
            for name, shard in self.slots.items():
                # `.data`: the fill stage writes slots of later batches while autograd holds the table for
                # the current batch's backward. Those rows are disjoint from the current batch's (pins), so
                # the writes must not bump the version counter that autograd checks.
                state = None if shard.state is None else shard.state.data
                store.bind(name, weights=shard.weight.data, state=state)
        except BaseException:
            self.close(flush=False)  # a store bound to part of its tables must not stay open
            raise
        self.store = store

    def close(self, *, flush: bool = True) -> None:
        """Close the store (flushing it, unless ``flush=False`` after a failure) and release the lock."""
        self.store = None
        self.directory.close(flush=flush)

    def snapshot(self, dest: Path) -> list[Path]:
        """Flush and copy this rank's store into ``dest`` (part of a checkpoint); returns what it wrote."""
        if self.store is None:
            return []
        self.store.snapshot(dest)
        return [dest]

    def local_rows(self, name: str) -> Rows:
        """Every row of ``name`` this rank's store holds, ascending ids, in bounded chunks."""
        if self.store is None or name not in self.slots:
            return
        for chunk in self.store.iter_rows(name):
            yield chunk.ids, chunk.weights, chunk.state

    def snapshot_rows(self, name: str, snapshot: Path) -> Rows:
        """Every row of ``name`` in this rank's store ``snapshot`` (of a checkpoint), as :meth:`local_rows`."""
        spec = next((t for t in self.tables if t.name == name), None)
        if spec is None:
            return
        for chunk in snapshot_chunks(snapshot, spec, seed=self.config.seed):
            yield chunk.ids, chunk.weights, chunk.state
