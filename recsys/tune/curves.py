"""Hit-rate curves against capacity: exact LRU stack distances, and policy simulations on a grid.

LRU is a stack algorithm: one pass computes, for every access, the smallest cache that hits it, which
gives the whole curve at once. The pass treats the trace as a sequence of single accesses — each batch's
distinct ids in the order of their previous use (longest ago first, new ids before them) — so a row's
stack distance is the number of distinct ids used since its previous use, counting those of its own batch
touched before it. The store runs a batch at once (its rows share one tick and are pinned together), so
its LRU differs from this by less than one batch of rows; :func:`simulate` models it exactly.

The other policies are not stack algorithms under pins, so their curves are simulations at a grid of
capacities. Large traces are sampled spatially (SHARDS): a hash of the id keeps a share ``R`` of the id
space, and a cache of ``c`` rows over the sample stands for one of ``c / R`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recsys.tune.trace import BIG, CapacityTooSmall, SimPolicy, Trace, min_capacity, prepare, simulate

__all__ = ["Curve", "lru_stack_distances", "lru_curve", "policy_curve", "capacity_grid"]


@dataclass(frozen=True)
class Curve:
    """Hit rate and rows filled per training batch at each capacity (full-trace rows).

    Attributes:
        capacities: (K,) rows.
        hit_rates: (K,) weighted device-style hit rates; NaN where the capacity cannot hold the batches.
        miss_rows: (K,) distinct rows filled into the cache per training batch.
    """

    policy: str
    capacities: np.ndarray
    hit_rates: np.ndarray
    miss_rows: np.ndarray

    def at(self, capacity: float) -> tuple[float, float]:
        """(hit rate, rows filled per batch) interpolated at ``capacity``; flat beyond the grid."""
        ok = ~np.isnan(self.hit_rates)
        caps = self.capacities[ok]
        return (
            float(np.interp(capacity, caps, self.hit_rates[ok])),
            float(np.interp(capacity, caps, self.miss_rows[ok])),
        )


def _bit_prefix(tree: np.ndarray, idx: np.ndarray, levels: int) -> np.ndarray:
    """Fenwick prefix sums over positions ``[0, idx]`` for a vector of indices."""
    i = idx + 1
    total = np.zeros(idx.shape[0], dtype=np.int64)
    for _ in range(levels):
        total += tree[i]
        i = i - (i & -i)
    return total


def _bit_add(tree: np.ndarray, idx: np.ndarray, delta: int) -> None:
    i = idx + 1
    size = tree.shape[0]
    while i.shape[0]:
        np.add.at(tree, i, delta)
        i = i + (i & -i)
        i = i[i < size]


def lru_stack_distances(trace: Trace) -> np.ndarray:
    """(N,) LRU stack distance of every access, in the trace's access order; ``BIG`` for first uses.

    An access hits in an LRU cache of ``c`` rows exactly when its distance is ``<= c``.
    """
    n = trace.ids.shape[0]
    levels = max(1, int(n + 1).bit_length())
    tree = np.zeros((1 << levels) + 1, dtype=np.int64)  # tree[0] stays 0: the sentinel of prefix sums
    last_pos = np.full(trace.num_ids, -1, dtype=np.int64)
    out = np.full(n, BIG, dtype=np.int64)
    marks = 0  # distinct ids seen so far: one mark at each id's latest position
    for b in range(trace.num_batches):
        lo, hi = int(trace.offsets[b]), int(trace.offsets[b + 1])
        if lo == hi:
            continue
        ids = trace.ids[lo:hi]
        prev = last_pos[ids]
        order = np.argsort(prev, kind="stable")  # longest-ago first; first uses (-1) before them
        prev_sorted = prev[order]
        pos = lo + np.arange(hi - lo, dtype=np.int64)
        seen = prev_sorted >= 0
        dist = np.full(hi - lo, BIG, dtype=np.int64)
        if seen.any():
            q = prev_sorted[seen]
            dist[seen] = marks - _bit_prefix(tree, q, levels) + np.flatnonzero(seen) + 1
            _bit_add(tree, q, -1)
        _bit_add(tree, pos, 1)
        marks += int((~seen).sum())
        last_pos[ids[order]] = pos
        out[lo + order] = dist
    return out


def lru_curve(trace: Trace, capacities: np.ndarray, *, distances: np.ndarray | None = None) -> Curve:
    """The exact LRU curve at ``capacities`` (full-trace rows) from stack distances."""
    d = lru_stack_distances(trace) if distances is None else distances
    batch_train = np.repeat(trace.train, np.diff(trace.offsets))
    d, w = d[batch_train], trace.weights[batch_train]
    order = np.argsort(d, kind="stable")
    d_sorted = d[order]
    cum_w = np.concatenate([[0.0], np.cumsum(w[order], dtype=np.float64)])
    cum_n = np.arange(d_sorted.shape[0] + 1, dtype=np.float64)
    scaled = np.floor(np.asarray(capacities, dtype=np.float64) * trace.sample_rate)
    k = np.searchsorted(d_sorted, scaled, side="right")
    total_w = cum_w[-1]
    n_train = max(1, trace.num_train_batches)
    hit_rates = cum_w[k] / total_w if total_w else np.ones_like(scaled)
    miss_rows = (d_sorted.shape[0] - cum_n[k]) / trace.sample_rate / n_train
    return Curve("lru-stack", np.asarray(capacities, dtype=np.float64), hit_rates, miss_rows)


def capacity_grid(lo: int, hi: int, points: int) -> np.ndarray:
    """``points`` capacities from ``lo`` to ``hi``: half spaced geometrically, half linearly."""
    hi = max(hi, lo + 1)
    geo = np.geomspace(lo, hi, points // 2 + 1)
    lin = np.linspace(lo, hi, points - points // 2 + 1)
    return np.unique(np.round(np.concatenate([geo, lin])).astype(np.int64))


def policy_curve(
    trace: Trace,
    capacities: np.ndarray,
    *,
    policy: SimPolicy,
    lookahead: int,
    pinned_batches: int,
    prepared: tuple[np.ndarray, np.ndarray] | None = None,
) -> Curve:
    """Hit rates of ``policy`` simulated at each capacity (full-trace rows; NaN below the minimum)."""
    prepared = prepare(trace) if prepared is None else prepared
    floor = min_capacity(trace, pinned_batches=pinned_batches)
    n_train = max(1, trace.num_train_batches)
    rates, misses = [], []
    for cap in capacities:
        scaled = int(round(float(cap) * trace.sample_rate))
        if scaled < floor:
            rates.append(np.nan)
            misses.append(np.nan)
            continue
        try:
            res = simulate(
                trace,
                scaled,
                policy=policy,
                lookahead=lookahead,
                pinned_batches=pinned_batches,
                prepared=prepared,
            )
        except CapacityTooSmall:
            rates.append(np.nan)
            misses.append(np.nan)
            continue
        rates.append(res.hit_rate)
        misses.append(res.miss_rows / trace.sample_rate / n_train)
    return Curve(policy.value, np.asarray(capacities, np.float64), np.array(rates), np.array(misses))
