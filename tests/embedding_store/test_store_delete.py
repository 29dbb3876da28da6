"""``TieredStore.delete`` against a dict reference: a deleted id is an id never seen, from every tier.

Rows are placed on one tier at a time (device, host clean or dirty, the writer's queue, LMDB), deleted,
read back as their lazy init, trained again and read back as the new value, across a reopen. A backend
wrapper holds the writer's commits (rows stay queued) or a prefetch's unlocked read (a delete runs in
the middle of it).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from es_helpers import bits, init_packed, packed_at, slot_tensors

from embedding_store import LmdbOptions, OptimizerKind, StoreConfig, TableSpec, Tier, TieredStore
from embedding_store.backends import RowBackend, open_backend, open_snapshot
from embedding_store.writer import WriteBehind, WriterSettings

SEED = 5
SPEC = TableSpec(name="t", dim=3, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
GONE = [42, 3, 17]  # the ids deleted
KEPT = [5, 60]  # rows beside them that must survive


class _Gated:
    """A backend whose commits wait for ``commits`` and whose reads wait for ``reads`` (both open at
    first); ``reading`` is set when a read is waiting."""

    def __init__(self, inner: RowBackend) -> None:
        self.inner = inner
        self.commits = threading.Event()
        self.reads = threading.Event()
        self.reading = threading.Event()
        self.commits.set()
        self.reads.set()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def put_rows(self, writes) -> None:  # type: ignore[no-untyped-def]
        assert self.commits.wait(10), "commits held too long"
        self.inner.put_rows(writes)

    def delete_rows(self, table: str, ids: np.ndarray) -> None:
        assert self.commits.wait(10), "commits held too long"
        self.inner.delete_rows(table, ids)

    def get_rows(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.reading.set()
        assert self.reads.wait(10), "reads held too long"
        return self.inner.get_rows(table, ids)


class _Run:
    """A store of SPEC over a gated backend, and the reference: id -> packed row of the ids written."""

    def __init__(self, path: Path, *, host_rows: int, layout: str = "log") -> None:
        self.path = path
        self.config = StoreConfig(
            seed=SEED,
            device_capacity_rows=8,
            host_capacity_rows=host_rows,
            lmdb=LmdbOptions(layout=layout, initial_map_size_bytes=1 << 20, writer_batch_rows=4),
        )
        self.ref: dict[int, np.ndarray] = {}
        self.batch = 0
        self.rng = np.random.default_rng(0)
        self.open()

    def open(self) -> None:
        inner = open_backend(self.path, options=self.config.lmdb, seed=SEED, tables=[SPEC])
        self.backend = _Gated(inner)
        self.store = TieredStore(self.path, config=self.config, tables=[SPEC], backend=self.backend)  # type: ignore[arg-type]
        self.weights, self.state = slot_tensors(SPEC, 8)
        self.store.bind("t", weights=self.weights, state=self.state)

    def reopen(self) -> None:
        self.store.close()
        self.open()

    def expected(self, ids: list[int]) -> np.ndarray:
        rows = init_packed(SPEC, SEED, np.array(ids, dtype=np.int64))
        for k, i in enumerate(ids):
            if i in self.ref:
                rows[k] = self.ref[i]
        return rows

    def train(self, ids: list[int]) -> None:
        """One batch: its rows must come up as the reference says, then take new values."""
        batch, self.batch = self.batch, self.batch + 1
        slots = self.store.make_resident(batch, {"t": torch.tensor(ids)})["t"]
        assert (bits(packed_at(self.weights, self.state, slots)) == bits(self.expected(ids))).all()
        rows = self.rng.standard_normal((len(ids), SPEC.row_floats)).astype(np.float32)
        self.weights[slots] = torch.from_numpy(rows[:, : SPEC.dim].copy())
        self.state[slots] = torch.from_numpy(rows[:, SPEC.dim].copy())
        self.ref.update(zip(ids, rows, strict=True))
        self.store.release(batch)

    def delete(self, ids: list[int]) -> None:
        self.store.delete("t", np.array(ids, dtype=np.int64))
        for i in ids:
            self.ref.pop(i, None)

    def check(self, parked: tuple[int, ...] = ()) -> None:
        """read_rows and iter_rows equal the reference (deleted and never-seen ids read as init).

        ``parked``: ids a prefetch may have parked in the host tier as their init rows, which iter_rows
        may stream, as it does a prefetched id never seen."""
        ids = sorted(set(GONE + KEPT + [999]))
        chunk = self.store.read_rows("t", np.array(ids, dtype=np.int64))
        assert (bits(packed_at(chunk.weights, chunk.state, slice(None))) == bits(self.expected(ids))).all()
        chunks = list(self.store.iter_rows("t", chunk_rows=2))
        got_ids = np.concatenate([c.ids.numpy() for c in chunks]).tolist() if chunks else []
        assert set(self.ref) <= set(got_ids) <= set(self.ref) | set(parked)
        assert got_ids == sorted(got_ids)
        if chunks:
            got = np.concatenate([packed_at(c.weights, c.state, slice(None)) for c in chunks])
            assert (bits(got) == bits(self.expected(got_ids))).all()

    def resident(self) -> dict[Tier, int]:
        return self.store.stats().resident_rows["t"]


def _place(run: _Run, where: str) -> None:
    """Write GONE and KEPT so that their latest rows are on the tier ``where`` only."""
    run.train(GONE + KEPT)
    if where == "device":
        assert run.resident()[Tier.DEVICE] == 5
        return
    run.store.evict("t")  # device -> host (dirty), or straight to the writer when there is no host
    if where == "host_dirty":
        assert run.resident()[Tier.HOST] == 5 and run.resident()[Tier.SSD] == 0
        return
    if where == "writer":  # an older copy on disk, the latest queued behind held commits
        run.store.flush()
        run.train(GONE + KEPT)
        run.backend.commits.clear()
        run.store.evict("t")
        assert run.store.stats().writer_pending_rows == 5 and run.resident()[Tier.DEVICE] == 0
        return
    run.store.flush()
    if where == "host_clean":
        assert run.resident()[Tier.HOST] == 5 and run.resident()[Tier.SSD] == 5
        return
    assert where == "ssd"
    assert run.resident() == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.SSD: 5}


@pytest.mark.parametrize(
    ("where", "host_rows", "layout"),
    [
        ("device", 4, "log"),
        ("host_dirty", 8, "log"),
        ("host_clean", 8, "log"),
        ("writer", 0, "log"),
        ("ssd", 0, "log"),
        ("writer", 0, "btree"),
        ("ssd", 0, "memory"),
    ],
)
def test_a_deleted_row_reads_as_init_then_trains_as_a_fresh_insert(tmp_path, where, host_rows, layout):
    run = _Run(tmp_path / "store", host_rows=host_rows, layout=layout)
    _place(run, where)
    run.check()
    run.delete([3, 999, 42, 17, 3])  # duplicates and an id without a row
    run.check()  # the writer may still hold older rows of GONE: they must read as deleted
    stats = run.store.stats().tables["t"]
    assert stats[Tier.SSD].deleted == 4
    assert stats[Tier.DEVICE].deleted == (3 if where == "device" else 0)
    assert stats[Tier.HOST].deleted == (3 if where.startswith("host") else 0)
    run.backend.commits.set()
    run.store.wait_for_writes()
    assert run.resident()[Tier.SSD] == (2 if where in ("writer", "ssd", "host_clean") else 0)
    run.check()
    run.reopen()  # the delete is on disk: a tombstone in the log layout
    run.check()
    run.train(GONE)  # make_resident fills init rows (checked in train), as for ids never seen
    run.check()
    run.store.evict("t")
    run.reopen()
    run.check()  # the new rows won over the delete
    run.store.close()


def test_a_delete_during_a_prefetchs_unlocked_read_is_not_undone(tmp_path) -> None:
    run = _Run(tmp_path / "store", host_rows=2)
    run.train(GONE + KEPT)
    run.store.flush()
    run.reopen()  # every row on disk only
    run.train([42])  # a newer copy of 42 ...
    run.store.evict("t")
    run.backend.commits.clear()
    run.train([77, 78])
    run.store.evict("t")  # ... pushed out of the host tier by these: queued behind held commits
    assert run.store.stats().writer_pending_rows == 1
    run.backend.reads.clear()
    batch = run.batch
    run.batch += 1
    run.store.lookahead(batch, {"t": torch.tensor(GONE + KEPT + [999])})
    prefetch = threading.Thread(target=run.store.prefetch, args=(batch,))
    prefetch.start()
    assert run.backend.reading.wait(10)  # it took 42's queued row and is reading the rest, unlocked
    run.delete(GONE)
    run.backend.reads.set()
    prefetch.join(10)
    assert not prefetch.is_alive()
    run.check(parked=(999,))  # while the delete is queued
    run.backend.commits.set()
    run.store.wait_for_writes()
    run.check(parked=(999,))
    run.train(GONE + KEPT)  # GONE comes up as init, KEPT as trained
    run.reopen()
    run.check()
    run.store.close()


def test_deletes_racing_prefetches_in_another_thread_match_the_reference(tmp_path) -> None:
    """The pipeline's shape, with deletes: batch i trains and ids are deleted while a later batch is
    prefetched by another thread; every row read equals the reference."""
    run = _Run(tmp_path / "store", host_rows=4)
    rng = np.random.default_rng(1)
    pool = np.arange(1, 25)
    for step in range(150):
        ahead = 1000 + step  # announced for the prefetch only
        run.store.lookahead(ahead, {"t": torch.from_numpy(rng.choice(pool, 6, replace=False))})
        prefetch = threading.Thread(target=run.store.prefetch, args=(ahead,))
        prefetch.start()
        run.delete(rng.choice(pool, 3, replace=False).tolist())
        run.train(sorted(rng.choice(pool, 5, replace=False).tolist()))
        if step % 3 == 0:
            run.store.evict("t")  # rows go down through the host to the writer and the disk
        prefetch.join(10)
        got = run.store.read_rows("t", torch.from_numpy(pool))
        want = run.expected(pool.tolist())
        assert (bits(packed_at(got.weights, got.state, slice(None))) == bits(want)).all(), step
    run.store.close()


def test_a_prefetch_after_a_queued_delete_reads_init_rows_not_the_stale_disk_ones(tmp_path) -> None:
    run = _Run(tmp_path / "store", host_rows=8)
    run.train(GONE + KEPT)
    run.store.flush()
    run.reopen()
    run.backend.commits.clear()
    run.delete(GONE)  # queued; LMDB still holds the rows
    run.store.lookahead(100, {"t": torch.tensor(GONE + KEPT)})
    run.store.prefetch(100)
    assert run.resident()[Tier.HOST] == 5  # the init rows of GONE, the disk rows of KEPT
    run.check(parked=tuple(GONE))
    run.train(GONE + KEPT)
    run.backend.commits.set()
    run.store.close()


def test_a_snapshot_after_a_delete_excludes_its_ids(tmp_path) -> None:
    run = _Run(tmp_path / "store", host_rows=2)
    run.train(GONE + KEPT)
    run.store.evict("t", np.array([3, 5, 60]))  # some in the host, some queued, some on the device
    run.store.flush()
    run.train([42, 60])
    run.store.evict("t", np.array([60]))
    run.backend.commits.clear()
    run.delete(GONE)
    run.backend.commits.set()
    run.store.snapshot(tmp_path / "snap")
    reader = open_snapshot(tmp_path / "snap", seed=SEED, tables=[SPEC])
    try:
        chunks = list(reader.chunks(SPEC))
    finally:
        reader.close()
    ids = np.concatenate([c[0] for c in chunks]).tolist()
    assert ids == sorted(KEPT)
    assert (bits(np.concatenate([c[1] for c in chunks])) == bits(run.expected(ids))).all()
    run.store.close()


def test_deleting_a_pinned_id_raises_and_deletes_nothing(tmp_path) -> None:
    run = _Run(tmp_path / "store", host_rows=4)
    run.train(GONE + KEPT)
    run.store.evict("t", np.array([42]))
    slots = run.store.make_resident(50, {"t": torch.tensor([5])})["t"]
    with pytest.raises(ValueError, match=r"pinned by an in-flight batch: \[5\]"):
        run.store.delete("t", np.array([42, 5, 3]))
    assert all(s.deleted == 0 for s in run.store.stats().tables["t"].values())
    assert run.store.stats().writer_pending_rows == 0
    run.check()
    assert (bits(packed_at(run.weights, run.state, slots)) == bits(run.expected([5]))).all()
    run.store.release(50)
    run.delete([42, 5, 3])  # released: now it goes
    run.check()
    run.store.close()


def test_the_writer_answers_deleted_until_a_later_row_of_the_id(tmp_path) -> None:
    """``find`` and its pass over the queue agree: the newest pending operation of each id wins."""
    spec = TableSpec(name="w", dim=2, optimizer=OptimizerKind.EXACT_SGD)
    options = LmdbOptions(layout="memory")
    backend = _Gated(open_backend(tmp_path, options=options, seed=0, tables=[spec]))
    backend.commits.clear()
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    with WriteBehind(backend, WriterSettings(batch_rows=2, max_pending_rows=100)) as writer:  # type: ignore[arg-type]
        writer.submit("w", np.array([1, 2, 3]), rows[:3])
        writer.submit_delete("w", np.array([2, 3, 7]))
        writer.submit("w", np.array([3, 9]), rows[3:5])
        query = np.array([9, 1, 2, 3, 4, 7])
        for found, got, deleted in (writer.find("w", query), writer.find_in_queue("w", query)):
            assert found.tolist() == [True, True, False, True, False, False]
            assert deleted.tolist() == [False, False, True, False, False, True]
            assert got.tolist() == [rows[4].tolist(), rows[0].tolist(), rows[3].tolist()]
        assert writer.lookup("w", query)[0].tolist() == found.tolist()
        backend.commits.set()
        writer.drain()
        assert writer.ids_deleted == 3
    on_disk, got = backend.get_rows("w", np.array([1, 2, 3, 7, 9]))
    assert on_disk.tolist() == [True, False, True, False, True]
    assert got.tolist() == [rows[0].tolist(), rows[3].tolist(), rows[4].tolist()]


def test_a_log_scan_that_a_delete_overtakes_lists_its_ids_again(tmp_path) -> None:
    """The writer thread deletes while ``iter_rows`` scans: the scan skips the ids, and fails no read."""
    backend = open_backend(tmp_path, options=LmdbOptions(layout="log"), seed=SEED, tables=[SPEC])
    ids = np.arange(10, 20, dtype=np.int64)
    rows = np.random.default_rng(2).standard_normal((10, SPEC.row_floats)).astype(np.float32)
    backend.put_rows([("t", ids, rows)])
    log = backend.log  # type: ignore[attr-defined]
    read = log.get_rows
    raced: list[np.ndarray] = []

    def overtaken(table: str, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not raced:  # between the scan's listing of the ids and its read of them
            raced.append(chunk[1:3].copy())
            backend.delete_rows(table, raced[0])
        return read(table, chunk)

    log.get_rows = overtaken
    got_ids, got_rows = backend.scan("t", after=11, limit=4)
    assert raced[0].tolist() == [13, 14]
    assert got_ids.tolist() == [12, 15, 16, 17]
    assert (bits(got_rows) == bits(rows[[2, 5, 6, 7]])).all()
    backend.close()
