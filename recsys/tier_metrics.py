"""What the tiers did during a run: hit rates per log window and over training, and the warnings; and
what the bounded tables decided (:class:`BoundsMetrics`).

One component owns every definition, for the log lines, ``metrics.jsonl`` and ``summary.json`` alike
(``docs/tiers.md`` explains them):

- ``device_hit_rate``: ids found in their owner's slots / ids requested (one request per sending rank).
- ``host_hit_rate``: the share of rows filled into the device tier that came from host DRAM rather than
  from LMDB or a first initialisation: ``1 - (ssd_rows_read + rows_initialised) / device_rows_in``.

A device tier below ``THRASH_HIT_RATE`` on a warm table thrashes; the warning names the table, its slots
and the way out. Warm: its slots are full and it has evicted rows over the span. Until then every miss is
an id's first use, which no number of slots avoids (a 1-step run misses every id it sees once). Every
method that says "collective" must be called on all ranks together.

The host figure compares rows read from below with rows filled into the device tier, and the prefetch reads
a row from LMDB a few batches before it is filled (``store.lookahead``): over a log window the reads can
lead the fills. A span whose reads outnumber its fills reports a host hit rate of 0, never below.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from recsys.capacities import Capacities, mismatch_warning
from recsys.table_names import feature_of
from recsys.tier_counters import COUNTERS, TierCounters

if TYPE_CHECKING:
    from recsys.bounded import BoundedTables

__all__ = [
    "BOUNDS_COUNTERS",
    "COUNTERS",
    "PREDICTION_TOLERANCE",
    "THRASH_HIT_RATE",
    "BoundsMetrics",
    "TierMetrics",
    "bounds_figures",
    "rates_of",
]

# A device tier that answers less than this share of a warm table's lookups thrashes.
THRASH_HIT_RATE = 0.5
# Measured hit rates this far below the predicted ones get a warning.
PREDICTION_TOLERANCE = 0.02


_EVICTIONS = COUNTERS.index("device_evictions")


def rates_of(c: Mapping[str, float]) -> dict[str, float]:
    """The two hit rates of one set of counters (``COUNTERS`` by name); 1.0 where nothing was asked."""
    requests = c["device_hits"] + c["device_misses"]
    below = c["ssd_rows_read"] + c["rows_initialised"]
    return {
        "device_hit_rate": c["device_hits"] / requests if requests else 1.0,
        "host_hit_rate": 1.0 - min(below, c["device_rows_in"]) / c["device_rows_in"]
        if c["device_rows_in"]
        else 1.0,
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
            if float(d[0] + d[1]) > 0 and float(d[_EVICTIONS]) > 0
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
            if requests and c["device_evictions"] > 0 and rates["device_hit_rate"] < THRASH_HIT_RATE:
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


# -- bounded tables -------------------------------------------------------------------------------------

# The counters of ``BoundedTables.counters()`` per table, in the order of the vectors summed over ranks:
# rows and candidates held now, then running totals.
BOUNDS_COUNTERS = (
    "rows",
    "candidates",
    "admitted_total",
    "expired_total",
    "capped_total",
    "default_lookups_total",
    "lookups_total",
)


def bounds_figures(c: Mapping[str, int], *, row_bytes: int) -> dict[str, Any]:
    """One bounded table's figures from its counters (``BOUNDS_COUNTERS`` by name) over a span: the totals
    as counted in the span, ``rows`` and ``candidates`` as held at its end; ``stored_bytes`` is ``rows``
    times ``row_bytes`` (a packed row: weights and optimizer state), the same tiered and in memory;
    ``default_share`` is NaN where the span looked nothing up."""
    lookups, default = int(c["lookups_total"]), int(c["default_lookups_total"])
    return {
        "candidates": int(c["candidates"]),
        "rows": int(c["rows"]),
        "stored_bytes": int(c["rows"]) * row_bytes,
        "admitted": int(c["admitted_total"]),
        "expired": int(c["expired_total"]),
        "capped": int(c["capped_total"]),
        "lookups": lookups,
        "default_lookups": default,
        "default_share": default / lookups if lookups else math.nan,
    }


class BoundsMetrics:
    """What the bounded tables decided, per table and log window and over the run, summed over ranks.

    The owners decide a step when its batch is routed, which a pipeline does ahead of training (tiered:
    the routing stage's lookahead; in memory: TorchRec's pipeline takes batches ahead), so the counters
    read at a log point would depend on how far ahead each run decided. Instead each rank's counters are
    recorded right after every step's decision (:meth:`recording`), and a window ending once ``s`` steps
    are trained reports the counters recorded after step ``s - 1``: tiered and in-memory runs, pipelined
    and sequential, report the same numbers.

    Args:
        bounded: this rank's bounded tables (the binding's ``bounded``: :mod:`recsys.binding`), with
            their state as the run starts (a resumed run's totals include the steps before the resume).
        row_bytes: table name -> bytes of one stored row (float32 weights and optimizer state).
        world_size: ranks of the run (the figures are over all of them).

    Example::

        metrics = BoundsMetrics(bounded, row_bytes={"t_cat_0": 36}, world_size=1)
        with metrics.recording():
            ...  # train steps 0 .. 99
            figures = metrics.window(100)  # collective
    """

    def __init__(self, bounded: BoundedTables, *, row_bytes: Mapping[str, int], world_size: int) -> None:
        self.bounded = bounded
        self.names = sorted(bounded.rules)
        self.row_bytes = {name: int(row_bytes[name]) for name in self.names}
        self.world_size = world_size
        self._lock = threading.Lock()  # decisions are recorded on the routing stage's thread
        self._decided: dict[int, np.ndarray] = {}  # step -> (T, K) counters after its decision
        self._latest = self._counters()  # (T, K) the counters after the last step taken from _decided
        self._window_start = self._latest

    def _counters(self) -> np.ndarray:
        """(T, K) int64: this rank's ``BOUNDS_COUNTERS`` of every bounded table (zeros where not held)."""
        held = self.bounded.counters()
        out = np.zeros((len(self.names), len(BOUNDS_COUNTERS)), dtype=np.int64)
        for i, name in enumerate(self.names):
            if name in held:
                out[i] = [held[name][key] for key in BOUNDS_COUNTERS]
        return out

    @contextlib.contextmanager
    def recording(self) -> Iterator[BoundsMetrics]:
        """Record this rank's counters after every step's decision while the context is open (an observer
        of this ``BoundedTables``, removed on exit)."""

        def recorded(step: int) -> None:
            counters = self._counters()
            with self._lock:
                self._decided[int(step)] = counters

        self.bounded.observe(recorded)
        try:
            yield self
        finally:
            self.bounded.unobserve(recorded)

    def _at(self, steps: int) -> np.ndarray:
        """(T, K) this rank's counters once steps ``0 .. steps - 1`` are decided (later ones excluded)."""
        with self._lock:
            for step in sorted(s for s in self._decided if s < steps):
                self._latest = self._decided.pop(step)
        return self._latest

    def _sum(self, matrices: np.ndarray) -> np.ndarray:
        total = torch.from_numpy(np.ascontiguousarray(matrices, dtype=np.int64))
        if self.world_size > 1:
            dist.all_reduce(total)
        return total.numpy()

    def _figures(self, end: np.ndarray, start: np.ndarray) -> dict[str, Any]:
        """``{"default_share", "tables": {name: figures}}`` of the span from ``start`` to ``end``."""
        span = end - start
        span[:, :2] = end[:, :2]  # rows and candidates: as held at the end
        tables = {
            name: bounds_figures(
                dict(zip(BOUNDS_COUNTERS, row.tolist(), strict=True)), row_bytes=self.row_bytes[name]
            )
            for name, row in zip(self.names, span, strict=True)
        }
        lookups = sum(t["lookups"] for t in tables.values())
        default = sum(t["default_lookups"] for t in tables.values())
        return {"default_share": default / lookups if lookups else math.nan, "tables": tables}

    def window(self, steps: int) -> dict[str, Any]:
        """The figures of the steps decided since the previous window, up to step ``steps - 1``, over all
        ranks (collective): per table ``candidates`` and ``rows`` held at the window's end,
        ``stored_bytes``, and ``admitted``, ``expired``, ``capped``, ``lookups``, ``default_lookups`` and
        ``default_share`` in the window; ``default_share`` over every bounded table beside them."""
        now = self._at(steps)
        both = self._sum(np.stack([now, self._window_start]))
        self._window_start = now
        return self._figures(both[0], both[1])

    def over_run(self, steps: int) -> dict[str, Any]:
        """The figures of the whole run up to step ``steps - 1`` (a resumed run's earlier steps included:
        the totals are part of the checkpoint), over all ranks (collective), shaped like :meth:`window`'s."""
        end = self._sum(self._at(steps))
        return self._figures(end, np.zeros_like(end))
