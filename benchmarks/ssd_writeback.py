"""Write-back into an SSD store much larger than a transaction: B-tree updates by id vs a log by write time.

A design study with ``lmdb`` used directly (not the store). One run, one machine, one disk:

0. index: the id -> log location maps an append-only log needs, over the N base ids (hashed 64-bit
   ids, as the store's keys are): a sorted array (``searchsorted``), a compact open-addressing table
   (uint64 ids and uint32 sequence numbers in two arrays, load <= 0.75) and a dense array (bounded ids);
   the store's own ``HashIdMap`` beside them for scale. Bytes per id, lookups/s in batches of
   ``batch_rows`` ids.
1. append: N rows of 260 bytes (dim 64 + one Adagrad float) bulk-appended in id order to an id-keyed
   LMDB db (``putmulti(append=True)``, sync off, no writemap) and synced: the ``append`` baseline.
2. phase A, today's design: R random existing ids written back with ``putmulti`` in transactions of
   ``batch_rows`` rows, sorted within each (the background writer's pattern); then point reads by id,
   cold (the file fsynced and dropped from the page cache with ``POSIX_FADV_DONTNEED``, read in
   sub-batches so the effect of the branch pages warming up shows) and warm.
3. phase B, log by write time: the B-tree store is deleted and a log store built: every row is a record
   (8-byte id + the 260-byte row) under an increasing 8-byte sequence number, one LMDB db per segment of
   ``segment_rows`` sequence numbers (or one db for all, ``log_delete="cursor"``), and the compact hash
   maps each id to the sequence number of its live record. Write-back appends (``append=True``) the same
   R rows (same transactions), marks the old records dead, and compacts: while the oldest segment is at
   least ``dead_fraction`` dead, its live records (found in the index) move to the head and the segment
   goes (``txn.drop`` of its db, or ``cursor.delete`` over its key range). With ``log_start="aged"`` the
   log starts in the steady state of that policy under uniform random updates (live fraction
   u = 1 - dead_fraction at the tail, exp(-(slots - p)(1 - u)/N) at slot p, N ln(1/u)/(1 - u) slots in
   all), so compaction runs from the first transaction; ``"fresh"`` starts from N live
   records and needs ~N ln(1/u) updates before the first compaction. Then point reads through the
   index (sequence numbers -> ``getmulti``), cold and warm. Compaction reads with the OS's read-ahead on
   (the oldest segments have left the page cache); point reads run with it off, as the store's do.

Not measured: id-keyed buckets (rows grouped into 4 KiB values by id hash). A transaction of B random rows
over N/b buckets of b rows carries ~1 + Bb/N rows per bucket it touches, so each bucket rewrite of b rows
carries ~1 row while Bb << N: amplification ~b/(1 + Bb/N): ~14 for a page of 14 rows at N/B ~ 1500,
as the leaves of the B-tree; only batches of ~N/3 rows (a merge) bring it to ~3.

Bytes written, after ``env.sync(True)`` and ``os.sync()``: ``wchar`` of ``/proc/self/io`` (what LMDB handed
the kernel; the page cache can only coalesce it), the device's sectors from ``/sys/dev/block/MAJ:MIN/stat``
(the whole device: other processes' writes included) and ``write_bytes`` of ``/proc/self/io`` (pages
dirtied, but a large folio is charged whole: it can read far above the others). Write amplification =
min(wchar, device) / (rows written back x 260), compaction included. Disk reads per row = ``read_bytes`` /
4096 / rows (and the device's read requests / rows). Every read checks the id and the version written
into the row. Phase A starts with the B-tree as its build left it in the page cache (its leaves are read
from memory: the B-tree's best case); phase B starts with the log dropped from the page cache (the
compacted segments are read from disk: the log's worst case).

Prints one JSON record per phase and, as its LAST line, the summary (see ``run``).

Usage: python benchmarks/ssd_writeback.py [--rows 50000000] [--writeback-rows 4000000]
       [--dir /tmp/ssd_writeback] [--segment-rows N] [--dead-fraction 0.5] [--log-start aged|fresh]
       [--log-delete drop|cursor] [--read-rows 40000] [--keep]
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, also when imported as a module
from harness import emit, machine_info  # noqa: E402

from embedding_store.hashing import mix64  # noqa: E402
from embedding_store.index import HashIdMap  # noqa: E402

ROW_BYTES = 260  # 64 float32 + one row-wise Adagrad float
HEADER = 8  # a log record's id
PAGE = 4096
MAP_SIZE = 1 << 36
BUILD_CHUNK = 1 << 18
MOVE_CHUNK = 1 << 18
READ_BATCHES = 4
NO_SEQ = np.uint32(0xFFFFFFFF)

# -- probes -----------------------------------------------------------------------------------------


def _device_stat(path: Path) -> Path | None:
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


class _Io:
    """This process's and the store's device's I/O counters since construction."""

    def __init__(self, path: Path) -> None:
        self._dev = _device_stat(path)
        self._start = self._read()

    def _read(self) -> dict[str, int]:
        with open("/proc/self/io") as f:
            out = {k: int(v) for k, v in (line.split(": ") for line in f)}
        if self._dev is not None:
            f = [int(x) for x in self._dev.read_text().split()]
            out.update(dev_read_ios=f[0], dev_read_bytes=512 * f[2], dev_write_bytes=512 * f[6])
        return out

    def delta(self) -> dict[str, int]:
        end = self._read()
        keys = ("read_bytes", "write_bytes", "wchar", "dev_read_ios", "dev_read_bytes", "dev_write_bytes")
        return {k: end[k] - self._start[k] for k in keys if k in end}


def _meminfo_gib() -> dict[str, float]:
    with open("/proc/meminfo") as f:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return {f"{k.lower()}_gib": round(kib[k] / 2**20, 2) for k in ("MemTotal", "MemFree", "MemAvailable")}


def _open(path: Path, *, readahead: bool) -> lmdb.Environment:
    path.mkdir(parents=True, exist_ok=True)
    return lmdb.open(
        str(path),
        map_size=MAP_SIZE,
        subdir=True,
        max_dbs=4096,
        sync=False,
        metasync=False,
        readahead=readahead,
        writemap=False,
        lock=True,
    )


def _drop_from_cache(path: Path) -> None:
    """fsync ``path/data.mdb`` and drop it from the page cache (its environment closed, or idle: pages its
    map holds stay cached)."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_probe(file: Path, reads: int = 500) -> float:
    """Milliseconds per random 4 KiB O_DIRECT read of ``file`` now: how busy the shared disk is."""
    fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT wants
    pages = np.random.default_rng().integers(0, max(1, os.fstat(fd).st_size // PAGE), reads)
    start = time.perf_counter()
    try:
        for page in pages.tolist():
            os.preadv(fd, [buf], page * PAGE)
    finally:
        os.close(fd)
    return (time.perf_counter() - start) / reads * 1e3


def _db_stats(env: lmdb.Environment, dbs: list[Any]) -> dict[str, int]:
    out = {"file_bytes": (env.info()["last_pgno"] + 1) * PAGE, "depth": 0}
    for db in dbs:
        with env.begin(db=db) as txn:
            st = txn.stat(db)
        out["depth"] = max(out["depth"], st["depth"])
        for k in ("branch_pages", "leaf_pages", "overflow_pages", "entries"):
            out[k] = out.get(k, 0) + st[k]
    return out


# -- rows -------------------------------------------------------------------------------------------


def hashed_ids(n: int) -> np.ndarray:
    """N distinct hashed ids (63-bit, as int64), sorted: random 8-byte keys like the store's."""
    ids = np.sort((mix64(np.arange(n, dtype=np.uint64)) >> np.uint64(1)).view(np.int64))
    assert bool((ids[1:] != ids[:-1]).all())
    return ids


def _keys(x: np.ndarray) -> list[bytes]:
    return np.ascontiguousarray(x, dtype=">u8").view("V8").tolist()


class _Rows:
    """Record bytes: [8-byte id header (log)] + a 260-byte row that starts with its id and version."""

    def __init__(self, seed: int) -> None:
        self._pool = np.random.default_rng(seed).integers(0, 256, (4096, ROW_BYTES), dtype=np.uint8)

    def values(self, ids: np.ndarray, version: int, *, header: bool) -> list[bytes]:
        off = HEADER if header else 0
        buf = np.empty((ids.shape[0], off + ROW_BYTES), dtype=np.uint8)
        buf[:, off:] = self._pool[np.arange(ids.shape[0]) % self._pool.shape[0]]
        id_bytes = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
        buf[:, off : off + 8] = id_bytes
        buf[:, off + 8 : off + 12] = np.full(ids.shape[0], version, "<u4").view(np.uint8).reshape(-1, 4)
        if header:
            buf[:, :8] = id_bytes
        return buf.view(f"V{off + ROW_BYTES}").ravel().tolist()


def _decode(values: list[bytes], *, header: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, versions) written in the rows of ``values``; a log record's header must match its row."""
    off = HEADER if header else 0
    buf = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), off + ROW_BYTES)
    ids = buf[:, off : off + 8].copy().view("<u8").ravel().view(np.int64)
    if header:
        assert bool((buf[:, :8].copy().view("<u8").ravel().view(np.int64) == ids).all())
    return ids, buf[:, off + 8 : off + 12].copy().view("<u4").ravel()


def _batches(n: int, total: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Sorted unique random positions in [0, n), ``batch`` a transaction, ~``total`` in all."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < total:
        pos = np.unique(rng.integers(0, n, min(batch, total - done)))
        done += pos.shape[0]
        yield pos


# -- index ------------------------------------------------------------------------------------------


class CompactHashIndex:
    """id (int64 >= 0) -> uint32 sequence number: open addressing, linear probing, load <= ``load``."""

    _MUL = np.uint64(0x9E3779B97F4A7C15)
    _EMPTY = np.int64(-1)

    def __init__(self, n: int, load: float = 0.75) -> None:
        self.size = 1 << max(4, math.ceil(math.log2(n / load)))
        self.keys = np.full(self.size, self._EMPTY, dtype=np.int64)
        self.vals = np.full(self.size, NO_SEQ, dtype=np.uint32)
        self._shift = np.uint64(64 - (self.size.bit_length() - 1))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return ((ids.view(np.uint64) * self._MUL) >> self._shift).astype(np.int64)

    def cells(self, ids: np.ndarray) -> np.ndarray:
        """Cells of (N,) ids, -1 where absent."""
        pos, out = self._home(ids), np.full(ids.shape[0], -1, dtype=np.int64)
        active = np.arange(ids.shape[0])
        while active.size:
            k = np.take(self.keys, pos)
            hit = k == np.take(ids, active)
            out[active[hit]] = pos[hit]
            go = ~hit & (k != self._EMPTY)
            active, pos = active[go], (pos[go] + 1) & (self.size - 1)
        return out

    def insert(self, ids: np.ndarray, seqs: np.ndarray) -> None:
        """Insert (N,) unique absent ids."""
        pos, active = self._home(ids), np.arange(ids.shape[0])
        while active.size:
            free = np.take(self.keys, pos) == self._EMPTY
            self.keys[pos[free]] = ids[active[free]]  # several claim one cell: the last write wins
            won = free & (np.take(self.keys, pos) == ids[active])
            self.vals[pos[won]] = seqs[active[won]]
            active, pos = active[~won], (pos[~won] + 1) & (self.size - 1)


def _lookups_per_s(fn: Any, queries: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for q in queries:
        fn(q)
    return sum(q.shape[0] for q in queries) / (time.perf_counter() - start)


def bench_index(ids: np.ndarray, batch: int, seed: int) -> tuple[CompactHashIndex, dict[str, Any]]:
    """The candidate id -> sequence-number maps over ``ids``; returns the compact hash (seq = position)."""
    n = ids.shape[0]
    rng = np.random.default_rng(seed)
    queries = [ids[np.unique(rng.integers(0, n, batch))] for _ in range(32)]
    pos_queries = [np.searchsorted(ids, q) for q in queries]
    out: dict[str, Any] = {"phase": "index", "ids": n, "batch": batch}
    seq32 = np.arange(n, dtype=np.uint32)
    out["sorted_array"] = {
        "bytes_per_id": (ids.itemsize + seq32.itemsize),
        "lookups_per_s": _lookups_per_s(lambda q: np.take(seq32, np.searchsorted(ids, q)), queries),
    }
    out["dense_array"] = {  # bounded ids: the id is the position
        "bytes_per_id": seq32.itemsize,
        "lookups_per_s": _lookups_per_s(lambda p: np.take(seq32, p), pos_queries),
    }
    index = CompactHashIndex(n)
    start = time.perf_counter()
    index.insert(ids, seq32)
    insert_s = time.perf_counter() - start
    assert bool((index.vals[index.cells(queries[0])] == np.searchsorted(ids, queries[0])).all())
    out["compact_hash"] = {
        "bytes_per_id": index.nbytes / n,
        "load": n / index.size,
        "insert_ids_per_s": n / insert_s,
        "lookups_per_s": _lookups_per_s(lambda q: index.vals[index.cells(q)], queries),
    }
    m = min(n, 8_000_000)  # the store's map (load <= 1/3, int64 pairs), at up to 8M ids
    store_map = HashIdMap(m)
    store_map.insert(ids[:m], np.arange(m))
    small = [q[q <= ids[m - 1]] for q in queries]
    out["store_hash_id_map"] = {
        "ids": m,
        "bytes_per_id": store_map._kv.nbytes / m,
        "lookups_per_s": _lookups_per_s(store_map.lookup, small),
    }
    del store_map
    for name, cells_per_id in (("sorted_array", 1), ("dense_array", 1), ("compact_hash", None)):
        rec = out[name]
        if cells_per_id is None:  # next power of two at load <= 0.75
            size = 1 << math.ceil(math.log2(1e8 / 0.75))
            rec["rss_at_100m_ids_gib"] = size * 12 / 2**30
        else:
            rec["rss_at_100m_ids_gib"] = 1e8 * rec["bytes_per_id"] / 2**30
    return index, out


# -- phase A: the id-keyed B-tree -------------------------------------------------------------------


def _timed_sync(env: lmdb.Environment) -> float:
    start = time.perf_counter()
    env.sync(True)
    return time.perf_counter() - start


def build_btree(path: Path, ids: np.ndarray, rows: _Rows) -> dict[str, Any]:
    """Bulk append of every id in order: the append baseline."""
    env = _open(path, readahead=False)
    db = env.open_db(b"rows")
    io = _Io(path)
    start = time.perf_counter()
    for lo in range(0, ids.shape[0], BUILD_CHUNK):
        part = ids[lo : lo + BUILD_CHUNK]
        pairs = list(zip(_keys(part), rows.values(part, 0, header=False), strict=True))
        with env.begin(write=True) as txn:
            txn.cursor(db=db).putmulti(pairs, append=True)
    unsynced = time.perf_counter() - start
    seconds = unsynced + _timed_sync(env)
    os.sync()
    disk = io.delta()
    rec = {"phase": "append", "rows": ids.shape[0], "seconds": seconds, "rows_per_s": ids.shape[0] / seconds}
    rec.update(rows_per_s_unsynced=ids.shape[0] / unsynced, write_amplification=_wa(disk, ids.shape[0]))
    rec.update(disk=disk, lmdb=_db_stats(env, [db]))
    env.close()
    return rec


def _wa(disk: dict[str, int], rows: int) -> dict[str, float]:
    """Bytes written / payload: ``disk`` = min(``write_syscalls``: what LMDB handed the kernel, which the
    page cache can only coalesce; ``device``: what the whole device wrote); ``proc_write_bytes`` is
    /proc/self/io's count, which charges a whole large folio per page dirtied in it."""
    payload = rows * ROW_BYTES
    out = {"proc_write_bytes": disk["write_bytes"] / payload, "write_syscalls": disk["wchar"] / payload}
    if "dev_write_bytes" in disk:
        out["device"] = disk["dev_write_bytes"] / payload
    out["disk"] = min(out["write_syscalls"], out.get("device", math.inf))
    return out


def _write_record(phase: str, rows: int, seconds: float, unsynced: float, io: _Io) -> dict[str, Any]:
    os.sync()
    disk = io.delta()
    rec: dict[str, Any] = {"phase": phase, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}
    rec.update(rows_per_s_unsynced=rows / unsynced, write_amplification=_wa(disk, rows), disk=disk)
    rec["disk_reads_per_row"] = disk["read_bytes"] / PAGE / rows
    return rec


def btree_writeback(path: Path, ids: np.ndarray, rows: _Rows, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phase A: putmulti of random existing ids, sorted within each transaction."""
    env = _open(path, readahead=False)
    db = env.open_db(b"rows")
    versions = np.zeros(ids.shape[0], dtype=np.uint32)
    probe_ms = disk_probe(path / "data.mdb")
    io, done, lmdb_s = _Io(path), 0, 0.0
    start = time.perf_counter()
    for version, pos in enumerate(_batches(ids.shape[0], cfg["writeback_rows"], cfg["batch_rows"], 1), 1):
        versions[pos] = version
        part = ids[pos]
        pairs = list(zip(_keys(part), rows.values(part, version, header=False), strict=True))
        t = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.cursor(db=db).putmulti(pairs)
        lmdb_s += time.perf_counter() - t
        done += pos.shape[0]
    unsynced = time.perf_counter() - start
    rec = _write_record("btree_writeback", done, unsynced + _timed_sync(env), unsynced, io)
    rec.update(lmdb_seconds=lmdb_s, disk_probe_read_ms=probe_ms, lmdb=_db_stats(env, [db]))
    env.close()

    def read(pos: np.ndarray, env: lmdb.Environment) -> list[bytes]:
        with env.begin() as txn:
            return [v for _, v in txn.cursor(db=env.open_db(b"rows", txn=txn)).getmulti(_keys(ids[pos]))]

    rec["reads"] = read_test(path, read, ids, versions, cfg)
    return rec


def read_test(path: Path, read: Any, ids: np.ndarray, versions: np.ndarray, cfg: dict[str, Any]) -> dict:
    """Random point reads of ``cfg['read_rows']`` ids: cold (dropped from the page cache, in
    ``READ_BATCHES`` batches), then warm; ``read(positions, env)`` returns the records in order (a
    log's records carry an id header)."""
    header = path.name == "log"
    rng = np.random.default_rng(7)
    size = cfg["read_rows"] // READ_BATCHES
    parts = [np.unique(rng.integers(0, ids.shape[0], size)) for _ in range(READ_BATCHES)]
    _drop_from_cache(path)
    env = _open(path, readahead=False)
    out: dict[str, Any] = {"disk_probe_read_ms": disk_probe(path / "data.mdb")}
    out.update(cold_disk_reads_per_row=[], cold_device_reads_per_row=[])
    for label in ("cold", "warm"):
        seconds = 0.0
        for pos in parts:
            io = _Io(path)
            start = time.perf_counter()
            values = read(pos, env)
            seconds += time.perf_counter() - start
            disk = io.delta()
            got_ids, got_versions = _decode(values, header=header)
            assert bool((got_ids == ids[pos]).all()) and bool((got_versions == versions[pos]).all())
            if label == "cold":
                out["cold_disk_reads_per_row"].append(disk["read_bytes"] / PAGE / pos.shape[0])
                out["cold_device_reads_per_row"].append(disk.get("dev_read_ios", 0) / pos.shape[0])
        out[f"{label}_rows_per_s"] = sum(p.shape[0] for p in parts) / seconds
    env.close()
    return out


# -- phase B: the log -------------------------------------------------------------------------------


class _Log:
    """Records under increasing sequence numbers, in one db per segment (or one db), with the index."""

    def __init__(self, path: Path, index: CompactHashIndex, cfg: dict[str, Any]) -> None:
        self.path, self.index = path, index
        self.seg = cfg["segment_rows"]
        self.per_segment = cfg["log_delete"] == "drop"
        self.dead_fraction = cfg["dead_fraction"]
        self.env = _open(path, readahead=True)  # compaction reads old segments sequentially
        self.dbs: dict[int, Any] = {}
        self.slots = np.zeros(1024, dtype=np.int64)  # records per segment
        self.dead = np.zeros(1024, dtype=np.int64)  # dead records per segment
        self.next_seq = self.oldest = 0
        self.moved = self.compactions = self.deleted = 0
        self.compact_s = self.compact_read_s = 0.0  # compaction, and its reads of old records

    def bind(self, env: lmdb.Environment) -> None:
        """Use ``env`` (the log's environment, reopened) and its handles of the live segments."""
        self.env, names, self.dbs = env, list(self.dbs), {}
        with env.begin(write=True) as txn:
            for s in names:
                self._db(s, txn)

    def reopen(self, *, readahead: bool, cold: bool) -> None:
        """Close and reopen the environment; ``cold``: drop its file from the page cache first."""
        self.env.sync(True)
        self.env.close()
        if cold:
            _drop_from_cache(self.path)
        self.bind(_open(self.path, readahead=readahead))

    def _db(self, s: int, txn: lmdb.Transaction) -> Any:
        name = f"seg{s:08d}".encode() if self.per_segment else b"log"
        key = s if self.per_segment else 0
        if key not in self.dbs:
            self.dbs[key] = self.env.open_db(name, txn=txn, create=True)
        return self.dbs[key]

    def put(self, txn: lmdb.Transaction, values: list[bytes]) -> np.ndarray:
        """Append ``values`` under the next sequence numbers; returns them."""
        seqs = np.arange(self.next_seq, self.next_seq + len(values), dtype=np.int64)
        segs = seqs // self.seg
        for s in np.unique(segs).tolist():
            lo, hi = np.searchsorted(segs, [s, s + 1])
            pairs = list(zip(_keys(seqs[lo:hi]), values[lo:hi], strict=True))
            txn.cursor(db=self._db(s, txn)).putmulti(pairs, append=True)
            if s >= self.slots.shape[0]:
                grow = np.zeros(2 * s + 2, dtype=np.int64)
                self.slots, self.dead = np.r_[self.slots, grow], np.r_[self.dead, grow]
            self.slots[s] += hi - lo
        self.next_seq += len(values)
        return seqs

    def get(self, txn: lmdb.Transaction, seqs: np.ndarray) -> list[bytes]:
        """Records of sorted sequence numbers."""
        segs = seqs // self.seg
        out: list[bytes] = []
        for s in np.unique(segs).tolist():
            lo, hi = np.searchsorted(segs, [s, s + 1])
            out += [v for _, v in txn.cursor(db=self._db(s, txn)).getmulti(_keys(seqs[lo:hi]))]
        return out

    def write_back(self, ids: np.ndarray, values: list[bytes]) -> None:
        """One transaction of new versions; the index moves to them after the commit."""
        with self.env.begin(write=True) as txn:
            seqs = self.put(txn, values)
        cells = self.index.cells(ids)
        old = self.index.vals[cells].astype(np.int64)
        self.dead[: old.max() // self.seg + 1] += np.bincount(old // self.seg)
        self.index.vals[cells] = seqs
        while self.oldest < self.next_seq // self.seg and (
            self.dead[self.oldest] >= self.dead_fraction * self.slots[self.oldest]
        ):
            self.compact(self.oldest)

    def compact(self, s: int) -> None:
        """Move the live records of segment ``s`` (the index's entries into it) to the head; drop ``s``."""
        start = time.perf_counter()
        lo, hi = s * self.seg, (s + 1) * self.seg
        cells = np.flatnonzero((self.index.vals >= lo) & (self.index.vals < hi))
        cells = cells[np.argsort(self.index.vals[cells])]
        done_to = lo  # cursor mode: old keys below this are deleted
        for c in range(0, max(cells.shape[0], 1), MOVE_CHUNK):
            part = cells[c : c + MOVE_CHUNK]
            old = self.index.vals[part].astype(np.int64)
            last = c + MOVE_CHUNK >= cells.shape[0]
            with self.env.begin(write=True) as txn:
                t = time.perf_counter()
                values = self.get(txn, old)
                self.compact_read_s += time.perf_counter() - t
                got, _ = _decode(values, header=True)
                assert bool((got == self.index.keys[part]).all())
                new = self.put(txn, values)
                end = hi if last else int(old[-1]) + 1
                if self.per_segment and last:
                    txn.drop(self.dbs.pop(s), delete=True)
                elif not self.per_segment:
                    self.deleted += self._delete_range(txn, done_to, end)
                    done_to = end
            self.index.vals[part] = new
        self.moved += cells.shape[0]
        self.compactions += 1
        self.slots[s] = self.dead[s] = 0
        self.oldest = s + 1
        self.compact_s += time.perf_counter() - start

    def _delete_range(self, txn: lmdb.Transaction, lo: int, hi: int) -> int:
        cur, end, n = txn.cursor(db=self.dbs[0]), _keys(np.array([hi]))[0], 0
        if cur.set_range(_keys(np.array([lo]))[0]):
            while cur.key() and cur.key() < end:
                cur.delete()
                n += 1
        return n


def _aged_layout(n: int, dead_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """The log of n ids in the steady state of FIFO compaction under uniform random updates: (slots,)
    int64, the id's position for its live record, -(position + 1) for a dead (older) copy."""
    u = 1.0 - dead_fraction
    m = round(n * math.log(1 / u) / (1 - u))
    live = np.empty(m, dtype=bool)
    for lo in range(0, m, 1 << 24):
        p = np.arange(lo, min(m, lo + (1 << 24)), dtype=np.float64)
        live[lo : lo + p.shape[0]] = rng.random(p.shape[0]) < np.exp(-(m - p) * (1 - u) / n)
    extra = int(live.sum()) - n  # make the live slots exactly n
    flip = rng.choice(np.flatnonzero(live if extra > 0 else ~live), abs(extra), replace=False)
    live[flip] = extra < 0
    layout = np.empty(m, dtype=np.int64)
    layout[live] = rng.permutation(n)
    layout[~live] = -1 - rng.integers(0, n, m - n)
    return layout


def build_log(path: Path, ids: np.ndarray, index: CompactHashIndex, rows: _Rows, cfg: dict) -> _Log:
    n = ids.shape[0]
    if cfg["log_start"] == "aged":
        layout = _aged_layout(n, cfg["dead_fraction"], np.random.default_rng(3))
    else:
        layout = np.arange(n, dtype=np.int64)
    log = _Log(path, index, cfg)
    io = _Io(path)
    start = time.perf_counter()
    for lo in range(0, layout.shape[0], BUILD_CHUNK):
        pos = layout[lo : lo + BUILD_CHUNK]
        pos = np.where(pos >= 0, pos, -1 - pos)
        with log.env.begin(write=True) as txn:
            log.put(txn, rows.values(ids[pos], 0, header=True))
    unsynced = time.perf_counter() - start
    rec = _write_record("log_build", layout.shape[0], unsynced + _timed_sync(log.env), unsynced, io)
    live = np.flatnonzero(layout >= 0)
    start = time.perf_counter()
    index.vals[index.cells(ids[layout[live]])] = live
    rec["index_update_ids_per_s"] = n / (time.perf_counter() - start)
    dead = np.bincount(np.flatnonzero(layout < 0) // log.seg, minlength=1)
    log.dead[: dead.shape[0]] = dead
    rec.update(slots=layout.shape[0], live_rows=n, log_start=cfg["log_start"])
    rec["oldest_segment_dead_fraction"] = float(log.dead[0] / log.slots[0])
    rec["lmdb"] = _db_stats(log.env, list(log.dbs.values()))
    emit(rec)
    return log


def log_writeback(log: _Log, ids: np.ndarray, rows: _Rows, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phase B: the same transactions as phase A, appended, with compaction."""
    log.reopen(readahead=True, cold=True)  # old segments are on disk, not in the page cache
    versions = np.zeros(ids.shape[0], dtype=np.uint32)
    probe_ms = disk_probe(log.path / "data.mdb")
    io, done = _Io(log.path), 0
    start = time.perf_counter()
    for version, pos in enumerate(_batches(ids.shape[0], cfg["writeback_rows"], cfg["batch_rows"], 1), 1):
        versions[pos] = version
        log.write_back(ids[pos], rows.values(ids[pos], version, header=True))
        done += pos.shape[0]
    unsynced = time.perf_counter() - start
    rec = _write_record("log_writeback", done, unsynced + _timed_sync(log.env), unsynced, io)
    rec.update(compaction_rows_moved=log.moved, compactions=log.compactions, compaction_seconds=log.compact_s)
    rec.update(compaction_read_seconds=log.compact_read_s, disk_probe_read_ms=probe_ms)
    rec.update(records_written_per_row=(done + log.moved) / done, cursor_deletes=log.deleted)
    rec["live_fraction"] = ids.shape[0] / int(log.slots.sum())
    rec["lmdb"] = _db_stats(log.env, list(log.dbs.values()))
    segments = sorted(log.dbs) if log.per_segment else None
    log.env.close()

    def log_read(pos: np.ndarray, env: lmdb.Environment) -> list[bytes]:
        seqs = log.index.vals[log.index.cells(ids[pos])].astype(np.int64)
        order = np.argsort(seqs)
        if log.env is not env:
            log.bind(env)
        with env.begin() as txn:
            values = log.get(txn, seqs[order])
        out = np.empty(len(values), dtype=object)
        out[order] = values
        return out.tolist()

    rec["reads"] = read_test(log.path, log_read, ids, versions, cfg)
    rec["segments"] = None if segments is None else len(segments)
    return rec


# -- the run ----------------------------------------------------------------------------------------


def run(
    dir: Path,
    rows: int,
    *,
    writeback_rows: int = 4_000_000,
    batch_rows: int = 1 << 15,
    segment_rows: int | None = None,
    dead_fraction: float = 0.5,
    log_start: str = "aged",
    log_delete: str = "drop",
    read_rows: int = 40_000,
    keep: bool = False,
) -> dict[str, Any]:
    """All phases on ``rows`` base rows under ``dir`` (made empty first; deleted after unless ``keep``).

    Returns the summary: ``append_rows_per_s`` (the B-tree's bulk build), for ``btree`` and ``log``:
    ``*_writeback_rows_per_s``, ``*_write_amplification`` (with its ``_parts``),
    ``*_writeback_vs_append``, ``*_cold_read_rows_per_s``, ``*_warm_read_rows_per_s`` and
    ``*_cold_disk_reads_per_row`` (one per read batch); ``compaction_rows_moved``, ``compactions``,
    ``log_records_written_per_row``, ``index_bytes_per_id`` (the compact hash at these ids),
    ``index_rss_at_100m_ids_gib``, the sizes and settings, and the machine's memory (``free_ram_gib`` =
    MemAvailable at the start).
    """
    if segment_rows is None:  # ~24+ segments of live rows, 64k..2M records each
        segment_rows = 1 << min(21, max(16, (rows // 24).bit_length() - 1))
    cfg = dict(writeback_rows=writeback_rows, batch_rows=batch_rows, segment_rows=segment_rows)
    cfg.update(dead_fraction=dead_fraction, log_start=log_start, log_delete=log_delete, read_rows=read_rows)
    shutil.rmtree(dir, ignore_errors=True)
    dir.mkdir(parents=True)
    mem = _meminfo_gib()
    emit({"phase": "machine", **machine_info("numpy", "lmdb"), **mem, "config": cfg, "base_rows": rows})
    ids = hashed_ids(rows)
    row_data = _Rows(0)
    index, index_rec = bench_index(ids, batch_rows, 2)
    emit(index_rec)
    append = build_btree(dir / "btree", ids, row_data)
    emit(append)
    btree = btree_writeback(dir / "btree", ids, row_data, cfg)
    emit(btree)
    shutil.rmtree(dir / "btree")
    log = build_log(dir / "log", ids, index, row_data, cfg)
    logw = log_writeback(log, ids, row_data, cfg)
    emit(logw)
    if not keep:
        shutil.rmtree(dir)
    base = append["rows_per_s"]
    summary = {
        "append_rows_per_s": base,
        "btree_writeback_rows_per_s": btree["rows_per_s"],
        "btree_write_amplification": btree["write_amplification"]["disk"],
        "btree_write_amplification_parts": btree["write_amplification"],
        "log_writeback_rows_per_s": logw["rows_per_s"],
        "log_write_amplification": logw["write_amplification"]["disk"],
        "log_write_amplification_parts": logw["write_amplification"],
        "btree_writeback_vs_append": btree["rows_per_s"] / base,
        "log_writeback_vs_append": logw["rows_per_s"] / base,
        "writeback_vs_append": {"btree": btree["rows_per_s"] / base, "log": logw["rows_per_s"] / base},
        "compaction_rows_moved": logw["compaction_rows_moved"],
        "compaction_seconds": logw["compaction_seconds"],
        "compaction_read_seconds": logw["compaction_read_seconds"],
        "disk_probe_read_ms": {  # random 4 KiB reads of the shared disk at each phase's start
            "btree_writeback": btree["disk_probe_read_ms"],
            "btree_reads": btree["reads"]["disk_probe_read_ms"],
            "log_writeback": logw["disk_probe_read_ms"],
            "log_reads": logw["reads"]["disk_probe_read_ms"],
        },
        "compactions": logw["compactions"],
        "log_records_written_per_row": logw["records_written_per_row"],
        "index_bytes_per_id": index_rec["compact_hash"]["bytes_per_id"],
        "index_rss_at_100m_ids_gib": index_rec["compact_hash"]["rss_at_100m_ids_gib"],
        "sorted_index_bytes_per_id": index_rec["sorted_array"]["bytes_per_id"],
    }
    for name, rec in (("btree", btree["reads"]), ("log", logw["reads"])):
        summary[f"{name}_cold_read_rows_per_s"] = rec["cold_rows_per_s"]
        summary[f"{name}_warm_read_rows_per_s"] = rec["warm_rows_per_s"]
        summary[f"{name}_cold_disk_reads_per_row"] = rec["cold_disk_reads_per_row"]
    summary.update(cfg)
    summary.update(base_rows=rows, writeback_rows=btree["rows"], log_slots=log.next_seq)
    summary.update(free_ram_gib=mem["memavailable_gib"], **mem)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ssd_writeback"))
    parser.add_argument("--rows", type=int, default=50_000_000)
    parser.add_argument("--writeback-rows", type=int, default=4_000_000)
    parser.add_argument("--batch-rows", type=int, default=1 << 15)
    parser.add_argument("--segment-rows", type=int, default=None, help="default: ~rows/24, 64k..2M")
    parser.add_argument("--dead-fraction", type=float, default=0.5)
    parser.add_argument("--log-start", choices=("aged", "fresh"), default="aged")
    parser.add_argument("--log-delete", choices=("drop", "cursor"), default="drop")
    parser.add_argument("--read-rows", type=int, default=40_000)
    parser.add_argument("--keep", action="store_true", help="leave the stores in --dir")
    a = parser.parse_args()
    emit(
        run(
            a.dir,
            a.rows,
            writeback_rows=a.writeback_rows,
            batch_rows=a.batch_rows,
            segment_rows=a.segment_rows,
            dead_fraction=a.dead_fraction,
            log_start=a.log_start,
            log_delete=a.log_delete,
            read_rows=a.read_rows,
            keep=a.keep,
        )
    )


if __name__ == "__main__":
    main()
