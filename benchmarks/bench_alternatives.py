"""tierrec side by side with what a user would do instead: TorchRec with the table in memory, hashing ids
into a table that fits RAM, and a table bigger than RAM over a memory-mapped file.

Every arm is one rank of the same :class:`~recsys.trainer.Trainer` (TorchRec's DistributedModelParallel,
FBGEMM's fused row-wise Adagrad, a DLRM of dim 64) on bench_scale.py's stream (``--tables`` Zipf(1.05)
features over raw 63-bit ids whose hidden per-id effects decide the labels), with the same held-out
samples. Only where the table's rows live differs.

**fits RAM** (``--fit-ids`` ids per table, so every row fits in memory; ``--fit-repeats`` pairs run
alternately in this process): TorchRec in memory (``store.tiered = false`` and ``sparse.max_rows_per_table``
= the id space: no id is folded; batches read on the pipeline's load worker, as a DataLoader would) against
tierrec whose device tier holds every row. Reports the steady samples/s of each pair (the windows after
``--fit-warmup`` steps: by then the Zipf stream has touched most of its ids, whose first touch creates
their row through the tiers; with 1 M ids a table and 60 steps it had not, and the device hit rate was
0.71 instead of 0.89) and ``fits_ram_vs_torchrec``, the median ratio with its quartiles, and each arm's
CPU ms per 1,000 samples.

**larger than RAM** (``--steps`` of ``--batch``: bench_scale's ~100 M distinct ids at the defaults; each arm
a child process of its own, one after the other, its files deleted when measured):

- ``tierrec``: the three tiers, ``--host-rows`` host rows and ``--device-rows`` device slots per table;
- ``tierrec_fp16``: the same at ``sparse.weights_precision = fp16``; ``tierrec_admit2``: with
  ``[store.bounds] admit_after = 2``;
- ``hashed_ram``: ``store.tiered = false``, ids folded modulo ``--host-rows`` + ``--device-rows`` rows per
  table: hashed into the memory of tierrec's two upper tiers (the same rows, the same row bytes), hash
  collisions accepted;
- ``hashed_ram_sized``: the same, hashed into the rows that a user would give it on this machine: a share
  (``--ram-share``) of the memory available when the program starts, less ``--ram-reserve-gib`` for the
  process and the dense model, over the tables' row bytes (the store's ``TableSpec``); ``--ram-cap-rows``
  caps it (the smoke run);
- ``mmap``: ``store.tiered = false``, one row per distinct id of the training stream, as a user who maps
  a table would keep it: an id-to-row index in RAM (each table's distinct ids as one sorted array, looked up
  with ``searchsorted``; ``index_gib`` in the record, counted in its RSS), held-out ids the index lacks share
  one extra row. The parent writes the index (``<dir>/vocab``) while it replays the stream, and the arm
  reads its data through the factory ``alternatives.placement.vocab_stream`` (``data.source``). At the
  defaults the file is 102 M rows of 256 bytes, 24.3 GiB, more than a 23.5 GiB machine's memory;
- ``mmap_folded`` (not run unless named): the same mapping with ids folded into ``--mmap-rows`` rows per
  table, the mapped arm of the first recorded run (12.5 M rows a table: 100 M rows, 23.8 GiB).
  Both mapped arms put FBGEMM's weights over one file-backed shared mapping (``torch.from_file``,
  FBGEMM's ``preallocated_host_buffers``) with ``madvise(MADV_RANDOM)`` for training (``MADV_SEQUENTIAL``
  while the rows are initialised); the page cache is its cache and the kernel's dirty-page write-back its
  write path, at the machine's ``vm.dirty_*`` settings (reported). Differs from tierrec in: the row-wise
  Adagrad state stays in RAM (4 bytes a row), and TorchRec's and our initialisation write every row of the
  file before training (``init_s``, ``init_disk_bytes``; not counted in the fit).

Per arm: samples/s over the fit and its first and last tenth (of the log windows, total samples over total
time: ``harness.window_rate``; ``last_tenth`` holds the major
faults/s, disk read and write MB/s, busy fraction, queue and cores used over those windows, from a 1 s
timeline: whether the table still outgrows the page cache at the end), bytes written to the disk
during the fit plus what makes its model durable at the end (the store's flush; the mapping's ``msync``):
``disk_bytes`` (the device's sectors, which count other processes too) and ``proc_write_bytes``
(``/proc/self/io``, charged to the process that dirtied the page); the disk's busy fraction and mean queue
(``/sys/block``), major page faults, CPU seconds per 1,000 samples and cores used, peak RSS (``VmHWM``) and
the sampled peaks of anonymous and file-backed resident memory; held-out AUC and log loss of the final model.
The mmap arm also reports the file's size against the machine's memory and the page cache at the end.

For each in-memory arm (``hashed_ram``, ``hashed_ram_sized``, ``mmap``, ``mmap_folded``), the training stream's ids are
replayed first (before any arm runs) and folded as the arm folds them: ``<arm>_shared_row_fraction`` is the
share of the distinct ids whose row holds another id too, ``<arm>_shared_lookup_fraction`` the share of the
lookups that read such a row (0 for an arm that keeps one row per id).

The LAST line is one JSON object with, besides every arm's record: ``fits_ram_vs_torchrec``; for tierrec
against each other arm ``over_ram_vs_<arm>_last_tenth`` (last-tenth samples/s over the arm's),
``over_ram_auc_vs_<arm>`` (AUC difference), ``over_ram_disk_bytes_vs_<arm>`` and
``over_ram_cpu_per_sample_vs_<arm>``; the same four for every pair of arms under ``versus``
(``versus.<candidate>.<baseline>``); ``over_ram_cpu_s_per_1k_samples`` of each arm; the shared-row
fractions and ``hashed_ram_sized_rows_per_table``.

``--repeats N`` runs every larger-than-RAM arm N times in alternating order (A B C, C B A, ...); each arm's
record then holds the median of its repeats with ``<key>_range`` [min, max] beside it, and ``repeats``.
An arm recorded in a run of its own (the exact mapped table at full size) is set against another recorded
run's arms by ``benchmarks/versus.py``, which prints the same keys.

Usage: python benchmarks/bench_alternatives.py [--only fits_ram,over_ram] [--arms tierrec,mmap,...]
       [--repeats 2] [--steps 1700] [--batch 16384] [--dir /tmp/bench_alternatives] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from alternatives.compare import headline_keys, median_record, versus
from alternatives.mapped import MADV_RANDOM, MappedWeights, meminfo_kib, vm_dirty_settings
from alternatives.placement import VOCAB_ENV, ram_sized_rows, shared_fractions, vocab_files
from bench_scale import stream_overrides
from harness import (
    RssPeak,
    alternate,
    emit,
    first_tenth,
    last_tenth,
    machine_info,
    paired_ratios,
    quiet,
    run_child,
    status_kib,
    window_rate,
)
from ssd_tier.disk import DiskIo, DiskTimeline
from tiered_training.runs import SilentProgress, StampedWindows, train_once

from recsys.build import TrainSpec
from recsys.config import config_from_dict
from recsys.distributed import free_port, init_distributed
from recsys.trainer import Trainer

OVER_RAM_ARMS = ("tierrec", "tierrec_fp16", "tierrec_admit2", "hashed_ram", "hashed_ram_sized", "mmap")
OPTIONAL_ARMS = ("mmap_folded",)
FOLDING_ARMS = ("hashed_ram", "hashed_ram_sized", "mmap_folded")  # ids modulo the arm's rows
MAPPED_ARMS = ("mmap", "mmap_folded")


def say(text: str) -> None:
    print(f"[bench_alternatives {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- one arm, in a child process ------------------------------------------------------------------------


def base_overrides(args: argparse.Namespace, out: Path, steps: int) -> list[str]:
    return [
        "train.threads_per_rank=1",
        "train.nproc=1",
        f"train.steps={steps}",
        f"train.batch_size={args.batch}",
        f"train.log_every={max(1, steps // 50)}",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        "eval.every=0",
        f"eval.batch_size={min(args.batch, 16384)}",
        *stream_overrides(args),
        f"synthetic.eval_samples={args.eval_samples}",
        f"store.path={out / 'store'}",
    ]


def arm_overrides(args: argparse.Namespace, arm: str) -> list[str]:
    if arm == "tierrec":
        return []
    if arm == "tierrec_fp16":
        return ["sparse.weights_precision=fp16"]
    if arm == "tierrec_admit2":
        return ["store.bounds={admit_after=2}"]
    if arm in FOLDING_ARMS:
        return ["store.tiered=false", f"sparse.max_rows_per_table={folded_rows(args, arm)}"]
    if arm == "mmap":  # one row per distinct id: no table is folded
        rows = max(np.load(f, mmap_mode="r").shape[0] for f in vocab_files(args.dir)) + 1
        return [
            "store.tiered=false",
            f"sparse.max_rows_per_table={rows}",
            "data.source=alternatives.placement:vocab_stream",
        ]
    raise ValueError(f"unknown arm {arm!r}")


def folded_rows(args: argparse.Namespace, arm: str) -> int:
    """Rows per table of an arm that folds ids into an in-memory table."""
    if arm == "hashed_ram":
        return args.host_rows + args.device_rows
    if arm == "hashed_ram_sized":
        assert args.hashed_sized_rows > 0, "sized by the parent (ram_sized_rows)"
        return args.hashed_sized_rows
    return args.mmap_rows


def run_arm(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """Fit one arm of the larger-than-RAM part; its record (module docstring)."""
    out = args.dir / arm
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = config_from_dict({}, [*base_overrides(args, out, args.steps), *arm_overrides(args, arm)])
    mapped = MappedWeights(out / "mmap" / "weights.f32") if arm in MAPPED_ARMS else None
    if arm == "mmap":
        os.environ[VOCAB_ENV] = str(args.dir)
    env = distributed()
    disk0 = DiskIo(out)
    t0 = time.perf_counter()
    trainer = Trainer(
        cfg, env, out_dir=out / "run", spec=TrainSpec(progress=SilentProgress, fused_params=mapped)
    )
    trainer.start(resume=False)
    if mapped is not None:
        mapped.advise(MADV_RANDOM)
    os.sync()  # the initial rows on the disk before the fit is measured
    init = {"init_s": time.perf_counter() - t0, "init_disk_bytes": disk0.delta().get("dev_write_bytes")}
    disk = DiskIo(out)
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    windows = StampedWindows(0, out / "run" / "metrics.jsonl")
    with RssPeak(interval_s=0.2) as rss, DiskTimeline(out) as timeline:
        start = time.perf_counter()
        summary = trainer.fit(windows)
        fit_s = time.perf_counter() - start
        durable = time.perf_counter()
        if trainer.tiered is not None:
            assert trainer.tiered.store is not None
            trainer.tiered.store.flush()
        if mapped is not None:
            mapped.msync()
        os.sync()
        durable_s = time.perf_counter() - durable
    usage = resource.getrusage(resource.RUSAGE_SELF)
    io = disk.delta()
    wall_ms = 1e3 * (fit_s + durable_s)
    cache = meminfo_kib("MemTotal", "Cached", "Dirty")
    trainer.close()  # the tiered arms' rows are flushed already
    count = len(windows.rows)
    tenth = last_tenth(count).stop - last_tenth(count).start
    samples = summary["samples_this_process"]
    cpu_s = (usage.ru_utime - usage0.ru_utime) + (usage.ru_stime - usage0.ru_stime)
    record: dict[str, Any] = {
        "arm": arm,
        "overrides": arm_overrides(args, arm),
        "steps": summary["steps"],
        "fit_s": fit_s,
        "samples_per_s": summary["samples_per_s"],
        "samples_per_s_first_tenth": window_rate(windows.rows, 0, part=first_tenth(count)),
        "samples_per_s_last_tenth": window_rate(windows.rows, 0, part=last_tenth(count)),
        "auc": summary["auc"],
        "logloss": summary["logloss"],
        "disk_bytes": io.get("dev_write_bytes"),
        "proc_write_bytes": io["write_bytes"],
        "disk_read_bytes": io.get("dev_read_bytes"),
        "durable_s": durable_s,
        "disk_busy_fraction": io["dev_busy_ms"] / wall_ms if "dev_busy_ms" in io else None,
        "disk_mean_queue": io["dev_queue_ms"] / wall_ms if "dev_queue_ms" in io else None,
        "major_faults": usage.ru_majflt - usage0.ru_majflt,
        "cpu_s_per_1k_samples": 1e3 * cpu_s / samples,
        "cores_used": cpu_s / (fit_s + durable_s),
        # the last tenth of the training windows (the held-out evaluation after them left out)
        "last_tenth": timeline.rates(
            windows.stamps[-tenth - 1] - timeline.t0, windows.stamps[-1] - timeline.t0
        )
        if len(windows.stamps) > tenth
        else {},
        "peak_rss_gib": status_kib("VmHWM")["VmHWM"] / 2**20,
        "peak_rss_sampled_gib": {k: v / 2**20 for k, v in rss.peak.items()},
        **init,
    }
    if arm == "mmap":  # the id-to-row index, held in RAM by the arm's dataset
        record["index_gib"] = sum(f.stat().st_size for f in vocab_files(args.dir)) / 2**30
    if mapped is not None:
        assert mapped.weights is not None
        record.update(
            mmap_file_gib=mapped.weights.numel() * 4 / 2**30,
            machine_ram_gib=cache["MemTotal"] / 2**20,
            page_cache_gib_at_end=cache["Cached"] / 2**20,
            vm_dirty=vm_dirty_settings(),
        )
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return record


# -- fits RAM: alternating pairs in this process ------------------------------------------------------------


def fits_ram(args: argparse.Namespace) -> dict[str, Any]:
    """TorchRec in memory vs tierrec holding every row in its device tier, ``--fit-repeats`` pairs."""
    space = args.fit_ids
    root = args.dir / "fits_ram"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    common = [
        *base_overrides(args, root, args.fit_steps),
        f"synthetic.id_space={space}",
        f"sparse.max_rows_per_table={space}",
    ]
    variants = {
        "torchrec": [*common, "store.tiered=false"],
        "tierrec": [*common, "store.tiered=true", f"store.device_rows={space}", f"store.host_rows={space}"],
    }
    env = distributed()

    def run(name: str, repeat: int) -> dict[str, Any]:
        out = root / f"{name}_{repeat}"
        result = train_once(env, variants[name], out_dir=out, warmup_steps=args.fit_warmup)
        shutil.rmtree(out, ignore_errors=True)
        record = {
            "samples_per_s": result["samples_per_s"],
            "cpu_s_per_1k_samples": result["cpu_ms_per_step"] / args.batch,  # ms per sample = s per 1,000
            "cores_used": result["cores_used"],
            "device_hit_rate": result["device_hit_rate"],
        }
        emit({"part": "fits_ram", "arm": name, "repeat": repeat, **record})
        return record

    runs = alternate(list(variants), args.fit_repeats, run)
    shutil.rmtree(root, ignore_errors=True)
    ratio = paired_ratios(
        [r["samples_per_s"] for r in runs["tierrec"]], [r["samples_per_s"] for r in runs["torchrec"]]
    )
    return {
        "fits_ram_vs_torchrec": ratio["median"],
        "fits_ram_vs_torchrec_quartiles": [ratio["q1"], ratio["q3"]],
        "fits_ram_ratios": ratio["ratios"],
        "fits_ram_ids_per_table": space,
        "fits_ram_cpu_s_per_1k_samples": {
            name: statistics.median(r["cpu_s_per_1k_samples"] for r in rs) for name, rs in runs.items()
        },
        "fits_ram_samples_per_s": {
            name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()
        },
    }


# -- larger than RAM: each arm in a child process -------------------------------------------------------------


def over_ram(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cfg = config_from_dict({}, base_overrides(args, args.dir, args.steps))
    if "hashed_ram_sized" in args.arms:
        available = meminfo_kib("MemAvailable")["MemAvailable"] * 1024
        sizing = dict(share=args.ram_share, reserve_gib=args.ram_reserve_gib, cap_rows=args.ram_cap_rows)
        out.update(ram_sized_rows(cfg, available, **sizing))
        args.hashed_sized_rows = out["hashed_ram_sized_rows_per_table"]
        argv = [*argv, "--hashed-sized-rows", str(args.hashed_sized_rows)]
    in_memory = [a for a in args.arms if a in FOLDING_ARMS or a == "mmap"]
    if in_memory:
        say(f"over_ram: replaying the stream's ids to place them as {', '.join(in_memory)} do")
        rows = {a: None if a == "mmap" else folded_rows(args, a) for a in in_memory}
        index = args.dir if "mmap" in in_memory else None
        out.update(shared_fractions(cfg, steps=args.steps, batch=args.batch, rows=rows, index_root=index))
        if out.get("mmap_shared_row_fraction", 0.0) != 0.0:  # the index must give every id its own row
            raise SystemExit(f"mmap: {out['mmap_shared_row_fraction']} of the ids share a row")

    def run(arm: str, repeat: int) -> dict[str, Any]:
        say(f"over_ram: {arm}, repeat {repeat + 1} of {args.repeats} ({args.steps} steps of {args.batch})")
        record = run_child([__file__, *argv, "--arm", arm])
        emit({"part": "over_ram", "repeat": repeat, **record})
        say(
            f"over_ram: {arm}: {record['samples_per_s']:,.0f} samples/s (last tenth "
            f"{record['samples_per_s_last_tenth']:,.0f}), auc {record['auc']:.4f}, "
            f"{(record['disk_bytes'] or 0) / 1e9:.2f} GB written"
        )
        return record

    runs = alternate(args.arms, args.repeats, run)  # A B C, C B A, ...: drift hits every arm alike
    if not args.keep:
        shutil.rmtree(args.dir / "vocab", ignore_errors=True)
    arms = {arm: median_record(records) for arm, records in runs.items()}
    out["over_ram"] = arms
    out["over_ram_repeats"] = args.repeats
    out["over_ram_cpu_s_per_1k_samples"] = {arm: r["cpu_s_per_1k_samples"] for arm, r in arms.items()}
    out["versus"] = {a: {b: versus(arms[a], arms[b]) for b in arms if b != a} for a in arms}
    out.update(headline_keys(out["versus"].get("tierrec", {})))
    return out


_ENV: Any = None


def distributed() -> Any:
    """This process's one-rank process group (made once)."""
    global _ENV
    if _ENV is None:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
        )
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        _ENV = init_distributed(threads_per_rank=1)
    return _ENV


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="fits_ram,over_ram", help="parts: fits_ram, over_ram")
    parser.add_argument("--arms", default=",".join(OVER_RAM_ARMS), help="the larger-than-RAM arms")
    parser.add_argument("--steps", type=int, default=1700, help="larger than RAM: steps (~100 M ids)")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--host-rows", type=int, default=1_000_000, help="tierrec's host rows per table")
    parser.add_argument("--device-rows", type=int, default=262_144, help="tierrec's device slots per table")
    parser.add_argument(
        "--mmap-rows",
        type=int,
        default=12_500_000,
        help="mmap_folded: rows per table of the mapped file (8 x 256 B: 23.8 GiB)",
    )
    parser.add_argument(
        "--ram-share", type=float, default=0.8, help="hashed_ram_sized: share of MemAvailable at start"
    )
    parser.add_argument(
        "--ram-reserve-gib",
        type=float,
        default=1.5,
        help="hashed_ram_sized: kept for the process and the dense model (the hashed arm's peak RSS less its rows)",
    )
    parser.add_argument(
        "--ram-cap-rows", type=int, default=0, help="hashed_ram_sized: at most this many rows"
    )
    parser.add_argument("--hashed-sized-rows", type=int, default=0, help=argparse.SUPPRESS)  # the parent's
    parser.add_argument(
        "--repeats", type=int, default=1, help="larger than RAM: runs of every arm, alternating (ABC CBA ...)"
    )
    parser.add_argument("--eval-samples", type=int, default=1 << 20)
    parser.add_argument("--fit-ids", type=int, default=200_000, help="fits RAM: ids per table")
    parser.add_argument("--fit-steps", type=int, default=100)
    parser.add_argument("--fit-warmup", type=int, default=40, help="fits RAM: steps left out of the rate")
    parser.add_argument("--fit-repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_alternatives"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="seconds at tiny sizes: the code path only")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a child's one arm
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.tables = 6, 512, 2
        args.host_rows, args.device_rows, args.mmap_rows, args.ram_cap_rows = 4000, 2048, 50_000, 20_000
        args.repeats = 2
        args.eval_samples, args.fit_ids, args.fit_steps, args.fit_warmup, args.fit_repeats = (
            1024,
            2000,
            6,
            2,
            2,
        )
    args.only = [p for p in args.only.split(",") if p]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(OVER_RAM_ARMS) - set(OPTIONAL_ARMS)) + sorted(
        set(args.only) - {"fits_ram", "over_ram"}
    )
    if unknown:
        parser.error(f"unknown parts or arms: {unknown}")
    return args


def main(argv: list[str]) -> None:
    quiet()
    args = parse(argv)
    if args.arm:  # a child: one arm, its record as the last line
        emit(run_arm(args, args.arm))
        return
    emit(
        {
            "machine": machine_info("torch", "torchrec", "fbgemm_gpu", "lmdb"),
            "args": vars(args) | {"dir": str(args.dir)},
        }
    )
    result: dict[str, Any] = {"vm_dirty": vm_dirty_settings()}
    if "fits_ram" in args.only:
        result.update(fits_ram(args))
    if "over_ram" in args.only:
        result.update(over_ram(args, argv))
    emit(result)


if __name__ == "__main__":
    main(sys.argv[1:])
