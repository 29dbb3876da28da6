"""Where the log layout's write-back spends its CPU: one process, one store, no disk waits by default.

A log-layout store of ``--base-rows`` hashed ids of 260-byte rows (``ssd_store_writeback.SPEC``) filled by
sorted ``put_rows`` of 1 M rows; random stored ids written back in transactions of ``--batch`` rows until
compaction has started; then ``--rows`` rows more, measured: rows/s, the process's CPU, compaction's
share and the rows it copied, and with ``--profile N`` the N functions of most own time (cProfile). 1,000
sampled rows are then read back and compared with the newest write of each.

A base that the page cache holds (the default, 8 M rows: ~3.5 GiB with the log's dead records) measures the
writer's own CPU; ``bench_ssd.py`` measures the same write-back into 50 M rows against LMDB's sorted append.
To compare two trees, run this on each in turn, with ``PYTHONPATH`` naming the tree.

Usage: python benchmarks/writeback_profile.py [--base-rows 8000000] [--rows 8000000] [--profile 25]
       [--dir /tmp/writeback_profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import time
from pathlib import Path

import numpy as np
from harness import emit, machine_info
from ssd_store_writeback import CHECK_ROWS, MAP_BYTES, SPEC, _rows, check_newest, fill
from ssd_writeback import hashed_ids

from embedding_store import LmdbOptions
from embedding_store.lmdb_backend import LmdbBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-rows", type=float, default=8e6)
    parser.add_argument("--rows", type=float, default=8e6, help="rows written back in the measured window")
    parser.add_argument("--batch", type=int, default=32768, help="ids drawn per transaction")
    parser.add_argument("--profile", type=int, default=0, help="print the N functions of most own time")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/writeback_profile"))
    args = parser.parse_args()
    base, total = int(args.base_rows), int(args.rows)
    emit({"machine": machine_info("numpy", "lmdb")})
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    options = LmdbOptions(initial_map_size_bytes=MAP_BYTES, layout="log")
    backend = LmdbBackend(args.dir, options=options, seed=0, tables=[SPEC])
    try:
        ids = hashed_ids(base)
        fill(backend, ids)
        rng = np.random.default_rng(0)
        version = np.zeros(base, dtype=np.int32)  # newest write of each base id (0: the fill)
        log = backend._log
        assert log is not None
        writes = 0

        def write(pick: np.ndarray) -> None:
            nonlocal writes
            writes += 1
            backend.put_rows([("t", ids[pick], _rows(ids[pick], writes))])
            version[pick] = writes

        while log.stats.compactions == 0:  # a fresh log has nothing dead to compact
            write(np.unique(rng.integers(0, base, size=args.batch)))
        picks, drawn = [], 0  # drawn before the clock starts: the input, not the store's work
        while drawn < total:
            picks.append(np.unique(rng.integers(0, base, size=args.batch)))
            drawn += picks[-1].shape[0]
        before = (log.stats.copied_rows, log.stats.compactions, log.stats.compact_s)
        profile = cProfile.Profile() if args.profile else None
        start, cpu = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        for pick in picks:
            write(pick)
        if profile is not None:
            profile.disable()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        copied = log.stats.copied_rows - before[0]
        compact_s = log.stats.compact_s - before[2]
        check_newest(backend, ids, version, rng, "log")
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        emit(
            {
                "base_rows": base,
                "rows": drawn,
                "seconds": seconds,
                "rows_per_s": drawn / seconds,
                "cpu_s": cpu,
                "cpu_ns_per_row": cpu / drawn * 1e9,
                "compactions": log.stats.compactions - before[1],
                "copied_rows": copied,
                "copies_per_row": copied / drawn,
                "compact_share": compact_s / seconds,
                "compact_ns_per_copied_row": compact_s / max(1, copied) * 1e9,
                "profiled": bool(profile),
                "checked_rows": CHECK_ROWS,
            }
        )
    finally:
        backend.close()
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
