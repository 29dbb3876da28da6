"""The log layout of the LMDB backend (embedding_store/backends/log_tables.py) against a dict oracle: reads, scans,
reopen, compaction with its space bound, reads racing the writer, a segment drop that meets a full map, and a
SIGKILL anywhere in a compaction.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from embedding_store import LmdbOptions, OptimizerKind, StoreCorruptError, StoreFullError, TableSpec
from embedding_store.backends import log_format, open_backend
from embedding_store.backends import log_tables as lmdb_log
from embedding_store.backends.btree import BTreeBackend
from embedding_store.backends.log import LogBackend
from embedding_store.backends.log_format import Geometry, runs_name, segment_name
from embedding_store.backends.log_live import Liveness
from embedding_store.backends.log_records import Commit, replay_runs
from embedding_store.log_index import DenseSeqIndex, HashSeqIndex, SortedSeqIndex
from embedding_store.snapshot import scan_snapshot

sys.path.insert(0, str(Path(__file__).parent))
import log_child  # noqa: E402

BOUNDED = TableSpec(name="b", dim=2, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=5000)
UNBOUNDED = TableSpec(name="u", dim=3, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
FAULTS = Path(__file__).resolve().parents[1] / "faults"


def _options(**kw: object) -> LmdbOptions:
    return LmdbOptions(
        **{"initial_map_size_bytes": 1 << 20, "log_segment_rows": 50, "log_compact_at": 0.5, **kw}
    )


def _open(path: Path, **kw: object) -> LogBackend:
    return open_backend(path, options=_options(**kw), seed=0, tables=[BOUNDED, UNBOUNDED])


def _id_space(spec: TableSpec) -> int:
    return spec.num_embeddings or 1 << 62


class _Oracle:
    def __init__(self) -> None:
        self.rows: dict[str, dict[int, np.ndarray]] = {"b": {}, "u": {}}

    def put(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        self.rows[table].update(zip(ids.tolist(), rows, strict=True))

    def check(self, backend: LogBackend, table: str, ids: np.ndarray) -> None:
        found, rows = backend.get_rows(table, ids)
        want = [i in self.rows[table] for i in ids.tolist()]
        assert found.tolist() == want
        expect = [self.rows[table][i] for i in ids[found].tolist()]
        assert np.array_equal(rows, np.array(expect, dtype=np.float32).reshape(rows.shape))

    def check_all(self, backend: LogBackend) -> None:
        for table, rows in self.rows.items():
            assert backend.num_rows(table) == len(rows)
            got_ids, got_rows, after = [], [], -1
            while True:
                ids, chunk = backend.scan(table, after=after, limit=37)
                if not ids.shape[0]:
                    break
                got_ids.append(ids)
                got_rows.append(chunk)
                after = int(ids[-1])
            ids = np.concatenate(got_ids) if got_ids else np.empty(0, np.int64)
            assert ids.tolist() == sorted(rows)
            if ids.shape[0]:
                assert np.array_equal(np.concatenate(got_rows), np.stack([rows[i] for i in ids.tolist()]))


def _random_writes(rng: np.random.Generator, oracle: _Oracle, backend: LogBackend, steps: int) -> None:
    for step in range(steps):
        writes = []
        for spec in (BOUNDED, UNBOUNDED):
            pool = 300 if step % 3 else 3000  # mostly rewrites of a hot set: dead records to compact
            ids = np.unique(
                rng.integers(0, pool, size=int(rng.integers(0, 90))) * (1 if spec is BOUNDED else 7_777_777)
            )
            rows = rng.standard_normal((ids.shape[0], spec.row_floats)).astype(np.float32)
            writes.append((spec.name, ids.astype(np.int64), rows))
        backend.put_rows(writes)
        for table, ids, rows in writes:
            oracle.put(table, ids, rows)
        if step % 10 == 0:
            for spec in (BOUNDED, UNBOUNDED):
                scale = 1 if spec is BOUNDED else 7_777_777
                q = np.unique(rng.integers(0, 3200, size=120) * scale)
                oracle.check(backend, spec.name, q.astype(np.int64))


def _check_liveness(backend: LogBackend) -> None:
    """The writer's live bits and counts equal what the index and the runs say (the oracle)."""
    log = backend.log
    assert log is not None
    for t in log._tables.values():
        _, records = replay_runs(log._env, t.runs_db, t.spec, t.geo)
        assert t.alive.records == records
        seqs = np.sort(t.index.items()[1])
        for seg in t.alive.records:
            want = seqs[(seqs >= seg * t.geo.segment) & (seqs < (seg + 1) * t.geo.segment)]
            assert np.array_equal(t.alive.live_seqs(seg), want), seg
            assert t.alive.live[seg] == want.shape[0]


def test_liveness_follows_a_set_oracle() -> None:
    rng = np.random.default_rng(3)
    segment, owner, live = 100, {}, set()  # owner: id -> its newest record
    alive, seq = Liveness(segment, {}, np.empty(0, np.int64)), 0
    for _ in range(300):
        ids = np.unique(rng.integers(0, 400, size=int(rng.integers(1, 60))))
        seqs = np.arange(seq, seq + ids.shape[0], dtype=np.int64)
        for seg in np.unique(seqs // segment).tolist():
            alive.open(seg)
        old = np.array([owner.get(i, -1) for i in ids.tolist()], dtype=np.int64)
        alive.publish(old, seqs)
        live -= set(old.tolist())
        live |= set(seqs.tolist())
        owner.update(zip(ids.tolist(), seqs.tolist(), strict=True))
        seq += ids.shape[0] + int(rng.integers(0, 5))  # block padding: numbers that are no record
        if rng.random() < 0.1:  # a drop of a fully dead segment (what compaction leaves)
            dead = [s for s in alive.records if s < seq // segment and alive.live[s] == 0]
            for s in dead:
                alive.drop(s)
    for seg in alive.records:
        want = sorted(x for x in live if x // segment == seg)
        assert alive.live_seqs(seg).tolist() == want
        assert alive.live[seg] == len(want)
    assert alive.totals()[1] == len(live)
    rebuilt = Liveness(segment, dict(alive.records), np.array(sorted(live), dtype=np.int64))
    for seg in alive.records:
        assert np.array_equal(rebuilt.live_seqs(seg), alive.live_seqs(seg))
    with pytest.raises(RuntimeError, match="not live"):  # a record that dies twice is a writer bug
        alive.publish(np.array([max(live)], dtype=np.int64), np.empty(0, np.int64))
        alive.publish(np.array([max(live)], dtype=np.int64), np.empty(0, np.int64))


def test_compaction_runs_when_the_log_is_compact_at_dead(tmp_path: Path) -> None:
    backend = _open(tmp_path / "env")  # 50-row segments, compact_at 0.5
    log = backend.log
    assert log is not None
    ids = np.arange(2_000, dtype=np.int64)
    rows = np.zeros((ids.shape[0], UNBOUNDED.row_floats), dtype=np.float32)
    backend.put_rows([("u", ids, rows)])
    rng, oracle = np.random.default_rng(1), dict.fromkeys(ids.tolist(), 0.0)
    for step in range(1, 400):
        pick = np.unique(rng.integers(0, ids.shape[0], size=40))
        before = log.stats.compactions
        backend.put_rows([("u", pick, np.full((pick.shape[0], UNBOUNDED.row_floats), step, np.float32))])
        oracle.update(dict.fromkeys(pick.tolist(), float(step)))
        records, live = log.space("u")
        if log.stats.compactions == before:  # none ran: the log was less than half dead before this write
            assert records - pick.shape[0] - live < 0.5 * (records - pick.shape[0]) + 50
        else:  # only as much as the space needs: it stopped once the log was less than half dead
            assert records - live >= 0.5 * records - 60
        assert records - live < 0.5 * records + 100  # never more dead than compact_at, plus the open head
    assert log.stats.compactions > 20
    found, got = backend.get_rows("u", ids)
    assert found.all() and got[:, 0].tolist() == [oracle[i] for i in ids.tolist()]
    backend.close()


@pytest.mark.parametrize("threads", [1, 16])
def test_log_matches_a_dict_oracle_through_compaction_and_reopen(tmp_path: Path, threads: int) -> None:
    rng = np.random.default_rng(0)
    oracle = _Oracle()
    backend = _open(tmp_path / "env", read_threads=threads, read_split="always")
    _random_writes(rng, oracle, backend, 120)
    oracle.check_all(backend)
    _check_liveness(backend)
    log = backend.log
    assert log is not None and log.stats.compactions > 10 and log.stats.copied_rows > 0
    for spec in (BOUNDED, UNBOUNDED):  # compaction bounds the space: live / (1 - 0.5), plus open segments
        records, live = log.space(spec.name)
        assert records <= 2 * live + 3 * 50, (spec.name, records, live)
    backend.close()
    backend = _open(tmp_path / "env", log_segment_rows=999)  # a store keeps its own segment size
    oracle.check_all(backend)
    _random_writes(rng, oracle, backend, 30)
    oracle.check_all(backend)
    _check_liveness(backend)
    backend.close()
    for spec in (BOUNDED, UNBOUNDED):  # the read-only scan of a closed store sees the same rows
        chunks = list(scan_snapshot(tmp_path / "env", spec, seed=0, chunk_rows=29))
        ids = np.concatenate([c[0] for c in chunks])
        assert ids.tolist() == sorted(oracle.rows[spec.name])
        assert np.array_equal(
            np.concatenate([c[1] for c in chunks]),
            np.stack([oracle.rows[spec.name][i] for i in ids.tolist()]),
        )


def test_a_large_read_drops_the_mapped_pages_between_chunks(tmp_path: Path) -> None:
    """``unmap_every_rows`` bounds the pages one read maps: a read of 500 blocks is counted (and its
    mapped pages dropped) every 40 blocks at most."""
    backend = _open(tmp_path / "env", unmap_every_rows=40, read_threads=4, read_split="always")
    rng = np.random.default_rng(1)
    ids = np.arange(5000, dtype=np.int64) * 7_777_777
    rows = rng.standard_normal((ids.shape[0], UNBOUNDED.row_floats)).astype(np.float32)
    for a in range(0, ids.shape[0], 10):  # every write starts a block: 500 blocks
        backend.put_rows([("u", ids[a : a + 10], rows[a : a + 10])])
    log = backend.log
    assert log is not None
    counted: list[int] = []
    log._io = dataclasses.replace(log._io, count_read=counted.append)
    found, got = backend.get_rows("u", ids)
    assert found.all() and np.array_equal(got, rows)
    assert sum(counted) == 500 and max(counted) <= 40, counted
    backend.close()


def test_a_store_keeps_its_layout(tmp_path: Path) -> None:
    ids, rows = np.array([1, 5]), np.ones((2, 2), np.float32)
    for layout in ("btree", "log"):
        backend = open_backend(tmp_path / layout, options=_options(layout=layout), seed=0, tables=[BOUNDED])
        backend.put_rows([("b", ids, rows)])
        backend.close()
        other = "log" if layout == "btree" else "btree"
        backend = open_backend(tmp_path / layout, options=_options(layout=other), seed=0, tables=[BOUNDED])
        assert isinstance(backend, BTreeBackend) == (layout == "btree")
        found, got = backend.get_rows("b", np.array([1, 2, 5]))
        assert found.tolist() == [True, False, True] and np.array_equal(got, rows)
        backend.close()


def test_reads_racing_writes_and_compactions_always_find_committed_rows(tmp_path: Path) -> None:
    """Every read sees each id that was committed before it began, with a version at least that new."""
    backend = _open(tmp_path / "env", log_segment_rows=64, read_threads=4, read_split="always")
    ids = np.arange(0, 2000, 7, dtype=np.int64)
    committed = np.full(ids.shape[0], -1)  # version of each id known committed
    stop, errors = threading.Event(), []

    def reader() -> None:
        rng = np.random.default_rng(1)
        try:
            while not stop.is_set():
                pick = np.unique(rng.integers(0, ids.shape[0], size=300))
                floor = committed[pick].copy()
                found, rows = backend.get_rows("b", ids[pick])
                want = floor >= 0
                assert found[want].all(), "a committed row was not found"
                got = np.full(pick.shape[0], -1.0)
                got[found] = rows[:, 1]
                assert (got[want] >= floor[want]).all(), "a read returned a row older than one committed"
                assert np.array_equal(rows[:, 0], ids[pick][found].astype(np.float32))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    rng = np.random.default_rng(2)
    try:
        for version in range(300):
            pick = np.unique(rng.integers(0, ids.shape[0], size=60))
            rows = np.stack([ids[pick], np.full(pick.shape[0], version)], axis=1).astype(np.float32)
            backend.put_rows([("b", ids[pick], rows)])
            committed[pick] = version
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert backend.log is not None and backend.log.stats.compactions > 20
    backend.close()


class _FullAtDrop:
    """A log's commit whose segment drops (its exclusive commits) meet a full map: the first ``runs`` runs
    of each of the first ``drops`` drops run the drop, then raise LMDB's MapFullError inside the
    transaction, as a commit that finds no room for its free list does. The transaction aborts, and the
    backend grows the map and runs it again (or gives up at ``max_map_size_bytes``)."""

    def __init__(self, commit: Commit, *, drops: int, runs: int = 1) -> None:
        self._commit, self._drops, self._runs = commit, drops, runs
        self.drops = self.faults = 0

    def __call__(
        self, fill: Callable[[object], None], need_bytes: int, num_rows: int, *, exclusive: bool = False
    ) -> None:
        if not exclusive or self.drops >= self._drops:
            return self._commit(fill, need_bytes, num_rows, exclusive=exclusive)
        self.drops += 1
        runs = [0]

        def full(txn: object) -> None:
            fill(txn)
            runs[0] += 1
            if runs[0] <= self._runs:
                self.faults += 1
                raise lmdb.MapFullError("injected: the map is full at the commit of a segment drop")

        return self._commit(full, need_bytes, num_rows, exclusive=exclusive)


def _check_named_dbs(backend: LogBackend) -> None:
    """The environment holds the runs and the segments the writer knows of, no more: dropped segments are
    gone, and none of the others is missing."""
    log = backend.log
    assert log is not None
    want = {b"__meta__"}
    for t in log._tables.values():
        assert set(t.segs) == set(t.alive.records)
        want |= {runs_name(t.spec.name)} | {segment_name(t.spec.name, seg) for seg in t.alive.records}
    with backend._env.begin() as txn:
        assert {bytes(key) for key, _ in txn.cursor()} == want


def _check_all(backend: LogBackend, oracle: _Oracle) -> None:
    """Rows, live bits and named databases of ``backend`` equal the oracle's."""
    oracle.check_all(backend)
    _check_liveness(backend)
    _check_named_dbs(backend)


def test_a_drop_that_meets_a_full_map_grows_it_and_runs_again(tmp_path: Path) -> None:
    """Issue 41: ``txn.drop(db, delete=True)`` closes the segment's handle for the whole environment even
    when its transaction then aborts on a full map; the run after the resize must not use that handle."""
    backend = _open(tmp_path / "env", initial_map_size_bytes=1 << 16)
    log = backend.log
    assert log is not None
    full = _FullAtDrop(log._io.commit, drops=12)
    log._io = dataclasses.replace(log._io, commit=full)
    rng, oracle = np.random.default_rng(4), _Oracle()
    _random_writes(rng, oracle, backend, 120)
    assert full.faults == 12 and log.stats.compactions > 20
    assert backend.map_size_bytes() >= 1 << (16 + 12)  # every fault doubled the map
    _check_all(backend, oracle)
    backend.close()
    backend = _open(tmp_path / "env")
    _check_all(backend, oracle)
    _random_writes(rng, oracle, backend, 20)
    oracle.check_all(backend)
    backend.close()


def test_a_drop_that_meets_a_full_map_at_its_cap_leaves_the_segment_to_a_later_compaction(
    tmp_path: Path,
) -> None:
    """A drop that finds the map full at ``max_map_size_bytes`` raises StoreFullError with nothing of it
    applied; the store stays usable and a later compaction drops the segment (its handle is not reused:
    the slot may belong to a segment opened since)."""
    backend = _open(tmp_path / "env", initial_map_size_bytes=1 << 20, max_map_size_bytes=1 << 22)
    log = backend.log
    assert log is not None
    full = _FullAtDrop(log._io.commit, drops=1, runs=99)  # 1 -> 2 -> 4 MiB, then the cap
    log._io = dataclasses.replace(log._io, commit=full)
    rng, oracle, failed = np.random.default_rng(5), _Oracle(), 0
    for _ in range(150):
        writes = []
        for spec in (BOUNDED, UNBOUNDED):
            ids = np.unique(rng.integers(0, 300, size=int(rng.integers(1, 90))))
            rows = rng.standard_normal((ids.shape[0], spec.row_floats)).astype(np.float32)
            writes.append((spec.name, ids.astype(np.int64), rows))
        try:
            backend.put_rows(writes)
        except StoreFullError as err:
            assert "at the cap" in str(err)
            failed += 1
        for table, ids, rows in writes:  # the append committed before the compaction that failed
            oracle.put(table, ids, rows)
    assert failed == 1 and full.faults == 3 and log.stats.compactions > 20
    _check_all(backend, oracle)
    backend.close()
    backend = _open(tmp_path / "env")
    _check_all(backend, oracle)
    backend.close()


WIDE = TableSpec(name="w", dim=100, optimizer=OptimizerKind.EXACT_SGD)  # 5 rows a block, 10 blocks a segment


@pytest.mark.parametrize(("unmap_every", "walk_blocks"), [(3, 1024), (None, 2), (7, 3)])
def test_compaction_walks_multi_block_segments_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unmap_every: int | None, walk_blocks: int
) -> None:
    """Compaction reads a segment's blocks by walking them (``_read_span``), ``unmap_every_rows`` blocks
    a chunk at most, unpacked ``WALK_BLOCKS`` at a time: the rows stay equal to a dict oracle through
    compactions and a reopen."""
    monkeypatch.setattr(lmdb_log, "WALK_BLOCKS", walk_blocks)
    backend = open_backend(
        tmp_path / "env", options=_options(unmap_every_rows=unmap_every), seed=0, tables=[WIDE]
    )
    log = backend.log
    assert log is not None and log._tables["w"].geo == Geometry(block=5, segment=50)
    counted: list[int] = []  # blocks counted by each chunk of compaction's reads
    reading = [False]
    log._io = dataclasses.replace(log._io, count_read=lambda n: reading[0] and counted.append(n))
    read_span = log._read_span

    def counted_read(*args: object) -> np.ndarray:
        reading[0] = True
        try:
            return read_span(*args)  # type: ignore[arg-type]
        finally:
            reading[0] = False

    log._read_span = counted_read  # type: ignore[method-assign]
    rng, oracle = np.random.default_rng(3), _Oracle()
    oracle.rows["w"] = {}
    for _ in range(150):
        ids = np.unique(rng.integers(0, 400, size=int(rng.integers(1, 40)))).astype(np.int64) * 3
        rows = rng.standard_normal((ids.shape[0], WIDE.row_floats)).astype(np.float32)
        backend.put_rows([("w", ids, rows)])
        oracle.put("w", ids, rows)
    assert log.stats.compactions > 10 and log.stats.copied_rows > 100
    assert counted and max(counted) <= (unmap_every or 10), counted
    everything = np.array(sorted(oracle.rows["w"]), dtype=np.int64)
    oracle.check(backend, "w", everything)
    backend.close()
    backend = open_backend(tmp_path / "env", options=_options(), seed=0, tables=[WIDE])
    oracle.check(backend, "w", everything)
    backend.close()


@pytest.mark.parametrize(("threads", "join_blocks"), [(1, 1024), (1, 3), (4, 2)])
def test_reads_take_rows_out_of_blocks_joined_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, join_blocks: int
) -> None:
    """A read takes each row out of its block inside the read's transaction (the block viewed in the map,
    not copied), joining ``JOIN_BLOCKS`` blocks at a time: rows of many blocks and segments, read whole,
    in pieces, in any order and with ids that were never written, equal a dict oracle's, on one reader
    thread and split over several."""
    monkeypatch.setattr(log_format, "JOIN_BLOCKS", join_blocks)
    backend = open_backend(
        tmp_path / "env", options=_options(read_threads=threads, read_split="always"), seed=0, tables=[WIDE]
    )
    rng, oracle = np.random.default_rng(5), _Oracle()
    oracle.rows["w"] = {}
    for _ in range(40):  # every write starts a block: blocks of 1..5 rows over many segments
        ids = np.unique(rng.integers(0, 300, size=int(rng.integers(1, 12)))).astype(np.int64) * 7
        rows = rng.standard_normal((ids.shape[0], WIDE.row_floats)).astype(np.float32)
        backend.put_rows([("w", ids, rows)])
        oracle.put("w", ids, rows)
    stored = np.array(sorted(oracle.rows["w"]), dtype=np.int64)
    assert len(backend.log._tables["w"].segs) > 2
    for ids in (stored, rng.permutation(stored), stored[::3], np.concatenate([stored[:5], [1, 2]])):
        found, got = backend.get_rows("w", ids)
        assert np.array_equal(found, np.isin(ids, stored))
        want = np.stack([oracle.rows["w"][i] for i in ids[found].tolist()])
        assert np.array_equal(got, want)
    backend.close()


@pytest.mark.parametrize("walk_blocks", [1024, 2])
def test_compaction_refuses_a_segment_with_a_missing_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walk_blocks: int
) -> None:
    monkeypatch.setattr(lmdb_log, "WALK_BLOCKS", walk_blocks)
    backend = open_backend(tmp_path / "env", options=_options(), seed=0, tables=[WIDE])
    ids = np.arange(50, dtype=np.int64)  # one full segment: blocks 0..9
    rows = np.arange(50 * WIDE.row_floats, dtype=np.float32).reshape(50, -1)
    backend.put_rows([("w", ids, rows)])
    backend.put_rows([("w", ids[:20], rows[:20] + 1)])  # blocks 0..3 dead, the segment sealed
    log = backend.log
    assert log is not None
    t = log._tables["w"]
    with backend._env.begin(write=True) as txn:
        txn.delete((6).to_bytes(8, "big"), db=t.segs[0])  # rows 30..34
    with pytest.raises(StoreCorruptError, match="blocks .* of log segment 0 are not all there"):
        log.compact("w", 0)
    assert 0 in t.segs  # nothing was dropped
    found, got = backend.get_rows("w", ids[20:30])
    assert found.all() and np.array_equal(got, rows[20:30])
    backend.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_read_refuses_a_block_the_index_points_at_that_is_missing(tmp_path: Path, threads: int) -> None:
    backend = open_backend(
        tmp_path / "env", options=_options(read_threads=threads, read_split="always"), seed=0, tables=[WIDE]
    )
    ids = np.arange(50, dtype=np.int64) * 11  # blocks 0..9 of segment 0
    rows = np.arange(50 * WIDE.row_floats, dtype=np.float32).reshape(50, -1)
    backend.put_rows([("w", ids, rows)])
    log = backend.log
    assert log is not None
    with backend._env.begin(write=True) as txn:
        txn.delete((6).to_bytes(8, "big"), db=log._tables["w"].segs[0])  # rows 30..34
    found, got = backend.get_rows("w", ids[:30])  # the blocks that are there still read
    assert found.all() and np.array_equal(got, rows[:30])
    with pytest.raises(StoreCorruptError, match="points at blocks that are missing"):
        backend.get_rows("w", ids)
    backend.close()


def test_damaged_runs_are_refused(tmp_path: Path) -> None:
    backend = _open(tmp_path / "env")
    backend.put_rows([("u", np.array([3, 9]), np.ones((2, 4), np.float32))])
    with backend._env.begin(write=True) as txn:  # a run record of the wrong length
        db = backend.log._tables["u"].runs_db
        txn.put((0).to_bytes(8, "big"), b"\x01\x02\x03", db=db)
    backend.close()
    with pytest.raises(StoreCorruptError, match="damaged run record"):
        _open(tmp_path / "env")


@pytest.mark.parametrize("index", [DenseSeqIndex(10_000), HashSeqIndex(4), SortedSeqIndex(merge_min=64)])
def test_seq_index_upserts_like_a_dict(index) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    oracle: dict[int, int] = {}
    for step in range(50):  # sequence numbers pass 2^32 half way (the indexes widen their values)
        ids = np.unique(rng.integers(0, 10_000, size=int(rng.integers(1, 400))))
        seqs = rng.integers(0, 1 << (30 if step < 25 else 40), size=ids.shape[0])
        old = index.upsert(ids, seqs)
        assert old.tolist() == [oracle.get(i, -1) for i in ids.tolist()]
        oracle.update(zip(ids.tolist(), seqs.tolist(), strict=True))
        q = rng.integers(0, 10_000, size=500)
        assert index.lookup(q).tolist() == [oracle.get(i, -1) for i in q.tolist()]
        assert len(index) == len(oracle)
    ids, seqs = index.items()
    assert dict(zip(ids.tolist(), seqs.tolist(), strict=True)) == oracle


def test_sorted_seq_index_through_directory_splits() -> None:
    """700 k hashed ids: the directory doubles (past 8 ids a bucket), the arrays grow and merge many
    times; every id keeps its newest number (a dict oracle)."""
    rng = np.random.default_rng(5)
    index, want = SortedSeqIndex(), {}
    pool = np.unique(rng.integers(0, 1 << 63, size=700_000, dtype=np.int64))
    seq = 0
    for step in range(60):
        pick = pool[: (step + 1) * pool.shape[0] // 60]  # the known ones again, and new ones
        ids = np.unique(pick[rng.integers(0, pick.shape[0], size=20_000)])
        ids = np.union1d(ids, pool[step * pool.shape[0] // 60 : (step + 1) * pool.shape[0] // 60])
        old = index.upsert(ids, np.arange(seq, seq + ids.shape[0]))
        assert np.array_equal(old, np.array([want.get(i, -1) for i in ids.tolist()]))
        want.update(zip(ids.tolist(), range(seq, seq + ids.shape[0]), strict=True))
        seq += ids.shape[0]
    assert int(64 - index._shift) >= 17 and len(index) == pool.shape[0] == len(want)
    q = np.concatenate([pool[rng.integers(0, pool.shape[0], 5000)], rng.integers(0, 1 << 63, 5000)])
    assert index.lookup(q).tolist() == [want.get(i, -1) for i in q.tolist()]
    ids, seqs = index.items()
    order = np.argsort(ids)
    assert np.array_equal(ids[order], pool)
    assert np.array_equal(seqs[order], np.array([want[i] for i in pool.tolist()]))
    hashed = HashSeqIndex()
    hashed.upsert(ids, seqs)
    assert index.nbytes() < 0.8 * hashed.nbytes()  # the delta's fixed 2^17 cells weigh most here


def _kill_in_compaction(tmp_path: Path, seed: int, kills: int) -> None:
    """Run the child, SIGKILLed inside its n-th compaction, ``kills`` times; after each kill the reopened
    store must be the oracle after some batch, at least the last one a finished run wrote."""
    store = tmp_path / "store"
    store.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), *sys.path])}
    done = -1  # last batch known committed
    for _ in range(kills):
        n = int(rng.integers(1, 12))
        child = subprocess.run(
            [sys.executable, str(Path(log_child.__file__)), str(store), str(seed), str(done + 1), "60"],
            env={**env, "TIERREC_FAULT": f"compact:kill:{n}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert child.returncode == -9, (child.returncode, child.stderr[-2000:])
        backend = log_child.open_backend(store)
        ids, rows = backend.scan("t", after=-1, limit=1 << 30)
        backend.close()
        upto = int(rows[:, 1].max())
        assert done <= upto < done + 61
        want = log_child.expected(seed, upto)
        assert ids.tolist() == sorted(want)
        assert np.array_equal(rows, np.array([want[i] for i in ids.tolist()], dtype=np.float32))
        done = upto


def test_sigkill_inside_compaction_leaves_a_committed_prefix(tmp_path: Path) -> None:
    _kill_in_compaction(tmp_path, seed=0, kills=2)


@pytest.mark.slow
def test_sigkill_inside_compaction_many_times(tmp_path: Path) -> None:
    for seed in range(3):
        _kill_in_compaction(tmp_path / str(seed), seed=seed, kills=6)


@pytest.mark.parametrize("sizes", [(16, 16, 16), (13, 11, 19), (5, 3, 40)])
def test_compaction_reads_a_segment_whose_blocks_have_gaps_where_tombstones_are(tmp_path, sizes):
    """Tombstones take sequence numbers but write no blocks, so a segment's block numbers can have gaps
    (after full blocks or after a write's short last block); compacting it keeps every live row exact (it
    used to stop at the gap as a corrupt segment, or misread a short block)."""
    from embedding_store.backends import open_backend

    wide = TableSpec(name="w", dim=60, optimizer=OptimizerKind.EXACT_SGD)  # 8 rows a block
    options = LmdbOptions(log_segment_rows=64, log_compact_at=0.2)
    want: dict[int, np.ndarray] = {}

    def put(backend, ids, shift=0.0):
        rows = np.repeat(ids[:, None].astype(np.float32), wide.row_floats, axis=1) + shift
        backend.put_rows([("w", ids, rows)])
        want.update(zip(ids.tolist(), rows, strict=True))

    first, gone, then = sizes
    backend = open_backend(tmp_path / "s", options=options, seed=0, tables=[wide])
    put(backend, np.arange(first))
    put(backend, np.arange(200, 200 + gone))
    backend.delete_rows("w", np.arange(200, 200 + gone))  # their tombstones' sequence numbers: no blocks
    for i in range(200, 200 + gone):
        del want[i]
    put(backend, np.arange(first, first + then))
    for k in range(40):  # the odd ids rewritten until the first segments are compacted
        put(backend, np.arange(1, first + then, 2), float(k))
    assert backend.log.stats.compactions > 0
    for reopen in (False, True):
        if reopen:
            backend.close()
            backend = open_backend(tmp_path / "s", options=options, seed=0, tables=[wide])
        ids = np.array(sorted(want), dtype=np.int64)
        found, rows = backend.get_rows("w", ids)
        assert found.all() and np.array_equal(rows, np.stack([want[i] for i in ids.tolist()]))
        assert not backend.get_rows("w", np.arange(200, 216))[0].any()
    backend.close()


def test_compaction_does_not_misread_blocks_after_a_gap_inside_its_walk(tmp_path):
    """A gap in a segment's block numbers inside the walked span, with more blocks after the span than
    the gap is wide: the walk gets as many blocks as it asked for, but shifted past the gap. Compaction
    must notice (the walk does not end on the span's last block) and read the span by key."""
    from embedding_store.backends import open_backend

    wide = TableSpec(name="w", dim=60, optimizer=OptimizerKind.EXACT_SGD)  # 8 rows a block
    options = LmdbOptions(log_segment_rows=128, log_compact_at=0.95)  # compaction only when asked
    want: dict[int, np.ndarray] = {}

    def put(backend, ids, shift=0.0):
        rows = np.repeat(ids[:, None].astype(np.float32), wide.row_floats, axis=1) + shift
        backend.put_rows([("w", ids, rows)])
        want.update(zip(ids.tolist(), rows, strict=True))

    backend = open_backend(tmp_path / "s", options=options, seed=0, tables=[wide])
    put(backend, np.arange(16))  # blocks 0, 1
    put(backend, np.arange(200, 216))  # blocks 2, 3
    backend.delete_rows("w", np.arange(200, 216))  # tombstones: sequence numbers of blocks 4, 5
    for i in range(200, 216):
        del want[i]
    put(backend, np.arange(16, 96))  # blocks 6..15: the segment is full
    put(backend, np.arange(24, 96), 0.5)  # segment 1; blocks 7..15 die: segment 0's live rows end in block 6
    backend.log.compact("w", 0)  # walks blocks 0..6: seven blocks come back, 0-3 and 6-8
    for reopen in (False, True):
        if reopen:
            backend.close()
            backend = open_backend(tmp_path / "s", options=options, seed=0, tables=[wide])
        ids = np.array(sorted(want), dtype=np.int64)
        found, rows = backend.get_rows("w", ids)
        assert found.all() and np.array_equal(rows, np.stack([want[i] for i in ids.tolist()]))
    backend.close()
