"""The floor of the tier stages' work, timed in the same run: what the store's backend read and wrote
(recorded by :class:`CapturingBackend`) redone with raw py-lmdb, and each step's ``torch.unique`` and
``index_select`` (bench_stage_cpu.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store.backends import RowBackend, Writes
from recsys.routing import values_by_feature
from stage_cpu.driver import Driver

LMDB_KW = {"map_size": 1 << 36, "subdir": True, "sync": False, "metasync": False, "readahead": False}


class CapturingBackend:
    """A :class:`~embedding_store.backends.RowBackend` that passes every call to ``inner`` and, while
    :attr:`on`, records the ids of the rows read and the groups each commit wrote: the work the floor
    redoes with raw py-lmdb. It is handed to the store (``TieredStore(..., backend=)``); nothing of the
    store or its backend is patched."""

    def __init__(self, inner: RowBackend) -> None:
        self.inner = inner
        self.reads: list[np.ndarray] = []
        self.commits: list[list[tuple[str, np.ndarray, int]]] = []
        self.on = False
        self._lock = (
            threading.Lock()
        )  # reads come from the reader pool and the stages, commits from the writer

    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        found, rows = self.inner.get_rows(table, ids)
        if self.on and found.any():
            with self._lock:
                self.reads.append(ids[found].copy())
        return found, rows

    def put_rows(self, writes: Writes) -> None:
        self.inner.put_rows(writes)
        if self.on:
            with self._lock:
                self.commits.append([(t, ids.copy(), rows.shape[1]) for t, ids, rows in writes])

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        self.inner.delete_rows(table, ids)

    def scan(self, table: str, *, after: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.scan(table, after=after, limit=limit)

    def num_rows(self, table: str) -> int:
        return self.inner.num_rows(table)

    def sync(self) -> None:
        self.inner.sync()

    def snapshot(self, dest: Path) -> None:
        self.inner.snapshot(dest)

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def map_size_bytes(self) -> int:
        return self.inner.map_size_bytes()

    def close(self) -> None:
        self.inner.close()


def lmdb_floor(capture: CapturingBackend, row_bytes: int, scratch: Path) -> tuple[int, int, int, int]:
    """Thread CPU ns of raw getmulti of every read key and of sorted putmulti(append=True) of every commit.

    Returns: (read ns, rows read, write ns, rows written).
    """
    reads = capture.reads
    every = np.unique(np.concatenate(reads)) if reads else np.empty(0, np.int64)
    env = lmdb.open(str(scratch / "get"), **LMDB_KW)
    value = bytes(row_bytes)
    with env.begin(write=True) as txn:  # untimed: a copy of the keys the store read
        txn.cursor().putmulti([(k, value) for k in _keys(every)], append=True)
    read_ns, n_read = 0, 0
    for ids in reads:
        start = time.thread_time_ns()
        with env.begin() as txn:
            pairs = txn.cursor().getmulti(_keys(ids))
        rows = np.frombuffer(b"".join(v for _, v in pairs), dtype=np.float32)
        read_ns += time.thread_time_ns() - start
        n_read += ids.shape[0]
        assert rows.shape[0] == ids.shape[0] * row_bytes // 4
    env.close()
    env = lmdb.open(str(scratch / "put"), max_dbs=64, **LMDB_KW)
    dbs: dict[str, object] = {}
    write_ns, n_written = 0, 0
    for base, groups in enumerate(capture.commits):
        prepared = []
        for table, ids, floats in groups:
            db = dbs.setdefault(table, env.open_db(table.encode()))
            rows = np.zeros((ids.shape[0], floats), dtype=np.float32)
            # ids < 2^32 here: keys above every earlier commit's, so each putmulti appends
            prepared.append((db, np.sort(ids) + (base << 32), rows))
        start = time.thread_time_ns()
        with env.begin(write=True) as txn:
            for db, ids, rows in prepared:
                values = rows.reshape(-1).view(f"V{rows.shape[1] * 4}").tolist()
                txn.cursor(db=db).putmulti(list(zip(_keys(ids), values, strict=True)), append=True)
        write_ns += time.thread_time_ns() - start
        n_written += sum(ids.shape[0] for _, ids, _ in prepared)
    env.close()
    return read_ns, n_read, write_ns, n_written


def _keys(ids: np.ndarray) -> list[bytes]:
    return np.ascontiguousarray(ids, dtype=">u8").view("V8").tolist()


def floor_step(driver: Driver, kjt: KeyedJaggedTensor, local: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Thread CPU ns of the step's floor: torch.unique of each table's ids, index_select of its rows."""
    values = values_by_feature(kjt)
    unique_ns = gather_ns = 0
    for n, k in zip(driver.names, driver.keys, strict=True):
        ids = values[k].clone()
        start = time.thread_time_ns()
        torch.unique(ids, return_inverse=True)
        mid = time.thread_time_ns()
        driver.weights[n].index_select(0, local[n])
        gather_ns += time.thread_time_ns() - mid
        unique_ns += mid - start
    return unique_ns, gather_ns
