"""The RowBackend contract (embedding_store/backends/base.py), one suite for the memory, B-tree and log
backends, each against a dict oracle: read-your-writes, ascending scans, deletes, snapshots, reopening,
a full store, and refusals of another seed or table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreFullError,
    StoreIncompatibleError,
    TableSpec,
    restore_snapshot,
)
from embedding_store.backends import RowBackend, open_backend, open_snapshot

LAYOUTS = ("memory", "btree", "log")
BOUNDED = TableSpec(name="b", dim=3, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, num_embeddings=4000)
UNBOUNDED = TableSpec(name="u", dim=5, optimizer=OptimizerKind.EXACT_SGD)
TABLES = (BOUNDED, UNBOUNDED)
SEED = 11


def _options(layout: str, **kw: object) -> LmdbOptions:
    # Small log segments: compaction (and its tombstone copies) runs in every test of the log layout.
    kw.setdefault("log_segment_rows", 64)
    return LmdbOptions(layout=layout, initial_map_size_bytes=1 << 20, **kw)  # type: ignore[arg-type]


def _open(path: Path, layout: str, **kw: object) -> RowBackend:
    return open_backend(path, options=_options(layout, **kw), seed=SEED, tables=TABLES)


def _rows(rng: np.random.Generator, spec: TableSpec, n: int) -> np.ndarray:
    """Rows of arbitrary bits (NaNs included): only an exact copy compares equal."""
    return (
        rng.integers(0, 1 << 32, size=(n, spec.row_floats), dtype=np.uint64)
        .astype(np.uint32)
        .view(np.float32)
    )


def _ids(rng: np.random.Generator, spec: TableSpec, n: int) -> np.ndarray:
    high = spec.num_embeddings or (1 << 40)
    return np.unique(rng.integers(0, 300, size=n) * (high // 300))


class Oracle:
    def __init__(self) -> None:
        self.rows: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in TABLES}

    def put(self, backend: RowBackend, spec: TableSpec, ids: np.ndarray, rows: np.ndarray) -> None:
        backend.put_rows([(spec.name, ids, rows)])
        self.rows[spec.name].update(zip(ids.tolist(), rows.copy(), strict=True))

    def delete(self, backend: RowBackend, spec: TableSpec, ids: np.ndarray) -> None:
        backend.delete_rows(spec.name, ids)
        for i in ids.tolist():
            self.rows[spec.name].pop(i, None)

    def want(self, spec: TableSpec, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        have = self.rows[spec.name]
        found = np.array([i in have for i in ids.tolist()], dtype=bool)
        kept = [have[i] for i in ids.tolist() if i in have]
        return found, np.array(kept, dtype=np.float32).reshape(len(kept), spec.row_floats)

    def check(self, backend: RowBackend, rng: np.random.Generator) -> None:
        for spec in TABLES:
            have = self.rows[spec.name]
            probe = np.unique(np.concatenate([np.array(sorted(have), dtype=np.int64), _ids(rng, spec, 50)]))
            found, rows = backend.get_rows(spec.name, probe)
            want_found, want_rows = self.want(spec, probe)
            assert np.array_equal(found, want_found), spec.name
            assert rows.view(np.uint32).tolist() == want_rows.view(np.uint32).tolist(), spec.name
            assert backend.num_rows(spec.name) == len(have)
            ids, rows = _scan_all(backend, spec.name, limit=int(rng.integers(1, 40)))
            assert ids.tolist() == sorted(have)
            assert rows.view(np.uint32).tolist() == self.want(spec, ids)[1].view(np.uint32).tolist()


def _scan_all(backend: RowBackend, table: str, *, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row by pages of ``limit`` (each page ascending, past the last page's end)."""
    parts, after = [], -1
    while True:
        ids, rows = backend.scan(table, after=after, limit=limit)
        assert ids.shape[0] <= limit and (np.diff(ids) > 0).all() and (ids > after).all()
        if ids.shape[0]:
            parts.append((ids, rows))
            after = int(ids[-1])
        if ids.shape[0] < limit:
            break
    if not parts:
        return np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.float32)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


def test_read_your_writes_and_a_later_put_wins(tmp_path: Path, layout: str) -> None:
    rng, oracle = np.random.default_rng(1), Oracle()
    backend = _open(tmp_path / "s", layout)
    for _ in range(30):
        for spec in TABLES:
            ids = _ids(rng, spec, int(rng.integers(1, 60)))
            oracle.put(backend, spec, ids, _rows(rng, spec, ids.shape[0]))
            found, rows = backend.get_rows(spec.name, ids)  # the write just made, read back exactly
            assert (
                found.all()
                and rows.view(np.uint32).tolist() == oracle.want(spec, ids)[1].view(np.uint32).tolist()
            )
    oracle.check(backend, rng)
    backend.close()


def test_scans_ascend_from_after_in_pages_of_limit(tmp_path: Path, layout: str) -> None:
    rng, oracle = np.random.default_rng(2), Oracle()
    backend = _open(tmp_path / "s", layout)
    ids = np.array([3, 4, 9, 100, 101, 102, 4000 - 1])
    oracle.put(backend, BOUNDED, ids, _rows(rng, BOUNDED, ids.shape[0]))
    got, _ = backend.scan("b", after=-1, limit=3)
    assert got.tolist() == [3, 4, 9]
    got, _ = backend.scan("b", after=4, limit=3)  # strictly after
    assert got.tolist() == [9, 100, 101]
    got, rows = backend.scan("b", after=101, limit=100)
    assert got.tolist() == [102, 3999] and np.array_equal(
        rows.view(np.uint32), oracle.want(BOUNDED, got)[1].view(np.uint32)
    )
    assert backend.scan("b", after=3999, limit=5)[0].shape[0] == 0
    assert backend.scan("u", after=-1, limit=5)[0].shape[0] == 0  # an empty table
    backend.close()


def test_deletes_then_reads_scans_counts_and_puts_again(tmp_path: Path, layout: str) -> None:
    rng, oracle = np.random.default_rng(3), Oracle()
    backend = _open(tmp_path / "s", layout)
    ids = np.arange(0, 400, 2)
    oracle.put(backend, BOUNDED, ids, _rows(rng, BOUNDED, ids.shape[0]))
    oracle.delete(backend, BOUNDED, np.arange(0, 100, 2))
    found, _ = backend.get_rows("b", np.arange(0, 100, 2))
    assert not found.any() and backend.num_rows("b") == 150
    oracle.delete(backend, BOUNDED, np.array([1, 3, 2000, 3999]))  # never stored: nothing happens
    oracle.delete(backend, BOUNDED, np.arange(0, 100, 2))  # deleted already: nothing happens
    oracle.delete(backend, BOUNDED, np.empty(0, dtype=np.int64))
    assert backend.num_rows("b") == 150
    oracle.check(backend, rng)
    again = np.arange(0, 50, 2)  # put back after the delete: found, with the new rows
    oracle.put(backend, BOUNDED, again, _rows(rng, BOUNDED, again.shape[0]))
    oracle.check(backend, rng)
    backend.close()
    backend = _open(tmp_path / "s", layout)  # deletes and puts after them survive a reopen
    oracle.check(backend, rng)
    backend.close()


@pytest.mark.parametrize("seed", range(3))
def test_random_puts_deletes_and_reopens_follow_the_oracle(tmp_path: Path, layout: str, seed: int) -> None:
    """Many small writes and deletes over few ids: the log layout compacts all along (tombstones among
    the dead records), and every reopen rebuilds the same rows from what is on disk."""
    rng, oracle = np.random.default_rng(seed), Oracle()
    backend = _open(tmp_path / "s", layout)
    for step in range(120):
        spec = TABLES[int(rng.integers(0, 2))]
        ids = _ids(rng, spec, int(rng.integers(1, 30)))
        if rng.random() < 0.3:
            oracle.delete(backend, spec, ids)
        else:
            oracle.put(backend, spec, ids, _rows(rng, spec, ids.shape[0]))
        if step % 40 == 39:
            oracle.check(backend, rng)
            backend.close()
            backend = _open(tmp_path / "s", layout)
    oracle.check(backend, rng)
    backend.close()


def test_a_snapshot_reads_back_read_only_and_restores(tmp_path: Path, layout: str) -> None:
    rng, oracle = np.random.default_rng(4), Oracle()
    backend = _open(tmp_path / "s", layout)
    for spec in TABLES:
        ids = _ids(rng, spec, 200)
        oracle.put(backend, spec, ids, _rows(rng, spec, ids.shape[0]))
        oracle.delete(backend, spec, ids[::5])
    (tmp_path / "snap").mkdir()
    backend.snapshot(tmp_path / "snap")
    oracle.put(backend, BOUNDED, np.array([1]), _rows(rng, BOUNDED, 1))  # after the snapshot: not in it
    backend.close()
    del oracle.rows["b"][1]
    before = sorted(p.name for p in (tmp_path / "snap").iterdir())
    reader = open_snapshot(tmp_path / "snap", seed=SEED, tables=TABLES)
    assert reader.seed == SEED and reader.layout == layout and set(reader.tables) == {"b", "u"}
    for spec in TABLES:
        chunks = list(reader.chunks(spec, chunk_rows=17))
        assert all(c[0].shape[0] <= 17 for c in chunks)
        ids = np.concatenate([c[0] for c in chunks])
        rows = np.concatenate([c[1] for c in chunks])
        assert ids.tolist() == sorted(oracle.rows[spec.name])
        assert rows.view(np.uint32).tolist() == oracle.want(spec, ids)[1].view(np.uint32).tolist()
    assert list(reader.chunks(TableSpec(name="other", dim=3), chunk_rows=5)) == []
    with pytest.raises(StoreIncompatibleError):
        list(reader.chunks(TableSpec(name="b", dim=4, num_embeddings=4000), chunk_rows=5))
    reader.close()
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == before  # nothing written
    with pytest.raises(StoreIncompatibleError, match="seed"):
        open_snapshot(tmp_path / "snap", seed=SEED + 1)
    restore_snapshot(tmp_path / "snap", tmp_path / "restored")
    backend = _open(tmp_path / "restored", layout)
    oracle.check(backend, rng)
    backend.close()


def test_a_full_store_refuses_a_write_and_applies_nothing(tmp_path: Path, layout: str) -> None:
    rng, oracle = np.random.default_rng(5), Oracle()
    cap = 1 << 20
    backend = _open(tmp_path / "s", layout, max_map_size_bytes=cap, log_segment_rows=1 << 16)
    ids = np.arange(1000)
    oracle.put(backend, UNBOUNDED, ids, _rows(rng, UNBOUNDED, ids.shape[0]))
    big = np.arange(10_000, 10_000 + cap // UNBOUNDED.row_bytes)  # more rows than the cap holds
    with pytest.raises(StoreFullError):
        backend.put_rows(
            [("b", np.array([5]), _rows(rng, BOUNDED, 1)), ("u", big, _rows(rng, UNBOUNDED, big.shape[0]))]
        )
    oracle.check(backend, rng)  # neither group was applied
    oracle.put(backend, UNBOUNDED, np.array([7]), _rows(rng, UNBOUNDED, 1))  # a write that fits still does
    oracle.check(backend, rng)
    backend.close()
    backend = _open(tmp_path / "s", layout, max_map_size_bytes=cap, log_segment_rows=1 << 16)
    oracle.check(backend, rng)
    backend.close()


def test_another_seed_or_table_is_refused(tmp_path: Path, layout: str) -> None:
    backend = _open(tmp_path / "s", layout)
    backend.put_rows([("b", np.array([1, 2]), np.ones((2, BOUNDED.row_floats), np.float32))])
    backend.close()
    with pytest.raises(StoreIncompatibleError, match="seed"):
        open_backend(tmp_path / "s", options=_options(layout), seed=SEED + 1, tables=TABLES)
    for other in (
        TableSpec(name="b", dim=4, optimizer=BOUNDED.optimizer, num_embeddings=4000),
        TableSpec(name="b", dim=3, optimizer=OptimizerKind.EXACT_ADAGRAD, num_embeddings=4000),
        TableSpec(name="b", dim=3, optimizer=BOUNDED.optimizer, num_embeddings=5000),
    ):
        with pytest.raises(StoreIncompatibleError, match="'b'"):
            open_backend(tmp_path / "s", options=_options(layout), seed=SEED, tables=[other])
    backend = open_backend(tmp_path / "s", options=_options(layout), seed=SEED, tables=[BOUNDED])
    found, _ = backend.get_rows("b", np.array([1, 2, 3]))
    assert found.tolist() == [True, True, False]  # the refusals changed nothing
    backend.close()


def test_a_store_keeps_the_layout_it_was_made_with(tmp_path: Path, layout: str) -> None:
    backend = _open(tmp_path / "s", layout)
    backend.put_rows([("b", np.array([1]), np.ones((1, BOUNDED.row_floats), np.float32))])
    backend.close()
    for asked in LAYOUTS:
        backend = _open(tmp_path / "s", asked)
        reader_layout = type(backend).__name__
        assert backend.get_rows("b", np.array([1]))[0].all(), (layout, asked, reader_layout)
        backend.close()
        reader = open_snapshot(tmp_path / "s", seed=SEED)
        assert reader.layout == layout
        reader.close()


def test_log_a_tombstone_outlives_the_compaction_of_its_segment(tmp_path: Path) -> None:
    """A delete's tombstone lands in a newer segment than the row it hides; when that segment is
    compacted first, the tombstone is copied to the head, so a reopen (which replays the runs) does not
    bring the row back from the older segment."""
    wide = TableSpec(name="w", dim=60, optimizer=OptimizerKind.EXACT_SGD)  # 8 rows a block
    options = LmdbOptions(log_segment_rows=64, log_compact_at=0.2)
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[wide])
    rows = np.arange(64 * wide.row_floats, dtype=np.float32).reshape(64, -1)
    backend.put_rows([("w", np.arange(64), rows)])  # segment 0, all live but id 0 after the delete
    backend.delete_rows("w", np.array([0]))  # its tombstone: segment 1
    for k in range(20):  # one id rewritten, a block each: its segments die and are compacted
        backend.put_rows([("w", np.array([100]), rows[:1] + k)])
    log = backend.log  # type: ignore[attr-defined]
    segs = log._tables["w"].segs
    assert log.stats.compactions > 0 and 1 in segs
    log.compact("w", 1)  # the tombstone's segment (dead but for it), before segment 0
    assert 1 not in segs and 0 in segs  # segment 0, older, holds id 0's record still
    assert not backend.get_rows("w", np.array([0]))[0].any()
    backend.close()
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[wide])
    found, got = backend.get_rows("w", np.arange(64))
    assert found.tolist() == [False] + [True] * 63 and np.array_equal(got, rows[1:])
    assert backend.num_rows("w") == 64  # ids 1..63 and 100
    backend.close()


def test_log_forgets_a_deleted_id_only_once_no_record_of_it_is_left(tmp_path: Path) -> None:
    """A deleted id's tombstone is dropped (and the index forgets the id) when its segment is compacted
    and every put of the id is older than the oldest segment left; while an older put is on disk, the
    tombstone goes to the head, so a reopen never brings that put back."""
    wide = TableSpec(name="w", dim=60, optimizer=OptimizerKind.EXACT_SGD)  # 8 rows a block
    options = LmdbOptions(log_segment_rows=64, log_compact_at=0.95)  # compaction only when asked
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[wide])
    log = backend.log  # type: ignore[attr-defined]
    t = log._tables["w"]
    rows = np.arange(64 * wide.row_floats, dtype=np.float32).reshape(64, -1)
    backend.put_rows([("w", np.arange(64), rows)])  # segment 0: id 0's first put among them
    backend.put_rows([("w", np.arange(1), rows[:1] + 1)])  # segment 1: id 0's newest put
    backend.put_rows([("w", np.arange(1000, 1063), rows[:63])])  # fills segment 1
    backend.delete_rows("w", np.array([0]))  # segment 2: the tombstone
    backend.put_rows([("w", np.arange(2000, 2070), np.tile(rows[:1], (70, 1)))])
    assert sorted(t.segs) == [0, 1, 2, 3]
    log.compact("w", 1)  # id 0's newest put (dead) is gone, its first put in segment 0 is not
    log.compact("w", 2)  # so the tombstone is carried to the head and the index keeps id 0
    assert log.stats.forgotten_ids == 0 and t.index.lookup(np.array([0]))[0] >= 0
    backend.close()
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[wide])
    log = backend.log  # type: ignore[attr-defined]
    assert not backend.get_rows("w", np.array([0]))[0].any()
    log.compact("w", 0)  # the first put goes too: the carried tombstone hides nothing left
    tomb_seg = int(log._tables["w"].deleted.tomb_of(np.array([0]))[0]) // 64
    backend.put_rows([("w", np.arange(3000, 3200), np.tile(rows[:1], (200, 1)))])  # seals its segment
    log.compact("w", tomb_seg)
    assert log.stats.forgotten_ids == 1 and log._tables["w"].index.lookup(np.array([0]))[0] == -1
    assert len(log._tables["w"].deleted) == 0 and backend.num_rows("w") == 63 + 63 + 70 + 200
    backend.close()
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[wide])
    assert not backend.get_rows("w", np.array([0]))[0].any() and backend.num_rows("w") == 396
    backend.close()


def test_log_under_churn_of_new_ids_stays_bounded(tmp_path: Path) -> None:
    """Rows that are put once and deleted (a capped table's churn): the log's rows stay within
    1 / (1 - compact_at) of the live ones plus the open segments, and the index and the tombstones stay
    bounded (an index that never forgot a deleted id grew with every delete)."""
    rng, oracle = np.random.default_rng(5), Oracle()
    backend = _open(tmp_path / "s", "log", log_compact_at=0.25)
    t = backend.log._tables["u"]  # type: ignore[attr-defined]
    live, first = 400, 0
    for _ in range(150):
        ids = np.arange(first, first + 60, dtype=np.int64) * 7
        first += 60
        oracle.put(backend, UNBOUNDED, ids, _rows(rng, UNBOUNDED, 60))
        have = np.array(sorted(oracle.rows["u"]), dtype=np.int64)
        if have.shape[0] > live:
            oracle.delete(backend, UNBOUNDED, have[: have.shape[0] - live])
        records = sum(t.alive.records.values())
        tombs = sum(t.alive.tombs.values())
        assert records - tombs <= live / 0.75 + 2 * 64
        assert tombs <= live + 4 * 64 and len(t.index) <= 2 * live + 4 * 64
    assert backend.log.stats.forgotten_ids > 5 * live  # type: ignore[attr-defined]
    oracle.check(backend, rng)
    backend.close()
    backend = _open(tmp_path / "s", "log", log_compact_at=0.25)
    oracle.check(backend, rng)
    backend.close()
