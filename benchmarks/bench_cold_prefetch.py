"""Tier prefetch over a cold LMDB file against the same steps over cached pages, in one run.

The stage calls of ``bench_stage_cpu.Driver`` (route s+3, prefetch s+2, fill s+1, release s-2) drive a store
of 4 Zipf(1.05) tables of 2 M ids (dim 64 + row-wise Adagrad, an 8,192-slot device tier and an 8,192-row
host tier per table). A first pass of ``--fill-steps`` steps writes the store; then, ``--repeats`` times,
alternating, a copy of it is opened either with ``data.mdb`` dropped from the page cache (``cold``) or as
it is (``warm``) and ``--steps`` further steps run with ``--compute-ms`` of sleep per step standing in for
the training step. Per variant (medians over the repeats): wall ms per step, prefetch wall ms per step, the
prefetch's LMDB reads (``TieredTable.read_plan``) ms per step, process CPU ms per step, major page
faults per step, and the blocks the prefetch read per step. The LAST line is one JSON object with those
and ``cold_prefetch_vs_warm`` (warm prefetch ms / cold prefetch ms: 1 would mean the disk costs nothing).

Usage: python benchmarks/bench_cold_prefetch.py [--steps 300] [--repeats 2] [--compute-ms 20] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_stage_cpu as stage
import numpy as np
from harness import alternate, emit, machine_info
from tiered_training.cold import drop_page_cache

SHAPE = stage.Shape("ssd_bound", tables=4, id_space=2_000_000, device_rows=8192, host_rows=8192)
DIM = 64


def batches(steps: int) -> dict[int, Any]:
    rng = np.random.default_rng(0)
    keys = [f"f{i}" for i in range(SHAPE.tables)]
    return {
        s: stage.make_batch(
            [stage.zipf_ids(rng, SHAPE.ids_per_table, SHAPE.id_space, SHAPE.alpha, salt=1000 * t + 7)
             for t in range(SHAPE.tables)],
            keys,
        )
        for s in range(-1, steps + 4)
    }  # fmt: skip


def majflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def timed(fn: Any, acc: list, rows: Any = None) -> Any:
    """``fn`` adding its wall seconds to ``acc[0]`` (and ``rows(arg)`` to ``acc[1]``) at every call."""

    def call(arg: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(arg)
        finally:
            acc[0] += time.perf_counter() - start
            if rows is not None:
                acc[1] += rows(arg)

    return call


def run(base: Path, work: Path, variant: str, first: int, steps: int, compute_ms: float, data: dict) -> dict:
    """``steps`` steps from ``first`` on a copy of the filled store, its file cold or cached."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    os.sync()
    if variant == "cold":
        drop_page_cache(work / "data.mdb")
    driver = stage.Driver(SHAPE, work, DIM, stage.Timers())
    reads, prefetch = [0.0, 0], [0.0]  # seconds in the tables' LMDB reads and rows read; in prefetch
    for table in driver.store._tables.values():  # noqa: SLF001 - timed on this run's store only
        table.read_plan = timed(table.read_plan, reads, lambda plan: plan.ids.shape[0])  # type: ignore[method-assign]
    driver.prefetch = timed(driver.prefetch, prefetch)  # type: ignore[method-assign]
    driver.start(first, data.__getitem__)
    wall0, cpu0, faults0 = time.perf_counter(), time.process_time(), majflt()
    for s in range(first, first + steps):
        driver.step(s, data.__getitem__)
        time.sleep(compute_ms / 1e3)
    out = {
        "variant": variant,
        "wall_ms_per_step": (time.perf_counter() - wall0) / steps * 1e3,
        "prefetch_ms_per_step": prefetch[0] / steps * 1e3,
        "lmdb_read_ms_per_step": reads[0] / steps * 1e3,
        "cpu_ms_per_step": (time.process_time() - cpu0) / steps * 1e3,
        "major_faults_per_step": (majflt() - faults0) / steps,
        "rows_read_per_step": reads[1] / steps,
    }
    driver.store.close(flush=False)
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fill-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_cold_prefetch_"))
    emit(machine_info())
    data = batches(args.fill_steps + args.steps)
    base = root / "filled"
    shutil.rmtree(base, ignore_errors=True)
    filler = stage.Driver(SHAPE, base, DIM, stage.Timers())
    filler.start(-1, data.__getitem__)
    for s in range(-1, args.fill_steps - 1):
        filler.step(s, data.__getitem__)
    filler.store.close()
    first = args.fill_steps - 1

    def one(variant: str, repeat: int) -> dict:
        result = run(base, root / "work", variant, first, args.steps, args.compute_ms, data)
        result["repeat"] = repeat
        emit(result)
        return result

    runs = alternate(["cold", "warm"], args.repeats, one)
    summary: dict[str, Any] = {}
    for variant, results in runs.items():
        for key in results[0]:
            if key.endswith("_per_step"):
                summary[f"{variant}_{key}"] = statistics.median(r[key] for r in results)
    summary["cold_prefetch_vs_warm"] = (
        summary["warm_prefetch_ms_per_step"] / summary["cold_prefetch_ms_per_step"]
    )
    summary.update(steps=args.steps, repeats=args.repeats, compute_ms=args.compute_ms)
    shutil.rmtree(root, ignore_errors=True)
    emit(summary)


if __name__ == "__main__":
    main()
