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
   tiered pipelined vs the same model untiered (every table in memory).
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
   checkpoint after the restored ``data.mdb`` was fsynced and dropped from the page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``, checked with ``mincore``), so the first touches of stored
   rows are disk reads: pipelined vs sequential, whole resumed fit.
4. delays: a tiny model with injected delays, by wrapping methods in this program only: SSD read
   (``TieredTables.prefetch``), key routing (``TieredTables.route``) and compute (a forward hook on the
   model). From the pipeline's per-batch spans after a warm-up (means): the step (interval between the
   consumer's starts of consecutive batches) over the slowest stage's time per batch (pipelined), and
   over the sum of the stages' times (sequential).
5. hit rates: the same 2-table Zipf id trace run through the store with LOOKAHEAD (depth
   ``--lookahead``) and with LRU, pipelined; device hit rate = device hits / (hits + misses) of the
   training batches (per unique id per batch, counted before the final evaluation). Belady's optimum is
   simulated offline over the recorded per-batch unique-id trace with the same device capacity and the
   same constraints as the store: a batch's rows must all be resident at once (all-or-nothing fill, no
   bypass), and the rows of the other batches in flight are pinned and cannot be evicted — as many as
   the LOOKAHEAD run had filled and not yet released when it filled each batch (median; TorchRec's
   pipeline included; ``belady_unpinned_hit_rate`` drops that constraint). On a miss, MIN evicts the
   unpinned rows whose next use is furthest away.

Prints the machine and versions first and, as its LAST line, one JSON object with
fits_cache_tiered_vs_untiered (>= 0.9), pipelined_vs_sequential (>= 1.3), ssd_bound_tiered_vs_untiered,
pipelined_vs_sequential_cold, step_vs_slowest_stage (<= 1.15), sequential_step_vs_sum (~1),
lookahead_hit_rate, lru_hit_rate, belady_hit_rate, lookahead_vs_belady (>= 0.95), the lookahead depth,
the sizes used, and the CPU-time and overlap-bound companions of the throughput ratios.

Usage: python benchmarks/bench_pipeline.py [--quick] [--repeats 5] [--lookahead 128] [--dir /tmp/...]
       [--only fits_cache,ssd_bound,cold,delays,hit_rates] [--delays-ms 20,10,30]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

import recsys.tiered
import recsys.train
from recsys.config import config_from_dict
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.distributed import DistEnv, free_port, init_distributed
from recsys.tiered import TieredTables
from recsys.train import Trainer
from recsys.tune.trace import belady_hits

EXPERIMENTS = ("fits_cache", "ssd_bound", "cold", "delays", "hit_rates")

# One rank with one intra-op thread: the pipeline's workers get the second core.
COMMON = [
    "train.threads_per_rank=1",
    "synthetic.eval_samples=256",
    "eval.batch_size=256",
    "pipeline.trace_batches=100000",  # every batch's stage spans (span_stats)
]
# A DLRM big enough that dense compute is a real share of the step, small enough for a 2-core machine.
MODEL = ["model.embedding_dim=32", "model.dense_arch=[256, 32]", "model.over_arch=[256, 128]"]
ZIPF_SPACE = 2_000_000
ZIPF_TABLES = 4
ZIPF_BATCH = 2048


def machine_info() -> dict[str, object]:
    import fbgemm_gpu
    import torchrec

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": round(mem_gb, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "numpy": np.__version__,
        "lmdb": lmdb.__version__,
        "cuda": torch.cuda.is_available(),
    }


def two_thread_speedup() -> float:
    """How much faster two threads sort two arrays than one thread sorts both (numpy releases the GIL):
    ~2 on an idle 2-core machine, ~1 when other processes take the second core. Pipelining can only
    overlap stages where this is above 1, so it is printed beside the ratios."""
    arrays = [np.random.default_rng(i).random(1_000_000) for i in range(2)]

    def work(x: np.ndarray) -> None:
        for _ in range(4):
            np.sort(x)

    start = time.perf_counter()
    for x in arrays:
        work(x)
    serial = time.perf_counter() - start
    threads = [threading.Thread(target=work, args=(x,)) for x in arrays]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial / (time.perf_counter() - start)


def machine_cpu() -> tuple[float, float, float]:
    """(busy, steal, wall) CPU seconds of the whole machine so far, all CPUs together (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    total = sum(fields[:8])
    return (total - idle - steal) / tick, steal / tick, total / tick


def emit(record: dict[str, Any]) -> None:
    def clean(v: Any) -> Any:
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    print(json.dumps({k: clean(v) for k, v in record.items()}), flush=True)


# -- driving the Trainer in-process ----------------------------------------------------------------


class Windows:
    """A MetricsLog stand-in that keeps the train records (samples/s per ``log_every`` window)."""

    def __init__(self, start_step: int) -> None:
        self.start_step = start_step  # a resumed fit starts here
        self.rows: list[dict[str, Any]] = []

    def write(self, **record: Any) -> None:
        if record.get("kind") == "train":
            self.rows.append(record)

    def steady_rate(self, warmup_steps: int) -> float:
        """Samples/s over the windows that start ``warmup_steps`` or more after the fit's first step
        (weighted by their steps, i.e. total samples over total time)."""
        rows = self.rows
        starts = [self.start_step] + [r["step"] for r in rows[:-1]]
        spans = [(r["step"] - s, r["samples_per_s"], s) for r, s in zip(rows, starts, strict=True)]
        keep = [(n, rate) for n, rate, s in spans if s - self.start_step >= warmup_steps] or [
            (n, rate) for n, rate, _ in spans
        ]
        return sum(n for n, _ in keep) / sum(n / rate for n, rate in keep)


FEEDS: list[Any] = []  # the StagedPipeline of each tiered fit (see ``quiet``), for its stage spans


def span_stats(feed: Any, warmup: int) -> dict[str, Any]:
    """Steady-state means over the batches from ``warmup`` on, from the feed's per-batch spans: each
    stage's time per batch, and the step time as the interval between the consumer's starts of
    consecutive batches (means, so that in sequential mode the stages add up to the step exactly)."""
    counters = feed.timeline.counters
    stage_ms = {}
    for name, c in counters.items():
        durations = [(end - start) / 1e6 for batch, start, end in c.spans if batch >= warmup]
        if durations:
            stage_ms[name] = statistics.fmean(durations)
    starts = sorted((batch, start) for batch, start, _ in counters[feed.config.consumer_name].spans)
    gaps = [
        (b - a) / 1e6
        for (i, a), (j, b) in zip(starts, starts[1:], strict=False)
        if i >= warmup and j == i + 1
    ]
    return {"span_stage_ms": stage_ms, "span_step_ms": statistics.fmean(gaps) if gaps else None}


def make_config(overrides: list[str]) -> Any:
    return config_from_dict({}, [*COMMON, *overrides])


def train_once(
    env: DistEnv,
    overrides: list[str],
    *,
    out_dir: Path,
    warmup_steps: int,
    resume: bool = False,
    prepare: Callable[[Trainer], None] | None = None,
) -> dict[str, Any]:
    """Build a Trainer, fit it, return throughput, tier and pipeline statistics; closes the trainer."""
    cfg = make_config(overrides)
    trainer = Trainer(cfg, env, out_dir=out_dir)
    FEEDS.clear()
    try:
        trainer.start(resume=resume)
        if prepare is not None:
            prepare(trainer)
        windows = Windows(trainer.step)
        cpu_start, machine_start = time.process_time(), machine_cpu()
        with ThreadCpu() as threads:
            summary = trainer.fit(windows)  # type: ignore[arg-type]
        cpu_s = time.process_time() - cpu_start
        busy, steal, total = (b - a for a, b in zip(machine_start, machine_cpu(), strict=True))
        tiers = trainer.tier_stats()
    finally:
        trainer.close()
    device = [t["device"] for t in tiers.values()]
    hits, misses = sum(d["hits"] for d in device), sum(d["misses"] for d in device)
    batch = cfg.train.batch_size
    steady = windows.steady_rate(warmup_steps)
    pipe = trainer.pipeline_stats or {}
    return {
        "samples_per_s": steady,
        "step_s": batch / steady,
        "fit_samples_per_s": summary["samples_per_s"],
        "steps": summary["steps"],
        # CPU seconds of all this process's threads per second of training: > 1 only if stages overlap
        "cores_used": cpu_s / summary["train_seconds"],
        # the rest of the machine meanwhile: other processes' CPU (in cores) and time the hypervisor took
        "other_processes_cores": max(0.0, busy - cpu_s) * (os.cpu_count() or 1) / max(total, 1e-9),
        "steal_fraction": steal / max(total, 1e-9),
        "cpu_ms_per_step": 1e3 * cpu_s * cfg.train.batch_size / max(1, summary["samples"]),
        # per thread (pipeline stage threads together): where the CPU time of a step goes
        "thread_cpu_ms_per_step": {
            k: 1e3 * v * cfg.train.batch_size / max(1, summary["samples"])
            for k, v in threads.per_name().items()
        },
        "device_hit_rate": hits / (hits + misses) if hits + misses else None,
        "ssd_rows_read": sum(t["ssd"]["hits"] for t in tiers.values()),
        "ssd_rows_written": sum(t["ssd"]["rows_in"] for t in tiers.values()),
        "bound_by": pipe.get("bound_by"),
        "consumer_wait_fraction": pipe.get("consumer_wait_fraction"),
        "stage_ms": {k: 1e3 * v["busy_per_item_s"] for k, v in pipe.get("stages", {}).items()},
        **(span_stats(FEEDS[-1], warmup_steps) if FEEDS else {}),
    }


def alternate(
    env: DistEnv,
    name: str,
    variants: dict[str, list[str]],
    *,
    repeats: int,
    warmup_steps: int,
    root: Path,
    **kwargs: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Run every variant ``repeats`` times, alternating them (A B C A B C ...), printing each run."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for variant in order:
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                result = train_once(
                    env, variants[variant], out_dir=Path(tmp), warmup_steps=warmup_steps, **kwargs
                )
            runs[variant].append(result)
            emit({"experiment": name, "variant": variant, "repeat": repeat, **result})
    return runs


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def paired(candidate: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput ratios of each repeat's candidate run over the baseline run next to it (``alternate``
    runs them back to back), with their quartiles: how far one repeat's ratio strays from the median."""
    ratios = [c["samples_per_s"] / b["samples_per_s"] for c, b in zip(candidate, baseline, strict=True)]
    low, mid, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"ratios": [round(r, 4) for r in ratios], "q1": low, "median": mid, "q3": high}


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


class ThreadCpu:
    """CPU seconds of each named thread of this process while it runs (sampled from /proc every 0.25 s, so
    threads that end keep their last reading)."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK")
        self._seen: dict[str, tuple[str, float]] = {}  # native thread id -> (name, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)

    def _read(self) -> None:
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                self._seen[tid] = (names.get(tid, "other"), (int(fields[11]) + int(fields[12])) / self._tick)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._read()

    def __enter__(self) -> ThreadCpu:
        self._read()
        self._start = dict(self._seen)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def per_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, (name, cpu) in self._seen.items():
            name = "tierrec-pipeline" if name.startswith("tierrec-pipeline") else name
            out[name] = out.get(name, 0.0) + cpu - self._start.get(tid, (name, 0.0))[1]
        return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0.005}


# -- experiment 1: the working set fits the device tier --------------------------------------------


def fits_cache(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = 60 if args.quick else 120
    space = 10_000
    base = [
        *MODEL,
        "synthetic.num_sparse=8",
        f"synthetic.id_space={space}",
        "train.batch_size=2048",
        f"train.steps={steps}",
        "train.log_every=10",
    ]
    variants = {
        "untiered": [*base, "store.tiered=false"],
        "tiered": [*base, "store.tiered=true", "store.device_rows=10240", "store.host_rows=10240"],
    }
    runs = alternate(
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
        "fits_cache_device_hit_rate": median(runs["tiered"], "device_hit_rate"),
    }
    emit({"experiment": "fits_cache", **out})
    return out


# -- experiment 2: a Zipf table 20x larger than the host tier ---------------------------------------


def touched_rows(space: int, *, batch: int, steps: int, start: int = 0) -> int:
    """Distinct ids of one synthetic Zipf feature over ``steps`` batches (the rows a table touches)."""
    data = SyntheticCriteo(SyntheticConfig(num_sparse=1, id_space=space), seed=0)
    parts = [
        np.unique(data.batch(step=s, rank=0, world_size=1, batch_size=batch).sparse.values().numpy())
        for s in range(start, start + steps)
    ]
    return int(np.unique(np.concatenate(parts)).shape[0])


def zipf_base(steps: int) -> list[str]:
    return [
        *MODEL,
        f"synthetic.num_sparse={ZIPF_TABLES}",
        f"synthetic.id_space={ZIPF_SPACE}",
        "synthetic.zipf_alpha=1.05",
        f"sparse.max_rows_per_table={ZIPF_SPACE}",  # untiered: every id has its own row, as when tiered
        f"train.batch_size={ZIPF_BATCH}",
        f"train.steps={steps}",
        "train.log_every=10",
    ]


def ssd_bound(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = 60 if args.quick else 100
    touched = touched_rows(ZIPF_SPACE, batch=ZIPF_BATCH, steps=steps)
    host_rows = touched // 20
    tiered = ["store.tiered=true", "store.device_rows=8192", f"store.host_rows={host_rows}"]
    base = zipf_base(steps)
    variants = {
        "untiered": [*base, "store.tiered=false"],
        "pipelined": [*base, *tiered, "pipeline.mode=pipelined"],
        "sequential": [*base, *tiered, "pipeline.mode=sequential"],
        # the default lowers the stage threads' priority (pipeline.worker_nice); this run does not
        "pipelined_equal_priority": [*base, *tiered, "pipeline.mode=pipelined", "pipeline.worker_nice=0"],
    }
    runs = alternate(env, "ssd_bound", variants, repeats=args.repeats, warmup_steps=steps // 5, root=args.dir)
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


# -- experiment 3: the same, resumed onto a store whose pages are not in the page cache -------------


def drop_page_cache(path: Path) -> None:
    """fsync (dirty pages cannot be dropped) and POSIX_FADV_DONTNEED the whole file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore), or None where it cannot be measured."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0 or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return None
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / pages


@contextlib.contextmanager
def cold_restores(log: list[float | None]) -> Iterator[None]:
    """While active, every store restored from a checkpoint has its data.mdb dropped from the page cache."""
    original = recsys.tiered.restore_snapshot

    def restore(snapshot: Path, path: Path) -> None:
        original(snapshot, path)
        data = Path(path) / "data.mdb"
        drop_page_cache(data)
        log.append(cached_fraction(data))

    recsys.tiered.restore_snapshot = restore  # TieredTables.open looks it up in its module
    try:
        yield
    finally:
        recsys.tiered.restore_snapshot = original


def cold(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    first = 40 if args.quick else 100
    more = 40 if args.quick else 80
    touched = touched_rows(ZIPF_SPACE, batch=ZIPF_BATCH, steps=first + more)
    host_rows = touched // 20
    tiered = ["store.tiered=true", "store.device_rows=8192", f"store.host_rows={host_rows}"]
    run_dir = args.dir / "cold_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    # The first run fills the store (every row it touched ends in LMDB) and checkpoints it at its end.
    filled = train_once(
        env,
        [*zipf_base(first), *tiered, f"train.checkpoint_every={first}", "train.keep_checkpoints=1"],
        out_dir=run_dir,
        warmup_steps=0,
    )
    emit({"experiment": "cold", "variant": "fill_store", **filled})
    resumed = [*zipf_base(first + more), *tiered, "train.checkpoint_every=0"]  # no new checkpoint
    variants = {
        "pipelined": [*resumed, "pipeline.mode=pipelined"],
        "sequential": [*resumed, "pipeline.mode=sequential"],
    }
    cached: list[float | None] = []
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with cold_restores(cached):
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for variant in order:
                # Resume measures from the first resumed step: the cold reads come first.
                result = train_once(env, variants[variant], out_dir=run_dir, warmup_steps=0, resume=True)
                result["page_cache_fraction_at_open"] = cached[-1]
                runs[variant].append(result)
                emit({"experiment": "cold", "variant": variant, "repeat": repeat, **result})
    store_mb = sum(p.stat().st_size for p in run_dir.rglob("data.mdb")) / 2**20
    shutil.rmtree(run_dir, ignore_errors=True)
    out = {
        "pipelined_vs_sequential_cold": median(runs["pipelined"], "fit_samples_per_s")
        / median(runs["sequential"], "fit_samples_per_s"),
        "pipelined_vs_sequential_cold_overlap_bound": overlap_bound(runs["sequential"]),
        "cold_stored_rows_read": median(runs["pipelined"], "ssd_rows_read"),
        "cold_checkpoint_store_mib": round(store_mb, 1),
    }
    emit({"experiment": "cold", **out})
    return out


# -- experiment 4: injected stage delays -----------------------------------------------------------


@contextlib.contextmanager
def injected_delays(ssd_s: float, route_s: float) -> Iterator[None]:
    """Wrap TieredTables.prefetch (SSD read) and .route (key routing) with sleeps (GIL released)."""
    prefetch, route = TieredTables.prefetch, TieredTables.route

    @functools.wraps(prefetch)
    def slow_prefetch(self: TieredTables, *a: Any, **kw: Any) -> Any:
        time.sleep(ssd_s)
        return prefetch(self, *a, **kw)

    @functools.wraps(route)
    def slow_route(self: TieredTables, *a: Any, **kw: Any) -> Any:
        time.sleep(route_s)
        return route(self, *a, **kw)

    TieredTables.prefetch, TieredTables.route = slow_prefetch, slow_route  # type: ignore[method-assign]
    try:
        yield
    finally:
        TieredTables.prefetch, TieredTables.route = prefetch, route  # type: ignore[method-assign]


def delays(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = 50 if args.quick else 100
    ssd_ms, route_ms, compute_ms = (float(x) for x in args.delays_ms.split(","))
    base = [
        "model.embedding_dim=8",
        "model.dense_arch=[16, 8]",
        "model.over_arch=[16]",
        "synthetic.num_sparse=4",
        "synthetic.id_space=100000",
        "train.batch_size=256",
        f"train.steps={steps}",
        "train.log_every=10",
        "store.tiered=true",
        "store.device_rows=4096",
        "store.host_rows=4096",
    ]

    def compute_hook(trainer: Trainer) -> None:
        trainer.dmp.register_forward_hook(lambda *_: time.sleep(compute_ms / 1e3))

    variants = {
        "pipelined": [*base, "pipeline.mode=pipelined"],
        "sequential": [*base, "pipeline.mode=sequential"],
    }
    with injected_delays(ssd_ms / 1e3, route_ms / 1e3):
        runs = alternate(
            env,
            "delays",
            variants,
            repeats=args.repeats,
            warmup_steps=20,
            root=args.dir,
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


# -- experiment 5: device hit rates against Belady --------------------------------------------------


class TraceRecorder:
    """Wraps a trainer's fill/release (instance attributes) to record the per-batch unique-id trace, the
    most batches in flight (filled, not yet released), and the device counters before the final eval."""

    def __init__(self, trainer: Trainer) -> None:
        tables = trainer.tiered
        assert tables is not None
        self.trace: list[dict[str, np.ndarray]] = []
        self.in_flight: set[int] = set()
        self.in_flight_at_fill: list[
            int
        ] = []  # batches pinned while each training batch fills, itself included
        self.device_before_eval: dict[str, tuple[int, int]] | None = None
        fill, release, evaluate = tables.fill, tables.release, trainer.evaluate

        def traced_fill(routed: Any) -> Any:
            if routed.channel == recsys.tiered.TRAIN:
                assert routed.batch_id == len(self.trace), "batches are filled in order"
                self.trace.append({k: v.numpy().copy() for k, v in routed.owner_ids.items()})
                self.in_flight.add(routed.batch_id)
                self.in_flight_at_fill.append(len(self.in_flight))
            return fill(routed)

        def traced_release(batch_id: int) -> None:
            self.in_flight.discard(batch_id)
            release(batch_id)

        def traced_evaluate(*a: Any, **kw: Any) -> Any:
            if self.device_before_eval is None:
                stats = tables.stats()
                self.device_before_eval = {
                    name: (int(t["device"]["hits"]), int(t["device"]["misses"]))  # type: ignore[call-overload]
                    for name, t in stats.items()
                }
            return evaluate(*a, **kw)

        tables.fill, tables.release = traced_fill, traced_release  # type: ignore[method-assign]
        trainer.evaluate = traced_evaluate  # type: ignore[method-assign]

    def hit_rate(self) -> float:
        assert self.device_before_eval is not None
        hits = sum(h for h, _ in self.device_before_eval.values())
        misses = sum(m for _, m in self.device_before_eval.values())
        return hits / (hits + misses)


def hit_rates(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    steps = 120 if args.quick else 300
    device_rows = 8192
    base = [
        "model.embedding_dim=8",
        "model.dense_arch=[16, 8]",
        "model.over_arch=[16]",
        "synthetic.num_sparse=2",
        f"synthetic.id_space={ZIPF_SPACE}",
        "synthetic.zipf_alpha=1.05",
        "train.batch_size=1024",
        f"train.steps={steps}",
        "train.log_every=20",
        "store.tiered=true",
        f"store.device_rows={device_rows}",
        "store.host_rows=65536",
        f"store.lookahead={args.lookahead}",
        "pipeline.mode=pipelined",
    ]
    recorders: dict[str, TraceRecorder] = {}
    for policy in ("lookahead", "lru"):

        def prepare(trainer: Trainer, policy: str = policy) -> None:
            recorders[policy] = TraceRecorder(trainer)

        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            result = train_once(
                env, [*base, f"store.policy={policy}"], out_dir=Path(tmp), warmup_steps=0, prepare=prepare
            )
        emit(
            {
                "experiment": "hit_rates",
                "variant": policy,
                "train_hit_rate": recorders[policy].hit_rate(),
                **result,
            }
        )
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
        "lookahead_hit_rate": look.hit_rate(),
        "lru_hit_rate": lru.hit_rate(),
        "belady_hit_rate": belady,
        "lookahead_vs_belady": look.hit_rate() / belady,
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


# -- main -------------------------------------------------------------------------------------------


def quiet() -> None:
    """No progress bars or planner chatter: the output is one JSON record per line."""
    bar = recsys.train.tqdm

    def silent_bar(*a: Any, **kw: Any) -> Any:
        progress = bar(*a, **{**kw, "disable": True})
        progress.write = lambda text, *_, **__: print(text, file=sys.stderr)  # warnings: stderr
        return progress

    recsys.train.tqdm = silent_bar  # type: ignore[attr-defined]
    feed = recsys.train.tiered_feed

    def kept_feed(*a: Any, **kw: Any) -> Any:
        FEEDS.append(feed(*a, **kw))
        return FEEDS[-1]

    recsys.train.tiered_feed = kept_feed  # Trainer._feed looks it up in its module
    logging.getLogger().setLevel(logging.ERROR)
    for name in ("torchrec", "recsys", "pipelines", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a ~2-minute smoke run (fewer steps, 1 repeat)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats per variant (default 5; --quick: 1)"
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
    args.repeats = args.repeats or (1 if args.quick else 5)
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
            **machine_info(),
            "torch_threads": torch.get_num_threads(),
            "two_thread_speedup": speedup_start,
            "quick": args.quick,
            "repeats": args.repeats,
        }
    )
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        for name in only:
            t0 = time.perf_counter()
            result.update(globals()[name](env, args))
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
        quick=args.quick,
        repeats=args.repeats,
    )
    emit(result)


if __name__ == "__main__":
    main()
