"""The tiers' rates and warnings (recsys/tier_metrics.py) from counters set by hand: the thrashing warning
speaks only for a device tier that is full and still misses, and hit rates stay in [0, 1]."""

from __future__ import annotations

import torch

from recsys.capacities import Capacities
from recsys.tier_metrics import COUNTERS, TierMetrics, rates_of


class _Counters:
    """Stands in for a store shard's counters: one table's monotonic vector, set by the test."""

    def __init__(self) -> None:
        self.values = dict.fromkeys(COUNTERS, 0.0)

    def add(self, **deltas: float) -> None:
        for name, value in deltas.items():
            self.values[name] += value

    def counters(self) -> dict[str, torch.Tensor]:
        return {"t_cat_0": torch.tensor([self.values[n] for n in COUNTERS], dtype=torch.float64)}


def _metrics(counters: _Counters) -> TierMetrics:
    capacities = Capacities(device_rows={"cat_0": 100}, host_rows={"cat_0": 50})
    return TierMetrics(counters, capacities=capacities, world_size=1)  # type: ignore[arg-type]


def test_a_cold_cache_that_never_evicted_is_not_thrashing() -> None:
    counters = _Counters()
    metrics = _metrics(counters)
    # one step: 80 ids, each seen for the first time, all misses, and the 100 slots not yet full
    counters.add(device_misses=80, device_rows_in=80, rows_initialised=80)
    rates, warning = metrics.window(warm=True, steps=1)
    assert rates["device_hit_rate"] == 0.0 and warning is None
    metrics.training_done()
    per_table, warnings = metrics.over_training(1)
    assert per_table["t_cat_0"]["device_hit_rate"] == 0.0 and warnings == []


def test_a_full_cache_that_evicts_and_misses_is_thrashing() -> None:
    counters = _Counters()
    metrics = _metrics(counters)
    counters.add(device_hits=20, device_misses=80, device_rows_in=80, device_evictions=60, ssd_rows_read=80)
    rates, warning = metrics.window(warm=True, steps=20)
    assert rates["device_hit_rate"] == 0.2
    assert warning is not None and warning.startswith("CACHE THRASHING: table t_cat_0 device hit rate 0.200")
    metrics.training_done()
    _, warnings = metrics.over_training(20)
    assert len(warnings) == 1 and "over training with 100 slots" in warnings[0]
    # the window after: it hits, so it no longer warns
    counters.add(device_hits=90, device_misses=10, device_rows_in=10, device_evictions=10)
    assert metrics.window(warm=True, steps=20)[1] is None


def test_host_hit_rate_stays_in_0_1_when_the_prefetch_reads_ahead_of_the_fills() -> None:
    # a window in which the prefetch read 120 rows from LMDB for later batches, and 40 rows were filled
    assert rates_of({**dict.fromkeys(COUNTERS, 0.0), "ssd_rows_read": 120, "device_rows_in": 40}) == {
        "device_hit_rate": 1.0,
        "host_hit_rate": 0.0,
    }
    assert (
        rates_of({**dict.fromkeys(COUNTERS, 0.0), "ssd_rows_read": 10, "device_rows_in": 40})["host_hit_rate"]
        == 0.75
    )
