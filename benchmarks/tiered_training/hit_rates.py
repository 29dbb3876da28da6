"""Experiment 5 of ``bench_pipeline.py``: device hit rates of LOOKAHEAD and LRU on the same Zipf id trace,
against Belady's optimum simulated offline on the trace recorded during the LOOKAHEAD run."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from harness import emit

from recsys.data.batch import Batch
from recsys.distributed import DistEnv
from recsys.tiered import TRAIN, RoutedBatch, TieredTables
from recsys.tune.trace import belady_hits
from tiered_training.runs import sized, train_once, zipf_space


class TraceRecorder:
    """What a tier binding from :meth:`tables` fills and releases: the per-batch unique-id trace of the
    training batches, and how many batches are in flight (filled, not yet released) at each fill."""

    def __init__(self) -> None:
        self.trace: list[dict[str, np.ndarray]] = []
        self.in_flight: set[int] = set()
        self.in_flight_at_fill: list[
            int
        ] = []  # batches pinned while each training batch fills, itself included

    def filled(self, routed: RoutedBatch) -> None:
        if routed.channel == TRAIN:
            assert routed.batch_id == len(self.trace), "batches are filled in order"
            self.trace.append({k: v.numpy().copy() for k, v in routed.owner_ids.items()})
            self.in_flight.add(routed.batch_id)
            self.in_flight_at_fill.append(len(self.in_flight))

    def released(self, batch_id: int) -> None:
        self.in_flight.discard(batch_id)

    def tables(self) -> type[TieredTables]:
        """A tier binding that reports every fill and release to this recorder before doing it."""
        recorder = self

        class TracingTables(TieredTables):
            def fill(self, routed: RoutedBatch) -> Batch:
                recorder.filled(routed)
                return super().fill(routed)

            def release(self, batch_id: int) -> None:
                recorder.released(batch_id)
                super().release(batch_id)

        return TracingTables


def hit_rates(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = sized(args, 300)
    device_rows = 8192
    base = [
        "model.embedding_dim=8",
        "model.dense_arch=[16, 8]",
        "model.over_arch=[16]",
        "synthetic.num_sparse=2",
        f"synthetic.id_space={zipf_space(args)}",
        "synthetic.zipf_alpha=1.05",
        "train.batch_size=1024",
        f"train.steps={steps}",
        "train.log_every=2" if args.smoke else "train.log_every=20",
        "store.tiered=true",
        f"store.device_rows={device_rows}",
        "store.host_rows=65536",
        f"store.lookahead={args.lookahead}",
        "pipeline.mode=pipelined",
    ]
    recorders = {policy: TraceRecorder() for policy in ("lookahead", "lru")}
    rates: dict[str, float] = {}
    for policy, recorder in recorders.items():
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            result = train_once(
                env,
                [*base, f"store.policy={policy}"],
                out_dir=Path(tmp),
                warmup_steps=0,
                tables=recorder.tables(),
            )
        # The training batches' device hit rate (the trainer's TierMetrics leaves the evaluation out).
        rates[policy] = result["train_device_hit_rate"]
        emit({"experiment": "hit_rates", "variant": policy, **result})
    look, lru = recorders["lookahead"], recorders["lru"]
    names = sorted(look.trace[0])
    for a, b in zip(look.trace, lru.trace, strict=True):  # the same id trace in both runs
        assert all(np.array_equal(a[n], b[n]) for n in names)
    counts = look.in_flight_at_fill[10:] or look.in_flight_at_fill  # steady state
    pinned = int(np.median(counts))

    def belady_rate(pins: int) -> float:
        hits = misses = 0
        for name in names:
            h, m = belady_hits([batch[name] for batch in look.trace], device_rows, pins)
            hits, misses = hits + h, misses + m
        return hits / (hits + misses)

    belady = belady_rate(pinned)
    out = {
        "lookahead_hit_rate": rates["lookahead"],
        "lru_hit_rate": rates["lru"],
        "belady_hit_rate": belady,
        "lookahead_vs_belady": rates["lookahead"] / belady,
        "lookahead_depth": args.lookahead,
        "hit_rate_device_rows": device_rows,
        "hit_rate_batches_in_flight": pinned,
        "hit_rate_batches_in_flight_max": max(counts),
        "belady_unpinned_hit_rate": belady_rate(1),
        "hit_rate_unique_ids_per_batch": float(
            np.mean([sum(b[n].shape[0] for n in names) / len(names) for b in look.trace])
        ),
    }
    emit({"experiment": "hit_rates", **out})
    return out
