"""WriteBehind.lookup (through the writer's index of its pending rows) answers as a pass over its queue
(``lookup_queue``) does at the same moment (read-your-writes, docs/design.md, invariant 6), while the
writer holds any number of submissions, commits some of them, or one is in flight.

A backend that blocks every commit until the test lets it go keeps the writer's queue still while both
are asked about the same ids.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from embedding_store.writer import WriteBehind, WriterSettings

ROW = 3  # floats per row


class GatedBackend:
    """put_rows waits until the test allows one more transaction, and records what it wrote."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.allowed = 0  # transactions the test let through
        self.done = 0
        self.waiting = False
        self.written: dict[str, dict[int, np.ndarray]] = {}

    def allow(self, n: int) -> None:
        with self.cond:
            self.allowed += n
            self.cond.notify_all()

    def put_rows(self, writes) -> None:
        with self.cond:
            self.waiting = True
            self.cond.wait_for(lambda: self.allowed > self.done)
            self.waiting = False
        for table, ids, rows in writes:
            self.written.setdefault(table, {}).update(zip(ids.tolist(), rows, strict=True))
        with self.cond:
            self.done += 1


def _settle(writer: WriteBehind, backend: GatedBackend) -> None:
    """Wait until the writer's queue stands still: nothing pending, or a commit waiting to be allowed;
    then withdraw the transactions allowed but not used (the next ones wait again)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with backend.cond:
            if (backend.waiting and backend.allowed == backend.done) or writer.pending_rows == 0:
                backend.allowed = backend.done
                return
        time.sleep(0.0005)
    raise AssertionError("the writer did not settle")


def _same(writer: WriteBehind, table: str, ids: np.ndarray) -> None:
    found, rows = writer.lookup(table, ids)
    want_found, want_rows = writer.lookup_queue(table, ids)
    np.testing.assert_array_equal(found, want_found)
    if want_found.any():
        np.testing.assert_array_equal(rows, want_rows)


@pytest.mark.parametrize("seed", range(4))
def test_lookups_match_the_writer_through_submissions_and_commits(seed) -> None:
    rng = np.random.default_rng(seed)
    backend = GatedBackend()
    settings = WriterSettings(batch_rows=int(rng.integers(5, 60)), max_pending_rows=1 << 20, linger_s=0.0)
    writer = WriteBehind(backend, settings)  # type: ignore[arg-type]
    tables = ["a", "b"]
    space = 200  # ids collide often: newer copies must win
    value = 0.0
    try:
        for _step in range(150):
            action = rng.random()
            if action < 0.55:
                table = tables[int(rng.integers(0, 2))]
                ids = np.unique(rng.integers(0, space, size=int(rng.integers(1, 40))))
                rows = (value + np.arange(ids.shape[0] * ROW, dtype=np.float32)).reshape(-1, ROW)
                value += ids.shape[0] * ROW
                writer.submit(table, ids, rows, indexed=bool(rng.random() < 0.9))
            else:
                backend.allow(int(rng.integers(1, 4)))
            _settle(writer, backend)
            for table in tables:
                _same(writer, table, np.unique(rng.integers(0, space, size=60)))
                _same(writer, table, rng.integers(0, space, size=20))  # any order, duplicates
                _same(writer, table, np.empty(0, dtype=np.int64))
        backend.allow(10_000)
        writer.drain()
        for table in tables:
            found, _ = writer.lookup(table, np.arange(space))
            assert not found.any()  # everything committed: LMDB holds it all
    finally:
        backend.allow(10_000)
        writer.close()


def test_a_table_with_nothing_submitted_finds_nothing() -> None:
    backend = GatedBackend()
    backend.allow(100)
    with WriteBehind(backend, WriterSettings(batch_rows=8, max_pending_rows=64)) as writer:  # type: ignore[arg-type]
        found, rows = writer.lookup("t", np.arange(5))
        assert not found.any() and rows.shape[0] == 0
