"""The row cache: exactly the rows of an uncached read, least recently used rows evicted, thread-safe."""

from __future__ import annotations

import threading

import lmdb
import numpy as np
import pytest

from recsys.serving.bundle import FeatureSpec
from recsys.serving.cache import LmdbRows, RowCache

DIM, FLOATS = 4, 5  # weights, then one float of optimizer state that the cache must drop


def _rows_of(ids: np.ndarray) -> np.ndarray:
    return np.stack([ids * 10.0 + c for c in range(FLOATS)], axis=1).astype(np.float32)


@pytest.fixture
def source(tmp_path):
    """A table storing the even ids below 2000 (row of id i: 10 i + column), read-only like a bundle's."""
    ids = np.arange(0, 2000, 2, dtype=np.int64)
    env = lmdb.open(str(tmp_path), map_size=1 << 24, max_dbs=2, lock=False)
    with env.begin(write=True, db=env.open_db(b"t")) as txn:
        keys = ids.astype(">u8").view("V8").tolist()
        txn.cursor().putmulti(
            list(zip(keys, _rows_of(ids).view(f"V{4 * FLOATS}").reshape(-1).tolist(), strict=True)),
            append=True,
        )
    env.close()
    rows = LmdbRows(tmp_path, tables=["t"], row_floats=FLOATS)
    yield rows
    rows.close()


def _cache(source, capacity, id_space=None):
    feature = FeatureSpec(name="f", table="t", kind="tiered", dim=DIM, rows=1000, id_space=id_space)
    return RowCache(
        source, feature, capacity=capacity, fill=lambda ids: np.full((ids.shape[0], DIM), -1.0, np.float32)
    )


def _expected(ids):
    want = _rows_of(ids)[:, :DIM]
    want[(ids % 2 == 1) | (ids >= 2000)] = -1.0  # never stored: the fill
    return want


@pytest.mark.parametrize(("capacity", "id_space"), [(0, None), (50, None), (50, 4000), (5000, 4000)])
def test_lookups_return_the_stored_rows_whatever_the_capacity(source, capacity, id_space):
    cache = _cache(source, capacity, id_space)
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = np.unique(rng.zipf(1.3, 300) % 3000).astype(np.int64)
        np.testing.assert_array_equal(cache.lookup(ids).numpy(), _expected(ids))
    stats = cache.stats()
    assert stats.rows <= capacity and stats.stored + stats.unseen == stats.misses
    assert (stats.hits > 0) == (capacity > 0)


def test_the_least_recently_used_rows_go_first(source):
    cache = _cache(source, 32)  # evicts 32 // 16 = 2 rows at least when full
    for i in range(0, 64, 2):  # fills it with ids 0..62, one lookup each: older ids were used earlier
        cache.lookup(np.array([i]))
    cache.lookup(np.arange(0, 32, 2))  # ids 0..30 are now the most recent
    cache.lookup(np.array([100, 102]))  # two new rows: the two oldest (32, 34) go
    before = cache.stats()
    cache.lookup(np.arange(0, 32, 2))
    assert cache.stats().hits - before.hits == 16
    cache.lookup(np.array([32, 34, 36]))
    after = cache.stats()
    assert after.misses - before.misses == 2 and after.hits - before.hits == 17


def test_threads_share_one_cache(source):
    cache = _cache(source, 100)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            ids = np.unique(rng.integers(0, 400, 40)).astype(np.int64)
            if not np.array_equal(cache.lookup(ids).numpy(), _expected(ids)):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cache.stats()
    assert stats.rows <= 100 and stats.hits > 0
    held = cache._id_at[cache._id_at >= 0]
    assert np.unique(held).shape[0] == held.shape[0] == len(cache._map)  # no id cached twice
