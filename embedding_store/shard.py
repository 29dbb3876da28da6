"""One rank shard's store directory under one lock, from before the directory is replaced until close.

A job keeps each rank's store in a directory of its own (``<root>/rank_r``) and replaces that directory
whenever it opens it: emptied for a fresh run, restored from a checkpoint's snapshot, or rebuilt from the
snapshots of another partition of the rows. So a second process must be refused before anything is
deleted, and the lock cannot live inside the directory it guards: :class:`ShardDirectory` holds
``<root>/rank_r.lock`` (``flock``, as :class:`~embedding_store.DirectoryLock`) from its construction
until :meth:`ShardDirectory.close`, and the store it opens takes no lock of its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from embedding_store.config import StoreConfig, TableSpec
from embedding_store.errors import StoreClosedError, StoreError
from embedding_store.lockfile import DirectoryLock
from embedding_store.snapshot import restore_resharded, restore_snapshot
from embedding_store.store import TieredStore

__all__ = ["ShardDirectory"]


class ShardDirectory:
    """The directory of one rank shard's store, held from claim to close (a context manager).

    Args:
        path: the shard's directory. Its parent is created if missing and holds the lock file
            ``<name>.lock``; the directory itself is only touched by the ``open_*`` methods.

    Raises:
        StoreLockedError: another process (or handle) holds the shard: ``store <path> is in use by
            process <pid>``; its ``holder`` is the pid as text.
        OSError: the parent cannot be created or the lock file cannot be opened.

    Example:
        >>> shard = ShardDirectory(root / "rank_0")  # refused here, before anything is deleted
        >>> store = shard.open_fresh(config=cfg, tables=[spec])  # or open_snapshot / open_resharded
        >>> ...
        >>> shard.close()  # closes the store (flushing it) and releases the lock
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = DirectoryLock(self.path.parent, name=f"{self.path.name}.lock", guards=self.path)
        self.store: TieredStore | None = None

    def open_fresh(self, *, config: StoreConfig, tables: Sequence[TableSpec]) -> TieredStore:
        """Delete what the directory holds and open an empty store in it."""
        self._clear()
        return self._open(config, tables)

    def open_snapshot(
        self, snapshot: str | os.PathLike[str], *, config: StoreConfig, tables: Sequence[TableSpec]
    ) -> TieredStore:
        """Replace the directory with a copy of ``snapshot`` (``TieredStore.snapshot``'s) and open it."""
        self._clear()
        restore_snapshot(snapshot, self.path)
        return self._open(config, tables)

    def open_resharded(
        self,
        snapshots: Sequence[str | os.PathLike[str]],
        *,
        config: StoreConfig,
        tables: Sequence[TableSpec],
        keep: Callable[[str, np.ndarray], np.ndarray],
    ) -> TieredStore:
        """Replace the directory with the rows of ``snapshots`` (another partition's) that ``keep(table,
        ids)`` ((n,) int64 -> (n,) bool) accepts, streamed in chunks, and open it."""
        self._clear()
        restore_resharded(snapshots, self.path, config=config, tables=tables, keep=keep)
        return self._open(config, tables)

    def _clear(self) -> None:
        if not self._lock.held:
            raise StoreClosedError(f"store {self.path} was closed")
        if self.store is not None:
            raise StoreError(f"store {self.path} is open; close() it before opening it again")
        if self.path.exists():
            shutil.rmtree(self.path)

    def _open(self, config: StoreConfig, tables: Sequence[TableSpec]) -> TieredStore:
        self.store = TieredStore(self.path, config=config, tables=tables, lock=self._lock)
        return self.store

    def close(self, *, flush: bool = True) -> None:
        """Close the store, if one is open (flushing it, unless ``flush=False`` after a failure), then
        release the lock, even when closing the store fails. Idempotent."""
        try:
            if self.store is not None:
                store, self.store = self.store, None
                store.close(flush=flush)
        finally:
            self._lock.release()

    def __enter__(self) -> ShardDirectory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush=exc_type is None)
