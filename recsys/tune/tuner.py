"""``recsys tune-cache``: replay a run's id stream, compute hit-rate curves, recommend capacities.

Steps: :func:`~recsys.tune.replay.replay` the training run's batches (every rank's share, routed to the
owners); per table and owner, simulate the configured policy (and LRU, LFU, Belady for comparison) on a
grid of capacities, sampling large traces spatially; split the device budget across tables to save the
most bytes of device fills, then the host budget to save the most bytes of LMDB reads (the host tier is
exclusive of the device tier, so device + host behaves like one cache of their summed size); finally
simulate the chosen capacities exactly for the predicted hit rates.

Budgets are totals over all ranks: a row-wise table holds its device and host rows on every rank.

``host_hit_rate`` is the share of rows filled into the device tier that come from host DRAM rather than
from LMDB or a first initialisation — ``1 - (ssd_rows_read + rows_initialised) / device_rows_in`` in the
store's counters, which is what ``recsys train`` measures. Both it and ``device_hit_rate`` are over the
training batches; evaluation batches are replayed (they move rows) but not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelines import PipelineMode
from recsys.config import RunConfig
from recsys.errors import UserError
from recsys.tiered import row_bytes, slot_row_bytes
from recsys.tune.curves import capacity_grid, lru_curve, policy_curve
from recsys.tune.replay import Replay, replay
from recsys.tune.split import split_budget
from recsys.tune.trace import SIM_POLICIES, SimPolicy, Trace, min_capacity, prepare, simulate

__all__ = ["TuneResult", "min_device_rows", "min_device_rows_by_feature", "tune", "SAMPLE_ABOVE_ACCESSES"]

# Traces of more accesses than this are sampled spatially down to about this many for the predictions at
# the chosen capacities, and curves on the capacity grid use samples of about CURVE_SAMPLE_ACCESSES.
# A sample keeps at least MIN_SAMPLED_IDS (curves: MIN_CURVE_IDS) distinct ids: small id spaces stay exact.
SAMPLE_ABOVE_ACCESSES = 1_000_000
CURVE_SAMPLE_ACCESSES = 300_000
MIN_SAMPLED_IDS = 100_000
MIN_CURVE_IDS = 20_000
GRID_POINTS = 10
# Batches of fills the host tier must hold for the prefetcher (the one it reads, the one the fill takes).
PREFETCH_BATCHES = 2
CANDIDATES = 48


@dataclass
class _Table:
    name: str
    feature: str
    traces: list[Trace]  # per owner, possibly sampled
    prepared: list[tuple[np.ndarray, np.ndarray]]
    curve_traces: list[Trace]  # per owner, sampled harder for the grid of curves
    curve_prepared: list[tuple[np.ndarray, np.ndarray]]
    min_rows: int  # per owner
    distinct: int  # most distinct ids of one owner
    row_bytes: int
    slot_bytes: int  # of a device-tier slot (recsys.tiered.slot_row_bytes)
    owners: int
    pinned: int  # training batches in flight at a fill (recsys.tune.replay.batches_in_flight)
    memo: dict[tuple[int, SimPolicy, int], tuple[float, float, float, float]] = field(default_factory=dict)
    per_batch: dict[tuple[int, SimPolicy, int], list[np.ndarray]] = field(default_factory=dict)

    def run(self, capacity: int, policy: SimPolicy, lookahead: int) -> tuple[float, float, float, float]:
        """(weighted hits, weighted requests, rows filled per training batch, the most rows one batch
        filled on one owner) over the owners."""
        key = (capacity, policy, lookahead)
        if key in self.memo:
            return self.memo[key]
        hits = requests = fills = peak = 0.0
        for trace, prep in zip(self.traces, self.prepared, strict=True):
            scaled = max(1, int(round(capacity * trace.sample_rate)))
            res = simulate(
                trace,
                scaled,
                policy=policy,
                lookahead=lookahead,
                pinned_batches=self.pinned,
                prepared=prep,
            )
            hits += res.hits
            requests += res.requests
            fills += res.miss_rows / trace.sample_rate / max(1, trace.num_train_batches)
            peak = max(peak, res.peak_miss_rows / trace.sample_rate)
            assert res.batch_miss_rows is not None
            self.per_batch.setdefault(key, []).append(res.batch_miss_rows / trace.sample_rate)
        self.memo[key] = (hits, requests, fills, peak)
        return self.memo[key]

    def overflow(self, capacity: int, host_rows: int, policy: SimPolicy, lookahead: int) -> float:
        """Rows per training batch read twice: the prefetcher reads a batch's rows that no tier holds into
        the host tier, which keeps at most ``host_rows`` of them; the fill reads the rest again. The rows
        it reads are the misses of the device + host cache (``capacity`` rows)."""
        self.run(capacity, policy, lookahead)
        parts = self.per_batch[(capacity, policy, lookahead)]
        return sum(float(np.maximum(m - host_rows, 0).sum()) / max(1, m.shape[0]) for m in parts)

    def curves(self, grid: np.ndarray, policy: SimPolicy, lookahead: int) -> tuple[np.ndarray, np.ndarray]:
        """(hit rates, rows filled per training batch) of ``policy`` at ``grid``, summed over owners."""
        hit_sum = np.zeros(grid.shape[0])
        req_sum = 0.0
        fills = np.zeros(grid.shape[0])
        for trace, prep in zip(self.curve_traces, self.curve_prepared, strict=True):
            curve = policy_curve(
                trace, grid, policy=policy, lookahead=lookahead, pinned_batches=self.pinned, prepared=prep
            )
            req = float(trace.weights.sum())
            hit_sum += curve.hit_rates * req
            req_sum += req
            fills += curve.miss_rows
        return hit_sum / max(req_sum, 1e-12), fills

    def lru_stack(self, grid: np.ndarray) -> np.ndarray:
        hit_sum = np.zeros(grid.shape[0])
        req_sum = 0.0
        for trace in self.traces:
            req = float(trace.weights.sum())
            hit_sum += lru_curve(trace, grid).hit_rates * req
            req_sum += req
        return hit_sum / max(req_sum, 1e-12)


@dataclass
class TuneResult:
    """What ``tune-cache`` writes: ``doc`` is tune.json; ``curves`` feed the plots."""

    doc: dict[str, Any]
    curves: dict[str, dict[str, list[float]]]


def table_min_rows(traces: list[Trace], pinned_batches: int) -> int:
    """Device rows per owner that one table needs: the most of any owner's :func:`min_capacity`."""
    return max(min_capacity(t, pinned_batches=pinned_batches) for t in traces)


def min_device_rows_by_feature(
    config: RunConfig, *, world_size: int, batches: int | None = None, features: list[str] | None = None
) -> dict[str, int]:
    """Per tiered feature (or those of ``features``), the fewest device slots per owning rank with which
    ``config`` trains on ``world_size`` ranks: the ``min_device_rows`` of ``recsys tune-cache`` (which
    replays the same batches, ``train.nproc`` ranks), from one replay of the first ``batches`` training
    steps (default ``train.steps``, the whole run with its final evaluation).

    A smaller capacity fails the run with the store's capacity error, for certain in
    ``pipeline.mode = "sequential"`` and when the fill stage wins its race in ``pipelined`` mode.

    Raises:
        UserError: the config has no tiered tables, or a feature of ``features`` is not tiered.
    """
    rep = replay(config, batches=batches, world_size=world_size, features=features)
    return {
        rep.features[name]: table_min_rows(traces, rep.pinned_batches) for name, traces in rep.traces.items()
    }


def min_device_rows(config: RunConfig, feature: str, *, world_size: int, batches: int | None = None) -> int:
    """The fewest device slots per owning rank that the table of ``feature`` needs to train ``config`` on
    ``world_size`` ranks (see :func:`min_device_rows_by_feature`; only that table is traced)."""
    return min_device_rows_by_feature(config, world_size=world_size, batches=batches, features=[feature])[
        feature
    ]


def _sample(trace: Trace, accesses: int, min_ids: int) -> Trace:
    """``trace``, or a spatial sample of about ``accesses`` accesses (and at least ``min_ids`` ids)."""
    rate = max(accesses / max(1, trace.ids.shape[0]), min_ids / max(1, trace.num_ids))
    return trace.sample(rate) if rate < 1 else trace


def _interp_fills(grid: np.ndarray, fills: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    ok = ~np.isnan(fills)
    return np.interp(capacity, grid[ok], fills[ok])


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def tune(
    config: RunConfig, *, device_budget: int, host_budget: int, batches: int | None = None
) -> TuneResult:
    """Recommend per-table device and host rows for ``config`` under the two budgets (bytes, all ranks).

    Raises:
        UserError: the device budget cannot hold the batches in flight (the message states the minimum),
            or the config has no tiered tables.
    """
    rep: Replay = replay(config, batches=batches)
    policy = config.store.policy
    lookahead = config.store.lookahead if config.pipeline.mode is PipelineMode.PIPELINED else 0
    rbytes = row_bytes(config.sparse, config.model.table_dim)
    sbytes = slot_row_bytes(config.sparse, config.model.table_dim)
    tables: list[_Table] = []
    for name, traces in rep.traces.items():
        sampled = [_sample(trace, SAMPLE_ABOVE_ACCESSES, MIN_SAMPLED_IDS) for trace in traces]
        for_curves = [_sample(trace, CURVE_SAMPLE_ACCESSES, MIN_CURVE_IDS) for trace in traces]
        tables.append(
            _Table(
                name=name,
                feature=rep.features[name],
                traces=sampled,
                prepared=[prepare(t) for t in sampled],
                curve_traces=for_curves,
                curve_prepared=[prepare(t) for t in for_curves],
                min_rows=table_min_rows(traces, rep.pinned_batches),
                distinct=max(max(t.num_ids for t in traces), 1),
                row_bytes=rbytes,
                slot_bytes=sbytes,
                owners=len(traces),
                pinned=rep.pinned_batches,
            )
        )
    min_bytes = sum(t.min_rows * t.slot_bytes * t.owners for t in tables)
    if device_budget < min_bytes:
        worst = ", ".join(f"{t.name} {t.min_rows} rows" for t in tables)
        raise UserError(
            f"--device-budget {_format_bytes(device_budget)} cannot hold the batches in flight: the tiered "
            f"tables need at least {_format_bytes(min_bytes)} ({min_bytes} bytes: {worst} per owner, "
            f"{sbytes} bytes a row, {rep.pinned_batches} training batches pinned)"
        )

    # Curves of every policy on a grid per table (full-trace rows), for the report and the split.
    curves: dict[str, dict[str, list[float]]] = {}
    fills_of: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for t in tables:
        grid = capacity_grid(t.min_rows, t.distinct, GRID_POINTS).astype(np.float64)
        # The split reads the configured policy's curve between grid points: sample it more densely.
        fine = capacity_grid(t.min_rows, t.distinct, 2 * GRID_POINTS).astype(np.float64)
        _, fine_fills = t.curves(fine, policy, lookahead)
        fills_of[t.name] = (fine, fine_fills)
        entry: dict[str, list[float]] = {"capacity": grid.tolist()}
        for p in SIM_POLICIES:
            rates, _ = t.curves(grid, p, lookahead)
            entry[p.value] = rates.tolist()
        entry["lru_stack"] = t.lru_stack(grid).tolist()
        curves[t.name] = entry

    # Device split: save the most bytes of rows filled into the device tier.
    n = len(tables)
    equal_device = [int(device_budget / n // (t.slot_bytes * t.owners)) for t in tables]
    costs, values, options = [], [], []
    for t, eq in zip(tables, equal_device, strict=True):
        grid, fills = fills_of[t.name]
        caps = np.unique(
            np.concatenate(
                [np.linspace(t.min_rows, t.distinct, CANDIDATES).round(), [eq] if eq >= t.min_rows else []]
            ).astype(np.int64)
        )
        caps = caps[caps >= t.min_rows]
        saved = _interp_fills(grid, fills, caps[:1]) - _interp_fills(grid, fills, caps)
        options.append(caps)
        costs.append(caps * t.slot_bytes * t.owners)
        values.append(saved * t.row_bytes)
    pick = split_budget(costs, values, device_budget)
    assert pick is not None  # the minimum fits (checked above)
    device_rows = [int(options[i][k]) for i, k in enumerate(pick)]
    # Leftover budget (grid rounding) goes to the tables in proportion to their rows, capped at their ids.
    spare = device_budget - sum(d * t.slot_bytes * t.owners for d, t in zip(device_rows, tables, strict=True))
    for i, t in enumerate(tables):
        extra = int(spare / n // (t.slot_bytes * t.owners))
        device_rows[i] = min(t.distinct, device_rows[i] + max(0, extra))

    # Host split given the device rows: save the most bytes of LMDB reads (device + host as one cache).
    # The prefetcher parks a batch's rows in the host tier before the fill takes them; a host tier too
    # small for that reads some from LMDB twice, so the options are none (no prefetch), or at least
    # PREFETCH_BATCHES batches' worth of fills.
    equal_host = [int(host_budget / n // (t.row_bytes * t.owners)) for t in tables]

    def host_split(device_rows: list[int]) -> list[int]:
        costs, values, options = [], [], []
        for t, d, eq in zip(tables, device_rows, equal_host, strict=True):
            grid, fills = fills_of[t.name]
            room = max(0, t.distinct - d)
            floor = min(room, int(math.ceil(PREFETCH_BATCHES * t.run(d, policy, lookahead)[3])))
            hs = np.concatenate([[0], np.linspace(floor, room, CANDIDATES).round(), [min(eq, room)]])
            hs = np.unique(hs.astype(np.int64))
            hs = hs[(hs == 0) | (hs >= floor)]
            saved = _interp_fills(grid, fills, np.array([d])) - _interp_fills(grid, fills, d + hs)
            options.append(hs)
            costs.append(hs * t.row_bytes * t.owners)
            values.append(saved * t.row_bytes)
        pick = split_budget(costs, values, host_budget)
        assert pick is not None  # zero host rows always fit
        return [int(options[i][k]) for i, k in enumerate(pick)]

    def predict(device: list[int], host: list[int]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        per: dict[str, dict[str, float]] = {}
        tot_hits = tot_req = tot_fills = tot_ssd = 0.0
        for t, d, h in zip(tables, device, host, strict=True):
            hits, req, fills, _ = t.run(d, policy, lookahead)
            below = fills
            if h:
                below = t.run(d + h, policy, lookahead)[2] + t.overflow(d + h, h, policy, lookahead)
            per[t.name] = {
                "predicted_device_hit_rate": hits / req if req else 1.0,
                "predicted_host_hit_rate": 1.0 - below / fills if fills else 1.0,
                "device_rows_filled_per_step": fills,
                "ssd_rows_per_step": below,
            }
            tot_hits, tot_req, tot_fills, tot_ssd = (
                tot_hits + hits,
                tot_req + req,
                tot_fills + fills,
                tot_ssd + below,
            )
        total = {
            "predicted_device_hit_rate": tot_hits / tot_req if tot_req else 1.0,
            "predicted_host_hit_rate": 1.0 - tot_ssd / tot_fills if tot_fills else 1.0,
            "device_rows_filled_per_step": tot_fills,
            "ssd_rows_per_step": tot_ssd,
        }
        return per, total

    # The split works on interpolated curves; simulate the candidates exactly and keep the best. An even
    # split of the device budget (when it holds every table's batches) competes too: it is optimal when
    # the tables are alike.
    host_rows = host_split(device_rows)
    chosen, total = predict(device_rows, host_rows)
    equal_ok = all(e >= t.min_rows for e, t in zip(equal_device, tables, strict=True))
    equal = predict(equal_device, equal_host)[1] if equal_ok else None
    if equal is not None:
        alternatives = [(equal_device, equal_host), (equal_device, host_split(equal_device))]
        if device_rows != equal_device:
            alternatives.append((device_rows, host_rows))
        ranked: list[tuple[Any, ...]] = []
        for dev, host in alternatives:
            per, tot = predict(dev, host)
            ranked.append(
                (
                    -tot["predicted_device_hit_rate"],
                    tot["ssd_rows_per_step"],
                    len(ranked),
                    dev,
                    host,
                    per,
                    tot,
                )
            )
        ranked.sort(key=lambda r: r[:3])
        best_dev, best_host, best_per, best_tot = ranked[0][3:]
        if best_tot["predicted_device_hit_rate"] > total["predicted_device_hit_rate"] or (
            best_tot["predicted_device_hit_rate"] == total["predicted_device_hit_rate"]
            and best_tot["ssd_rows_per_step"] < total["ssd_rows_per_step"]
        ):
            device_rows, host_rows, chosen, total = best_dev, best_host, best_per, best_tot

    doc: dict[str, Any] = {
        "batches": rep.train_batches,
        "world_size": rep.world_size,
        "sharding": "row_wise" if rep.row_wise else "table_wise",
        "policy": policy.value,
        "lookahead": lookahead,
        "pinned_batches": rep.pinned_batches,
        "device_budget_bytes": device_budget,
        "host_budget_bytes": host_budget,
        "device_bytes": sum(d * t.slot_bytes * t.owners for d, t in zip(device_rows, tables, strict=True)),
        "host_bytes": sum(h * t.row_bytes * t.owners for h, t in zip(host_rows, tables, strict=True)),
        "tables": {},
        "total": total,
        "equal_split": None
        if equal is None
        else {
            "device_rows": dict(zip([t.name for t in tables], equal_device, strict=True)),
            "host_rows": dict(zip([t.name for t in tables], equal_host, strict=True)),
            **equal,
        },
    }
    for t, d, h in zip(tables, device_rows, host_rows, strict=True):
        doc["tables"][t.name] = {
            "feature": t.feature,
            "device_rows": d,
            "host_rows": h,
            **chosen[t.name],
            "row_bytes": t.row_bytes,
            "slot_bytes": t.slot_bytes,
            "owners": t.owners,
            "min_device_rows": t.min_rows,
            "distinct_ids": t.distinct,
            "sample_rate": min(tr.sample_rate for tr in t.traces),
        }
    doc["snippet"] = snippet(doc)
    return TuneResult(doc=doc, curves=curves)


def snippet(doc: dict[str, Any]) -> str:
    """TOML to paste into a config: explicit per-table capacities (or ``capacities_from``)."""
    lines = ["[store.capacity]   # from recsys tune-cache (rows per owning rank)"]
    for entry in doc["tables"].values():
        lines.append(
            f"{entry['feature']} = {{ device = {entry['device_rows']}, host = {entry['host_rows']} }}"
        )
    return "\n".join(lines) + "\n"


def finite(x: float) -> float | None:
    return None if math.isnan(x) else x
