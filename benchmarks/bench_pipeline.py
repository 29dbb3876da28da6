"""Benchmark of tiered TorchRec training through the nested pipeline, baselines side by side.

One training rank (WORLD_SIZE=1, gloo, ``train.threads_per_rank=1``), so the pipeline's worker threads
have the second core. Every comparison runs its baseline and its candidate in this one process,
alternating them over ``--repeats`` repeats so that drift in the machine's speed hits both alike; the
ratios are of medians. ``*_paired`` gives each repeat's ratio of the two runs made back to back, with
quartiles: on a machine whose speed swings from one run to the next, their spread says how much one
ratio can be trusted. Throughput is the steady state of ``Trainer.fit``: samples/s over its
``train.log_every``-step windows after a warm-up (pipeline fill, first touches); the whole-fit
``samples_per_s`` of ``fit`` is printed too. Each run also prints ``cores_used`` (CPU seconds of all
the process's threads per second of training) and ``cpu_ms_per_step``: where other processes take the
CPUs, the wall-clock ratios measure the scheduler's share, and the CPU figures still compare the work;
``other_processes_cores`` and ``steal_fraction`` (from ``/proc/stat``) say how much of the machine others
took during the run.
``two_thread_speedup`` (two numpy sorts on two threads vs one after the other; ~2 on an idle 2-core
machine) is printed at the start and the end: pipelining can only gain where it is above 1.

Experiments (each prints its runs, then a summary line):

1. fits_cache: 8 tables of 10k ids, device tier of 10,240 slots per table (the working set fits):
   tiered pipelined vs the same model untiered (every table in memory);
   ``fits_cache_cpu_untiered_vs_tiered_sequential`` compares CPU per step with the tiers run
   sequentially (every stage on the training thread): the tiers' own CPU, without what two threads
   running at once cost each other on this machine (see ``two_thread_speedup``).
2. ssd_bound: 4 large Zipf(1.05) tables of 2M ids; the host tier holds 1/20 of the rows the run touches
   (counted from the data) and the device tier ~6 batches, so LMDB is read and written every step:
   pipelined vs ``pipeline.mode=sequential`` (both tiered), and pipelined vs untiered (in memory, same
   data, ids not folded). ``pipelined_vs_sequential_overlap_bound`` is the speed-up perfect overlap on
   two cores would give, from the sequential runs' own stage times: (tier + compute) / max(tier, compute);
   ``pipelined_vs_sequential_cpu_bound`` the speed-up the CPU allows at all: the sequential step over its
   CPU time per step (all threads, the LMDB writer included) spread over the cores at the measured
   ``two_thread_speedup``; ``pipelined_vs_sequential_equal_priority`` is the pipelined run with
   ``pipeline.worker_nice=0`` (stage threads at the training thread's priority). Each run
   prints ``thread_cpu_ms_per_step``: CPU per step of the training thread, the pipeline's stage threads
   and the writer.
3. cold: the same tables; a first run fills a store and checkpoints it; then each run resumes from that
   checkpoint, and a subclass of ``TieredTables`` fsyncs the restored ``data.mdb`` and drops it from the
   page cache right after its store opens (``posix_fadvise(POSIX_FADV_DONTNEED)``, checked with
   ``mincore``: ``page_cache_fraction_at_open``), so the first touches of stored rows are disk reads:
   pipelined vs sequential, whole resumed fit, and pipelined vs the same model in memory over as many
   steps (``cold_tiered_vs_untiered``).
4. delays: a tiny model with injected delays: SSD read and key routing by a subclass of
   ``TieredTables`` whose ``prefetch`` and ``route`` sleep first, compute by a forward hook on the
   model. From the pipeline's per-batch spans after a warm-up (means): the step (interval between the
   consumer's starts of consecutive batches) over the slowest stage's time per batch (pipelined), and
   over the sum of the stages' times (sequential).
5. hit rates: the same 2-table Zipf id trace run through the store with LOOKAHEAD (depth
   ``--lookahead``) and with LRU, pipelined; device hit rate = device hits / (hits + misses) of the
   training batches (per unique id per batch; the trainer's ``TierMetrics`` leaves evaluations out). Belady's optimum is
   simulated offline over the recorded per-batch unique-id trace with the same device capacity and the
   same constraints as the store: a batch's rows must all be resident at once (all-or-nothing fill, no
   bypass), and the rows of the other batches in flight are pinned and cannot be evicted — as many as
   the LOOKAHEAD run had filled and not yet released when it filled each batch (median; TorchRec's
   pipeline included; ``belady_unpinned_hit_rate`` drops that constraint). On a miss, MIN evicts the
   unpinned rows whose next use is furthest away.

The trainer is built with this program's parts through ``recsys.build.TrainSpec`` (the tier binding, a
feed that keeps its pipeline for the spans, a silent progress bar); the experiments live in
``benchmarks/tiered_training/`` and the probes in ``benchmarks/harness.py``.

Prints the machine and versions first and, as its LAST line, one JSON object with
fits_cache_tiered_vs_untiered (>= 0.9), pipelined_vs_sequential (>= 1.3), ssd_bound_tiered_vs_untiered,
pipelined_vs_sequential_cold, cold_tiered_vs_untiered, step_vs_slowest_stage (<= 1.15), sequential_step_vs_sum (~1),
lookahead_hit_rate, lru_hit_rate, belady_hit_rate, lookahead_vs_belady (>= 0.95), the lookahead depth,
the sizes used, and the CPU-time and overlap-bound companions of the throughput ratios.

Usage: python benchmarks/bench_pipeline.py [--smoke] [--repeats 5] [--lookahead 128] [--dir /tmp/...]
       [--only fits_cache,ssd_bound,cold,delays,hit_rates] [--delays-ms 20,10,30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import emit, machine_info, quiet, two_thread_speedup
from tiered_training.cold import cold
from tiered_training.delays import delays
from tiered_training.hit_rates import hit_rates
from tiered_training.throughput import fits_cache, ssd_bound

from recsys.distributed import DistEnv, free_port, init_distributed

EXPERIMENTS: dict[str, Callable[[DistEnv, argparse.Namespace], dict[str, Any]]] = {
    "fits_cache": fits_cache,
    "ssd_bound": ssd_bound,
    "cold": cold,
    "delays": delays,
    "hit_rates": hit_rates,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: 6 steps of small tables, 1 repeat (a test run)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats per variant (default 5; --smoke: 1)"
    )
    parser.add_argument(
        "--lookahead", type=int, default=128, help="LOOKAHEAD depth of the hit-rate experiment"
    )
    parser.add_argument(
        "--delays-ms", default="20,10,30", help="injected SSD read, key routing, compute delays"
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help="comma-separated experiments to run")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 5)
    if args.smoke:
        args.lookahead = min(args.lookahead, 4)
    only = [e for e in args.only.split(",") if e]
    unknown = sorted(set(only) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"--only: unknown experiments {unknown}; choose from {list(EXPERIMENTS)}")
    own_dir = args.dir is None
    args.dir = Path(tempfile.mkdtemp(prefix="bench_pipeline_")) if own_dir else args.dir
    args.dir.mkdir(parents=True, exist_ok=True)

    quiet()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    env = init_distributed(threads_per_rank=1)
    speedup_start = two_thread_speedup()
    args.two_thread_speedup = speedup_start
    emit(
        {
            **machine_info("torch", "torchrec", "fbgemm_gpu", "numpy", "lmdb"),
            "two_thread_speedup": speedup_start,
            "smoke": args.smoke,
            "repeats": args.repeats,
        }
    )
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        for name in only:
            t0 = time.perf_counter()
            result.update(EXPERIMENTS[name](env, args))
            emit({"experiment": name, "seconds": time.perf_counter() - t0})
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
        torch.distributed.destroy_process_group()
    result.update(
        two_thread_speedup_start=speedup_start,
        two_thread_speedup_end=two_thread_speedup(),
        load_avg_1m_end=os.getloadavg()[0],
        seconds=time.perf_counter() - started,
        smoke=args.smoke,
        repeats=args.repeats,
    )
    emit(result)


if __name__ == "__main__":
    main()
