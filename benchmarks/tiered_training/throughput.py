"""Experiments 1 and 2 of ``bench_pipeline.py``: fits_cache (the working set fits the device tier) and
ssd_bound (Zipf tables 20x larger than the host tier), and the bounds their ratios are read against."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from harness import emit

from recsys.distributed import DistEnv
from tiered_training.runs import (
    MODEL,
    ZIPF_BATCH,
    alternate_runs,
    median,
    paired,
    sized,
    touched_rows,
    zipf_base,
    zipf_space,
)


def overlap_bound(sequential: list[dict[str, Any]]) -> float:
    """The pipelined/sequential speed-up that perfect overlap on two cores would give, from the
    sequential runs' own stage times: the tier stages (load, route, prefetch, fill) share one core and
    compute has the other, so the step falls from their sum to their maximum (the background writer,
    busy in both modes, is not counted)."""

    def one(r: dict[str, Any]) -> float:
        stages = dict(r["span_stage_ms"])
        compute = stages.pop("compute")
        tier = sum(stages.values())
        return (tier + compute) / max(tier, compute)

    return statistics.median(one(r) for r in sequential)


def cpu_bound(sequential: list[dict[str, Any]], parallelism: float) -> float:
    """The speed-up no schedule can beat on this machine: the sequential step over the sequential run's
    CPU time per step (every thread, the writer included) spread over the cores, which together run
    ``parallelism`` times as fast as one (``two_thread_speedup``: ~1.75 on an idle 2-vCPU machine here,
    not 2, because two busy threads slow each other down)."""
    return statistics.median(r["step_s"] * 1e3 / (r["cpu_ms_per_step"] / parallelism) for r in sequential)


def fits_cache(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    """8 tables of 10k ids, 10,240 device slots each: tiered pipelined vs untiered."""
    steps = sized(args, 120)
    space = 10_000
    base = [
        *MODEL,
        "synthetic.num_sparse=8",
        f"synthetic.id_space={space}",
        "train.batch_size=2048",
        f"train.steps={steps}",
        "train.log_every=2" if args.smoke else "train.log_every=10",
    ]
    variants = {
        "untiered": [*base, "store.tiered=false"],
        "tiered": [*base, "store.tiered=true", "store.device_rows=10240", "store.host_rows=10240"],
        # the same tiers with every stage on the training thread: their CPU without two threads' contention
        "sequential": [
            *base,
            "store.tiered=true",
            "store.device_rows=10240",
            "store.host_rows=10240",
            "pipeline.mode=sequential",
        ],
    }
    runs = alternate_runs(
        env, "fits_cache", variants, repeats=args.repeats, warmup_steps=steps // 3, root=args.dir
    )
    ratio = median(runs["tiered"], "samples_per_s") / median(runs["untiered"], "samples_per_s")
    fit_ratio = median(runs["tiered"], "fit_samples_per_s") / median(runs["untiered"], "fit_samples_per_s")
    out = {
        "fits_cache_tiered_vs_untiered": ratio,
        "fits_cache_paired": paired(runs["tiered"], runs["untiered"]),
        "fits_cache_whole_fit_ratio": fit_ratio,
        # CPU seconds per step, untiered over tiered: the tiers' cost without the scheduler's share in it
        "fits_cache_cpu_untiered_vs_tiered": median(runs["untiered"], "cpu_ms_per_step")
        / median(runs["tiered"], "cpu_ms_per_step"),
        "fits_cache_cpu_untiered_vs_tiered_sequential": median(runs["untiered"], "cpu_ms_per_step")
        / median(runs["sequential"], "cpu_ms_per_step"),
        "fits_cache_device_hit_rate": median(runs["tiered"], "device_hit_rate"),
    }
    emit({"experiment": "fits_cache", **out})
    return out


def ssd_bound(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    """4 Zipf tables of 2M ids, host tier 1/20 of the touched rows: pipelined vs sequential vs untiered."""
    steps, space = sized(args, 100), zipf_space(args)
    touched = touched_rows(space, batch=ZIPF_BATCH, steps=steps)
    host_rows = touched // 20
    tiered = ["store.tiered=true", "store.device_rows=8192", f"store.host_rows={host_rows}"]
    base = zipf_base(steps, space)
    variants = {
        "untiered": [*base, "store.tiered=false"],
        "pipelined": [*base, *tiered, "pipeline.mode=pipelined"],
        "sequential": [*base, *tiered, "pipeline.mode=sequential"],
        # the default lowers the stage threads' priority (pipeline.worker_nice); this run does not
        "pipelined_equal_priority": [*base, *tiered, "pipeline.mode=pipelined", "pipeline.worker_nice=0"],
    }
    runs = alternate_runs(
        env, "ssd_bound", variants, repeats=args.repeats, warmup_steps=steps // 5, root=args.dir
    )
    pipelined = median(runs["pipelined"], "samples_per_s")
    out = {
        "pipelined_vs_sequential": pipelined / median(runs["sequential"], "samples_per_s"),
        "ssd_bound_tiered_vs_untiered": pipelined / median(runs["untiered"], "samples_per_s"),
        "pipelined_vs_sequential_equal_priority": median(runs["pipelined_equal_priority"], "samples_per_s")
        / median(runs["sequential"], "samples_per_s"),
        "pipelined_vs_sequential_paired": paired(runs["pipelined"], runs["sequential"]),
        "pipelined_vs_sequential_whole_fit": median(runs["pipelined"], "fit_samples_per_s")
        / median(runs["sequential"], "fit_samples_per_s"),
        "pipelined_vs_sequential_overlap_bound": overlap_bound(runs["sequential"]),
        "pipelined_vs_sequential_cpu_bound": cpu_bound(
            runs["sequential"], min(float(os.cpu_count() or 1), args.two_thread_speedup)
        ),
        "ssd_bound_cpu_untiered_vs_tiered": median(runs["untiered"], "cpu_ms_per_step")
        / median(runs["pipelined"], "cpu_ms_per_step"),
        "ssd_bound_cpu_sequential_vs_pipelined": median(runs["sequential"], "cpu_ms_per_step")
        / median(runs["pipelined"], "cpu_ms_per_step"),
        "ssd_bound_touched_rows_per_table": touched,
        "ssd_bound_host_rows": host_rows,
        "ssd_bound_device_hit_rate": median(runs["pipelined"], "device_hit_rate"),
    }
    emit({"experiment": "ssd_bound", **out})
    return out
