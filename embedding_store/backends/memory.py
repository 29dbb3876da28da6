"""The memory backend: rows in RAM, persisted to one file (``LmdbOptions.layout = "memory"``).

For small tables, and the oracle the LMDB backends are tested against. Rows live in one dict per table;
``sync()`` and ``close()`` write them all to ``memory.npz`` in the store directory (a temporary file,
fsynced, renamed over the old one, the directory fsynced), so the file always holds one complete state:
the last synced one. The file is a numpy ``.npz`` (read with ``allow_pickle=False``: no code in the
file runs) holding the metadata as JSON bytes (:mod:`~embedding_store.backends.meta`: format, seed,
layout, tables) and per table its sorted ids and rows. ``LmdbOptions.max_map_size_bytes`` caps the rows'
bytes (8 per id + ``row_bytes``): a write past it raises StoreFullError with nothing applied.
"""

from __future__ import annotations

import os
import threading
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from embedding_store.backends import meta as meta_
from embedding_store.backends.base import Writes
from embedding_store.config import LmdbOptions, TableSpec
from embedding_store.errors import StoreCorruptError, StoreError, StoreFullError, StoreIncompatibleError
from embedding_store.snapshot import fsync

__all__ = ["MEMORY_FILE", "MemoryBackend", "MemorySnapshot"]

MEMORY_FILE = "memory.npz"


def _load(path: Path) -> tuple[meta_.Meta, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The metadata (format 2, layout memory) and per table (sorted ids, rows) of a memory file."""
    where = str(path.parent)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = meta_.decode(data["meta"].tobytes(), where)
            meta, _ = meta_.upgrade(meta, where, page_size=None)
            if meta.get("layout") != "memory":
                raise StoreIncompatibleError(
                    f"store {where}: layout is recorded as {meta.get('layout')!r} in {MEMORY_FILE}, not 'memory'"
                )
            arrays = {}
            for i, name in enumerate(meta.get("order", [])):
                ids, rows = data[f"ids_{i}"], data[f"rows_{i}"]
                if ids.dtype != np.int64 or rows.dtype != np.float32 or rows.shape[:1] != ids.shape:
                    raise StoreCorruptError(f"store {where}: table {name!r} has arrays of another kind")
                arrays[name] = (ids, rows)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise StoreCorruptError(f"unreadable store file {path}: {err}") from err
    return meta, arrays


def _save(
    path: Path, meta: meta_.Meta, tables: dict[str, dict[int, np.ndarray]], specs: dict[str, TableSpec]
) -> None:
    """Write ``tables`` to ``path`` atomically (temporary file, fsync, rename, fsync of the directory)."""
    names = sorted(tables)
    arrays: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        rows = tables[name]
        ids = np.array(sorted(rows), dtype=np.int64)
        floats = specs[name].row_floats
        arrays[f"ids_{i}"] = ids
        arrays[f"rows_{i}"] = (
            np.stack([rows[k] for k in ids.tolist()]) if ids.shape[0] else np.empty((0, floats), np.float32)
        )
    record = {**meta, "order": names}
    arrays["meta"] = np.frombuffer(meta_.encode(record), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)
        fsync(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        kind = StoreFullError if "No space" in str(err) or err.errno == 28 else StoreError
        raise kind(f"cannot write {path}: {err}") from err


class MemoryBackend:
    """Rows of several tables in RAM, persisted to ``memory.npz`` on ``sync``/``close`` (see the module).

    Args:
        path: the store directory (created if missing).
        options: ``max_map_size_bytes`` caps the rows' bytes; the other options are LMDB's.
        seed: the store's init seed, recorded and checked on reopen.
        tables: the tables; ones already on disk must match their recorded description.

    Raises:
        StoreIncompatibleError: another seed or tables, or a format this code cannot read.
        StoreCorruptError: the file is unreadable.
    """

    def __init__(self, path: Path, *, options: LmdbOptions, seed: int, tables: Sequence[TableSpec]) -> None:
        self._file = Path(path) / MEMORY_FILE
        self._cap = options.max_map_size_bytes
        self._lock = threading.Lock()
        self._specs = {t.name: t for t in tables}
        where = str(path)
        loaded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if self._file.exists():
            self.meta, loaded = _load(self._file)
        else:
            self.meta = meta_.new_meta(seed=seed, layout="memory", page_size=None)
        self.meta.pop("order", None)
        changed = meta_.check_tables(self.meta, where, seed=seed, tables=tables, geometry=None)
        self._rows: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in tables}
        for name, (ids, rows) in loaded.items():
            self._rows[name] = dict(zip(ids.tolist(), rows, strict=True))
            if name not in self._specs:  # a table this opener does not name is kept as it is
                self._specs[name] = _spec_of(name, self.meta["tables"][name])
        self._bytes = sum(len(r) * (8 + self._specs[n].row_bytes) for n, r in self._rows.items())
        self._closed = False
        if changed or not self._file.exists():
            self.sync()

    # ----------------------------------------------------------------------------------------- reads
    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (N,) sorted unique ids: ((N,) found, (F, R) float32 rows of the found ids)."""
        rows = self._rows[table]
        with self._lock:
            got = [rows.get(i) for i in ids.tolist()]
        found = np.fromiter((r is not None for r in got), dtype=bool, count=len(got))
        kept = [r for r in got if r is not None]
        floats = self._specs[table].row_floats
        return found, np.stack(kept) if kept else np.empty((0, floats), dtype=np.float32)

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` stored rows with id > ``after``, ascending ids: ((n,) ids, (n, R) rows)."""
        with self._lock:
            rows = self._rows[table]
            ids = np.array(sorted(i for i in rows if i > after)[:limit], dtype=np.int64)
            kept = [rows[i] for i in ids.tolist()]
        floats = self._specs[table].row_floats
        return ids, np.stack(kept) if kept else np.empty((0, floats), dtype=np.float32)

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table``."""
        return len(self._rows[table])

    # ---------------------------------------------------------------------------------------- writes
    def put_rows(self, writes: Writes) -> None:
        """Write ``(table, ids, rows)`` groups at once; StoreFullError (nothing applied) past the cap."""
        with self._lock:
            grow = 0
            for table, ids, _ in writes:
                rows = self._rows[table]
                grow += sum(1 for i in ids.tolist() if i not in rows) * (8 + self._specs[table].row_bytes)
            if self._cap is not None and self._bytes + grow > self._cap:
                raise StoreFullError(
                    f"store {self._file.parent} is full: its rows would take {self._bytes + grow} bytes, "
                    f"the cap (store.lmdb.max_map_size_bytes) is {self._cap}"
                )
            for table, ids, new in writes:
                rows = self._rows[table]
                copy = np.array(new, dtype=np.float32, copy=True)  # the caller may reuse its array
                rows.update(zip(ids.tolist(), copy, strict=True))
            self._bytes += grow

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        """Delete the rows of ``ids`` (absent ones are skipped)."""
        with self._lock:
            rows = self._rows[table]
            for i in ids.tolist():
                if rows.pop(i, None) is not None:
                    self._bytes -= 8 + self._specs[table].row_bytes

    # -------------------------------------------------------------------------------------- lifetime
    def used_bytes(self) -> int:
        """Bytes of the rows held (8 per id + the row)."""
        return self._bytes

    def map_size_bytes(self) -> int:
        """The cap on the rows' bytes, or the bytes held when there is none."""
        return self._bytes if self._cap is None else self._cap

    def sync(self) -> None:
        """Write every row to ``memory.npz`` atomically."""
        with self._lock:
            snapshot = {name: dict(rows) for name, rows in self._rows.items()}
        _save(self._file, self.meta, snapshot, self._specs)

    def snapshot(self, dest: Path) -> None:
        """Write every row into ``dest/memory.npz`` (the directory exists and is empty)."""
        with self._lock:
            snapshot = {name: dict(rows) for name, rows in self._rows.items()}
        _save(Path(dest) / MEMORY_FILE, self.meta, snapshot, self._specs)

    def close(self) -> None:
        """Persist the rows (as ``sync``) and forget them (idempotent)."""
        if self._closed:
            return
        self.sync()
        self._closed = True


def _spec_of(name: str, have: dict[str, object]) -> TableSpec:
    from embedding_store.config import OptimizerKind

    return TableSpec(
        name=name,
        dim=int(have["dim"]),  # type: ignore[call-overload]
        optimizer=OptimizerKind(have["optimizer"]),
        num_embeddings=have["num_embeddings"],  # type: ignore[arg-type]
        init_scale=float(have["init_scale"]),  # type: ignore[arg-type]
    )


class MemorySnapshot:
    """A memory store or snapshot opened read-only (a :class:`~embedding_store.backends.base.SnapshotReader`)."""

    def __init__(self, path: Path) -> None:
        self.meta, self._arrays = _load(Path(path) / MEMORY_FILE)
        self._where = str(path)
        self.seed: int = self.meta.get("seed")  # type: ignore[assignment]
        self.layout = "memory"
        self.tables: dict[str, dict[str, object]] = self.meta["tables"]

    def chunks(
        self, spec: TableSpec, *, chunk_rows: int = 1 << 16
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``spec``'s rows, ascending ids, in chunks of ``chunk_rows``."""
        if spec.name not in self._arrays:
            return
        self.check(spec)
        ids, rows = self._arrays[spec.name]
        for a in range(0, ids.shape[0], chunk_rows):
            yield ids[a : a + chunk_rows].copy(), rows[a : a + chunk_rows].copy()

    def check(self, spec: TableSpec) -> None:
        """Raise StoreIncompatibleError when the snapshot holds ``spec``'s table with another description."""
        if spec.name in self.tables:
            meta_.check_tables(self.meta, self._where, seed=self.seed, tables=[spec], geometry=None)

    def close(self) -> None:
        self._arrays = {}
