"""One contract test run against every eviction policy, plus what makes each policy itself."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedding_store import PolicyKind
from embedding_store.policies import _kth, make_policy

ALL = list(PolicyKind)


@pytest.mark.parametrize("kind", ALL)
@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 64),
    touches=st.lists(st.lists(st.integers(0, 63), max_size=10), max_size=8),
    data=st.data(),
)
def test_contract_victims_are_distinct_candidates(kind, capacity, touches, data) -> None:
    """Every policy: n distinct victims drawn from the candidates, deterministic, error past the end."""
    policy = make_policy(kind, capacity)
    policy.insert(np.arange(capacity))
    for t in touches:
        policy.touch(np.array([x % capacity for x in t], dtype=np.int64))
    candidates = np.array(sorted(data.draw(st.sets(st.integers(0, capacity - 1)))), dtype=np.int64)
    distances = st.lists(st.integers(-1, 9), min_size=len(candidates), max_size=len(candidates))
    future = np.array(data.draw(distances), dtype=np.int64)
    n = data.draw(st.integers(0, len(candidates)))
    victims = policy.victims(n, candidates, future)
    assert victims.shape == (n,)
    assert len(set(victims.tolist())) == n
    assert set(victims.tolist()) <= set(candidates.tolist())
    np.testing.assert_array_equal(policy.victims(n, candidates, future), victims)  # no hidden state
    with pytest.raises(ValueError):
        policy.victims(len(candidates) + 1, candidates, future)


@pytest.mark.parametrize("kind", ALL)
def test_contract_removed_and_reinserted_positions_count_as_new(kind) -> None:
    policy = make_policy(kind, 4)
    policy.insert(np.arange(4))
    for _ in range(3):
        policy.touch(np.array([0]))
    policy.remove(np.array([0]))
    policy.insert(np.array([0]))
    policy.touch(np.array([1, 2, 3]))
    # Position 0 now holds a new row used once, before 1..3 were used again: every policy evicts it.
    assert policy.victims(1, np.arange(4)).tolist() == [0]


def test_lru_evicts_least_recently_used() -> None:
    policy = make_policy(PolicyKind.LRU, 4)
    policy.insert(np.arange(4))
    for slot in [2, 0, 3, 1]:
        policy.touch(np.array([slot]))
    assert policy.victims(2, np.arange(4)).tolist() == [2, 0]


def test_lfu_evicts_least_frequently_used_then_lru() -> None:
    policy = make_policy(PolicyKind.LFU, 4)
    policy.insert(np.arange(4))
    policy.touch(np.array([0, 0, 0, 1]))  # duplicates in one batch count once
    policy.touch(np.array([0, 1]))
    policy.touch(np.array([3]))
    # uses: 0 -> 3, 1 -> 3, 2 -> 1, 3 -> 2
    assert policy.victims(2, np.arange(4)).tolist() == [2, 3]


def test_lookahead_keeps_rows_of_announced_batches_then_lru() -> None:
    policy = make_policy(PolicyKind.LOOKAHEAD, 4)
    policy.insert(np.arange(4))
    for slot in [0, 1, 2, 3]:
        policy.touch(np.array([slot]))
    future = np.array([True, False, True, False])  # slots 0 and 2 are needed soon
    assert policy.victims(2, np.arange(4), future).tolist() == [1, 3]
    assert policy.victims(3, np.arange(4), future).tolist() == [1, 3, 0]  # then LRU among the needed


def test_lookahead_evicts_the_furthest_next_use_among_announced_rows() -> None:
    """Unannounced rows first (LRU among them), then announced rows by decreasing next-use distance."""
    policy = make_policy(PolicyKind.LOOKAHEAD, 6)
    policy.insert(np.arange(6))
    for slot in [5, 4, 3, 2, 1, 0]:  # slot 0 most recently used
        policy.touch(np.array([slot]))
    future = np.array([3, -1, 1, 5, -1, 3])  # batches until the next use; -1: not announced
    order = policy.victims(5, np.arange(6), future).tolist()
    assert order[:2] == [4, 1]  # unannounced, least recently used first
    assert order[2] == 3  # next use in 5 batches
    assert order[3:] == [5, 0]  # both in 3 batches: LRU among equals; slot 2 (needed next) stays
    assert policy.victims(3, np.arange(6), future).tolist() == order[:3]


@pytest.mark.parametrize("num_embeddings", [50, None])  # the dense and the hash index
def test_future_mask_marks_the_nearest_announced_use(num_embeddings) -> None:
    """A tier marks each held row with the distance of the nearest announced batch using it (dict oracle)."""
    from embedding_store import TableSpec
    from embedding_store.tiers import HostTier

    rng = np.random.default_rng(0)
    tier = HostTier(TableSpec(name="t", dim=2, num_embeddings=num_embeddings), 40, PolicyKind.LOOKAHEAD)
    tier.allocate(rng.choice(50, size=40, replace=False))
    parts = [np.unique(rng.integers(0, 50, size=rng.integers(1, 30))) for _ in range(6)]
    distances = [0, 1, 2, 4, 5, 7]
    want: dict[int, int] = {}
    for part, d in zip(parts, distances, strict=True):
        for i in part.tolist():
            want.setdefault(i, d)
    positions = tier.occupied()
    mark = tier.future_mask(positions, lambda: list(zip(distances, parts, strict=True)))
    assert mark.tolist() == [want.get(int(i), -1) for i in tier.ids[positions]]
    assert tier.future_mask(positions, list) is None  # nothing announced


def _random_choice(kind, rng, capacities: tuple[int, int], least_candidates: int):
    """A policy after a few random touches, sorted distinct candidates (at least ``least_candidates``),
    their future marks, a number of victims below their count (or all of them), and their sort keys."""
    capacity = int(rng.integers(*capacities))
    policy = make_policy(kind, capacity)
    policy.insert(np.arange(capacity))
    for _ in range(int(rng.integers(0, 6))):
        policy.touch(rng.integers(0, capacity, size=int(rng.integers(1, capacity + 1))))
    size = int(rng.integers(min(least_candidates, capacity), capacity + 1))
    candidates = np.sort(rng.choice(capacity, size=size, replace=False))
    future = rng.integers(-1, 4, size=candidates.shape[0])
    n = int(rng.integers(1, candidates.shape[0] + 1))
    return policy, candidates, future, n, policy._sort_key(candidates, future)


@pytest.mark.parametrize("kind", ALL)
def test_victims_are_the_smallest_keys_by_position(kind) -> None:
    """Up to 4,096 candidates: the n smallest (key, position) pairs in that order, as one lexsort of all
    of them gives (the selection sorts only the smallest keys and their ties); all of them as given."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        policy, candidates, future, n, key = _random_choice(kind, rng, (2, 4097), 1)
        want = candidates if n == candidates.shape[0] else candidates[np.lexsort((candidates, key))[:n]]
        np.testing.assert_array_equal(policy.victims(n, candidates, future), want, err_msg=f"trial {trial}")


@pytest.mark.parametrize("kind", ALL)
def test_large_candidate_sets_give_the_smallest_keys_ties_by_order(kind) -> None:
    """Over 4,096 candidates: the n smallest keys, ties broken by their order among the candidates (many
    ties: few touches over a large tier)."""
    rng = np.random.default_rng(2)
    for trial in range(40):
        policy, candidates, future, n, key = _random_choice(kind, rng, (4097, 20_000), 4097)
        want = np.sort(candidates[np.lexsort((np.arange(candidates.shape[0]), key))[:n]])
        got = policy.victims(n, candidates, future)
        np.testing.assert_array_equal(np.sort(got), want, err_msg=f"trial {trial}")


def test_kth_smallest_key_equals_a_sort() -> None:
    """The n-th smallest eviction key, counted when the smallest keys lie within a narrow range of ticks
    and partitioned when they do not (far-apart keys; announced rows' high bits), equals a full sort's."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        size = int(rng.integers(1, 5_000))
        if trial % 3 == 0:  # batch ticks with many ties: the counting path
            key = rng.integers(0, 2 * size, size=size)
        elif trial % 3 == 1:  # far apart: the partition
            key = rng.integers(0, 1 << 61, size=size)
        else:  # LOOKAHEAD-like: unneeded ticks, then announced rows above bit 61
            key = 1_000 + rng.integers(0, 300, size=size)
            needed = rng.random(size) < 0.4
            key[needed] |= (rng.integers(0, 5, size=int(needed.sum())) << 40) | (1 << 61)
        key = key.astype(np.int64)
        n = int(rng.integers(1, size + 1))
        assert _kth(key, n) == np.sort(key)[n - 1], f"trial {trial}"
