"""Read-only streaming of a closed LMDB store or snapshot's rows, in either layout
(:class:`LmdbSnapshot`, a :class:`~embedding_store.backends.base.SnapshotReader`).

Nothing is written to the directory (no lock file; a format-1 store's metadata is upgraded in memory
only). The mapped pages are dropped after each chunk, so memory stays near one chunk whatever the
table's size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from embedding_store.backends import meta as meta_
from embedding_store.backends.btree import rows_of
from embedding_store.backends.lmdb_env import LOG_MAX_SEGMENTS, map_error, read_meta
from embedding_store.backends.log_format import Geometry, rows_of_blocks, runs_name, segment_name
from embedding_store.backends.log_records import check_blocks, replay_runs
from embedding_store.backends.readahead import drop_mapped_pages
from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError, StoreError, StoreIncompatibleError

__all__ = ["LmdbSnapshot"]


class LmdbSnapshot:
    """A closed LMDB store or snapshot, opened read-only.

    Args:
        path: the directory holding ``data.mdb``.

    Raises:
        StoreIncompatibleError: a format, layout or page size this code cannot read.
        StoreCorruptError: the metadata or the environment is unreadable.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            self._env = lmdb.open(
                str(path),
                readonly=True,
                lock=False,
                subdir=True,
                max_dbs=64 + LOG_MAX_SEGMENTS,
                readahead=False,
            )
        except lmdb.Error as err:
            raise map_error(err, f"cannot open snapshot {path}") from err
        self._data_file = os.path.realpath(path / "data.mdb")
        try:
            raw = read_meta(self._env, str(path))
            if raw is None:
                raise StoreCorruptError(f"unreadable store metadata in {path}")
            page_size = int(self._env.stat()["psize"])
            meta, _ = meta_.upgrade(raw, str(path), page_size=page_size)
            if meta.get("layout") not in ("log", "btree"):
                raise StoreIncompatibleError(
                    f"store {path}: layout is recorded as {meta.get('layout')!r}, not an LMDB layout"
                )
            if meta.get("page_size") != page_size:
                raise StoreIncompatibleError(
                    f"store {path}: page_size is recorded as {meta.get('page_size')!r}, its LMDB "
                    f"environment has pages of {page_size} bytes"
                )
        except lmdb.Error as err:
            self._env.close()
            raise map_error(err, f"read of snapshot {path} failed") from err
        except StoreError:
            self._env.close()
            raise
        self.meta = meta
        self.seed: int = meta.get("seed")  # type: ignore[assignment]
        self.layout: str = meta["layout"]
        self.tables: dict[str, dict[str, object]] = meta["tables"]

    def chunks(
        self, spec: TableSpec, *, chunk_rows: int = 1 << 16
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``spec``'s rows, ascending ids, ``((n,) int64 ids, (n, R) float32 rows)`` with n <= ``chunk_rows``;
        nothing when the snapshot lacks the table.

        Raises:
            StoreIncompatibleError: the snapshot holds the table with another description.
        """
        if spec.name not in self.tables:
            return
        self.check(spec)
        try:
            if self.layout == "log":
                have = self.tables[spec.name]
                geo = Geometry(block=have["block_rows"], segment=have["segment_rows"])  # type: ignore[arg-type]
                parts = self._log_chunks(spec, geo, chunk_rows)
            else:
                parts = self._btree_chunks(spec, chunk_rows)
            for ids, rows in parts:
                drop_mapped_pages(self._data_file)
                yield ids, rows
        except lmdb.Error as err:
            raise map_error(err, f"read of snapshot {self._path} failed") from err

    def _open_db(self, name: bytes) -> Any | None:
        try:
            return self._env.open_db(name, create=False)
        except lmdb.NotFoundError:
            return None

    def _btree_chunks(self, spec: TableSpec, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        db = self._open_db(spec.name.encode())
        after = b""
        while db is not None:
            keys: list[bytes] = []
            vals: list[bytes] = []
            with self._env.begin(db=db) as txn:
                cursor = txn.cursor()
                found = cursor.set_range(after) if after else cursor.first()
                if found and after and cursor.key() == after:
                    found = cursor.next()
                while found and len(keys) < chunk_rows:
                    keys.append(cursor.key())
                    vals.append(cursor.value())
                    found = cursor.next()
            if not keys:
                return
            after = keys[-1]
            ids, rows = rows_of(spec.name, keys, vals, spec.row_bytes)
            del keys, vals
            yield ids, rows.copy()

    def _log_chunks(
        self, spec: TableSpec, geo: Geometry, chunk_rows: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Rows of ``spec``'s log, ascending ids, in chunks of ``chunk_rows``."""
        runs_db = self._open_db(runs_name(spec.name))
        if runs_db is None:
            return
        t, records = replay_runs(self._env, runs_db, spec, geo)
        segs = {seg: self._open_db(segment_name(spec.name, seg)) for seg in records}
        t.segs = {seg: db for seg, db in segs.items() if db is not None}
        check_blocks(self._env, t, str(self._path))
        ids, seqs = t.live_items()
        del t
        order = np.argsort(ids)
        ids, seqs = ids[order], seqs[order]
        for a in range(0, ids.shape[0], chunk_rows):
            part = seqs[a : a + chunk_rows]
            by_seq = np.argsort(part)
            ordered = part[by_seq]
            inverse, keys, seg_of, bounds = geo.plan(ordered)
            values: list[bytes] = []
            with self._env.begin() as txn:
                for lo, hi in zip(bounds, bounds[1:], strict=False):
                    db = segs.get(int(seg_of[lo]))
                    values.extend(
                        v for _, v in ([] if db is None else txn.cursor(db=db).getmulti(keys[lo:hi]))
                    )
            if len(values) != len(keys):
                raise StoreCorruptError(f"table {spec.name!r}: the log's blocks do not match its runs")
            rows = np.empty((part.shape[0], spec.row_floats), dtype=np.float32)
            rows[by_seq] = rows_of_blocks(values, inverse, ordered % geo.block, spec)
            yield ids[a : a + chunk_rows].copy(), rows

    def check(self, spec: TableSpec) -> None:
        """Raise StoreIncompatibleError when the snapshot holds ``spec``'s table with another description."""
        if spec.name in self.tables:
            meta_.check_tables(self.meta, str(self._path), seed=self.seed, tables=[spec], geometry=None)

    def close(self) -> None:
        self._env.close()
