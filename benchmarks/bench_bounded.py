"""Bounded tables against unbounded ones (issue 38's acceptance): admission, expiry and a row cap, each
on a real :class:`~recsys.trainer.Trainer` fit of one rank over bench_scale.py's stream shape (``--tables``
Zipf(1.05) features over the full 2^63 id space, dim 64, row-wise Adagrad, batches of ``--batch``, a
log-layout LMDB store behind ``--host-rows`` host rows and ``--device-rows`` device slots per table).

Three parts (``--only`` picks some); each pair runs in this process, one arm after the other (the arm
without the rule first), on the same stream, each arm into its own folder under ``--dir``, deleted once
measured. The program prints a progress line per tenth of every fit and a JSON record per arm on stdout,
and as its LAST line one JSON object:

**admission** (``admit_after = --admit-after`` (2) against no ``[store.bounds]``, ``--steps`` steps):

- ``rows_ratio``: stored rows at the end of training with admission over without (``rows_admit``,
  ``rows_none``): at the last log window, before the final evaluation, the store is flushed (every row
  held above LMDB written to it, as a run that stopped there would) and the rows LMDB then holds are
  counted (``TieredStore.stats``; the default rows included). The final evaluation comes after: without
  admission it gives every held-out id the run never trained a row of its own (``eval_rows_none``, from
  the store's ``rows_initialised``; with admission such ids read the default row), so the rows after the
  run (``rows_after_eval_*``, the store reopened) are not the trained model's;
- ``disk_bytes_ratio``: bytes written to the disk from the start of the fit to the end of that flush
  (training's write-back and the flush: the trained model made durable), with admission over without
  (``disk_bytes_admit``, ``disk_bytes_none``): ``wchar`` of ``/proc/self/io``, what the process handed
  the kernel (LMDB writes with ``pwrite``); beside it ``disk_bytes_training_ratio`` (up to the last
  window, without the flush), ``disk_bytes_with_eval_*`` (the whole arm: the evaluation's rows and the
  store's close included) and each arm's ``disk_end_of_training`` record (``write_bytes``; the device's
  sectors written, which count other processes too);
- ``auc_delta``: held-out AUC with admission minus without (``auc_admit``, ``auc_none``, and the log
  losses), the final evaluation of each fit on the same ``--eval-samples`` held-out samples;
- ``last_tenth_speedup``: samples/s over the last tenth of the log windows (total samples over total time:
  ``harness.window_rate``) with admission over without, the median of ``--repeats`` pairs run alternately
  (none admit, admit none, ...; ``last_tenth_speedup_pairs``, ``_range``)
  (``last_tenth_samples_per_s_admit``, ``_none``).

**expiry** (a stream drifting by ``--drift`` popularity ranks per sample, ``expire_after_steps =
--expire-after`` against 0; both arms with ``admit_after = --expiry-admit-after``, 1 by default: only
expiry differs):

- ``rows_growth_second_half_expire`` / ``_none``: rows at the end of training over rows at the
  midpoint (``rows_mid_*``, ``rows_end_*``: the training window whose step is nearest half of ``--steps``,
  and the last one). The row count is sampled at every log window from the training thread: with bounds,
  the ids with a row of their own (``trainer.tiered.bounded.counters()``; the routing stage may have
  decided the next few steps already); without, the rows the store has created (``rows_initialised``:
  no row ever leaves an unbounded table).

**cap** (``max_rows = --cap`` per table, the stream of admission, smaller tiers, ``--cap-device-rows`` and
``--cap-host-rows``, so that rows pass through the log and the cap's deletes reach it):

- ``cap_max_rows``: the largest ids-with-a-row count of any table over the run's log windows, against
  ``cap`` (``cap_held``: it never exceeded it);
- ``cap_log_bytes``: the size of the store's log file (``data.mdb``) after the flush at the end of
  training (the close after the evaluation writes the device tier's rows again: ``log_bytes_after_run``
  in the arm's record), against ``cap_log_bytes_limit`` = 1.5 x ``cap`` x tables x 260 bytes (the log
  holds every table of the rank), and ``cap_log_ratio`` = ``cap_log_bytes`` / (``cap`` x tables x 260);
  ``cap_log_within`` says whether it is under the limit.

Every arm's record also holds its ``wall_s`` (the fit: training, the flush at its end (``final_flush_s``)
and the final evaluation), ``samples_per_s``, ``auc``, ``logloss``, the per-table bounds counters at the
end (``bounds``) and the row count of every log window (``rows_by_step``).

Usage: python benchmarks/bench_bounded.py [--steps 1000] [--batch 16384] [--only admission,expiry,cap]
       [--set KEY=VALUE ...] [--dir /tmp/bench_bounded] [--keep]
       [--smoke]   (seconds at tiny sizes: the code path, not a figure)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_scale import stream_overrides
from harness import alternate, emit, last_tenth, machine_info, paired_ratios, quiet, window_rate
from ssd_tier.disk import DiskIo
from tiered_training.runs import SilentProgress

from embedding_store import Tier
from embedding_store.backends import open_backend
from recsys.build import TrainSpec
from recsys.config import config_from_dict
from recsys.distributed import DistEnv, free_port, init_distributed
from recsys.tiered import TieredTables
from recsys.trainer import Trainer

PARTS = ("admission", "expiry", "cap")
INITIALISED = TieredTables.COUNTERS.index("rows_initialised")


def say(text: str) -> None:
    """A progress line (stderr: stdout holds one JSON record per line)."""
    print(f"[bench_bounded {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Probe:
    """The metrics sink of one fit: at every training log window, its rate and what the store and the
    bounds hold then (read from the training thread, between steps); writes nothing.

    Args:
        trainer: the trainer being fitted (started: its store is open).
        disk: the arm's I/O counters.
        label: the arm's name, for the progress lines.
    """

    def __init__(self, trainer: Trainer, disk: DiskIo, label: str) -> None:
        self.trainer = trainer
        self.disk = disk
        self.label = label
        self.path = trainer.out_dir / "metrics.jsonl"  # named in a full-disk error only
        self.rows: list[dict[str, Any]] = []
        self.flushed: dict[str, Any] = {}  # at the end of training (flush)
        self.started = time.perf_counter()

    def read(self) -> dict[str, Any]:
        """Rows with a row of their own per bounded table, rows the store created, the disk so far."""
        tiered = self.trainer.tiered
        assert tiered is not None
        created = sum(int(c[INITIALISED]) for c in tiered.counters().values())
        per_table = (
            {} if tiered.bounded is None else {n: c["rows"] for n, c in tiered.bounded.counters().items()}
        )
        return {"created": created, "bounded_rows": per_table, "disk": self.disk.delta()}

    def write(self, **record: Any) -> None:
        """A record of the fit (``MetricsLog.write``'s keywords): a training window is sampled, and the
        last one flushes the store (:meth:`flush`); the others are dropped."""
        if record.get("kind") != "train":
            return
        now = self.read()
        rows = sum(now["bounded_rows"].values()) if now["bounded_rows"] else now["created"]
        self.rows.append(
            {"step": record["step"], "samples_per_s": record["samples_per_s"], "rows": rows, **now}
        )
        steps = self.trainer.config.train.steps
        if record["step"] == steps:
            self.flush()
        if (
            record["step"] % max(1, steps // 10) < self.trainer.config.train.log_every
            or record["step"] == steps
        ):
            say(
                f"{self.label}: step {record['step']}/{steps}, {record['samples_per_s']:,.0f} samples/s, "
                f"{rows:,} rows, {time.perf_counter() - self.started:.0f} s"
            )

    def flush(self) -> None:
        """The end of training (the last window, before the final evaluation): write every row held above
        LMDB to it, as a run that stopped here would; then count the rows LMDB holds, the disk so far and the
        size of the log file."""
        tiered = self.trainer.tiered
        assert tiered is not None and tiered.store is not None
        start = time.perf_counter()
        tiered.store.flush()
        stats = tiered.store.stats()
        self.flushed = {
            "rows": sum(tiers[Tier.SSD] for tiers in stats.resident_rows.values()),
            "disk": self.disk.delta(),
            "seconds": time.perf_counter() - start,
            "log_bytes": (tiered.path / "data.mdb").stat().st_size,
        }


def base_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """bench_scale.py's stream and model, sized by ``args``, its store under ``out``, then every ``--set``
    (an arm's own overrides come after them)."""
    return [
        "train.threads_per_rank=1",
        "train.nproc=1",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        f"train.log_every={max(1, args.steps // 50)}",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        "eval.every=0",
        f"eval.batch_size={min(args.batch, 16384)}",
        *stream_overrides(args),
        f"store.path={out / 'store'}",
        *args.set,
    ]


def bounds(**rule: int) -> list[str]:
    """The ``[store.bounds]`` override of the rule keys given (none when every one is off)."""
    on = {k: v for k, v in rule.items() if v and not (k == "admit_after" and v == 1)}
    return [f"store.bounds={{{', '.join(f'{k}={v}' for k, v in on.items())}}}"] if on else []


def stored(store_dir: Path, config: Any, tables: list[Any]) -> int:
    """Rows in the closed store ``store_dir`` (reopened), every table together."""
    backend = open_backend(store_dir, options=config.lmdb, seed=config.seed, tables=tables)
    try:
        return sum(backend.num_rows(t.name) for t in tables)
    finally:
        backend.close()


def run_arm(args: argparse.Namespace, label: str, overrides: list[str]) -> dict[str, Any]:
    """One fit of an arm into ``--dir``/``label``; its figures (module docstring), its folder deleted."""
    out = args.dir / label
    cfg = config_from_dict({}, [*base_overrides(args, out), *overrides])
    say(f"{label}: {' '.join(o for o in overrides)}")
    trainer = Trainer(cfg, ENV, out_dir=out / "run", spec=TrainSpec(progress=SilentProgress))
    disk = DiskIo(args.dir)
    trainer.start(resume=False)
    probe = Probe(trainer, disk, label)
    start = time.perf_counter()
    summary = trainer.fit(probe)
    wall = time.perf_counter() - start
    tiered = trainer.tiered
    assert tiered is not None and tiered.store is not None and probe.rows
    after_fit = probe.read()
    counters = {} if tiered.bounded is None else tiered.bounded.counters()
    store = tiered.store
    config, tables = store.config, list(store.tables.values())
    trainer.close()  # the final flush
    del tiered, store, trainer
    os.sync()
    total_disk = disk.delta()
    store_dir = out / "store" / "rank_0"
    rows_stored = stored(store_dir, config, tables)
    log_bytes = (store_dir / "data.mdb").stat().st_size
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    last = probe.rows[-1]
    result = {
        "arm": label,
        "overrides": overrides,
        "wall_s": wall,
        "steps": summary["steps"],
        "samples_per_s": summary["samples_per_s"],
        "last_tenth_samples_per_s": window_rate(probe.rows, 0, part=last_tenth(len(probe.rows))),
        "row_bytes": tables[0].row_bytes,  # the store's packed row (TableSpec), the same for every table
        "auc": summary["auc"],
        "logloss": summary["logloss"],
        "rows_end": probe.flushed["rows"],
        "final_flush_s": probe.flushed["seconds"],
        "disk_bytes": probe.flushed["disk"]["wchar"],
        "disk_bytes_training": last["disk"]["wchar"],
        "disk_end_of_training": probe.flushed["disk"],
        "eval_rows": after_fit["created"] - last["created"],
        "rows_stored_after_run": rows_stored,
        "disk_bytes_with_eval": total_disk["wchar"],
        "log_bytes": probe.flushed["log_bytes"],
        "log_bytes_after_run": log_bytes,
        "bounds": counters,
        "rows_by_step": [[r["step"], r["rows"]] for r in probe.rows],
        "max_table_rows": max((max(r["bounded_rows"].values(), default=0) for r in probe.rows), default=0),
    }
    emit(result)
    say(f"{label}: done in {wall:.0f} s, auc {summary['auc']}, {rows_stored:,} rows stored")
    return result


def ratio(a: float, b: float) -> float | None:
    """``a / b`` (None where ``b`` is 0)."""
    return a / b if b else None


def admission(args: argparse.Namespace) -> dict[str, Any]:
    """The admission pair: ``admit_after`` against no bounds, on the held-out split of ``--eval-samples``."""
    held_out = [f"synthetic.eval_samples={args.eval_samples}"]
    overrides = {"none": held_out, "admit": [*held_out, *bounds(admit_after=args.admit_after)]}
    runs = alternate(
        list(overrides), args.repeats, lambda name, _: run_arm(args, f"admission_{name}", overrides[name])
    )
    # Rows and AUC are the same in every repeat (the same model); the speed is the median pair.
    for name, rs in runs.items():
        if len({(r["rows_end"], r["auc"]) for r in rs}) > 1:
            raise SystemExit(f"admission_{name}: the repeats trained different models")
    none, admit = runs["none"][0], runs["admit"][0]
    speed = paired_ratios(
        [r["last_tenth_samples_per_s"] for r in runs["admit"]],
        [r["last_tenth_samples_per_s"] for r in runs["none"]],
    )
    return {
        "repeats": args.repeats,
        "last_tenth_speedup_pairs": speed["ratios"],
        "last_tenth_speedup_range": [min(speed["ratios"]), max(speed["ratios"])],
        "admit_after": args.admit_after,
        "eval_samples": args.eval_samples,
        "rows_ratio": ratio(admit["rows_end"], none["rows_end"]),
        "rows_admit": admit["rows_end"],
        "rows_none": none["rows_end"],
        "eval_rows_admit": admit["eval_rows"],
        "eval_rows_none": none["eval_rows"],
        "rows_after_eval_admit": admit["rows_stored_after_run"],
        "rows_after_eval_none": none["rows_stored_after_run"],
        "disk_bytes_ratio": ratio(admit["disk_bytes"], none["disk_bytes"]),
        "disk_bytes_admit": admit["disk_bytes"],
        "disk_bytes_none": none["disk_bytes"],
        "disk_bytes_with_eval_admit": admit["disk_bytes_with_eval"],
        "disk_bytes_with_eval_none": none["disk_bytes_with_eval"],
        "disk_bytes_training_ratio": ratio(admit["disk_bytes_training"], none["disk_bytes_training"]),
        "disk_bytes_training_admit": admit["disk_bytes_training"],
        "disk_bytes_training_none": none["disk_bytes_training"],
        "auc_delta": admit["auc"] - none["auc"],
        "auc_admit": admit["auc"],
        "auc_none": none["auc"],
        "logloss_admit": admit["logloss"],
        "logloss_none": none["logloss"],
        "last_tenth_speedup": speed["median"],
        "last_tenth_samples_per_s_admit": statistics.median(
            r["last_tenth_samples_per_s"] for r in runs["admit"]
        ),
        "last_tenth_samples_per_s_none": statistics.median(
            r["last_tenth_samples_per_s"] for r in runs["none"]
        ),
        "wall_s_admit": admit["wall_s"],
        "wall_s_none": none["wall_s"],
    }


def growth(arm: dict[str, Any], steps: int) -> tuple[int, int, float | None]:
    """(rows at the window nearest the midpoint, rows at the last window, their ratio)."""
    by_step = arm["rows_by_step"]
    mid = min(by_step, key=lambda r: (abs(r[0] - steps / 2), r[0]))[1]
    end = by_step[-1][1]
    return mid, end, ratio(end, mid)


def expiry(args: argparse.Namespace) -> dict[str, Any]:
    """The expiry pair on a drifting stream: ``expire_after_steps`` against none."""
    common = [f"synthetic.drift_ranks_per_sample={args.drift}", "synthetic.eval_samples=4096"]
    admit = args.expiry_admit_after
    none = run_arm(args, "expiry_none", [*common, *bounds(admit_after=admit)])
    expire = run_arm(
        args, "expiry_expire", [*common, *bounds(admit_after=admit, expire_after_steps=args.expire_after)]
    )
    out: dict[str, Any] = {
        "drift_ranks_per_sample": args.drift,
        "expire_after_steps": args.expire_after,
        "expiry_admit_after": admit,
    }
    for name, arm in (("expire", expire), ("none", none)):
        mid, end, ratio_ = growth(arm, args.steps)
        out.update(
            {f"rows_mid_{name}": mid, f"rows_end_{name}": end, f"rows_growth_second_half_{name}": ratio_}
        )
        out[f"expired_total_{name}"] = sum(c["expired_total"] for c in arm["bounds"].values())
    out["auc_expire"], out["auc_none_expiry"] = expire["auc"], none["auc"]
    return out


def cap(args: argparse.Namespace) -> dict[str, Any]:
    """The cap: ``max_rows`` per table through small tiers; its largest row count and the log's size."""
    tiers = [f"store.device_rows={args.cap_device_rows}", f"store.host_rows={args.cap_host_rows}"]
    arm = run_arm(args, "cap", [*tiers, "synthetic.eval_samples=4096", *bounds(max_rows=args.cap)])
    payload = args.cap * args.tables * arm["row_bytes"]
    return {
        "cap": args.cap,
        "cap_max_rows": arm["max_table_rows"],
        "cap_held": arm["max_table_rows"] <= args.cap,
        "cap_capped_total": sum(c["capped_total"] for c in arm["bounds"].values()),
        "cap_log_bytes": arm["log_bytes"],
        "cap_log_bytes_limit": 1.5 * payload,
        "cap_log_ratio": arm["log_bytes"] / payload,
        "cap_log_within": arm["log_bytes"] <= 1.5 * payload,
        "cap_rows_stored": arm["rows_stored_after_run"],
    }


RUNS = {"admission": admission, "expiry": expiry, "cap": cap}
ENV: DistEnv | None = None


def parse() -> argparse.Namespace:
    """The flags (``--smoke`` replaces the sizes with tiny ones)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps of every arm")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--host-rows", type=int, default=1_000_000, help="host-tier rows per table")
    parser.add_argument("--device-rows", type=int, default=262_144, help="device-tier slots per table")
    parser.add_argument("--eval-samples", type=int, default=1_048_576, help="admission's held-out split")
    parser.add_argument("--admit-after", type=int, default=2)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="admission: pairs run alternately (none admit, admit none, ...)",
    )
    parser.add_argument("--drift", type=float, default=2e-3, help="expiry: ranks drifted per sample")
    parser.add_argument("--expire-after", type=int, default=None, help="expiry (default: a fifth of --steps)")
    parser.add_argument("--expiry-admit-after", type=int, default=1, help="admit_after of both expiry arms")
    parser.add_argument("--cap", type=int, default=262_144, help="max_rows per table")
    parser.add_argument("--cap-device-rows", type=int, default=65_536)
    parser.add_argument("--cap-host-rows", type=int, default=65_536)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every arm"
    )
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_bounded"))
    parser.add_argument("--keep", action="store_true", help="keep every arm's folder")
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 tables, 20 steps of 512, tiny tiers")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch, args.tables, args.eval_samples = 20, 512, 2, 2048
        args.host_rows, args.device_rows = 1024, 4096
        args.cap, args.cap_device_rows, args.cap_host_rows = 3000, 2048, 512
    if args.expire_after is None:
        args.expire_after = max(8, args.steps // 5)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(args.only) - set(PARTS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown part; the parts are {','.join(PARTS)}")
    return args


def main() -> None:
    global ENV
    args = parse()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    quiet()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    ENV = init_distributed(threads_per_rank=1)
    emit(
        {
            **machine_info("torch", "torchrec", "numpy", "lmdb"),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
    )
    result: dict[str, Any] = {}
    try:
        for part in PARTS:
            if part in args.only:
                started = time.perf_counter()
                result.update(RUNS[part](args))
                say(f"{part}: {time.perf_counter() - started:.0f} s")
    finally:
        torch.distributed.destroy_process_group()
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
