"""Experiment 3 of ``bench_pipeline.py``: ssd_bound's tables resumed from a checkpoint whose restored
``data.mdb`` is not in the page cache, so the first touches of stored rows are disk reads; pipelined and
sequential, and the same model with every table in memory over as many steps (``cold_tiered_vs_untiered``:
pipelined fit samples/s over the in-memory model's)."""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from harness import alternate, emit

from recsys.distributed import DistEnv
from recsys.tiered import TieredTables
from tiered_training.runs import ZIPF_BATCH, median, sized, touched_rows, train_once, zipf_base, zipf_space
from tiered_training.throughput import overlap_bound


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


def cold_tables(fractions: list[float | None]) -> type[TieredTables]:
    """A tier binding whose store, once restored from a snapshot and opened, has its ``data.mdb`` dropped
    from the page cache; the share of its pages still cached then is appended to ``fractions``."""

    class ColdTables(TieredTables):
        def open(self, *, snapshot: Path | None = None, reshard_from: list[Path] | None = None) -> None:
            super().open(snapshot=snapshot, reshard_from=reshard_from)
            if snapshot is not None:
                data = self.path / "data.mdb"
                drop_page_cache(data)
                fractions.append(cached_fraction(data))

    return ColdTables


def cold(env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    first, more, space = sized(args, 100), sized(args, 80), zipf_space(args)
    touched = touched_rows(space, batch=ZIPF_BATCH, steps=first + more)
    host_rows = touched // 20
    tiered = ["store.tiered=true", "store.device_rows=8192", f"store.host_rows={host_rows}"]
    run_dir = args.dir / "cold_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    # The first run fills the store (every row it touched ends in LMDB) and checkpoints it at its end.
    filled = train_once(
        env,
        [*zipf_base(first, space), *tiered, f"train.checkpoint_every={first}", "train.keep_checkpoints=1"],
        out_dir=run_dir,
        warmup_steps=0,
    )
    emit({"experiment": "cold", "variant": "fill_store", **filled})
    # No new checkpoint, not even the final one: every resumed run starts from the fill's.
    resumed = [
        *zipf_base(first + more, space),
        *tiered,
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
    ]
    variants = {
        "pipelined": [*resumed, "pipeline.mode=pipelined"],
        "sequential": [*resumed, "pipeline.mode=sequential"],
        # The same model with every table in memory, over as many steps (a fresh run: nothing to read).
        "untiered": [*zipf_base(more, space), "store.tiered=false", "train.final_checkpoint=false"],
    }
    cached: list[float | None] = []
    tables = cold_tables(cached)

    def run(variant: str, repeat: int) -> dict[str, Any]:
        if variant == "untiered":
            result = train_once(env, variants[variant], out_dir=args.dir / "cold_untiered", warmup_steps=0)
            shutil.rmtree(args.dir / "cold_untiered", ignore_errors=True)
            emit({"experiment": "cold", "variant": variant, "repeat": repeat, **result})
            return result
        # Resume measures from the first resumed step: the cold reads come first.
        result = train_once(
            env, variants[variant], out_dir=run_dir, warmup_steps=0, resume=True, tables=tables
        )
        result["page_cache_fraction_at_open"] = cached[-1]
        emit({"experiment": "cold", "variant": variant, "repeat": repeat, **result})
        return result

    runs = alternate(list(variants), args.repeats, run)
    store_mb = sum(p.stat().st_size for p in run_dir.rglob("data.mdb")) / 2**20
    shutil.rmtree(run_dir, ignore_errors=True)
    out = {
        "pipelined_vs_sequential_cold": median(runs["pipelined"], "fit_samples_per_s")
        / median(runs["sequential"], "fit_samples_per_s"),
        "pipelined_vs_sequential_cold_overlap_bound": overlap_bound(runs["sequential"]),
        "cold_tiered_vs_untiered": median(runs["pipelined"], "fit_samples_per_s")
        / median(runs["untiered"], "fit_samples_per_s"),
        "cold_pipelined_vs_sequential": median(runs["pipelined"], "fit_samples_per_s")
        / median(runs["sequential"], "fit_samples_per_s"),
        "cold_stored_rows_read": median(runs["pipelined"], "ssd_rows_read"),
        "cold_checkpoint_store_mib": round(store_mb, 1),
    }
    emit({"experiment": "cold", **out})
    return out
