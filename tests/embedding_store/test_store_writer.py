"""The background writer: large submissions go in bounded transactions, and reads see pending rows."""

from __future__ import annotations

import threading

import numpy as np

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.lmdb_backend import LmdbBackend
from embedding_store.writer import WriteBehind


class _Recording(LmdbBackend):
    """Records the rows of every transaction; the first one waits until released."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
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
    with WriteBehind(backend, batch_rows=300, max_pending_rows=1 << 20) as writer:
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
