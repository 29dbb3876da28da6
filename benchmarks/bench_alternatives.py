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
  table: the same bytes as tierrec's two upper tiers (260-byte rows both), hash collisions accepted;
- ``mmap``: ``store.tiered = false`` with ``--mmap-rows`` rows per table (ids folded into them; the default
  makes a 23.8 GiB file of 100 M rows, just over a 23.5 GiB machine's memory), FBGEMM's
  weights over one file-backed shared mapping (``torch.from_file``, FBGEMM's ``preallocated_host_buffers``)
  with ``madvise(MADV_RANDOM)`` for training (``MADV_SEQUENTIAL`` while the rows are initialised); the
  page cache is its cache and the kernel's dirty-page write-back its write path, at the machine's
  ``vm.dirty_*`` settings (reported). Differs from tierrec in: the row-wise
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

The LAST line is one JSON object with, besides every arm's record: ``fits_ram_vs_torchrec``,
``over_ram_vs_mmap_last_tenth`` (tierrec's last-tenth samples/s over mmap's), ``over_ram_vs_hashed_ram_last_tenth``,
``over_ram_auc_vs_mmap`` and ``over_ram_auc_vs_hashed_ram`` (AUC differences), ``over_ram_disk_bytes_vs_mmap``.

Usage: python benchmarks/bench_alternatives.py [--only fits_ram,over_ram] [--arms tierrec,mmap,...]
       [--steps 1700] [--batch 16384] [--dir /tmp/bench_alternatives] [--smoke]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
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

OVER_RAM_ARMS = ("tierrec", "tierrec_fp16", "tierrec_admit2", "hashed_ram", "mmap")
MADV_RANDOM, MADV_SEQUENTIAL, MS_SYNC = 1, 2, 4
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = _LIBC.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def say(text: str) -> None:
    print(f"[bench_alternatives {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- the memory-mapped table ---------------------------------------------------------------------------


class _Buffers(dict):  # type: ignore[type-arg]
    """FBGEMM's ``preallocated_host_buffers``, passed through TorchRec's fused parameters: TorchRec groups
    tables by those (so they must hash) and copies them per table (so a copy must be the same object, or
    each table would get its own group and the file would be copied into memory)."""

    __hash__ = object.__hash__

    def __copy__(self) -> _Buffers:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Buffers:
        return self


class MappedWeights:
    """Builds the weights of the in-memory tables over one file (``TrainSpec.fused_params``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.weights: torch.Tensor | None = None

    def __call__(self, tables: list[Any]) -> dict[str, Any]:
        total = sum(t.num_embeddings * t.embedding_dim for t in tables)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.weights = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.float32)
        self.advise(MADV_SEQUENTIAL)  # the initialisation writes every row in order: read ahead for it
        return {"preallocated_host_buffers": _Buffers(weights=self.weights)}

    def advise(self, advice: int) -> None:
        """``madvise`` the whole mapping (MADV_RANDOM for training: no read-ahead around a fault)."""
        assert self.weights is not None
        if _LIBC.madvise(self.weights.data_ptr(), self.weights.numel() * 4, advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")

    def msync(self) -> None:
        """Write the mapping's dirty pages to the file and wait for them (the model made durable)."""
        assert self.weights is not None
        if _LIBC.msync(self.weights.data_ptr(), self.weights.numel() * 4, MS_SYNC) != 0:
            raise OSError(ctypes.get_errno(), "msync failed")


def vm_dirty_settings() -> dict[str, int]:
    """The kernel's dirty-page write-back settings (``/proc/sys/vm/dirty_*``)."""
    out = {}
    for p in sorted(Path("/proc/sys/vm").glob("dirty_*")):
        try:
            out[p.name] = int(p.read_text().split()[0])
        except (OSError, ValueError):
            continue
    return out


def meminfo_kib(*fields: str) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    for line in Path("/proc/meminfo").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in out:
            out[key] = int(line.split()[1])
    return out


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
    if arm == "hashed_ram":
        return ["store.tiered=false", f"sparse.max_rows_per_table={args.host_rows + args.device_rows}"]
    if arm == "mmap":
        return ["store.tiered=false", f"sparse.max_rows_per_table={args.mmap_rows}"]
    raise ValueError(f"unknown arm {arm!r}")


def run_arm(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """Fit one arm of the larger-than-RAM part; its record (module docstring)."""
    out = args.dir / arm
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = config_from_dict({}, [*base_overrides(args, out, args.steps), *arm_overrides(args, arm)])
    mapped = MappedWeights(out / "mmap" / "weights.f32") if arm == "mmap" else None
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
    arms: dict[str, dict[str, Any]] = {}
    for arm in args.arms:
        say(f"over_ram: {arm} ({args.steps} steps of {args.batch})")
        record = run_child([__file__, *argv, "--arm", arm])
        emit({"part": "over_ram", **record})
        say(
            f"over_ram: {arm}: {record['samples_per_s']:,.0f} samples/s (last tenth "
            f"{record['samples_per_s_last_tenth']:,.0f}), auc {record['auc']:.4f}, "
            f"{(record['disk_bytes'] or 0) / 1e9:.2f} GB written"
        )
        arms[arm] = record
    out: dict[str, Any] = {"over_ram": arms}
    tier = arms.get("tierrec")

    def versus(other: str, key: str, op: str) -> float | None:
        if tier is None or other not in arms or tier.get(key) is None or arms[other].get(key) is None:
            return None
        a, b = tier[key], arms[other][key]
        return a - b if op == "-" else (a / b if b else None)

    out.update(
        over_ram_vs_mmap_last_tenth=versus("mmap", "samples_per_s_last_tenth", "/"),
        over_ram_vs_hashed_ram_last_tenth=versus("hashed_ram", "samples_per_s_last_tenth", "/"),
        over_ram_auc_vs_mmap=versus("mmap", "auc", "-"),
        over_ram_auc_vs_hashed_ram=versus("hashed_ram", "auc", "-"),
        over_ram_disk_bytes_vs_mmap=versus("mmap", "disk_bytes", "/"),
    )
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
        help="rows per table of the mapped file (8 x 256 B: 23.8 GiB)",
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
        args.host_rows, args.device_rows, args.mmap_rows = 4000, 2048, 50_000
        args.eval_samples, args.fit_ids, args.fit_steps, args.fit_warmup, args.fit_repeats = (
            1024,
            2000,
            6,
            2,
            2,
        )
    args.only = [p for p in args.only.split(",") if p]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(OVER_RAM_ARMS)) + sorted(set(args.only) - {"fits_ram", "over_ram"})
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
