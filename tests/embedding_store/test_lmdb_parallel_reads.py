"""Reads split across the LMDB backend's reader threads (``LmdbOptions.read_threads``) return what one
transaction in the calling thread returns: the same found mask and the same bits of every row, in id order,
checked against a dict oracle, while the writer commits and the map grows, and after close."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from embedding_store import LmdbOptions, OptimizerKind, StoreError, TableSpec
from embedding_store.backends import RowBackend, open_backend
from embedding_store.backends.lmdb_threads import ReaderPool

DIM = 3
UNBOUNDED = TableSpec(name="u", dim=DIM, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
BOUNDED = TableSpec(name="b", dim=DIM, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, num_embeddings=1 << 16)
SPACE = 1 << 16  # ids drawn from [0, SPACE): about half of them stored
SIZES = (0, 1, 2, 63, 127, 128, 129, 500, 1000, 4097)


def _open(path, threads: int, **options) -> RowBackend:
    """A backend whose reads of 128 keys or more are split whether or not they fault (this file's pages
    are cached: under the default "auto" they would all stay in the calling thread)."""
    options.setdefault("read_split", "always")
    return open_backend(
        path, options=LmdbOptions(read_threads=threads, **options), seed=0, tables=[UNBOUNDED, BOUNDED]
    )


def _random_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows of arbitrary bits (NaNs and infinities included): only an exact copy compares equal."""
    return rng.integers(0, 1 << 32, size=(n, DIM + 1), dtype=np.uint64).astype(np.uint32).view(np.float32)


def _expect(oracle: dict[int, np.ndarray], ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    found = np.array([int(i) in oracle for i in ids], dtype=bool)
    rows = [oracle[int(i)] for i in ids if int(i) in oracle]
    return found, np.array(rows, dtype=np.float32).reshape(len(rows), DIM + 1)


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return bool(
        np.array_equal(a[0], b[0])
        and a[1].shape == b[1].shape
        and np.array_equal(a[1].view(np.uint32), b[1].view(np.uint32))
    )


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tierrec-lmdb-read")]


@pytest.mark.parametrize("unmap_every_rows", [None, 300])
def test_parallel_reads_equal_sequential_reads_and_the_oracle(tmp_path, unmap_every_rows) -> None:
    rng = np.random.default_rng(7)
    before = len(_reader_threads())
    sequential = _open(tmp_path / "seq", 1, unmap_every_rows=unmap_every_rows)
    parallel = _open(tmp_path / "par", 8, unmap_every_rows=unmap_every_rows)
    oracles: dict[str, dict[int, np.ndarray]] = {"u": {}, "b": {}}
    for _ in range(3):  # several transactions: rows overwritten, ids added
        for name in ("u", "b"):
            ids = np.unique(rng.integers(0, SPACE, size=SPACE // 4))
            rows = _random_rows(rng, ids.shape[0])
            for backend in (sequential, parallel):
                backend.put_rows([(name, ids, rows)])
            oracles[name].update(zip(ids.tolist(), rows, strict=True))
    for name, oracle in oracles.items():
        for n in SIZES:
            for _ in range(3):
                ids = np.unique(rng.integers(0, SPACE, size=n))
                want = _expect(oracle, ids)
                assert 0 < want[0].sum() < n or n < 10  # stored and missing ids in one read
                assert _same(sequential.get_rows(name, ids), want), (name, n)
                assert _same(parallel.get_rows(name, ids), want), (name, n)
        every = np.arange(SPACE, dtype=np.int64)  # the whole id space in one read: many runs
        assert _same(parallel.get_rows(name, every), sequential.get_rows(name, every))
        assert _same(parallel.get_rows(name, every), _expect(oracle, every))
    started = len(_reader_threads()) - before
    assert 1 <= started <= 7  # the split reads ran on the pool: at most 7 threads beside the caller's
    sequential.close()
    parallel.close()
    assert len(_reader_threads()) == before  # close() stopped them


def test_reads_during_commits_and_map_growth_see_whole_rows_that_only_get_newer(tmp_path) -> None:
    """A writer overwrites rows with rising versions (row = id, version, ...) in a map that starts at
    64 KiB and grows many times; readers on two threads check every row they get: its own id, a version
    written for it, never older than what the same reader saw before, never missing once found."""
    backend = _open(tmp_path / "env", 8, initial_map_size_bytes=1 << 16)
    space = 200_000
    ids_all = np.arange(0, space, 2, dtype=np.int64)  # even ids only: the odd ones stay missing
    start_map = backend.map_size_bytes()
    versions = 12
    done = threading.Event()
    errors: list[BaseException] = []

    def rows_for(ids: np.ndarray, version: int) -> np.ndarray:
        rows = np.zeros((ids.shape[0], DIM + 1), dtype=np.float32)
        rows[:, 0], rows[:, 1] = ids, version
        return rows

    def write() -> None:
        rng = np.random.default_rng(1)
        try:
            for version in range(versions):
                part = ids_all[: (version + 1) * ids_all.shape[0] // versions]  # more ids every version
                ids = np.sort(rng.choice(part, size=min(part.shape[0], 20_000), replace=False))
                backend.put_rows([("u", ids, rows_for(ids, version))])
        except BaseException as err:
            errors.append(err)
        finally:
            done.set()

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        seen = np.full(space, -1.0, dtype=np.float32)  # newest version read per id, -1: not found yet
        try:
            while not done.is_set():
                ids = np.unique(rng.integers(0, space, size=3000))
                found, rows = backend.get_rows("u", ids)
                got = ids[found]
                assert not (found & (ids % 2 == 1)).any()
                assert np.array_equal(rows[:, 0], got.astype(np.float32))
                assert (rows[:, 1] >= seen[got]).all()  # never older than before
                assert (seen[ids[~found]] < 0).all()  # never missing once found
                seen[got] = rows[:, 1]
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write), *(threading.Thread(target=read, args=(s,)) for s in (2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert backend.map_size_bytes() >= 32 * start_map  # the map grew (at least 5 times) under the reads
    backend.close()


def test_reads_after_close_raise(tmp_path) -> None:
    backend = _open(tmp_path / "env", 4)
    ids = np.arange(1000, dtype=np.int64)
    backend.put_rows([("u", ids, np.zeros((1000, DIM + 1), dtype=np.float32))])
    assert backend.get_rows("u", ids)[0].all()
    backend.close()
    backend.close()  # idempotent
    for n in (10, 1000):  # one transaction, and a split read
        with pytest.raises(StoreError):
            backend.get_rows("u", ids[:n])


@pytest.mark.parametrize("threads", [1, 2, 7, 16])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 127, 128, 129, 1000, 1023, 5000])
def test_runs_cover_the_keys_in_order(threads, n) -> None:
    runs = ReaderPool(threads, min_run=64).runs(n)
    assert runs[0].start == 0 and runs[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(runs, runs[1:], strict=False))
    assert len(runs) == max(1, min(threads, n // 64))
    assert len(runs) == 1 or min(r.stop - r.start for r in runs) >= 64


@pytest.mark.parametrize("bad", [0, -1, 257, 1.5, True, None])
def test_read_threads_is_checked(bad) -> None:
    with pytest.raises(ValueError, match="read_threads"):
        LmdbOptions(read_threads=bad)


class _FakeFaults:
    """Major faults that ``read`` reports per run, counted per thread as ``getrusage(RUSAGE_THREAD)`` is."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.faults_per_key = 0.0
        self.threads: list[tuple[slice, int]] = []

    def count(self) -> int:
        return getattr(self.local, "n", 0)

    def read(self, run: slice) -> list[int]:
        self.local.n = self.count() + int(self.faults_per_key * (run.stop - run.start))
        self.threads.append((run, threading.get_ident()))
        return list(range(run.start, run.stop))


def test_auto_split_reads_in_the_caller_until_reads_fault_then_splits_until_they_stop() -> None:
    fake = _FakeFaults()
    pool = ReaderPool(8, min_run=64, major_faults=fake.count)
    runs = pool.runs(1000)
    assert len(runs) == 8
    me = threading.get_ident()

    def read_all() -> list[int]:
        fake.threads.clear()
        got = pool.map(fake.read, runs)
        assert [x for run in got for x in run] == list(range(1000))  # the runs' values, in order
        return [ident for _, ident in sorted(fake.threads, key=lambda p: p[0].start)]

    assert set(read_all()) == {me} and not pool.faulting  # cached: every run in the calling thread
    fake.faults_per_key = 0.25  # the disk serves the reads now
    idents = read_all()
    # The first run faulted: the caller reads the next one while the pool reads the other six.
    assert idents[:2] == [me, me] and me not in idents[2:]
    assert pool.faulting
    idents = read_all()
    assert idents[0] == me and me not in idents[1:]  # split from the start
    fake.faults_per_key = 1 / 64  # fewer than 1 fault per 32 keys: cached again after this split read
    read_all()
    assert not pool.faulting
    assert set(read_all()) == {me}
    pool.close()


def test_always_split_splits_cached_reads() -> None:
    fake = _FakeFaults()
    pool = ReaderPool(4, min_run=64, split="always", major_faults=fake.count)
    got = pool.map(fake.read, pool.runs(512))
    assert [x for run in got for x in run] == list(range(512))
    assert len({ident for _, ident in fake.threads}) >= 2
    pool.close()


@pytest.mark.parametrize("bad", ["sometimes", "", None, 1])
def test_read_split_is_checked(bad) -> None:
    with pytest.raises(ValueError, match="read_split"):
        LmdbOptions(read_split=bad)
