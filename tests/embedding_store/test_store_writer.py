"""The background writer: large submissions go in bounded transactions, and reads see pending rows."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends import open_backend
from embedding_store.backends.lmdb_env import open_env
from embedding_store.backends.log import LogBackend
from embedding_store.writer import WriteBehind, WriterSettings


class _Recording(LogBackend):
    """Records the rows of every transaction; the first one waits until released."""

    def __init__(self, path, *, options, seed, tables) -> None:  # type: ignore[no-untyped-def]
        super().__init__(open_env(path, options, len(tables)), options=options, seed=seed, tables=tables)
        self.txn_rows: list[int] = []
        self.release = threading.Event()

    def put_rows(self, writes):  # type: ignore[no-untyped-def]
        self.release.wait(10)
        self.txn_rows.append(sum(ids.shape[0] for _, ids, _ in writes))
        super().put_rows(writes)


def test_a_large_submission_commits_in_bounded_transactions_and_stays_readable(tmp_path) -> None:
    spec = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_SGD)
    backend = _Recording(tmp_path / "env", options=LmdbOptions(), seed=0, tables=[spec])
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 1 << 40, size=2500))
    rows = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
    newer = ids[::7]
    newer_rows = rows[::7] + 1.0
    with WriteBehind(backend, WriterSettings(batch_rows=300, max_pending_rows=1 << 20)) as writer:
        writer.submit("t", ids, rows)
        writer.submit("t", newer, newer_rows)  # a later eviction of some of the same ids
        want = rows.copy()
        want[::7] = newer_rows
        found, got = writer.lookup("t", ids)  # nothing committed yet: all pending
        assert found.all() and np.array_equal(got, want)
        backend.release.set()
        writer.drain()
    assert backend.txn_rows and max(backend.txn_rows) <= 300
    assert sum(backend.txn_rows) == ids.shape[0] + newer.shape[0]
    found, got = backend.get_rows("t", ids)
    assert found.all() and np.array_equal(got, want)  # the newer rows won
    backend.close()


def _batches(n: int, size: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 1 << 40, size=n * size * 2))[: n * size]
    rng.shuffle(ids)
    return [
        (np.sort(part), rng.standard_normal((size, 4)).astype(np.float32)) for part in ids.reshape(n, size)
    ]


def test_small_evictions_gather_into_one_transaction_until_drained(tmp_path) -> None:
    spec = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_SGD)
    backend = _Recording(tmp_path / "env", options=LmdbOptions(), seed=0, tables=[spec])
    backend.release.set()
    parts = _batches(5, 100)
    with WriteBehind(
        backend, WriterSettings(batch_rows=10_000, max_pending_rows=1 << 20, min_batch_rows=1000, linger_s=60)
    ) as writer:
        for ids, rows in parts:
            writer.submit("t", ids, rows)
        threading.Event().wait(0.3)
        assert backend.txn_rows == [] and writer.pending_rows == 500  # gathering: below 1000, no linger yet
        found, got = writer.lookup("t", parts[2][0])
        assert found.all() and np.array_equal(got, parts[2][1])  # and readable meanwhile
        writer.drain()  # a flush does not wait for the linger
        assert backend.txn_rows == [500] and writer.pending_rows == 0
        for ids, rows in _batches(11, 100, seed=2):
            writer.submit("t", ids, rows)
        writer.drain()
    assert backend.txn_rows[1] >= 1000  # the threshold started the next transaction, not each submit
    assert sum(backend.txn_rows) == 1600
    for ids, rows in parts:
        found, got = backend.get_rows("t", ids)
        assert found.all() and np.array_equal(got, rows)
    backend.close()


def test_a_lingering_row_is_committed_without_a_drain(tmp_path) -> None:
    spec = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_SGD)
    backend = _Recording(tmp_path / "env", options=LmdbOptions(), seed=0, tables=[spec])
    backend.release.set()
    ((ids, rows),) = _batches(1, 10)
    with WriteBehind(
        backend,
        WriterSettings(batch_rows=10_000, max_pending_rows=1 << 20, min_batch_rows=1000, linger_s=0.2),
    ) as writer:
        writer.submit("t", ids, rows)
        for _ in range(100):  # up to 5 s; the transaction is recorded as it starts, counted once committed
            if backend.txn_rows and writer.pending_rows == 0:
                break
            threading.Event().wait(0.05)
        assert backend.txn_rows == [10] and writer.pending_rows == 0
    backend.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_writer_thread_runs_at_a_lower_priority_only(tmp_path) -> None:
    """The writer thread's nice is the caller's + ``nice`` (capped at 19); the caller's is unchanged."""

    def nice_of(tid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, tid)

    me = threading.get_native_id()
    base = nice_of(me)
    spec = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_SGD)
    backend = open_backend(tmp_path / "env", options=LmdbOptions(), seed=0, tables=[spec])
    seen: list[int] = []
    put_rows = backend.put_rows
    backend.put_rows = lambda writes: (seen.append(nice_of(threading.get_native_id())), put_rows(writes))  # type: ignore[method-assign]
    ((ids, rows),) = _batches(1, 10)
    with WriteBehind(backend, WriterSettings(batch_rows=100, max_pending_rows=1000, nice=4)) as writer:
        writer.submit("t", ids, rows)
        writer.drain()
    assert seen == [min(19, base + 4)] and nice_of(me) == base
    backend.close()
    with pytest.raises(ValueError, match="writer_nice must be an int in 0..19, got -1"):
        LmdbOptions(writer_nice=-1)
