"""CPU cost of the tier stages per routed id, next to the floor of the same work in raw torch and py-lmdb.

Every id of every batch passes through key routing, tier prefetch, device fill and write-back on host
threads (recsys/tiered.py's ``tiered_feed``). This program drives those calls in one thread, in the order
the pipeline makes them (the routing stage announces batch s+3, the prefetch stage reads batch s+2, the
fill stage makes batch s+1 resident while the consumer trains batch s, and batch s-2 is released after its
backward), and measures the CPU time of each call with ``time.thread_time_ns`` — what the stage threads
spend, whatever else runs on the machine. The background writer's CPU comes from
``/proc/self/task/<tid>/schedstat`` of the thread named ``tierrec-writer`` (and so does that of any other
thread of the process, e.g. reader threads of the backend, reported by name).

Per step and table the calls are the ones ``TieredTables`` makes on one rank:

- route: ``values_by_feature`` + ``Router.route`` (``torch.unique`` per table) + ``TieredStore.lookahead``;
- prefetch: ``TieredStore.prefetch``;
- fill: ``TieredStore.make_resident`` + ``Router.return_slots`` + the KJT of slot ids;
- release: ``TieredStore.release`` (its unpins are applied by the next locked call, counted there).

The floor, measured in the same run on the same ids: ``torch.unique(return_inverse=True)`` of each
table's ids of the step, an ``index_select`` of the step's unique rows from the slot table, and for
``ssd_bound`` raw py-lmdb: ``getmulti`` of the keys of the rows the store read from LMDB in the step (from
a second environment holding the same keys) and a sorted ``putmulti(append=True)`` of the rows the writer
committed, transaction for transaction; the two LMDB parts are the median of ``--floor-repeats`` runs
over all the measured steps' rows (on a shared machine single ones vary by +-20%).

Shapes:

- fits_cache: 8 tables of 10k-id Zipf(1.05) id spaces, 2,048 ids per table per step, 10,240 device slots
  per table: after a warm-up pass over every id, every lookup hits the device tier.
- ssd_bound: 4 tables of 2M-id Zipf(1.05) id spaces, 2,048 ids per table per step, a device tier of
  ``--ssd-device-rows`` slots and a host tier of ``--ssd-host-rows`` rows, so LMDB is read and written
  every step.

Prints each shape's figures and, as its LAST line, one JSON object: per shape ``stage_cpu_ns_per_id``,
``floor_ns_per_id``, ``ratio`` and the per-call breakdown (``calls_ns_per_id``), plus with ``--profile N``
the N functions of most own CPU (cProfile, ns per id) over extra steps after the measured ones.

Usage: python benchmarks/bench_stage_cpu.py [--steps 200] [--shapes fits_cache,ssd_bound] [--profile 15]
       [--smoke]   (seconds at tiny sizes: the code path, not a measurement)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import lmdb
import numpy as np
import torch
from stage_cpu.driver import Driver, Shape, Timers, make_batch, other_threads_cpu_ns, zipf_ids
from stage_cpu.floor import CapturingBackend, floor_step, lmdb_floor
from stage_cpu.trainer import run_trainer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedding_store import StoreStats, Tier


def run_shape(shape: Shape, args: argparse.Namespace, root: Path) -> dict[str, object]:
    rng = np.random.default_rng(args.seed)
    keys = [f"f{i}" for i in range(shape.tables)]
    total = args.warmup + args.steps + args.profile_steps + 8
    cover = -(-shape.id_space // shape.ids_per_table) if shape.id_space <= shape.device_rows else 0
    # fits_cache: a first pass over every id of the space (so that all later lookups hit), then Zipf.
    batches: dict[int, KeyedJaggedTensor] = {}
    for s in range(cover + total):
        if s < cover:
            part = np.arange(s * shape.ids_per_table, (s + 1) * shape.ids_per_table) % shape.id_space
            vals = [part.astype(np.int64)] * shape.tables
        else:
            vals = [
                zipf_ids(rng, shape.ids_per_table, shape.id_space, shape.alpha, salt=1000 * t + 7)
                for t in range(shape.tables)
            ]
        batches[s] = make_batch(vals, keys)
    timers = Timers()
    driver = Driver(shape, root / shape.name, args.dim, timers, wrap=CapturingBackend)
    capture = driver.backend
    assert isinstance(capture, CapturingBackend)
    batch_of = batches.__getitem__
    first = -1  # step -1 fills batch 0
    driver.start(first, batch_of)
    warm_end = cover + args.warmup
    for s in range(first, warm_end):
        driver.step(s, batch_of)
    driver.store.wait_for_writes()  # nothing of the warm-up left for the writer in the measured window
    timers.ns.clear()
    before = driver.store.stats()
    threads0, proc0 = other_threads_cpu_ns(), time.process_time_ns()
    capture.on = True
    unique_ns = gather_ns = floor_proc_ns = 0
    for s in range(warm_end, warm_end + args.steps):
        kjt = batches[s + 1]
        driver.step(s, batch_of)
        f0 = time.process_time_ns()
        u, g = floor_step(driver, kjt, driver.local[s + 1])  # once: a repeat would find the rows in cache
        floor_proc_ns += time.process_time_ns() - f0
        unique_ns += u
        gather_ns += g
    drain0 = time.thread_time_ns()
    driver.store.wait_for_writes()  # the window's evictions committed, on the writer's clock
    drain_ns = time.thread_time_ns() - drain0
    capture.on = False
    threads = {k: v - threads0.get(k, 0) for k, v in other_threads_cpu_ns().items()}
    threads = {k: v for k, v in threads.items() if v > 0}
    proc_ns = time.process_time_ns() - proc0 - floor_proc_ns - drain_ns
    after = driver.store.stats()
    calls = dict(timers.ns)
    profile: list[dict[str, object]] = []
    if args.profile:
        prof = cProfile.Profile()
        end = warm_end + args.steps
        prof.enable()
        for s in range(end, end + args.profile_steps):
            driver.step(s, batch_of)
        prof.disable()
        profile = top_functions(prof, args.profile, args.profile_steps * shape.tables * shape.ids_per_table)
    driver.store.close(flush=False)
    row_bytes = 4 * (args.dim + 1)
    floors = [
        lmdb_floor(capture, row_bytes, Path(tempfile.mkdtemp(dir=root))) for _ in range(args.floor_repeats)
    ]
    read_ns, n_read, write_ns, n_written = (int(np.median([f[i] for f in floors])) for i in range(4))
    ids = args.steps * shape.tables * shape.ids_per_table
    stage_ns = sum(calls.values()) + sum(threads.values())
    floor = {
        "unique": unique_ns / ids,
        "index_select": gather_ns / ids,
        "lmdb_getmulti": read_ns / ids,
        "lmdb_putmulti": write_ns / ids,
    }
    floor_ns = sum(floor.values())
    return {
        "stage_cpu_ns_per_id": round(stage_ns / ids, 1),
        "floor_ns_per_id": round(floor_ns, 1),
        "ratio": round(stage_ns / ids / floor_ns, 2),
        "calls_ns_per_id": {k: round(v / ids, 1) for k, v in {**calls, **threads}.items()},
        "floor_parts_ns_per_id": {k: round(v, 1) for k, v in floor.items()},
        "stage_cpu_ms_per_step": round(stage_ns / args.steps / 1e6, 3),
        "process_cpu_ms_per_step": round(proc_ns / args.steps / 1e6, 3),
        "ids_per_step": shape.tables * shape.ids_per_table,
        "per_step": per_step_counts(before, after, args.steps),
        "lmdb_rows_read_per_step": round(n_read / args.steps, 1),
        "lmdb_rows_written_per_step": round(n_written / args.steps, 1),
        "profile": profile,
    }


def per_step_counts(before: StoreStats, after: StoreStats, steps: int) -> dict[str, float]:
    """Device and host hit rates and rows moved per step in the measured window, over all tables."""
    sums: dict[str, float] = defaultdict(float)
    for name, tiers in after.tables.items():
        old = before.tables[name]
        for tier, label in ((Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.SSD, "ssd")):
            sums[f"{label}_hits"] += tiers[tier].hits - old[tier].hits
            sums[f"{label}_misses"] += tiers[tier].misses - old[tier].misses
    out = {}
    for label in ("device", "host", "ssd"):
        seen = sums[f"{label}_hits"] + sums[f"{label}_misses"]
        out[f"{label}_hit_rate"] = round(sums[f"{label}_hits"] / seen, 3) if seen else 0.0
    out["device_misses_per_step"] = round(sums["device_misses"] / steps, 1)
    return out


def top_functions(prof: cProfile.Profile, n: int, ids: int) -> list[dict[str, object]]:
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}:{func}" if line else func
        rows.append((tottime, where, calls, cumtime))
    rows.sort(reverse=True)
    return [
        {
            "fn": where,
            "calls": calls,
            "own_ns_per_id": round(tot * 1e9 / ids, 1),
            "cum_ns_per_id": round(cum * 1e9 / ids, 1),
        }
        for tot, where, calls, cum in rows[:n]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="fits_cache,ssd_bound")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per shape")
    parser.add_argument("--warmup", type=int, default=60, help="steps before the measured ones")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ssd-device-rows", type=int, default=8192)
    parser.add_argument("--ssd-host-rows", type=int, default=8192)
    parser.add_argument("--profile", type=int, default=0, help="report the N functions of most own CPU")
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-repeats", type=int, default=3, help="LMDB floor: median of this many runs")
    parser.add_argument(
        "--trainer", action="store_true", help="also time the stage methods of a Trainer's real pipeline"
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: small tables, a few steps (a test run)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.floor_repeats, args.profile = 6, 10, 1, min(args.profile, 3)
    if not args.profile:
        args.profile_steps = 0
    shapes = {
        "fits_cache": Shape("fits_cache", tables=8, id_space=10_000, device_rows=10_240, host_rows=4096),
        "ssd_bound": Shape(
            "ssd_bound",
            tables=4,
            id_space=2_000_000,
            device_rows=args.ssd_device_rows,
            host_rows=args.ssd_host_rows,
        ),
    }
    if args.smoke:
        shapes = {
            "fits_cache": Shape("fits_cache", tables=2, id_space=2048, device_rows=4096, host_rows=1024),
            "ssd_bound": Shape(
                "ssd_bound", tables=2, id_space=20_000, device_rows=2048, host_rows=512, ids_per_table=512
            ),
        }
    torch.set_num_threads(1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_stage_cpu_"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, lmdb {lmdb.__version__}"
    )
    result: dict[str, object] = {}
    try:
        for name in args.shapes.split(","):
            res = run_shape(shapes[name], args, root)
            result[name] = res
            print(f"{name}: " + json.dumps({k: v for k, v in res.items() if k != "profile"}))
            for row in res["profile"]:  # type: ignore[union-attr]
                print(f"  {row}")
            if args.trainer:
                res["trainer"] = run_trainer(name, args, root)
                print(f"{name} (trainer): " + json.dumps(res["trainer"]))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
