"""The one id-map contract (``embedding_store.index.IdMap``) held by all five maps against a dict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedding_store.index import DenseIdMap, DenseSeqIndex, HashIdMap, IdMap
from embedding_store.log_index import HashSeqIndex, SortedSeqIndex

DENSE_IDS = 1 << 12  # the id space of the dense maps
CAPACITY = 48  # the live entries the fixed-size HashIdMap is sized for


@dataclass(frozen=True)
class Kind:
    make: Callable[[], IdMap]
    max_value: int  # values drawn below this (DenseIdMap holds int32 positions)
    dense: bool  # ids in [0, DENSE_IDS)
    capacity: int | None = None  # live entries at most (a full HashIdMap refuses more)


KINDS = {
    "DenseIdMap": Kind(lambda: DenseIdMap(DENSE_IDS), 1 << 31, dense=True),
    "HashIdMap": Kind(lambda: HashIdMap(CAPACITY), 1 << 62, dense=False, capacity=CAPACITY),
    "DenseSeqIndex": Kind(lambda: DenseSeqIndex(DENSE_IDS), 1 << 40, dense=True),
    "HashSeqIndex": Kind(lambda: HashSeqIndex(4), 1 << 40, dense=False),
    # merge_min=8: the delta merges into the sorted entries every few operations
    "SortedSeqIndex": Kind(lambda: SortedSeqIndex(merge_min=8), 1 << 40, dense=False),
}

# Small ids collide often (repeated upserts and removals of one id); large ones spread over int64.
any_id = st.one_of(st.integers(0, 60), st.integers(0, (1 << 63) - 1))
ops = st.lists(
    st.tuples(
        st.sampled_from(["upsert", "insert", "remove"]),
        st.lists(st.tuples(any_id, st.integers(0, (1 << 62) - 1)), max_size=24),
    ),
    max_size=30,
)


def check_reads(id_map: IdMap, ref: dict[int, int], query: list[int]) -> None:
    q = np.array(query + list(ref), dtype=np.int64)
    assert id_map.lookup(q).tolist() == [ref.get(i, -1) for i in q.tolist()]
    assert len(id_map) == len(ref)
    ids, values = id_map.items()
    assert ids.dtype == values.dtype == np.int64
    assert dict(zip(ids.tolist(), values.tolist(), strict=True)) == ref
    assert id_map.nbytes() > 0


@pytest.mark.parametrize("name", list(KINDS))
@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_map_follows_a_dict(name: str, ops: list[tuple[str, list[tuple[int, int]]]]) -> None:
    kind = KINDS[name]
    id_map, ref = kind.make(), {}
    for op, pairs in ops:
        chosen = dict((i % DENSE_IDS if kind.dense else i, v % kind.max_value) for i, v in pairs)
        if op == "insert":  # absent ids only
            chosen = {i: v for i, v in chosen.items() if i not in ref}
        if kind.capacity is not None and op != "remove":  # what the fixed table holds
            new = [i for i in chosen if i not in ref][: kind.capacity - len(ref)]
            chosen = {i: v for i, v in chosen.items() if i in ref or i in new}
        ids = np.array(list(chosen), dtype=np.int64)
        values = np.array(list(chosen.values()), dtype=np.int64)
        if op == "remove":
            assert id_map.remove(ids).tolist() == [ref.pop(i, -1) for i in chosen]
        elif op == "insert":
            id_map.insert(ids, values)
            ref.update(chosen)
        else:
            assert id_map.upsert(ids, values).tolist() == [ref.get(i, -1) for i in chosen]
            ref.update(chosen)
        check_reads(id_map, ref, list(chosen))


@pytest.mark.parametrize("name", list(KINDS))
def test_mark_writes_each_present_ids_value(name: str) -> None:
    id_map = KINDS[name].make()
    id_map.insert(np.array([5, 9, 17], dtype=np.int64), np.array([0, 4, 2], dtype=np.int64))
    out = np.full(6, -1, dtype=np.int64)
    id_map.mark(np.array([9, 17, 33], dtype=np.int64), 8, out)  # 33 is absent: nothing marked
    assert out.tolist() == [-1, -1, 8, -1, 8, -1]


@pytest.mark.parametrize("name", ["HashSeqIndex", "SortedSeqIndex"])
def test_growing_indexes_remove_through_growth_merges_and_splits(name: str) -> None:
    """1.2 M hashed ids, a tenth of the stored ones removed every step: the hash table doubles (its removals shift
    clusters back, across the table's end too); the sorted index merges, grows its directory and
    compacts its entries; every id keeps its newest number, removed ones read -1 (a dict oracle)."""
    rng = np.random.default_rng(7)
    index: IdMap = HashSeqIndex() if name == "HashSeqIndex" else SortedSeqIndex()
    pool = np.unique(rng.integers(0, 1 << 63, size=1_200_000, dtype=np.int64))
    want: dict[int, int] = {}
    seq = 0
    for step in range(20):
        ids = pool[rng.random(pool.shape[0]) < 0.15]
        assert index.upsert(ids, np.arange(seq, seq + ids.shape[0])).tolist() == [
            want.get(i, -1) for i in ids.tolist()
        ]
        want.update(zip(ids.tolist(), range(seq, seq + ids.shape[0]), strict=True))
        seq += ids.shape[0]
        gone = rng.permutation(np.fromiter(want, dtype=np.int64))[: len(want) // 10 + step]
        gone = np.concatenate([gone, pool[rng.integers(0, pool.shape[0], 100)]])  # absent ones too
        gone = np.unique(gone)
        assert index.remove(gone).tolist() == [want.pop(i, -1) for i in gone.tolist()]
        assert len(index) == len(want)
    if isinstance(index, SortedSeqIndex):
        assert int(64 - index._shift) >= 17  # the directory split at least once
    q = np.concatenate([pool[rng.integers(0, pool.shape[0], 20_000)], rng.integers(0, 1 << 63, 2000)])
    assert index.lookup(q).tolist() == [want.get(i, -1) for i in q.tolist()]
    ids, seqs = index.items()
    assert dict(zip(ids.tolist(), seqs.tolist(), strict=True)) == want


@pytest.mark.parametrize("name", ["HashSeqIndex", "SortedSeqIndex"])
def test_growing_indexes_refuse_negative_ids(name: str) -> None:
    index = KINDS[name].make()
    for call in (index.remove, lambda ids: index.upsert(ids, np.zeros(1, dtype=np.int64))):
        with pytest.raises(ValueError, match="ids must be >= 0"):
            call(np.array([-1], dtype=np.int64))
