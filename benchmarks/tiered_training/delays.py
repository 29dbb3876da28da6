"""Experiment 4 of ``bench_pipeline.py``: a tiny model with injected stage delays, pipelined vs
sequential, the step against the slowest stage and against the sum of the stages."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import emit

from recsys.data.batch import Batch
from recsys.distributed import DistEnv
from recsys.tiered import TRAIN, RoutedBatch, TieredTables
from recsys.trainer import Trainer
from tiered_training.runs import alternate_runs, median, sized


def slow_tables(ssd_s: float, route_s: float) -> type[TieredTables]:
    """A tier binding whose SSD read (``prefetch``) and key routing (``route``) first sleep ``ssd_s`` and
    ``route_s`` seconds (sleeps release the GIL, as the real stages do in I/O and collectives)."""

    class SlowTables(TieredTables):
        def prefetch(self, routed: RoutedBatch) -> None:
            time.sleep(ssd_s)
            super().prefetch(routed)

        def route(self, batch_id: int, batch: Batch, *, channel: str = TRAIN) -> RoutedBatch:
            time.sleep(route_s)
            return super().route(batch_id, batch, channel=channel)

    return SlowTables


def delays(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = sized(args, 100)
    ssd_ms, route_ms, compute_ms = (float(x) for x in args.delays_ms.split(","))
    base = [
        "model.embedding_dim=8",
        "model.dense_arch=[16, 8]",
        "model.over_arch=[16]",
        "synthetic.num_sparse=4",
        "synthetic.id_space=100000",
        "train.batch_size=256",
        f"train.steps={steps}",
        "train.log_every=2" if args.smoke else "train.log_every=10",
        "store.tiered=true",
        "store.device_rows=4096",
        "store.host_rows=4096",
    ]

    def compute_hook(trainer: Trainer) -> None:  # compute: a sleep after every forward of the model
        trainer.dmp.register_forward_hook(lambda *_: time.sleep(compute_ms / 1e3))

    variants = {
        "pipelined": [*base, "pipeline.mode=pipelined"],
        "sequential": [*base, "pipeline.mode=sequential"],
    }
    runs = alternate_runs(
        env,
        "delays",
        variants,
        repeats=args.repeats,
        warmup_steps=min(20, steps // 3),
        root=args.dir,
        tables=slow_tables(ssd_ms / 1e3, route_ms / 1e3),
        prepare=compute_hook,
    )
    p_ratio = statistics.median(
        r["span_step_ms"] / max(r["span_stage_ms"].values()) for r in runs["pipelined"]
    )
    s_ratio = statistics.median(
        r["span_step_ms"] / sum(r["span_stage_ms"].values()) for r in runs["sequential"]
    )
    out = {
        "step_vs_slowest_stage": p_ratio,
        "sequential_step_vs_sum": s_ratio,
        "delays_pipelined_vs_sequential": median(runs["sequential"], "span_step_ms")
        / median(runs["pipelined"], "span_step_ms"),
        "delays_ms": {"ssd_read": ssd_ms, "key_routing": route_ms, "compute": compute_ms},
        "delays_pipelined_stage_ms": runs["pipelined"][0]["span_stage_ms"],
        "delays_pipelined_step_ms": median(runs["pipelined"], "span_step_ms"),
        "delays_sequential_step_ms": median(runs["sequential"], "span_step_ms"),
    }
    emit({"experiment": "delays", **out})
    return out
