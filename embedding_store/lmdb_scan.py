"""Read-only streaming of a closed store or snapshot's rows, in either layout (``lmdb_backend``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError, StoreIncompatibleError
from embedding_store.lmdb_backend import (
    _LOG_MAX_DBS,
    _META_DB,
    _META_KEY,
    layout_of,
    map_error,
    table_meta,
)
from embedding_store.lmdb_log import replay_runs
from embedding_store.log_format import Geometry, rows_of_blocks, runs_name, segment_name
from embedding_store.readahead import drop_mapped_pages

__all__ = ["scan_snapshot"]


def scan_snapshot(
    path: Path, spec: TableSpec, *, seed: int, chunk_rows: int = 1 << 16
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Rows of ``spec``'s table in a closed store or snapshot, read-only, ascending ids, in chunks.

    Yields ``((n,) int64 ids, (n, R) float32 rows)`` with n <= ``chunk_rows``; the mapped pages are dropped
    after each chunk, so memory stays near one chunk whatever the table's size. Nothing is written to
    ``path`` (no lock file). A snapshot without the table yields nothing.

    Raises:
        StoreIncompatibleError: the snapshot holds the table with another layout, or another seed.
        StoreCorruptError: the snapshot is unreadable.
    """
    try:
        env = lmdb.open(
            str(path), readonly=True, lock=False, subdir=True, max_dbs=64 + _LOG_MAX_DBS, readahead=False
        )
    except lmdb.Error as err:
        raise map_error(err, f"cannot open snapshot {path}") from err
    data_file = os.path.realpath(path / "data.mdb")
    try:
        with env.begin() as txn:
            raw = txn.get(_META_KEY, db=env.open_db(_META_DB, txn=txn, create=False))
        try:
            if raw is None:
                raise ValueError("no metadata")
            meta = json.loads(bytes(raw))
        except (TypeError, ValueError) as err:
            raise StoreCorruptError(f"unreadable store metadata in {path}") from err
        if meta.get("seed") != seed:
            raise StoreIncompatibleError(
                f"snapshot {path} was written with seed {meta.get('seed')!r}, not {seed}"
            )
        have = meta.get("tables", {}).get(spec.name)
        if have is None:
            return
        if have != table_meta(spec):
            raise StoreIncompatibleError(
                f"table {spec.name!r} in {path} is {have}, the spec asks for {table_meta(spec)}"
            )
        layout, segment_rows = layout_of(meta)
        if layout == "log":

            def open_db(name: bytes) -> object | None:
                try:
                    return env.open_db(name, create=False)
                except lmdb.NotFoundError:
                    return None

            for ids, rows in scan_log(
                env, spec, segment_rows=segment_rows, chunk_rows=chunk_rows, open_db=open_db
            ):
                drop_mapped_pages(data_file)
                yield ids, rows
            return
        db = env.open_db(spec.name.encode(), create=False)
        after = b""
        while True:
            keys: list[bytes] = []
            vals: list[bytes] = []
            with env.begin(db=db) as txn:
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
            buf = b"".join(vals)
            if len(buf) != len(vals) * spec.row_bytes:
                raise StoreCorruptError(f"{path}: table {spec.name!r} has rows of unexpected size")
            ids = np.frombuffer(b"".join(keys), dtype=">u8").astype(np.int64)
            rows = np.frombuffer(buf, dtype=np.float32).reshape(len(vals), spec.row_floats).copy()
            del keys, vals, buf
            drop_mapped_pages(data_file)
            yield ids, rows
    except lmdb.Error as err:
        raise map_error(err, f"read of snapshot {path} failed") from err
    finally:
        env.close()


def scan_log(
    env: Any, spec: TableSpec, *, segment_rows: int, chunk_rows: int, open_db: Callable[[bytes], Any]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Rows of ``spec``'s table in a log-layout environment, ascending ids, in chunks of ``chunk_rows``
    (``open_db(name)``: the named database, read-only, or None when absent)."""
    runs_db = open_db(runs_name(spec.name))
    if runs_db is None:
        return
    geo = Geometry.of(spec, segment_rows)
    index, records, _ = replay_runs(env, runs_db, spec, geo)
    segs = {seg: open_db(segment_name(spec.name, seg)) for seg in records}
    ids, seqs = index.items()
    del index
    order = np.argsort(ids)
    ids, seqs = ids[order], seqs[order]
    for a in range(0, ids.shape[0], chunk_rows):
        part = seqs[a : a + chunk_rows]
        by_seq = np.argsort(part)
        ordered = part[by_seq]
        inverse, keys, seg_of, bounds = geo.plan(ordered)
        values: list[bytes] = []
        with env.begin() as txn:
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                db = segs.get(int(seg_of[lo]))
                values.extend(v for _, v in ([] if db is None else txn.cursor(db=db).getmulti(keys[lo:hi])))
        if len(values) != len(keys):
            raise StoreCorruptError(f"table {spec.name!r}: the log's blocks do not match its runs")
        rows = np.empty((part.shape[0], spec.row_floats), dtype=np.float32)
        rows[by_seq] = rows_of_blocks(values, inverse, ordered % geo.block, spec)
        yield ids[a : a + chunk_rows].copy(), rows
