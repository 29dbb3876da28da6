"""The floor of the tier stages' work, timed in the same run: what the store's backend read and wrote
(recorded by :class:`LmdbCapture`) redone with raw py-lmdb, and each step's ``torch.unique`` and
``index_select`` (bench_stage_cpu.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store import TieredStore
from recsys.routing import values_by_feature
from stage_cpu.driver import Driver

LMDB_KW = {"map_size": 1 << 36, "subdir": True, "sync": False, "metasync": False, "readahead": False}


class LmdbCapture:
    """Records the keys of the rows the store's backend reads and the groups its writer commits."""

    def __init__(self, store: TieredStore) -> None:
        backend = store._backend  # noqa: SLF001 - a benchmark's probe, wrapped on this instance only
        self.reads: list[np.ndarray] = []
        self.commits: list[list[tuple[str, np.ndarray, int]]] = []
        self.on = False
        get_rows, put_rows = backend.get_rows, backend.put_rows
        lock = threading.Lock()

        def get(table: str, ids: np.ndarray, *args: object, **kw: object) -> tuple[np.ndarray, np.ndarray]:
            found, rows = get_rows(table, ids, *args, **kw)
            if self.on and found.any():
                with lock:
                    self.reads.append(ids[found].copy())
            return found, rows

        def put(writes: list[tuple[str, np.ndarray, np.ndarray]], *args: object, **kw: object) -> None:
            put_rows(writes, *args, **kw)
            if self.on:
                with lock:
                    self.commits.append([(t, ids.copy(), rows.shape[1]) for t, ids, rows in writes])

        backend.get_rows, backend.put_rows = get, put


def lmdb_floor(capture: LmdbCapture, row_bytes: int, scratch: Path) -> tuple[int, int, int, int]:
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
