"""What the tiers' id -> position maps add to the one contract (tests/embedding_store/test_id_maps.py):
heavy churn through tombstones, a fixed capacity, the choice of map."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.index import DenseIdMap, HashIdMap, make_id_map


def test_hash_map_survives_heavy_churn_with_tombstones() -> None:
    rng = np.random.default_rng(0)
    id_map = HashIdMap(1000)
    live = np.empty(0, dtype=np.int64)
    for step in range(200):
        new = np.setdiff1d(rng.integers(0, 1 << 62, size=300), live)[: 1000 - live.shape[0]]
        id_map.insert(new, np.full(new.shape[0], step))
        live = np.concatenate([live, new])
        drop = rng.choice(live, size=live.shape[0] // 2, replace=False)
        id_map.remove(drop)
        live = np.setdiff1d(live, drop)
        assert (id_map.lookup(live) >= 0).all()
        assert (id_map.lookup(drop) == -1).all()
    assert len(id_map) == live.shape[0]


def test_hash_map_refuses_more_than_its_capacity() -> None:
    id_map = HashIdMap(4)
    with pytest.raises(ValueError):
        id_map.insert(np.arange(100, dtype=np.int64), np.arange(100))


def test_make_id_map_picks_dense_for_small_bounded_spaces() -> None:
    assert isinstance(make_id_map(1000, 10), DenseIdMap)
    assert isinstance(make_id_map(None, 10), HashIdMap)
    assert isinstance(make_id_map(1 << 40, 10), HashIdMap)
