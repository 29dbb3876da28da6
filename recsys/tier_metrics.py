"""What the tiers did during a run: hit rates per log window and over training, and the warnings.

One component owns every definition, for the log lines, ``metrics.jsonl`` and ``summary.json`` alike
(``docs/tiers.md`` explains them):

- ``device_hit_rate``: ids found in their owner's slots / ids requested (one request per sending rank).
- ``host_hit_rate``: the share of rows filled into the device tier that came from host DRAM rather than
  from LMDB or a first initialisation: ``1 - (ssd_rows_read + rows_initialised) / device_rows_in``.

A device tier below ``THRASH_HIT_RATE`` on a warm table thrashes; the warning names the table, its slots
and the way out. Every method that says "collective" must be called on all ranks together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from recsys.capacities import Capacities, mismatch_warning
from recsys.table_names import feature_of
from recsys.tier_counters import COUNTERS, TierCounters

__all__ = ["COUNTERS", "PREDICTION_TOLERANCE", "THRASH_HIT_RATE", "TierMetrics", "rates_of"]

# A device tier that answers less than this share of a warm table's lookups thrashes.
THRASH_HIT_RATE = 0.5
# Measured hit rates this far below the predicted ones get a warning.
PREDICTION_TOLERANCE = 0.02


def rates_of(c: Mapping[str, float]) -> dict[str, float]:
    """The two hit rates of one set of counters (``COUNTERS`` by name); 1.0 where nothing was asked."""
    requests = c["device_hits"] + c["device_misses"]
    below = c["ssd_rows_read"] + c["rows_initialised"]
    return {
        "device_hit_rate": c["device_hits"] / requests if requests else 1.0,
        "host_hit_rate": 1.0 - below / c["device_rows_in"] if c["device_rows_in"] else 1.0,
    }


def thrashing(table: str, rate: float, *, slots: int, over: str, key: str) -> str:
    """The one warning of a thrashing device tier; ``key``: the setting that sizes its slots."""
    return (
        f"CACHE THRASHING: table {table} device hit rate {rate:.3f} over {over} with {slots:,} slots per "
        f"owner; raise {key} (`recsys tune-cache` recommends one)"
    )


def _zeros() -> torch.Tensor:
    return torch.zeros(len(COUNTERS), dtype=torch.float64)


class TierMetrics:
    """The store counters of one rank's tiered tables, turned into rates and warnings.

    Args:
        counters: the counters of this rank's store shard (``TieredTables.tallies``).
        capacities: the slots and host rows each table was given (and tune.json's predictions).
        world_size: ranks of the run (the rates are over all of them).
    """

    def __init__(self, counters: TierCounters, *, capacities: Capacities, world_size: int) -> None:
        self.counters = counters
        self.capacities = capacities
        self.world_size = world_size
        self._window_start: dict[str, torch.Tensor] = {}
        self._eval: dict[str, torch.Tensor] = {}  # counters of evaluation batches, kept apart
        self._eval_start: dict[str, torch.Tensor] = {}
        self._train: dict[str, torch.Tensor] = {}

    def _sum(self, vector: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(vector)
        return vector

    def _gather(self, mine: Any) -> list[Any]:
        parts = [mine]
        if self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, mine)
        return parts

    # -- evaluation batches are not training batches ----------------------------------------------

    def evaluation_started(self) -> None:
        self._eval_start = self.counters.counters()

    def evaluation_done(self) -> None:
        for name, value in self.counters.counters().items():
            delta = value - self._eval_start.get(name, torch.zeros_like(value))
            self._eval[name] = self._eval.get(name, torch.zeros_like(value)) + delta

    def training_done(self) -> None:
        """Keep the training batches' counters (evaluations excluded) for :meth:`over_training`."""
        self._train = {
            name: value - self._eval.get(name, torch.zeros_like(value))
            for name, value in self.counters.counters().items()
        }

    # -- what the log shows -------------------------------------------------------------------------

    def window(self, *, warm: bool, steps: int) -> tuple[dict[str, float], str | None]:
        """Rates over all ranks since the previous call, and a warning naming the worst thrashing table
        (only once the cache is ``warm``) over the last ``steps`` steps (collective)."""
        now = self.counters.counters()
        deltas = {n: v - self._window_start.get(n, torch.zeros_like(v)) for n, v in now.items()}
        self._window_start = now
        total = self._sum(sum(deltas.values(), _zeros()))
        c = dict(zip(COUNTERS, total.tolist(), strict=True))
        window: dict[str, float] = {
            **rates_of(c),
            **{k: c[k] for k in ("ssd_rows_read", "ssd_rows_written", "rows_initialised")},
        }
        per_table = {
            n: rates_of(dict(zip(COUNTERS, d.tolist(), strict=True)))["device_hit_rate"]
            for n, d in deltas.items()
            if float(d[0] + d[1]) > 0
        }
        low = {n: r for n, r in per_table.items() if r < THRASH_HIT_RATE}
        if not (low and warm):
            return window, None
        worst = min(low, key=low.__getitem__)
        feature = feature_of(worst)
        slots, key = self.capacities.device_rows[feature], self.capacities.device_key(feature)
        return window, thrashing(worst, low[worst], slots=slots, over=f"the last {steps} steps", key=key)

    # -- what the summary holds ---------------------------------------------------------------------

    def store_stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per tiered table and tier, the store's counters summed over ranks (collective)."""
        total: dict[str, dict[str, dict[str, float]]] = {}
        for part in self._gather(self.counters.stats()):
            for table, tiers in part.items():
                for tier, counters in tiers.items():
                    slot = total.setdefault(table, {}).setdefault(tier, {})
                    for key, value in counters.items():
                        if isinstance(value, int | float):
                            slot[key] = slot.get(key, 0) + value
        return total

    def capacities_run(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None, list[str]]:
        """Per tiered table, the capacities it ran with: ``device_rows`` and ``host_rows`` per owner (the
        most of any owner), ``owners`` (the ranks holding a part of it) and ``from`` (the setting that
        sized it); the tables whose capacities are not those tune.json predicted its hit rates for (None
        without a tune); a warning for each of them (collective)."""
        ran: dict[str, dict[str, int]] = {}
        for part in self._gather(self.counters.capacity_rows):
            for name, rows in part.items():
                slot = ran.setdefault(name, {"device_rows": 0, "host_rows": 0, "owners": 0})
                slot["device_rows"] = max(slot["device_rows"], rows["device_rows"])
                slot["host_rows"] = max(slot["host_rows"], rows["host_rows"])
                slot["owners"] += 1
        ran = dict(sorted(ran.items()))
        differ = self.capacities.mismatches(ran) if self.capacities.tuned else None
        out = {n: {**c, "from": self.capacities.source.get(feature_of(n), "")} for n, c in ran.items()}
        if differ is None:
            return out, None, []
        return out, differ, [mismatch_warning(name, d) for name, d in differ.items()]

    def over_training(self, steps: int) -> tuple[dict[str, dict[str, float]], list[str]]:
        """Per tiered table, the rates over the training batches of all ranks beside tune.json's
        predictions, ``ssd_rows_per_step`` and ``device_requests`` (a table's weight in a total rate);
        and the warnings (collective)."""
        total: dict[str, dict[str, float]] = {}
        for part in self._gather({n: v.tolist() for n, v in self._train.items()}):
            for name, values in part.items():
                slot = total.setdefault(name, dict.fromkeys(COUNTERS, 0.0))
                for key, value in zip(COUNTERS, values, strict=True):
                    slot[key] += value
        out: dict[str, dict[str, float]] = {}
        warnings: list[str] = []
        for name, c in sorted(total.items()):
            feature = feature_of(name)
            requests = c["device_hits"] + c["device_misses"]
            rates = {
                **rates_of(c),
                "ssd_rows_per_step": (c["ssd_rows_read"] + c["rows_initialised"]) / max(1, steps),
                "device_requests": requests,
                **self.capacities.predicted.get(feature, {}),
            }
            out[name] = rates
            slots = self.capacities.device_rows[feature]
            if requests and rates["device_hit_rate"] < THRASH_HIT_RATE:
                key = self.capacities.device_key(feature)
                warnings.append(
                    thrashing(name, rates["device_hit_rate"], slots=slots, over="training", key=key)
                )
            elif "predicted_device_hit_rate" in rates and (
                rates["device_hit_rate"] < rates["predicted_device_hit_rate"] - PREDICTION_TOLERANCE
            ):
                warnings.append(
                    f"table {name}: device hit rate {rates['device_hit_rate']:.3f} is below the predicted "
                    f"{rates['predicted_device_hit_rate']:.3f} (was the run tuned on the same config?)"
                )
        return out, warnings
