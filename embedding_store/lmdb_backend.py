"""The SSD tier's storage backend: one LMDB environment per rank shard.

With this module, ``lmdb_scan`` (read-only snapshots) is the only one that imports ``lmdb``. A store has
one of two layouts, chosen when it is created (``LmdbOptions.layout``) and recorded in its metadata:
``"log"`` (the default, ``embedding_store.lmdb_log``: rows placed by write time, an id index in RAM) or
``"btree"``, one named DB per table keyed by id, described here. Keys are 8-byte big-endian ids, so
LMDB's byte order is ascending id order; values are packed float32 rows (see ``config``). Reads and writes are batched over
sorted keys (``getmulti``/``putmulti``). The map starts at ``initial_map_size_bytes`` and doubles when a
write transaction finds it full, up to ``max_map_size_bytes``; a full map or disk raises StoreFullError
after the transaction was aborted, so no write is ever half-applied. A bounded table (``num_embeddings``
up to 2^26) that is empty when the environment opens keeps one flag per id, set for every id a write
carries, and reads look up only flagged ids: the rest were never written, so they cannot be found.

Threads: reads may run in any thread while the background writer commits; changing the map size needs
no transaction open in this process, so reads and commits hold a shared lock and a resize an exclusive one.
A read of many keys is split into runs of consecutive keys, each read in its own transaction by one of
``read_threads`` threads (``lmdb_threads.ReaderPool``), so that many page faults of a cold file are in
flight at once. The runs' rows are joined in id order: one transaction's result, except that a commit
landing during the read may show in some runs and not in others (no row is older than one transaction
begun at the call would return).
"""

from __future__ import annotations

import errno
import itertools
import json
import operator
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb
import numpy as np

from embedding_store.config import LmdbOptions, TableSpec
from embedding_store.errors import StoreCorruptError, StoreError, StoreFullError, StoreIncompatibleError
from embedding_store.lmdb_log import LogIo, LogTables
from embedding_store.lmdb_threads import ReaderPool, SharedExclusiveLock
from embedding_store.log_format import encode_keys
from embedding_store.readahead import MappedFile, drop_mapped_pages

__all__ = [
    "FORMAT_VERSION",
    "LmdbBackend",
    "encode_keys",
    "layout_of",
    "map_error",
    "table_meta",
]

FORMAT_VERSION = 1
_META_DB = b"__meta__"
_META_KEY = b"format"
# Bounded tables up to this many ids that start empty keep a "may be stored" flag per id (1 byte each).
_FILTER_MAX_IDS = 1 << 26
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


def _row_values(rows: np.ndarray, row_bytes: int) -> list[bytes]:
    """(N, R) float32 rows -> N values of ``row_bytes`` bytes each (made in numpy's C loop)."""
    flat = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    return flat.view(f"V{row_bytes}").tolist() if flat.size else []


_KEY, _VALUE = operator.itemgetter(0), operator.itemgetter(1)

# Named databases of a log-layout environment beyond two per table: its segments (one per
# ``log_segment_rows`` records; ~330 for 100 M live rows of one table at the default compaction point).
_LOG_MAX_DBS = 1024


def layout_of(meta: dict) -> tuple[str, int]:
    """(layout, segment rows) recorded in a store's metadata; stores from before layouts are B-trees."""
    layout, rows = meta.get("layout", "btree"), meta.get("segment_rows", 0)
    if layout not in ("btree", "log") or not isinstance(rows, int) or (layout == "log" and rows < 1):
        raise StoreCorruptError(f"unknown store layout {layout!r} (segment rows {rows!r}) in the metadata")
    return layout, rows


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
    if isinstance(err, lmdb.MapFullError | lmdb.DiskError) or "No space left" in str(err):
        return StoreFullError(f"{what}: no space left on device ({err})")
    if "Input/output error" in str(err) and _disk_full(path):
        return StoreFullError(f"{what}: no space left on device on the filesystem of {path}")
    if isinstance(err, _CORRUPT):
        return StoreCorruptError(f"{what}: {err}")
    return StoreError(f"{what}: {err}")


def table_meta(spec: TableSpec) -> dict[str, object]:
    return {
        "dim": spec.dim,
        "optimizer": spec.optimizer.value,
        "num_embeddings": spec.num_embeddings,
        "init_scale": spec.init_scale,
        "dtype": "float32",
    }


class LmdbBackend:
    """Packed rows of several tables in one LMDB environment (a context manager).

    Args:
        path: the environment directory (created if missing).
        options: map size, sync and readahead options.
        seed: the store's init seed, recorded and checked on reopen.
        tables: the tables; ones already on disk must match dim, optimizer, id space, init scale.

    Raises:
        StoreIncompatibleError: the directory holds a store for other tables or another seed.
        StoreCorruptError: the metadata or the environment is unreadable.
    """

    def __init__(self, path: Path, *, options: LmdbOptions, seed: int, tables: Sequence[TableSpec]) -> None:
        self._options = options
        self._path = path
        self._rw = SharedExclusiveLock()
        self._readers = ReaderPool(options.read_threads, split=options.read_split)
        self._data_file = os.path.realpath(path / "data.mdb")
        self._mapped = MappedFile(self._data_file)
        self._rows_since_unmap = 0
        self._row_bytes = {t.name: t.row_bytes for t in tables}
        try:
            self._env = lmdb.open(
                str(path),
                map_size=options.initial_map_size_bytes,
                subdir=True,
                max_dbs=max(64, 2 * len(tables) + 2) + (_LOG_MAX_DBS if options.layout == "log" else 0),
                sync=options.sync,
                metasync=options.sync,
                readahead=options.readahead,
                lock=True,
                # a slot per transaction open at once: each reader thread's, the callers', the writer's
                max_readers=126 + options.read_threads,
            )
        except lmdb.Error as err:
            raise map_error(err, f"cannot open LMDB environment {path}") from err
        try:
            layout, segment_rows = self._check_meta(path, seed, tables)
            self._log: LogTables | None = None
            self._dbs = {}
            self._maybe_stored: dict[str, np.ndarray] = {}
            if layout == "log":
                self._log = LogTables(
                    self._env,
                    tables,
                    layout=(segment_rows, options.log_compact_at),
                    locks=(self._rw, self._readers),
                    io=LogIo(self._commit, self._count_read, self._mapped, options.unmap_every_rows),
                )
                return
            self._dbs = {t.name: self._env.open_db(t.name.encode(), create=True) for t in tables}
            # A table that starts empty knows which ids it may hold: the ones ever handed to put_rows.
            # Reads skip the others (first touches of never-written rows are most reads of a first pass).
            self._maybe_stored = {
                t.name: np.zeros(t.num_embeddings, dtype=bool)
                for t in tables
                if t.num_embeddings is not None
                and t.num_embeddings <= _FILTER_MAX_IDS
                and not self.num_rows(t.name)
            }
        except lmdb.Error as err:
            self._env.close()
            raise map_error(err, f"cannot open the tables of {path}") from err
        except StoreError:
            self._env.close()
            raise

    def _check_meta(self, path: Path, seed: int, tables: Sequence[TableSpec]) -> tuple[str, int]:
        """Check (or record) the seed and tables; returns the store's (layout, segment rows)."""
        meta_db = self._env.open_db(_META_DB, create=True)
        with self._env.begin(write=True, db=meta_db) as txn:
            raw = txn.get(_META_KEY)
            if raw is None:
                meta: dict = {
                    "format": FORMAT_VERSION,
                    "seed": seed,
                    "tables": {},
                    "layout": self._options.layout,
                }
                if self._options.layout == "log":
                    meta["segment_rows"] = self._options.log_segment_rows
            else:
                try:
                    meta = json.loads(bytes(raw))
                    known = meta["tables"]
                    assert isinstance(known, dict)
                except (ValueError, KeyError, TypeError, AssertionError) as err:
                    raise StoreCorruptError(f"unreadable store metadata in {path}") from err
                if meta.get("format") != FORMAT_VERSION:
                    raise StoreIncompatibleError(
                        f"store {path} has format {meta.get('format')!r}, not {FORMAT_VERSION}"
                    )
                if meta.get("seed") != seed:
                    raise StoreIncompatibleError(
                        f"store {path} was written with seed {meta.get('seed')!r}, not {seed}"
                    )
            changed = raw is None
            for spec in tables:
                want = table_meta(spec)
                have = meta["tables"].get(spec.name)
                if have is not None and have != want:
                    raise StoreIncompatibleError(
                        f"table {spec.name!r} in {path} is {have}, the spec asks for {want}"
                    )
                changed |= have is None
                meta["tables"][spec.name] = want
            if changed:  # a full map must still reopen: write only when something is new
                txn.put(_META_KEY, json.dumps(meta, sort_keys=True).encode())
        return layout_of(meta)

    # ----------------------------------------------------------------------------------------- reads
    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read rows of (N,) sorted unique ids.

        Returns:
            found: (N,) bool, True where the row exists.
            rows: (F, R) float32 rows of the found ids, in id order.
        """
        if self._log is not None:
            try:
                return self._log.get_rows(table, ids)
            except lmdb.Error as err:
                raise map_error(err, f"read of table {table!r} failed") from err
        maybe = self._maybe_stored.get(table)
        if maybe is not None and ids.shape[0]:
            stored = maybe[ids]
            if not stored.all():
                at = np.flatnonzero(stored)
                found_stored, rows = self._get_rows(table, ids[at])
                found = np.zeros(ids.shape[0], dtype=bool)
                found[at[found_stored]] = True  # a subsequence of sorted ids: rows keep their order
                return found, rows
        return self._get_rows(table, ids)

    def _get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row_bytes = self._row_bytes[table]
        step = self._options.unmap_every_rows or max(1, ids.shape[0])
        if ids.shape[0] <= step:
            return self._get_chunk(table, ids)
        # Large reads go in chunks so that the mapped pages are dropped between them (bounded RSS).
        parts = [self._get_chunk(table, ids[i : i + step]) for i in range(0, ids.shape[0], step)]
        found = np.concatenate([f for f, _ in parts])
        rows = np.concatenate([r for _, r in parts]) if parts else np.empty((0, row_bytes // 4), np.float32)
        return found, rows

    def _get_chunk(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        row_bytes = self._row_bytes[table]
        found = np.zeros(ids.shape[0], dtype=bool)
        if ids.shape[0] == 0:
            return found, np.empty((0, row_bytes // 4), dtype=np.float32)
        keys = encode_keys(ids)
        db = self._dbs[table]

        def read(run: slice) -> list[tuple[bytes, bytes]]:
            # buffers=False: py-lmdb's zero-copy buffers make getmulti ~10x slower every other call.
            with self._env.begin(db=db) as txn:
                return txn.cursor().getmulti(keys[run])

        try:
            # Every run's transaction ends inside the shared hold: no resize while one is open.
            with self._rw.shared():
                runs = self._readers.map(read, self._readers.runs(len(keys)))
        except lmdb.Error as err:
            raise map_error(err, f"read of table {table!r} failed") from err
        pairs = runs[0] if len(runs) == 1 else list(itertools.chain.from_iterable(runs))
        val_buf = b"".join(map(_VALUE, pairs))
        if len(val_buf) != len(pairs) * row_bytes:
            raise StoreCorruptError(f"table {table!r}: rows of unexpected size (want {row_bytes} bytes each)")
        self._count_read(ids.shape[0])
        if len(pairs) == ids.shape[0]:
            found[:] = True
        else:
            found_ids = np.frombuffer(b"".join(map(_KEY, pairs)), dtype=">u8").astype(np.int64)  # (F,)
            found[np.searchsorted(ids, found_ids)] = True
        return found, np.frombuffer(val_buf, dtype=np.float32).reshape(len(pairs), row_bytes // 4)

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` rows with id > ``after`` in ascending id order: ((n,) ids, (n, R) rows)."""
        if self._log is not None:
            try:
                return self._log.scan(table, after=after, limit=limit)
            except lmdb.Error as err:
                raise map_error(err, f"scan of table {table!r} failed") from err
        row_bytes = self._row_bytes[table]
        keys: list[bytes] = []
        vals: list[bytes] = []
        try:
            with self._rw.shared(), self._env.begin(db=self._dbs[table]) as txn:
                cursor = txn.cursor()
                start = encode_keys(np.array([after + 1], dtype=np.int64))[0] if after >= 0 else b""
                if cursor.set_range(start):
                    for key, val in cursor:
                        keys.append(key)
                        vals.append(val)
                        if len(keys) >= limit:
                            break
        except lmdb.Error as err:
            raise map_error(err, f"scan of table {table!r} failed") from err
        self._count_read(len(keys))
        val_buf = b"".join(vals)
        if len(val_buf) != len(vals) * row_bytes:
            raise StoreCorruptError(f"table {table!r}: rows of unexpected size (want {row_bytes} bytes each)")
        ids = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.int64)
        return ids, np.frombuffer(val_buf, dtype=np.float32).reshape(len(vals), row_bytes // 4)

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

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""
        if self._log is not None:
            return self._log.num_rows(table)
        with self._rw.shared(), self._env.begin() as txn:
            return int(txn.stat(self._dbs[table])["entries"])

    # ---------------------------------------------------------------------------------------- writes
    def put_rows(self, writes: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Write ``(table, (N,) sorted unique ids, (N, R) float32 rows)`` groups in ONE transaction.

        Raises:
            StoreFullError: the map hit its cap or the disk is full. Nothing of ``writes`` was applied,
                except in the log layout when the compaction that follows the append is what failed:
                the append was committed and is read back (the store is full either way).
        """
        if self._log is not None:
            try:
                self._log.put_rows(writes)
            except lmdb.Error as err:
                raise map_error(err, "write of the log failed", self._path) from err
            return
        items = []
        need_bytes = 0  # keys and values of this write, before LMDB's page overhead
        for table, ids, rows in writes:
            maybe = self._maybe_stored.get(table)
            if maybe is not None:  # before the commit: a reader that sees the row committed sees the flag
                maybe[ids] = True
            row_bytes = self._row_bytes[table]
            need_bytes += ids.shape[0] * (8 + row_bytes)
            values = _row_values(rows, row_bytes)
            items.append((self._dbs[table], list(zip(encode_keys(ids), values, strict=True))))

        def fill(txn: lmdb.Transaction) -> None:
            for db, pairs in items:
                txn.cursor(db=db).putmulti(pairs)

        self._commit(fill, need_bytes, sum(len(pairs) for _, pairs in items))

    def _commit(
        self,
        fill: Callable[[lmdb.Transaction], None],
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
                    raise StoreFullError(
                        f"store {self._path} is full: no space left on device for a write of {need_bytes} bytes"
                    ) from err
                raise map_error(err, "write transaction failed") from err
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise StoreFullError(
                        f"store {self._path} is full: no space left on device for a write of {need_bytes} bytes"
                    ) from err
                raise StoreError(f"write transaction failed: {err}") from err

    def used_bytes(self) -> int:
        """Bytes of the map in use (pages up to the last one written)."""
        info, stat = self._env.info(), self._env.stat()
        return int(info["last_pgno"] + 1) * int(stat["psize"])

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

    def map_size_bytes(self) -> int:
        """Current LMDB map size."""
        return int(self._env.info()["map_size"])

    def sync(self) -> None:
        """Force committed transactions to disk."""
        try:
            self._env.sync(True)
        except lmdb.Error as err:
            raise map_error(err, f"sync of store {self._path} failed", self._path) from err

    def copy_to(self, dest: Path) -> None:
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
