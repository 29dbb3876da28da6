"""Peak memory of checkpointing and re-partitioning a tiered table larger than the host tier.

A store of ``--rows`` rows (dim 32, row-wise Adagrad: 132-byte rows) is written to LMDB; then, each in a
fresh process, (1) ``TieredStore.snapshot`` (what a checkpoint does: flush + compacted LMDB copy) with a
host tier of ``--host-rows`` rows, and (2) ``restore_resharded`` (a restore onto another world size: the
snapshot streamed in chunks into a new store, here keeping every other row as a 2-rank row-wise owner
would). Each prints the table's size beside the process's peak RSS (VmHWM: mapped file pages included)
and peak anonymous memory (RssAnon sampled every 5 ms: what the process itself allocated), measured
against the same process right after it opened the store. The baseline is the table's raw size.

Usage: python benchmarks/bench_checkpoint.py [--rows 4000000] [--host-rows 65536] [--dir /tmp/bench_ckpt]
       [--smoke]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from harness import RssPeak, emit, machine_info, run_child, status_kib

from embedding_store import LmdbOptions, OptimizerKind, StoreConfig, TableSpec, TieredStore, restore_resharded
from embedding_store.backends import open_backend

SPEC = TableSpec(name="t", dim=32, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
SEED = 0


def _config(host_rows: int) -> StoreConfig:
    return StoreConfig(seed=SEED, device_capacity_rows=1024, host_capacity_rows=host_rows, lmdb=LmdbOptions())


def build(path: Path, rows: int) -> None:
    backend = open_backend(path, options=LmdbOptions(), seed=SEED, tables=[SPEC])
    chunk = 1 << 17
    rng = np.random.default_rng(0)
    for start in range(0, rows, chunk):
        ids = np.arange(start, min(rows, start + chunk), dtype=np.int64) * 7  # sparse, sorted ids
        backend.put_rows([("t", ids, rng.random((ids.shape[0], SPEC.row_floats), dtype=np.float32))])
    backend.sync()
    backend.close()


def every_other_row(table: str, ids: np.ndarray) -> np.ndarray:
    """The rows a 2-rank row-wise owner keeps: (n,) bool."""
    return ids % 2 == 0


def child(kind: str, src: Path, dest: Path, host_rows: int) -> None:
    store = None
    if kind == "snapshot":
        store = TieredStore(src, config=_config(host_rows), tables=[SPEC])
        store.bind("t", weights=torch.zeros(1024, SPEC.dim), state=torch.zeros(1024))
    base = status_kib("VmRSS", "RssAnon")
    t0 = time.perf_counter()
    with RssPeak(("RssAnon",), interval_s=0.005) as anon:  # RssAnon sampled in a thread
        if store is not None:
            store.snapshot(dest)
        else:
            restore_resharded([src], dest, config=_config(host_rows), tables=[SPEC], keep=every_other_row)
    seconds = time.perf_counter() - t0
    if store is not None:
        store.close()
    emit({"kind": kind, "seconds": seconds, "base_rss_kib": base["VmRSS"], "peak_rss_kib": status_kib("VmHWM")["VmHWM"],
          "base_anon_kib": base["RssAnon"], "peak_anon_kib": anon.peak["RssAnon"]}, digits=None)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--host-rows", type=int, default=65_536)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_ckpt"))
    parser.add_argument(
        "--smoke", action="store_true", help="20,000 rows, seconds (a test run, not a figure)"
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, src, dest = args.child
        child(kind, Path(src), Path(dest), args.host_rows)
        return
    if args.smoke:
        args.rows, args.host_rows = 20_000, 1024
    emit(machine_info("torch", "numpy"))
    shutil.rmtree(args.dir, ignore_errors=True)
    store, snap, resharded = args.dir / "store", args.dir / "snap", args.dir / "resharded"
    store.mkdir(parents=True)
    build(store, args.rows)
    table_mib = args.rows * SPEC.row_bytes / 2**20
    host_mib = args.host_rows * SPEC.row_bytes / 2**20
    print(f"table: {args.rows:,} rows x {SPEC.row_bytes} B = {table_mib:.0f} MiB raw "
          f"(LMDB file {(store / 'data.mdb').stat().st_size / 2**20:.0f} MiB); host tier {host_mib:.1f} MiB")  # fmt: skip
    results = {}
    for kind, src, dest in (("snapshot", store, snap), ("reshard", snap, resharded)):
        r = run_child([__file__, "--host-rows", str(args.host_rows), "--child", kind, str(src), str(dest)])
        grow_rss = (r["peak_rss_kib"] - r["base_rss_kib"]) / 1024
        grow_anon = (r["peak_anon_kib"] - r["base_anon_kib"]) / 1024
        print(f"{kind}: {r['seconds']:.1f} s; peak RSS +{grow_rss:.0f} MiB (file pages included), "
              f"peak anonymous +{grow_anon:.0f} MiB, table {table_mib:.0f} MiB")  # fmt: skip
        results[f"{kind}_peak_anon_over_table"] = round(grow_anon / table_mib, 4)
        results[f"{kind}_peak_rss_over_table"] = round(grow_rss / table_mib, 4)
    shutil.rmtree(args.dir, ignore_errors=True)
    emit(results)


if __name__ == "__main__":
    main()
