"""Sustained write-back through the store's backend into a store that already holds ``base_rows`` rows,
against LMDB's sorted bulk append of the same number of rows, measured in the same run (bench_ssd.py).

1. Fill: ``base_rows`` hashed 64-bit ids (:func:`ssd_tier.disk.hashed_ids`) of 260-byte rows (dim 64 + one
   row-wise Adagrad float), in sorted bulk ``put_rows`` of 1 M rows, then synced.
2. Write-back: transactions of ``batch_rows`` random stored ids (sorted and unique within each, as the
   background writer commits them), each row tagged with its write's number. The ids of a measured
   part are drawn before its clock starts (the rows are built inside it, as the baseline's are). In the
   log layout, writes run until compaction starts (``warm``: a fresh log has nothing dead to compact;
   with a base of N rows and uniform writes of stored ids, the log is ``log_compact_at`` = c dead after
   c / (1 - c) x N written rows) and then the measured window of ``window_rows`` rows, compaction included; the B-tree
   layout has no warm-up.
   The window starts after a sync and ends with ``sync`` + ``os.sync()``: its bytes reached the device.
   It is measured in ``PARTS`` consecutive parts too: under uniform updates every segment of the fresh
   base reaches the compaction point at about the same time, so the first part compacts far more than
   the steady state does.
3. Append baseline: the same number of rows under sorted fresh keys, ``putmulti(append=True)`` in
   transactions of ``batch_rows`` into an empty id-keyed LMDB, synced the same way, in parts too: each
   right after the log's part of as many rows, so that each pair meets the same machine (this disk's
   append rate has moved 2x between runs, and within one). ``writeback_vs_append`` is the whole window's
   rate over the baseline's whole rate; the parts' paired ratios are reported beside it.
4. Check: 1,000 sampled ids read back through the backend equal the newest write of each (an array
   oracle of write numbers).

The backend is opened by ``embedding_store.backends.open_backend`` and driven through its public methods;
the log layout's compaction counts and records per live row come from its public ``log`` attribute.

Write amplification = bytes the process handed the kernel (``wchar``) or the device wrote, whichever is
less (:func:`ssd_tier.disk.write_amplification`), per byte of rows written back in the window.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends import RowBackend, open_backend
from ssd_tier.disk import ROW_BYTES, DiskIo, drop_from_cache, hashed_ids, write_amplification

SPEC = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
FILL_ROWS = 1 << 20
MAP_BYTES = 1 << 37  # address space only: LMDB does not preallocate
CHECK_ROWS = 1000
PARTS = 3  # the window is measured in consecutive parts


def _rows(ids: np.ndarray, version: int) -> np.ndarray:
    """Row of ``id`` written by write ``version``: [version, id mod 2^20, 0, ...]."""
    rows = np.zeros((ids.shape[0], SPEC.row_floats), dtype=np.float32)
    rows[:, 0] = version
    rows[:, 1] = ids & 0xFFFFF
    return rows


def _synced(path: Path, backend: RowBackend | None = None, env: lmdb.Environment | None = None) -> None:
    if backend is not None:
        backend.sync()
    if env is not None:
        env.sync(True)
    os.sync()


class AppendBaseline:
    """Rows under sorted fresh keys appended in transactions of ``batch_rows`` into an empty id-keyed LMDB,
    in parts (:meth:`part`), each synced and its pages then dropped from the page cache (the log's store
    keeps the cache it had); :meth:`close` deletes the environment and returns the whole run."""

    def __init__(self, root: Path, batch_rows: int) -> None:
        self._path = root / "append"
        shutil.rmtree(self._path, ignore_errors=True)
        self._path.mkdir(parents=True)
        self._env = lmdb.open(
            str(self._path), map_size=MAP_BYTES, sync=False, metasync=False, readahead=False, max_dbs=4
        )
        self._db = self._env.open_db(b"rows")
        self._batch = batch_rows
        self._next = 0
        self.parts: list[dict[str, Any]] = []
        self._disk: dict[str, int] = {}

    def part(self, rows: int) -> dict[str, Any]:
        """Append the next ``rows`` rows (then synced); returns the part's record."""
        io, cpu = DiskIo(self._path), _cpu()
        start = time.perf_counter()
        for lo in range(self._next, self._next + rows, self._batch):
            ids = np.arange(lo, min(self._next + rows, lo + self._batch), dtype=np.int64)
            keys = ids.astype(">u8").view("V8").tolist()
            values = _rows(ids, 0).reshape(-1).view(f"V{ROW_BYTES}").tolist()
            with self._env.begin(write=True) as txn:
                txn.cursor(db=self._db).putmulti(list(zip(keys, values, strict=True)), append=True)
        _synced(self._path, env=self._env)
        seconds = time.perf_counter() - start
        disk = io.delta()
        self._next += rows
        for k, v in disk.items():
            self._disk[k] = self._disk.get(k, 0) + v
        drop_from_cache(self._path)  # the next part appends after these pages, reading only the right edge
        rec = {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, **_cpu(cpu)}
        rec["write_amplification"] = write_amplification(disk, rows)["disk"]
        self.parts.append(rec)
        return rec

    def close(self) -> dict[str, Any]:
        """The whole baseline (every part) as one record; the environment is deleted."""
        self._env.close()
        shutil.rmtree(self._path, ignore_errors=True)
        rows, seconds = sum(p["rows"] for p in self.parts), sum(p["seconds"] for p in self.parts)
        return {
            "rows": rows,
            "seconds": seconds,
            "rows_per_s": rows / seconds,
            "write_amplification": write_amplification(self._disk, rows),
            "parts": self.parts,
        }


def store_writeback(
    root: Path,
    *,
    layout: str,
    base_rows: int,
    window_rows: int,
    batch_rows: int,
    seed: int = 0,
    after_part: Callable[[int], Any] | None = None,
    log_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill, (warm,) measured write-back window and read-back check of one layout; the store is deleted.
    ``after_part(rows)`` runs after each measured part (synced) and before the next one's clock starts;
    ``log_options``: ``LmdbOptions`` fields of the log layout (``log_compact_at``, ``log_segment_rows``)."""
    path = root / f"store_{layout}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    chosen = (log_options or {}) if layout == "log" else {}
    options = LmdbOptions(initial_map_size_bytes=MAP_BYTES, layout=layout, **chosen)
    backend = open_backend(path, options=options, seed=0, tables=[SPEC])
    ids = hashed_ids(base_rows)
    version = np.zeros(base_rows, dtype=np.int32)  # newest write of each base id (0: the fill)
    start = time.perf_counter()
    fill(backend, ids)
    _synced(path, backend)
    out: dict[str, Any] = {"layout": layout, "base_rows": base_rows, "fill_s": time.perf_counter() - start}
    if layout == "log":
        out["log_compact_at"] = options.log_compact_at
    rng = np.random.default_rng(seed)
    log = getattr(backend, "log", None)  # the log layout's tables: their public stats and space
    writes = [0]

    def picks(rows: int) -> list[np.ndarray]:
        """Batches of sorted unique base rows adding up to at least ``rows`` (drawn before a timed part:
        the draw is the benchmark's input, not the store's work)."""
        out: list[np.ndarray] = []
        drawn = 0
        while drawn < rows:
            out.append(np.unique(rng.integers(0, base_rows, size=batch_rows)))
            drawn += out[-1].shape[0]
        return out

    def write_back(pick: np.ndarray | None = None) -> int:
        writes[0] += 1
        pick = np.unique(rng.integers(0, base_rows, size=batch_rows)) if pick is None else pick
        backend.put_rows([("t", ids[pick], _rows(ids[pick], writes[0]))])
        version[pick] = writes[0]
        return int(pick.shape[0])

    # The log is compact_at dead once c / (1 - c) x base rows were written back: compaction starts.
    goal = base_rows * options.log_compact_at / (1 - options.log_compact_at) if layout == "log" else 0
    warm, start = 0, time.perf_counter()
    while warm < goal:
        warm += write_back()
    out.update(warm_rows=warm, warm_s=time.perf_counter() - start)
    _synced(path, backend)
    parts, total_s, disk = [], 0.0, {}  # the window's disk counts: its parts' (not what runs between)
    for part in range(PARTS):  # consecutive thirds: the first compactions of a fresh log come at once
        batches = picks(window_rows // PARTS)
        part_io, before, cpu = DiskIo(path), _log_counts(log), _cpu()
        written, start = 0, time.perf_counter()
        for pick in batches:
            written += write_back(pick)
        unsynced = time.perf_counter() - start
        _synced(path, backend)
        seconds = time.perf_counter() - start
        total_s += seconds
        part_disk = part_io.delta()
        for k, v in part_disk.items():
            disk[k] = disk.get(k, 0) + v
        rec = {"part": part, "rows": written, "seconds": seconds, "rows_per_s": written / seconds}
        rec.update(_cpu(cpu))
        rec.update(
            rows_per_s_unsynced=written / unsynced,
            write_amplification=write_amplification(part_disk, written)["disk"],
        )
        rec["disk_reads_per_row"] = part_disk["read_bytes"] / 4096 / written
        rec.update({k: v - before[k] for k, v in _log_counts(log).items()})
        parts.append(rec)
        if after_part is not None:
            after_part(written)
    written = sum(p["rows"] for p in parts)
    out.update(window_rows=written, seconds=total_s, rows_per_s=written / total_s, parts=parts)
    out.update(write_amplification=write_amplification(disk, written), disk=disk)
    out["disk_reads_per_row"] = disk["read_bytes"] / 4096 / written
    if log is not None:
        records, live = log.space("t")
        out["records_per_live_row"] = records / live
    out["data_mdb_gib"] = (path / "data.mdb").stat().st_size / 2**30
    check_newest(backend, ids, version, rng, layout)
    out["checked_rows"] = CHECK_ROWS
    backend.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def _cpu(since: dict[str, float] | None = None) -> dict[str, float]:
    """This process's user and system CPU seconds (every thread), or those since ``since``: where the
    wall time of a part goes when it is not waiting for the disk."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    now = {"cpu_user_s": use.ru_utime, "cpu_sys_s": use.ru_stime}
    return now if since is None else {k: round(v - since[k], 3) for k, v in now.items()}


def _log_counts(log: Any) -> dict[str, float]:
    """The compaction counters of the log layout's tables ({} for the B-tree)."""
    keys = ("copied_rows", "compactions", "compact_s", "readahead_bytes")
    return {} if log is None else {k: getattr(log.stats, k) for k in keys}


def fill(backend: RowBackend, ids: np.ndarray) -> None:
    """Store ``ids`` with the fill's rows (write 0), in sorted ``put_rows`` of ``FILL_ROWS``."""
    for lo in range(0, ids.shape[0], FILL_ROWS):
        backend.put_rows([("t", ids[lo : lo + FILL_ROWS], _rows(ids[lo : lo + FILL_ROWS], 0))])


def check_newest(
    backend: RowBackend, ids: np.ndarray, version: np.ndarray, rng: np.random.Generator, what: str
) -> None:
    """``CHECK_ROWS`` sampled ids read back equal the newest write of each (``version``: its number)."""
    sample = rng.choice(ids.shape[0], CHECK_ROWS, replace=False)
    sample.sort()
    found, got = backend.get_rows("t", ids[sample])
    if not found.all() or not np.array_equal(got, _rows(ids[sample], 0) + _version_column(version[sample])):
        raise AssertionError(f"{what}: rows read back differ from the newest writes")


def _version_column(versions: np.ndarray) -> np.ndarray:
    col = np.zeros((versions.shape[0], SPEC.row_floats), dtype=np.float32)
    col[:, 0] = versions
    return col


def run_writeback(
    root: Path,
    *,
    base_rows: int,
    window_rows: int,
    btree_rows: int,
    batch_rows: int,
    log_options: dict[str, Any] | None = None,
) -> dict:
    """The log layout (measured window; ``log_options``: its ``LmdbOptions`` fields), the
    append baseline of the same rows, and the B-tree layout (``btree_rows`` rows; 0: skipped). Returns
    the summary's write-back keys."""
    baseline = AppendBaseline(root, batch_rows)
    try:
        log = store_writeback(
            root,
            layout="log",
            base_rows=base_rows,
            window_rows=window_rows,
            batch_rows=batch_rows,
            after_part=baseline.part,
            log_options=log_options,
        )
    finally:
        append = baseline.close()
    out: dict[str, Any] = {
        "writeback_vs_append": log["rows_per_s"] / append["rows_per_s"],
        "write_amplification": log["write_amplification"]["disk"],
        "writeback_vs_append_parts": [
            p["rows_per_s"] / a["rows_per_s"] for p, a in zip(log["parts"], append["parts"], strict=True)
        ],
        "append_rows_per_s_parts": [a["rows_per_s"] for a in append["parts"]],
        "write_amplification_parts": [p["write_amplification"] for p in log["parts"]],
        "writeback_rows_per_s": log["rows_per_s"],
        "append_rows_per_s": append["rows_per_s"],
        "append_write_amplification": append["write_amplification"]["disk"],
        "log": log,
        "append": append,
    }
    if btree_rows:
        btree = store_writeback(
            root, layout="btree", base_rows=base_rows, window_rows=btree_rows, batch_rows=batch_rows
        )
        out.update(
            btree_writeback_vs_append=btree["rows_per_s"] / append["rows_per_s"],
            btree_write_amplification=btree["write_amplification"]["disk"],
            btree=btree,
        )
    return out
