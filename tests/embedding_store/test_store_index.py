"""The vectorised id -> position maps against a dict."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedding_store.index import DenseIdMap, HashIdMap, make_id_map

MAX_ENTRIES = 40
big_ids = st.one_of(st.integers(0, 50), st.integers(0, (1 << 63) - 1))


@pytest.mark.parametrize("kind", ["hash", "dense"])
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(big_ids, max_size=12)), max_size=30))
def test_map_matches_dict(kind, ops) -> None:
    id_map = HashIdMap(MAX_ENTRIES) if kind == "hash" else DenseIdMap(1 << 20)
    ref: dict[int, int] = {}
    next_pos = 0
    for insert, raw in ops:
        ids = [i if kind == "hash" else i % (1 << 20) for i in raw]
        if insert:
            new = [i for i in dict.fromkeys(ids) if i not in ref][: MAX_ENTRIES - len(ref)]
            pos = np.arange(next_pos, next_pos + len(new))
            next_pos += len(new)
            id_map.insert(np.array(new, dtype=np.int64), pos)
            ref.update(zip(new, pos.tolist(), strict=True))
        else:
            gone = [i for i in dict.fromkeys(ids) if i in ref]
            id_map.remove(np.array(gone, dtype=np.int64))
            for i in gone:
                del ref[i]
        query = np.array(ids + list(ref), dtype=np.int64)
        want = [ref.get(int(i), -1) for i in query]
        assert id_map.lookup(query).tolist() == want
        assert len(id_map) == len(ref)


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
