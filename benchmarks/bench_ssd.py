"""The SSD tier at disk speed: cold reads through tier prefetch against the disk's own random-read rate, and
sustained write-back into a large store against LMDB's sorted bulk append, each measured in the same run.

1. Fill: ``--rows`` rows of ``--dim`` floats + row-wise Adagrad (dim 64: 260 bytes) through
   the backend's ``put_rows`` in sorted bulk transactions, then fsync.
2. Each measurement drops ``data.mdb`` from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``; the
   share of its pages still cached, by ``mincore``, is printed), opens a fresh :class:`TieredStore` (empty
   host tier) with ``LmdbOptions.read_threads = T`` and announces (``lookahead``) and ``prefetch``-es
   ``--batches`` batches of ``--batch`` random stored ids, distinct across the run: every row is read from
   LMDB. Rows/s = rows read / seconds inside ``prefetch``.
3. The disk: ``--depth`` threads ``os.preadv`` random 4 KiB-aligned blocks of the same ``data.mdb`` with
   ``O_DIRECT`` (no page cache) for ``--disk-s`` seconds (``fio``'s randread at iodepth 32 where fio is
   installed and ``--fio`` is given).

First a sweep of T over ``--sweep`` (once each, to choose the default), then ``--repeats`` alternating
repeats (``harness.alternate``) of T=1, T=the default (``LmdbOptions().read_threads``) and the disk. The
LAST line is one JSON object: ``cold_read_vs_disk`` (prefetch rows/s at the default depth / the disk's 4 KiB
reads/s), ``cold_rows_per_s_sequential`` and ``_parallel``, ``parallel_vs_sequential``,
``disk_random_4k_reads_per_s``: medians over the repeats, each with its per-repeat values (``*_runs``), and
the sizes. Each prefetch repeat is followed by a warm one of the same batches (a fresh store again, the
pages now cached): ``warm_parallel_vs_sequential`` is what splitting costs where no read faults. The store
(``--dir``) is deleted at the end unless ``--keep``.

4. Write-back (``ssd_tier/writeback.py``): a log-layout store of ``--writeback-base-rows``
   hashed ids (default 50 M, ~13 GiB), random stored ids written back in transactions of
   ``--writeback-batch`` rows until compaction runs, then a measured window of ``--writeback-rows``;
   the same number of rows appended in id order into an empty LMDB, a part after each of the log's three
   parts (paired ratios in ``writeback_vs_append_parts``); then the B-tree layout on a base of
   the same size for ``--btree-rows``. Adds ``writeback_vs_append``, ``write_amplification`` (bytes to
   the disk per byte of rows written back in the window, compaction included) and the B-tree's
   ``btree_writeback_vs_append`` / ``btree_write_amplification`` to the last line. Needs ~3x the base's
   size of free disk; ``--skip-writeback`` / ``--skip-reads`` run one half; ``--log-compact-at`` sets the
   log's ``LmdbOptions.log_compact_at`` (more dead records kept, fewer copies).

5. Precision: the same cold reads (default read_threads) of ``--rows`` fp32 rows (260 bytes at dim 64)
   and ``--rows`` fp16 rows (132 bytes: 15 rows a block, not 7), ``--repeats`` alternating repeats of the
   same ids: ``precision_cold_rows_per_s`` and ``fp16_vs_fp32_cold_rows``. ``--skip-precision`` skips it.

Usage: python benchmarks/bench_ssd.py [--rows 4000000] [--dir /tmp/bench_ssd] [--smoke]
       [--writeback-base-rows 50000000] [--writeback-rows 30000000] [--btree-rows 1000000]
       [--log-compact-at 0.4]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import alternate, emit, machine_info
from ssd_tier.writeback import run_writeback
from tiered_training.cold import cached_fraction, drop_page_cache

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreConfig,
    TableSpec,
    Tier,
    TieredStore,
    WeightsPrecision,
)
from embedding_store.backends import open_backend
from embedding_store.rows import pack_weights, weights_of

FILL_CHUNK = 1 << 18  # rows per fill transaction
MAP_BYTES = 1 << 36  # no map growth during the fill (LMDB does not preallocate)
BLOCK = 4096


def spec_of(dim: int, precision: WeightsPrecision = WeightsPrecision.FP32) -> TableSpec:
    return TableSpec(
        name="t", dim=dim, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, weights_precision=precision
    )


def rows_of(ids: np.ndarray, spec: TableSpec) -> np.ndarray:
    """The stored (packed) row of each id: id + j / 128 in column j, rounded to float32 (the check
    recomputes it; ids < 2^24 are exact in float32, so every id's row differs from its neighbours'). An
    fp16 table's weights are (id mod 2039) + j / 64 as halves, its state id + j / 128 as float32."""
    columns = np.arange(spec.row_floats, dtype=np.float32) / 128
    rows = (ids[:, None].astype(np.float32) + columns).astype(np.float32)
    if spec.weights_precision is WeightsPrecision.FP16:
        weights = (ids[:, None] % 2039).astype(np.float32) + np.arange(spec.dim, dtype=np.float32) / 64
        pack_weights(spec, weights, rows[:, : spec.weight_words])
    return rows


def fill(path: Path, spec: TableSpec, num_rows: int) -> float:
    """Write rows 0..num_rows-1 in sorted bulk transactions and fsync; returns the seconds taken."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    start = time.perf_counter()
    backend = open_backend(path, options=LmdbOptions(initial_map_size_bytes=MAP_BYTES), seed=0, tables=[spec])
    try:
        for low in range(0, num_rows, FILL_CHUNK):
            ids = np.arange(low, min(num_rows, low + FILL_CHUNK), dtype=np.int64)
            backend.put_rows([(spec.name, ids, rows_of(ids, spec))])
        backend.sync()
    finally:
        backend.close()
    return time.perf_counter() - start


def prefetch(
    path: Path, spec: TableSpec, threads: int, batches: list[np.ndarray], *, cold: bool = True
) -> dict[str, Any]:
    """Prefetch ``batches`` (sorted stored ids) through a fresh store (empty host tier), with the LMDB
    file's pages dropped from the page cache first (``cold``) or as they are."""
    data = path / "data.mdb"
    if cold:
        drop_page_cache(data)
    cached = cached_fraction(data)
    total = sum(b.shape[0] for b in batches)
    config = StoreConfig(
        seed=0,
        device_capacity_rows=1024,
        host_capacity_rows=total,
        lmdb=LmdbOptions(initial_map_size_bytes=MAP_BYTES, read_threads=threads),
    )
    seconds = 0.0
    with TieredStore(path, config=config, tables=[spec]) as store:
        for b, ids in enumerate(batches):
            store.lookahead(b, {spec.name: ids})
            start = time.perf_counter()
            store.prefetch(b)
            seconds += time.perf_counter() - start
        ssd = store.counters()[spec.name][Tier.SSD]
        check = batches[0][:: max(1, batches[0].shape[0] // 256)]
        chunk = store.read_rows(spec.name, check)  # host-tier rows now: what the prefetch read
        want = rows_of(check, spec)
        state = chunk.state.reshape(check.shape[0], -1).numpy()
        if not (
            np.array_equal(chunk.weights.numpy(), weights_of(spec, want))
            and np.array_equal(state, want[:, spec.weight_words :])
        ):
            raise AssertionError(f"read_threads={threads}: prefetched rows differ from the stored rows")
        store.close(flush=False)
    if ssd.hits != total:
        raise AssertionError(f"read_threads={threads}: {ssd.hits} rows came from LMDB, not {total}")
    return {
        "read_threads": threads,
        "rows": total,
        "seconds": seconds,
        "rows_per_s": total / seconds,
        "lmdb_read_share": ssd.seconds / seconds,  # of the prefetch time: the rest plans and files rows
        "page_cache_fraction_before": cached,
    }


def disk_random_reads(path: Path, depth: int, seconds: float, seed: int) -> dict[str, Any]:
    """4 KiB reads/s of ``depth`` threads reading random aligned blocks of ``path`` with O_DIRECT (Python's
    ``os.preadv`` releases the GIL during the read)."""
    blocks = path.stat().st_size // BLOCK
    stop = time.perf_counter() + seconds
    counts = [0] * depth
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        rng = np.random.default_rng([seed, k])
        buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while time.perf_counter() < stop:
                for offset in rng.integers(0, blocks, 256) * BLOCK:
                    if os.preadv(fd, [buf], int(offset)) != BLOCK:
                        raise OSError(f"short O_DIRECT read at {offset}")
                counts[k] += 256
        except BaseException as err:
            errors.append(err)
        finally:
            os.close(fd)
            buf.close()

    threads = [threading.Thread(target=reader, args=(k,), name=f"bench-disk-{k}") for k in range(depth)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {
        "tool": "preadv_o_direct",
        "depth": depth,
        "reads": sum(counts),
        "reads_per_s": sum(counts) / wall,
    }


def fio_random_reads(path: Path, depth: int, seconds: float) -> dict[str, Any]:
    """fio's 4 KiB randread of ``path`` at iodepth ``depth`` (libaio, O_DIRECT)."""
    import json

    out = subprocess.run(
        ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
         "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based",
         "--readonly", "--output-format=json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return {"tool": "fio", "depth": depth, "reads": job["total_ios"], "reads_per_s": job["iops"]}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows stored")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096, help="ids per prefetched batch")
    parser.add_argument("--batches", type=int, default=16, help="batches per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", default="1,4,8,16,32,64", help="read_threads to sweep (empty: none)")
    parser.add_argument("--depth", type=int, default=32, help="threads of the disk's random-read test")
    parser.add_argument("--disk-s", type=float, default=3.0, help="seconds of each disk test")
    parser.add_argument("--fio", action="store_true", help="measure the disk with fio where installed")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_ssd"))
    parser.add_argument("--keep", action="store_true", help="keep the store")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes throughout, seconds (a test run)")
    parser.add_argument("--writeback-base-rows", type=int, default=50_000_000, help="rows before write-back")
    parser.add_argument("--writeback-rows", type=int, default=30_000_000, help="rows of the measured window")
    parser.add_argument(
        "--writeback-batch", type=int, default=1 << 15, help="rows per write-back transaction"
    )
    parser.add_argument(
        "--log-compact-at",
        type=float,
        default=None,
        help="the log's LmdbOptions.log_compact_at (default: its default)",
    )
    parser.add_argument(
        "--log-segment-rows", type=int, default=None, help="the log's LmdbOptions.log_segment_rows"
    )
    parser.add_argument("--btree-rows", type=int, default=1_000_000, help="B-tree layout window (0: skip)")
    parser.add_argument("--skip-writeback", action="store_true")
    parser.add_argument("--skip-reads", action="store_true")
    parser.add_argument("--skip-precision", action="store_true", help="no fp32 vs fp16 cold reads")
    args = parser.parse_args()
    if args.smoke:  # a store of 20,000 rows, segments of 2,048 so that compaction runs in the window
        args.rows, args.batch, args.batches, args.repeats, args.sweep, args.disk_s = (
            20_000,
            1024,
            2,
            1,
            "",
            0.2,
        )
        args.writeback_base_rows, args.writeback_rows, args.btree_rows = 20_000, 12_000, 3_000
        args.writeback_batch, args.log_segment_rows = 2048, 2048
    emit({"machine": machine_info("numpy", "lmdb")})
    summary: dict[str, Any] = {}
    if not args.skip_reads:
        summary.update(cold_reads(args))
    if not args.skip_writeback:
        try:
            wb = run_writeback(
                args.dir,
                base_rows=args.writeback_base_rows,
                window_rows=args.writeback_rows,
                btree_rows=args.btree_rows,
                batch_rows=args.writeback_batch,
                log_options={
                    k: v
                    for k, v in (
                        ("log_compact_at", args.log_compact_at),
                        ("log_segment_rows", args.log_segment_rows),
                    )
                    if v is not None
                },
            )
        finally:
            if not args.keep:
                shutil.rmtree(args.dir, ignore_errors=True)
        for part in ("log", "append", "btree"):
            if part in wb:
                emit({"experiment": "writeback", "variant": part, **wb.pop(part)})
        summary.update(wb)
    if not args.skip_precision:
        summary.update(precision_reads(args))
    summary["load_avg_1m_end"] = os.getloadavg()[0]  # other processes share the disk and the CPUs
    emit(summary, digits=3)


def cold_reads(args: argparse.Namespace) -> dict[str, Any]:
    """Steps 1-3: the summary's cold-read keys."""
    spec = spec_of(args.dim)
    default = LmdbOptions().read_threads
    path = args.dir / "store"
    fill_s = fill(path, spec, args.rows)
    store_bytes = (path / "data.mdb").stat().st_size
    emit({"fill_rows": args.rows, "fill_s": fill_s, "data_mdb_mib": store_bytes / 2**20})
    rng = np.random.default_rng(0)
    per_run = args.batch * args.batches
    if per_run > args.rows:
        raise SystemExit(f"--batch x --batches = {per_run} is more than the {args.rows} rows stored")

    def batches() -> list[np.ndarray]:
        ids = rng.choice(args.rows, per_run, replace=False)
        return [np.sort(part) for part in np.split(ids, args.batches)]

    def disk(repeat: int) -> dict[str, Any]:
        if args.fio and shutil.which("fio"):
            return fio_random_reads(path / "data.mdb", args.depth, args.disk_s)
        return disk_random_reads(path / "data.mdb", args.depth, args.disk_s, seed=repeat)

    try:
        sweep = [int(t) for t in args.sweep.split(",") if t]
        swept = []
        for threads in sweep:
            result = prefetch(path, spec, threads, batches())
            emit({"experiment": "sweep", **result})
            swept.append(result)
        if swept:
            emit({"sweep_rows_per_s": {r["read_threads"]: round(r["rows_per_s"]) for r in swept}})
        variants = {"sequential": 1, "parallel": default}

        def run(name: str, repeat: int) -> dict[str, Any]:
            if name == "disk":
                result = disk(repeat)
            else:
                ids = batches()
                result = prefetch(path, spec, variants[name], ids)
                # The same rows again, their pages cached now: what splitting costs where nothing faults.
                result["warm"] = prefetch(path, spec, variants[name], ids, cold=False)
            emit({"experiment": "repeat", "variant": name, "repeat": repeat, **result})
            return result

        runs = alternate(["sequential", "parallel", "disk"], args.repeats, run)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    seq = [r["rows_per_s"] for r in runs["sequential"]]
    par = [r["rows_per_s"] for r in runs["parallel"]]
    dsk = [r["reads_per_s"] for r in runs["disk"]]
    warm_seq = [r["warm"]["rows_per_s"] for r in runs["sequential"]]
    warm_par = [r["warm"]["rows_per_s"] for r in runs["parallel"]]
    return {
        "cold_read_vs_disk": statistics.median(par) / statistics.median(dsk),
        "cold_rows_per_s_sequential": statistics.median(seq),
        "cold_rows_per_s_parallel": statistics.median(par),
        "parallel_vs_sequential": statistics.median(par) / statistics.median(seq),
        "disk_random_4k_reads_per_s": statistics.median(dsk),
        "warm_rows_per_s_sequential": statistics.median(warm_seq),
        "warm_rows_per_s_parallel": statistics.median(warm_par),
        "warm_parallel_vs_sequential": statistics.median(warm_par) / statistics.median(warm_seq),
        "read_threads": default,
        "disk_depth": args.depth,
        "disk_tool": runs["disk"][0]["tool"],
        "spread": {
            "sequential": spread(seq),
            "parallel": spread(par),
            "disk": spread(dsk),
            "warm_sequential": spread(warm_seq),
            "warm_parallel": spread(warm_par),
        },
        "cold_read_vs_disk_runs": [p / d for p, d in zip(par, dsk, strict=True)],
        "sweep_rows_per_s": {r["read_threads"]: r["rows_per_s"] for r in swept},
        "rows_stored": args.rows,
        "row_bytes": spec.row_bytes,
        "data_mdb_mib": store_bytes / 2**20,
        "rows_per_measurement": per_run,
        "batch_ids": args.batch,
        "repeats": args.repeats,
    }


def precision_reads(args: argparse.Namespace) -> dict[str, Any]:
    """Step 5: cold reads of fp32 rows (260 bytes at dim 64) against fp16 rows (132 bytes), ``--rows``
    each, at the default read_threads, ``--repeats`` alternating repeats of the same random ids."""
    specs = {p.value: spec_of(args.dim, p) for p in WeightsPrecision}
    paths = {name: args.dir / f"store_{name}" for name in specs}
    mib = {}
    per_run = min(args.rows, args.batch * args.batches)
    rng = np.random.default_rng(1)
    try:
        for name, spec in specs.items():
            fill(paths[name], spec, args.rows)
            mib[name] = (paths[name] / "data.mdb").stat().st_size / 2**20
        draws = [np.sort(rng.choice(args.rows, per_run, replace=False)) for _ in range(args.repeats)]

        def run(name: str, repeat: int) -> dict[str, Any]:
            ids = [np.sort(part) for part in np.array_split(draws[repeat], args.batches)]
            result = prefetch(paths[name], specs[name], LmdbOptions().read_threads, ids)
            emit({"experiment": "precision", "variant": name, "repeat": repeat, **result})
            return result

        runs = alternate(list(specs), args.repeats, run)
    finally:
        if not args.keep:
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
    rate = {name: [r["rows_per_s"] for r in runs[name]] for name in specs}
    return {
        "precision_cold_rows_per_s": {name: statistics.median(v) for name, v in rate.items()},
        "fp16_vs_fp32_cold_rows": statistics.median(rate["fp16"]) / statistics.median(rate["fp32"]),
        "fp16_vs_fp32_cold_rows_runs": [a / b for a, b in zip(rate["fp16"], rate["fp32"], strict=True)],
        "precision_row_bytes": {name: spec.row_bytes for name, spec in specs.items()},
        "precision_data_mdb_mib": mib,
    }


if __name__ == "__main__":
    main()
