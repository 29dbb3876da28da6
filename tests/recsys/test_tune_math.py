"""The cache-tuning math against oracles: brute-force LRU, an independent Belady, brute-force splits."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np
import pytest

from embedding_store import PolicyKind
from recsys.tune.curves import capacity_grid, lru_curve, lru_stack_distances, policy_curve
from recsys.tune.split import split_budget
from recsys.tune.trace import (
    BELADY,
    BIG,
    SIM_POLICIES,
    CapacityTooSmall,
    Trace,
    TraceBuilder,
    min_capacity,
    simulate,
)


def zipf_trace(
    seed: int, *, batches: int = 120, batch: int = 40, space: int = 400, alpha: float = 1.1, senders: int = 2
) -> Trace:
    rng = np.random.default_rng(seed)
    builder = TraceBuilder()
    for b in range(batches):
        ids = np.unique(rng.zipf(alpha, batch) % space)
        weights = rng.integers(1, senders + 1, ids.shape[0])  # how many ranks sent the id
        builder.add(ids * 7919 + 3, weights, train=b % 11 != 4)  # every 11th batch is an evaluation batch
    return builder.build()


def brute_force_stack_distances(trace: Trace) -> np.ndarray:
    """Per access, its position in an LRU list (1 = most recent) before the access, ``BIG`` if absent;
    each batch's ids are touched in the order of their previous use (longest ago first, new ids first)."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = np.full(trace.ids.shape[0], BIG, dtype=np.int64)
    last: dict[int, int] = {}
    position = 0
    for b in range(trace.num_batches):
        lo = int(trace.offsets[b])
        ids = trace.ids[lo : int(trace.offsets[b + 1])]
        order = sorted(range(ids.shape[0]), key=lambda j: last.get(int(ids[j]), -1))
        for j in order:
            x = int(ids[j])
            if x in lru:
                keys = list(lru)
                out[lo + j] = len(keys) - keys.index(x)
                lru.move_to_end(x)
            else:
                lru[x] = None
            last[x] = position
            position += 1
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stack_distances_equal_brute_force_lru(seed):
    trace = zipf_trace(seed, batches=60, batch=25, space=150)
    assert np.array_equal(lru_stack_distances(trace), brute_force_stack_distances(trace))


def test_lru_curve_equals_brute_force_cache_simulation():
    trace = zipf_trace(3, batches=60, batch=25, space=150)
    caps = np.array([5, 20, 40, 80, 150])
    curve = lru_curve(trace, caps)
    train = np.repeat(trace.train, np.diff(trace.offsets))
    d = brute_force_stack_distances(trace)
    for cap, rate in zip(caps, curve.hit_rates, strict=True):
        hits = trace.weights[train & (d <= cap)].sum()
        assert rate == pytest.approx(hits / trace.weights[train].sum())


def belady_oracle(trace: Trace, capacity: int, pinned: int) -> tuple[float, float]:
    """Belady's MIN with pins written independently with Python sets (weighted hits, requests)."""
    batches = [trace.ids[trace.offsets[b] : trace.offsets[b + 1]].tolist() for b in range(trace.num_batches)]
    weights = [
        trace.weights[trace.offsets[b] : trace.offsets[b + 1]].tolist() for b in range(trace.num_batches)
    ]
    uses: dict[int, list[int]] = {}
    for b, ids in enumerate(batches):
        for x in ids:
            uses.setdefault(x, []).append(b)
    resident: set[int] = set()
    last_train: dict[int, int] = {}
    hits = requests = 0.0
    k = 0
    for b, ids in enumerate(batches):
        train = bool(trace.train[b])
        if train:
            for x, w in zip(ids, weights[b], strict=True):
                requests += w
                hits += w if x in resident else 0
        new = [x for x in ids if x not in resident]
        need = len(resident) + len(new) - capacity
        if need > 0:
            cand = [x for x in resident if x not in ids and last_train.get(x, -(10**9)) <= k - pinned]

            def next_use(x: int, b: int = b) -> int:
                later = [u for u in uses[x] if u > b]
                return later[0] if later else 10**9

            cand.sort(key=next_use, reverse=True)
            assert len(cand) >= need
            resident -= set(cand[:need])
        resident |= set(new)
        if train:
            for x in ids:
                last_train[x] = k
            k += 1
    return hits, requests


@pytest.mark.parametrize(("seed", "capacity"), [(0, 60), (1, 90), (2, 140)])
def test_belady_simulation_equals_independent_oracle(seed, capacity):
    # One sender: rows tied on their next use are then interchangeable, whichever one MIN evicts.
    trace = zipf_trace(seed, batches=80, batch=20, space=300, senders=1)
    res = simulate(trace, capacity, policy=BELADY, pinned_batches=3)
    hits, requests = belady_oracle(trace, capacity, 3)
    assert res.requests == requests
    assert res.hits == hits


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lookahead_curve_lies_between_lru_and_belady(seed):
    trace = zipf_trace(seed, batches=150, batch=40, space=500, alpha=1.05 + 0.05 * seed)
    floor = min_capacity(trace, pinned_batches=4)
    caps = capacity_grid(floor, trace.num_ids, 10)
    rates = {
        p: policy_curve(trace, caps, policy=p, lookahead=4, pinned_batches=4).hit_rates
        for p in (PolicyKind.LRU, PolicyKind.LOOKAHEAD, BELADY)
    }
    assert np.all(rates[PolicyKind.LRU] <= rates[PolicyKind.LOOKAHEAD] + 1e-12)
    assert np.all(rates[PolicyKind.LOOKAHEAD] <= rates[BELADY] + 1e-12)
    assert rates[BELADY][0] > rates[PolicyKind.LRU][0]  # not all equal: the pins leave room to choose


def test_minimum_capacity_is_tight():
    trace = zipf_trace(5)
    floor = min_capacity(trace, pinned_batches=4)
    for policy in SIM_POLICIES:
        simulate(trace, floor, policy=policy, lookahead=2, pinned_batches=4)
    with pytest.raises(CapacityTooSmall):
        simulate(trace, floor - 1, policy=PolicyKind.LRU, pinned_batches=4)


def test_spatial_sampling_tracks_the_exact_curve():
    trace = zipf_trace(7, batches=300, batch=2000, space=200_000, alpha=1.05)
    caps = np.linspace(2000, trace.num_ids, 8)
    exact = lru_curve(trace, caps).hit_rates
    sampled = lru_curve(trace.sample(0.1), caps).hit_rates
    assert np.max(np.abs(exact - sampled)) < 0.02


@pytest.mark.parametrize("seed", range(6))
def test_split_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    tables = int(rng.integers(2, 4))
    costs = [np.sort(rng.integers(0, 12, int(rng.integers(2, 5)))) for _ in range(tables)]
    values = [np.sort(rng.random(c.shape[0])) * 10 for c in costs]
    budget = int(rng.integers(5, 25))
    best = None
    for pick in itertools.product(*(range(c.shape[0]) for c in costs)):
        cost = sum(int(c[k]) for c, k in zip(costs, pick, strict=True))
        value = sum(float(v[k]) for v, k in zip(values, pick, strict=True))
        if cost <= budget and (best is None or value > best + 1e-12):
            best = value
    pick = split_budget(costs, values, budget)
    if best is None:
        assert pick is None
        return
    assert pick is not None
    assert sum(int(c[k]) for c, k in zip(costs, pick, strict=True)) <= budget
    assert sum(float(v[k]) for v, k in zip(values, pick, strict=True)) == pytest.approx(best)


def brute_force_min_capacity(trace: Trace, pinned: int) -> int:
    best, held = 0, []
    for b in range(trace.num_batches):
        ids = trace.ids[trace.offsets[b] : trace.offsets[b + 1]].tolist()
        best = max(best, len(set(ids).union(*held)))
        if trace.train[b] and pinned > 1:
            held = [*held, set(ids)][-(pinned - 1) :]
    return best


@pytest.mark.parametrize("seed", range(4))
def test_minimum_capacity_equals_brute_force(seed):
    trace = zipf_trace(seed, batches=70, batch=30, space=250)
    for pinned in (1, 2, 4):
        assert min_capacity(trace, pinned_batches=pinned) == brute_force_min_capacity(trace, pinned)
