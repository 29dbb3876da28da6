"""What both LMDB layouts share: the environment, its metadata, commits that grow the map, the map of
the data file, and how LMDB's errors become StoreErrors (:func:`map_error`).

A store directory holds one LMDB environment (``data.mdb``). Its ``__meta__`` database holds the
metadata (:mod:`embedding_store.backends.meta`), which says the layout: ``"btree"``
(:mod:`~embedding_store.backends.btree`) or ``"log"`` (:mod:`~embedding_store.backends.log`).
:func:`open_env` opens the environment with as many named databases as the *recorded* layout needs, and
:class:`LmdbRows` is the base of both layouts' backends.

The map starts at ``initial_map_size_bytes`` and doubles when a write transaction finds it full, up to
``max_map_size_bytes``; a full map or disk raises StoreFullError after the transaction was aborted, so
no write is ever half-applied. Threads: reads may run in any thread while the background writer
commits; changing the map size needs no transaction open in this process, so reads and commits hold a
shared lock and a resize an exclusive one.
"""

from __future__ import annotations

import abc
import errno
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from embedding_store.backends import meta as meta_
from embedding_store.backends.lmdb_threads import ReaderPool, SharedExclusiveLock
from embedding_store.backends.readahead import MappedFile, drop_mapped_pages
from embedding_store.config import LmdbOptions, TableSpec
from embedding_store.errors import StoreCorruptError, StoreError, StoreFullError, StoreIncompatibleError

__all__ = ["LOG_MAX_SEGMENTS", "LmdbRows", "OpenEnv", "map_error", "max_dbs", "open_env", "read_meta"]

META_DB = b"__meta__"
META_KEY = b"format"
# Named databases of a log-layout environment beyond two per table: its segments, all tables together
# (one per ``log_segment_rows`` records; ~330 for 100 M live rows of one table at the default
# compaction point). A write that would need more raises StoreSegmentsError.
LOG_MAX_SEGMENTS = 1024
# How often a running snapshot copy drops its mapped pages of the data file.
_COPY_UNMAP_S = 0.02
_CORRUPT = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.BadChecksumError,
    lmdb.PanicError,
)
# LMDB reports a failed write of its pages as EIO ("Input/output error"), also when the disk is full; a
# filesystem with less than this left is taken to be full.
_FULL_DISK_FREE_BYTES = 64 << 20


def _disk_full(path: str | os.PathLike[str] | None) -> bool:
    """True when the filesystem holding ``path`` (or its nearest existing parent) is (nearly) full."""
    if path is None:
        return False
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_DISK_FREE_BYTES


def map_error(err: lmdb.Error, what: str, path: str | os.PathLike[str] | None = None) -> StoreError:
    """The StoreError of an LMDB error (raise it ``from err``): full, corrupt, or plain."""
    if isinstance(err, lmdb.MapFullError | lmdb.DiskError) or "No space left" in str(err):
        return StoreFullError(f"{what}: no space left on device ({err})")
    if "Input/output error" in str(err) and _disk_full(path):
        return StoreFullError(f"{what}: no space left on device on the filesystem of {path}")
    if isinstance(err, _CORRUPT):
        return StoreCorruptError(f"{what}: {err}")
    return StoreError(f"{what}: {err}")


def max_dbs(layout: str, tables: int) -> int:
    """Named databases an environment of ``layout`` needs (each table's, the metadata, log segments)."""
    return max(64, 2 * tables + 2) + (LOG_MAX_SEGMENTS if layout == "log" else 0)


def read_meta(env: Any, where: str) -> meta_.Meta | None:
    """The recorded metadata (any format), None in a new environment."""
    with env.begin() as txn:
        try:
            db = env.open_db(META_DB, txn=txn, create=False)
        except lmdb.NotFoundError:
            return None
        raw = txn.get(META_KEY, db=db)
    return None if raw is None else meta_.decode(raw, where)


@dataclass(frozen=True, slots=True)
class OpenEnv:
    """An environment opened for a store: where, the environment, its layout, its recorded metadata."""

    path: Path
    env: Any
    layout: str
    meta: meta_.Meta | None  # None: a new store


def _open(path: Path, options: LmdbOptions, dbs: int) -> Any:
    try:
        return lmdb.open(
            str(path),
            map_size=options.initial_map_size_bytes,
            subdir=True,
            max_dbs=dbs,
            sync=options.sync,
            metasync=options.sync,
            readahead=options.readahead,
            lock=True,
            # a slot per transaction open at once: each reader thread's, the callers', the writer's
            max_readers=126 + options.read_threads,
        )
    except lmdb.Error as err:
        raise map_error(err, f"cannot open LMDB environment {path}") from err


def open_env(path: Path, options: LmdbOptions, tables: int) -> OpenEnv:
    """Open the environment in ``path`` sized for its recorded layout (``options.layout`` when new)."""
    env = _open(path, options, max_dbs(options.layout, tables))
    try:
        meta = read_meta(env, str(path))
    except lmdb.Error as err:
        env.close()
        raise map_error(err, f"cannot read the metadata of {path}") from err
    except StoreError:
        env.close()
        raise
    layout = options.layout if meta is None else meta.get("layout", "btree")
    if layout not in ("log", "btree"):
        env.close()
        raise StoreIncompatibleError(
            f"store {path}: layout is recorded as {layout!r}, this code's LMDB layouts are 'log' and 'btree'"
        )
    if max_dbs(layout, tables) != max_dbs(options.layout, tables):
        env.close()  # max_dbs is fixed at open: open again, as the recorded layout needs
        env = _open(path, options, max_dbs(layout, tables))
    return OpenEnv(path=path, env=env, layout=layout, meta=meta)


class LmdbRows(abc.ABC):
    """The base of the LMDB layouts' backends: the environment of a store and its commits.

    Args:
        opened: the environment (:func:`open_env`); closed here if the constructor fails.
        options: map size, sync and readahead options.
        seed: the store's init seed, recorded and checked on reopen.
        tables: the tables; ones already on disk must match their recorded description.

    Raises:
        StoreIncompatibleError: another seed or tables, or a format or geometry this code cannot read.
        StoreCorruptError: the metadata or the environment is unreadable.
    """

    def __init__(
        self, opened: OpenEnv, *, options: LmdbOptions, seed: int, tables: Sequence[TableSpec]
    ) -> None:
        self._options = options
        self._path = opened.path
        self._env = opened.env
        self._rw = SharedExclusiveLock()
        self._readers = ReaderPool(options.read_threads, split=options.read_split)
        self._data_file = os.path.realpath(opened.path / "data.mdb")
        self._mapped = MappedFile(self._data_file)
        self._rows_since_unmap = 0
        try:
            self.meta = self._record_meta(opened, seed, tables)
            self._open_tables(tables)
        except lmdb.Error as err:
            self.close()
            raise map_error(err, f"cannot open the tables of {self._path}") from err
        except BaseException:
            self.close()
            raise

    def _geometry(self, spec: TableSpec) -> tuple[int, int]:
        """(block rows, segment rows) of a new table: only the log layout has them (asked only of it)."""
        raise TypeError(f"{type(self).__name__} has no log geometry (table {spec.name!r})")

    @abc.abstractmethod
    def _open_tables(self, tables: Sequence[TableSpec]) -> None:
        """Open (or create) the layout's structures of ``tables`` in the environment."""

    def _record_meta(self, opened: OpenEnv, seed: int, tables: Sequence[TableSpec]) -> meta_.Meta:
        """Check (or record) the metadata; a format-1 record is upgraded in place (only the metadata)."""
        page_size = int(self._env.stat()["psize"])
        where = str(self._path)
        if opened.meta is None:
            meta, changed = meta_.new_meta(seed=seed, layout=opened.layout, page_size=page_size), True
        else:
            meta, changed = meta_.upgrade(opened.meta, where, page_size=page_size)
            if meta.get("page_size") != page_size:
                raise StoreIncompatibleError(
                    f"store {where}: page_size is recorded as {meta.get('page_size')!r}, its LMDB "
                    f"environment has pages of {page_size} bytes"
                )
        geometry = self._geometry if opened.layout == "log" else None
        changed |= meta_.check_tables(meta, where, seed=seed, tables=tables, geometry=geometry)
        if changed:  # a full map must still reopen: write only when something is new

            def fill(txn: Any) -> None:
                txn.put(META_KEY, meta_.encode(meta), db=self._env.open_db(META_DB, txn=txn, create=True))

            self._commit(fill, 4096, 0)
        return meta

    # ----------------------------------------------------------------------------------------- reads
    def _count_read(self, rows: int) -> None:
        every = self._options.unmap_every_rows
        if every is None:
            return
        self._rows_since_unmap += rows
        if self._rows_since_unmap >= every:
            self._rows_since_unmap = 0
            # Under the map lock (shared; callers may hold it already): no resize moves the map meanwhile.
            # The map's kept address saves reading /proc/self/maps (~0.75 ms) on every drop.
            with self._rw.shared():
                if not self._mapped.drop(self.map_size_bytes()):
                    drop_mapped_pages(self._data_file)

    # ---------------------------------------------------------------------------------------- writes
    def _commit(
        self,
        fill: Callable[[Any], None],
        need_bytes: int,
        num_rows: int,
        *,
        exclusive: bool = False,
    ) -> None:
        """Run ``fill(txn)`` in one write transaction and commit it; after a full map, grow it and run the
        whole transaction again. ``exclusive``: hold the lock exclusively (no read runs meanwhile).

        Raises:
            StoreFullError: the map hit its cap or the disk is full; nothing of the transaction was applied.
        """
        while True:
            try:
                with (
                    self._rw.exclusive() if exclusive else self._rw.shared(),
                    self._env.begin(write=True) as txn,
                ):
                    fill(txn)
                self._count_read(num_rows)  # a write reads its path too
                return
            except lmdb.MapFullError as err:
                self._grow(err, need_bytes, num_rows)
            except lmdb.Error as err:
                if isinstance(err, lmdb.DiskError) or "No space left" in str(err) or _disk_full(self._path):
                    raise self._no_space(need_bytes) from err
                raise map_error(err, "write transaction failed") from err
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise self._no_space(need_bytes) from err
                raise StoreError(f"write transaction failed: {err}") from err

    def _no_space(self, need_bytes: int) -> StoreFullError:
        return StoreFullError(
            f"store {self._path} is full: no space left on device for a write of {need_bytes} bytes"
        )

    def _grow(self, cause: lmdb.Error, need_bytes: int, num_rows: int) -> None:
        with self._rw.exclusive():
            current = int(self._env.info()["map_size"])
            cap = self._options.max_map_size_bytes
            if cap is not None and current >= cap:
                raise StoreFullError(
                    f"store {self._path} is full: its LMDB map is at the cap of {cap} bytes "
                    f"({self.used_bytes()} in use) and a write of {num_rows} rows needed {need_bytes} bytes more"
                ) from cause
            new = 2 * current if cap is None else min(2 * current, cap)
            try:
                self._mapped.moved()  # the map is made again, maybe at another address
                self._env.set_mapsize(new)
            except lmdb.Error as err:
                raise map_error(err, f"cannot grow the LMDB map to {new} bytes") from err

    # -------------------------------------------------------------------------------------- lifetime
    def used_bytes(self) -> int:
        """Bytes of the map in use (pages up to the last one written)."""
        info, stat = self._env.info(), self._env.stat()
        return int(info["last_pgno"] + 1) * int(stat["psize"])

    def map_size_bytes(self) -> int:
        """Current LMDB map size."""
        return int(self._env.info()["map_size"])

    def sync(self) -> None:
        """Force committed transactions to disk."""
        try:
            self._env.sync(True)
        except lmdb.Error as err:
            raise map_error(err, f"sync of store {self._path} failed", self._path) from err

    def snapshot(self, dest: Path) -> None:
        """Write a compacted, consistent copy of the environment into the empty directory ``dest``.

        LMDB's copy reads every page through this process's mapping of the data file; a helper thread
        drops the mapped pages every ``_COPY_UNMAP_S`` seconds meanwhile (``MADV_DONTNEED``: the page cache
        stays, the pages re-fault if read again), so the copy does not pull the whole table into RSS.
        """
        done = threading.Event()

        def unmap() -> None:
            while not done.wait(_COPY_UNMAP_S):
                drop_mapped_pages(self._data_file)

        helper = threading.Thread(target=unmap, name="tierrec-copy-unmap", daemon=True)
        helper.start()
        try:
            with self._rw.shared():
                self._env.copy(str(dest), compact=True)
        except lmdb.Error as err:
            raise map_error(err, f"snapshot to {dest} failed", dest) from err
        finally:
            done.set()
            helper.join()

    def close(self) -> None:
        """Stop the reader threads and close the environment (idempotent)."""
        self._readers.close()
        self._env.close()
        self._mapped.close()
