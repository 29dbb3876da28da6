"""The tuner's simulation is the store: ``simulate`` counts the very hits, misses and rows filled that a
``TieredStore``'s device tier counts when it is driven through the same batches, pins and announcements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_store import OptimizerKind, PolicyKind, StoreConfig, TableSpec, Tier, TieredStore
from recsys.tune.curves import capacity_grid
from recsys.tune.trace import Trace, TraceBuilder, min_capacity, simulate

EVAL_BASE = 1 << 20  # batch ids of evaluation batches: after every training batch, so nothing they announce


def _trace(seed: int, pinned: int, *, batches: int = 90, alpha: float = 1.1) -> Trace:
    """Zipf batches with weights (ranks that sent an id), a fifth of them evaluation batches beside the
    training batches in flight, and evaluations after the last training batch beside fewer of them."""
    rng = np.random.default_rng(seed)
    builder = TraceBuilder()
    for b in range(batches):
        ids = np.unique(rng.zipf(alpha, 40) % 400) * 13 + 5
        train = rng.random() > 0.2 or b < 3
        builder.add(ids, rng.integers(1, 4, ids.shape[0]), train=train, held=pinned - 1)
    for held in sorted(rng.integers(0, pinned, 3).tolist(), reverse=True):
        ids = np.unique(rng.zipf(alpha, 60) % 400) * 13 + 5
        builder.add(ids, np.zeros(ids.shape[0], np.int64), train=False, held=held)
    return builder.build()


def _store_replay(  # noqa: PLR0913 - the simulation's parameters, one by one
    path: Path, trace: Trace, capacity: int, policy: PolicyKind, lookahead: int, pinned: int
) -> tuple[int, int, list[int]]:
    """(hits, requests, rows filled per training batch) of the store's device tier over the trace's
    training batches: each training id sent ``weight`` times, training batch k announced L batches
    ahead, pinned until ``pinned - 1`` later training batches are filled; an evaluation batch filled
    beside the last ``held`` training batches and released at once."""
    spec = TableSpec(name="t", dim=1, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=trace.num_ids)
    config = StoreConfig(
        seed=0,
        device_capacity_rows=capacity,
        host_capacity_rows=trace.num_ids,
        policy=policy,
        lookahead_batches=lookahead,
    )
    train_batches = [b for b in range(trace.num_batches) if trace.train[b]]
    ids_of = [trace.ids[trace.offsets[b] : trace.offsets[b + 1]] for b in range(trace.num_batches)]
    held_of = trace.held_batches(pinned)
    hits = requests = 0
    filled: list[int] = []
    in_flight: list[int] = []
    with TieredStore(path, config=config, tables=[spec]) as store:
        store.bind("t", weights=torch.zeros(capacity, 1))
        announced = 0
        k = 0
        for b in range(trace.num_batches):
            while in_flight and len(in_flight) > held_of[b]:
                store.release(in_flight.pop(0))
            before = store.counters()["t"][Tier.DEVICE]
            before_hits, before_misses, before_in = before.hits, before.misses, before.rows_in
            if trace.train[b]:
                while announced < min(len(train_batches), k + lookahead + 1):
                    store.lookahead(announced, {"t": torch.from_numpy(ids_of[train_batches[announced]])})
                    announced += 1
                w = trace.weights[trace.offsets[b] : trace.offsets[b + 1]]
                store.make_resident(k, {"t": torch.from_numpy(np.repeat(ids_of[b], w))})
                after = store.counters()["t"][Tier.DEVICE]
                hits += after.hits - before_hits
                requests += after.hits - before_hits + after.misses - before_misses
                filled.append(after.rows_in - before_in)
                in_flight.append(k)
                k += 1
            else:
                store.make_resident(EVAL_BASE + b, {"t": torch.from_numpy(ids_of[b])})
                store.release(EVAL_BASE + b)
    return hits, requests, filled


@pytest.mark.parametrize("policy", [PolicyKind.LRU, PolicyKind.LFU, PolicyKind.LOOKAHEAD])
@pytest.mark.parametrize(("seed", "pinned", "lookahead"), [(0, 4, 2), (1, 3, 4), (2, 2, 1)])
def test_simulation_counts_what_the_store_counts(tmp_path: Path, policy, seed, pinned, lookahead) -> None:
    trace = _trace(seed, pinned)
    floor = min_capacity(trace, pinned_batches=pinned)
    for i, capacity in enumerate(capacity_grid(floor, trace.num_ids, 5).tolist()):
        res = simulate(trace, capacity, policy=policy, lookahead=lookahead, pinned_batches=pinned)
        hits, requests, filled = _store_replay(tmp_path / f"s{i}", trace, capacity, policy, lookahead, pinned)
        assert res.batch_miss_rows is not None
        assert (res.requests, res.hits) == (requests, hits), capacity
        assert res.batch_miss_rows.tolist() == filled, capacity
