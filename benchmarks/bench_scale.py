"""A table larger than RAM, trained: a DLRM whose tiered tables touch ``--target-ids`` distinct raw 64-bit
ids of 260-byte rows (dim 64 + row-wise Adagrad; 132 bytes with `--set sparse.weights_precision=fp16`) in one run, one rank, bounded host and device tiers.

The run is a real :class:`~recsys.trainer.Trainer` fit on synthetic Criteo-layout data (``--tables``
Zipf(1.05) features over the full 2^63 id space: raw hashed ids, a log-layout LMDB store, its mapped
pages dropped every 1,024 rows so RSS stays bounded). It reports, as its LAST line, one JSON object:

- ``rows_in_lmdb``: rows stored at the end (the store reopened after the run's final flush; every touched
  row is there) and ``lmdb_gib``, the size of its file;
- ``wall_s`` (the fit) and ``samples_per_s_first_tenth`` / ``_last_tenth`` (over the first and last tenth
  of the steps, from the fit's per-window rates);
- ``writeback_rows_per_s``: rows written to LMDB per second of the fit (``writeback_rows``: with the
  final flush, from the store's counters); ``disk`` (``/proc/self/io``: ``wchar``, what the process handed the kernel;
  the device's sectors written, ``/sys/dev/block``, which counts other processes too) and
  ``disk_write_bytes_per_row_byte``: the lesser per byte of rows written back (the final flush included);
- ``peak_rss_gib`` (``VmHWM`` at the end of the fit and its final flush, and the peak sampled ``VmRSS`` with
  its anonymous / file split and ``peak_rss_sampled_in``: the fit or the final flush;
  ``peak_rss_with_check_gib`` includes the check's second index) against
  ``host_budget_gib``: the host tier's rows plus the device tier's slots (the CPU is the device here),
  and ``rss_limit_gib`` = budget + 3 GiB;
- ``checked_rows``, ``rows_exact``: ``--check`` (1,000) ids sampled from the training batches before the
  run; an independent replay records each one's row straight from the slot table every time a batch that
  holds it has finished its optimizer step (a dict oracle: the newest row of each sampled id), and at the
  end the reopened store's copy of every sampled row must equal it bit for bit.

Usage: python benchmarks/bench_scale.py [--target-ids 100000000] [--steps 1700] [--dir /tmp/bench_scale]
       [--smoke]   (a run of seconds at tiny sizes: the code path, not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import emit, machine_info, quiet
from ssd_tier.disk import DiskIo
from tiered_training.runs import Windows

from embedding_store import TableSpec, Tier
from embedding_store.backends import open_backend
from embedding_store.rows import pack_weights
from recsys.build import TrainSpec
from recsys.config import config_from_dict
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.distributed import free_port, init_distributed
from recsys.routing import values_by_feature
from recsys.sharding import local_shards
from recsys.tiered import RoutedBatch, TieredTables, row_bytes, slot_row_bytes
from recsys.trainer import Trainer

GIB = 2**30


def _hwm() -> int:
    """Peak resident bytes of this process so far (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class RssProbe:
    """Samples this process's VmRSS (with RssAnon / RssFile) every ``every_s`` seconds; keeps the peak."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.peak: dict[str, int] = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.peak_at_s = 0.0  # seconds after the probe started
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, name="rss-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with open("/proc/self/status") as f:
                now = {
                    k: int(v.split()[0]) * 1024
                    for k, v in (line.split(":", 1) for line in f)
                    if k in self.peak
                }
            if now["VmRSS"] > self.peak["VmRSS"]:
                self.peak, self.peak_at_s = now, time.perf_counter() - self.started

    def __enter__(self) -> RssProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def sampled_ids(
    data: SyntheticCriteo, features: list[str], *, steps: int, batch: int, count: int
) -> dict[str, np.ndarray]:
    """``count`` distinct (feature, id) pairs drawn from the training batches of 10 steps spread over the
    run (popular and rare ids as the data has them), per feature."""
    rng = np.random.default_rng(7)
    pool: dict[str, list[np.ndarray]] = {f: [] for f in features}
    for step in np.linspace(0, steps - 1, 10).astype(int).tolist():
        values = values_by_feature(data.batch(step=step, rank=0, world_size=1, batch_size=batch).sparse)
        for f in features:
            pool[f].append(values[f].numpy())
    per = -(-count // len(features))
    out = {}
    for f in features:
        ids = np.unique(np.concatenate(pool[f]))
        out[f] = np.sort(rng.choice(ids, min(per, ids.shape[0]), replace=False))
    return out


def recording_tables(
    sample: dict[str, np.ndarray], oracle: dict[str, dict[int, np.ndarray]]
) -> type[TieredTables]:
    """A tier binding that keeps, for every sampled id, its packed row (weights, then optimizer state) as
    the slot table holds it when a batch that contains it is released (its optimizer step done)."""

    class RecordingTables(TieredTables):
        specs: list[Any]
        _pending: dict[int, list[tuple[str, np.ndarray, torch.Tensor]]]

        def __init__(self, dmp: Any, tables: list[Any], *, plan: Any) -> None:
            super().__init__(dmp, tables, plan=plan)
            # This rank's slot tables (aliases of the live weights and optimizer state), found as the
            # binding finds them, through recsys.sharding's public local_shards.
            mine = [t for t in tables if t.name in self.names]
            self.slot_tables = {s.table: s for s in local_shards(dmp, mine)}
            self.precision = plan.weights_precision  # the slot tables may hold fp16 values as float32

        def fill(self, routed: RoutedBatch) -> Any:
            out = super().fill(routed)
            ids, slots = values_by_feature(routed.batch.sparse), values_by_feature(out.sparse)
            seen = []
            for name in self.names:
                feature = self.feature[name]
                mask = np.isin(ids[feature].numpy(), sample[feature])
                if mask.any():
                    seen.append((name, ids[feature].numpy()[mask], slots[feature][torch.from_numpy(mask)]))
            if not hasattr(self, "_pending"):
                self._pending = {}
            self._pending[routed.batch_id] = seen
            return out

        def release(self, batch_id: int) -> None:
            for name, ids, slots in getattr(self, "_pending", {}).pop(batch_id, []):
                shard = self.slot_tables[name]
                weights = shard.weight.data[slots]
                state = shard.state.data.reshape(shard.weight.shape[0], -1)[slots]
                spec = TableSpec(name=name, dim=weights.shape[1], weights_precision=self.precision)
                rows = np.empty((weights.shape[0], spec.row_floats), dtype=np.float32)  # as the store packs
                pack_weights(spec, weights.numpy(), rows[:, : spec.weight_words])
                rows[:, spec.weight_words :] = state.numpy()
                oracle.setdefault(name, {}).update(zip(ids.tolist(), rows.copy(), strict=True))
            super().release(batch_id)

    return RecordingTables


def stream_overrides(args: argparse.Namespace) -> list[str]:
    """The stream, model and tiers of this benchmark (``--tables``, ``--device-rows``, ``--host-rows``):
    Zipf 1.05 over raw 63-bit ids, dim 64, row-wise Adagrad, tiered with mapped pages dropped every 1,024
    rows. ``bench_bounded.py`` trains on the same."""
    return [
        "synthetic.num_dense=13",
        f"synthetic.num_sparse={args.tables}",
        f"synthetic.id_space={2**63}",
        "synthetic.zipf_alpha=1.05",
        "model.embedding_dim=64",
        "model.dense_arch=[128, 64]",
        "model.over_arch=[128, 64]",
        "sparse.optimizer=exact_rowwise_adagrad",
        "store.tiered=true",
        f"store.device_rows={args.device_rows}",
        f"store.host_rows={args.host_rows}",
        "store.unmap_every_rows=1024",
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    features = [f"cat_{i}" for i in range(args.tables)]
    overrides = [
        "train.threads_per_rank=1",
        "train.nproc=1",
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch}",
        "train.log_every=20",
        "train.checkpoint_every=0",
        # no checkpoint at the end: it measures training (and the digest of a 100 M-row checkpoint holds
        # every row in memory, more than this machine has)
        "train.final_checkpoint=false",
        "eval.every=0",
        "synthetic.eval_samples=256",
        "eval.batch_size=256",
        *stream_overrides(args),
        f"store.path={args.dir / 'store'}",
        *args.set,
    ]
    cfg = config_from_dict({}, overrides)
    row = row_bytes(cfg.sparse, cfg.model.embedding_dim)  # 260 bytes (fp32), 132 (fp16)
    slot = slot_row_bytes(cfg.sparse, cfg.model.embedding_dim)  # 260 unless FBGEMM's tables are fp16
    data = SyntheticCriteo(
        SyntheticConfig(num_sparse=args.tables, id_space=2**63, zipf_alpha=1.05, num_dense=13),
        seed=cfg.train.seed,
    )
    sample = sampled_ids(data, features, steps=args.steps, batch=args.batch, count=args.check)
    oracle: dict[str, dict[int, np.ndarray]] = {}
    budget = args.tables * (args.host_rows * row + args.device_rows * slot)
    trainer = Trainer(
        cfg, ENV, out_dir=args.dir / "run", spec=TrainSpec(tables=recording_tables(sample, oracle))
    )
    io = DiskIo(args.dir)
    with RssProbe() as rss:
        trainer.start(resume=False)
        windows = Windows(trainer.step, args.dir / "run" / "metrics.jsonl")
        start = time.perf_counter()
        summary = trainer.fit(windows)
        wall = time.perf_counter() - start
        fit_end_s = time.perf_counter() - rss.started
        tiered = trainer.tiered
        assert tiered is not None and tiered.store is not None
        counters = tiered.counters()
        column = TieredTables.COUNTERS.index("ssd_rows_written")
        written_in_fit = int(sum(float(c[column]) for c in counters.values()))
        store = tiered.store
        config, tables = store.config, list(store.tables.values())
        trainer.close()  # flushes every row held above LMDB
        # rows written into LMDB, the final flush included (the counters outlive the closed store)
        written = sum(c[Tier.SSD].rows_in for c in store.counters().values())
        del tiered, store, trainer  # the store's index goes before the check opens the store again
        train_peak = dict(rss.peak)
        peak_in = "fit" if rss.peak_at_s <= fit_end_s else "final flush"
    fit_hwm = _hwm()
    os.sync()
    disk = io.delta()
    store_dir = args.dir / "store" / "rank_0"
    backend = open_backend(store_dir, options=config.lmdb, seed=config.seed, tables=tables)
    try:
        rows_in_lmdb = sum(backend.num_rows(t.name) for t in tables)
        checked = exact = 0
        for spec in tables:
            want = oracle.get(spec.name, {})
            ids = np.array(sorted(want), dtype=np.int64)
            found, rows = backend.get_rows(spec.name, ids)
            at = np.cumsum(found) - 1  # row of each found id
            checked += ids.shape[0]
            exact += sum(
                bool(found[i]) and np.array_equal(rows[at[i]], want[int(x)]) for i, x in enumerate(ids)
            )
    finally:
        backend.close()
    steps = [r["step"] for r in windows.rows]
    rates = [r["samples_per_s"] for r in windows.rows]
    tenth = max(1, len(rates) // 10)
    payload = max(1, written) * row
    return {
        "rows_in_lmdb": rows_in_lmdb,
        "target_ids": args.target_ids,
        "reached_target": rows_in_lmdb >= args.target_ids,
        "lmdb_gib": (store_dir / "data.mdb").stat().st_size / GIB,
        "row_bytes": row,
        "rows_gib": rows_in_lmdb * row / GIB,
        "machine_ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "wall_s": wall,
        "steps": summary["steps"],
        "samples": summary["samples"],
        "samples_per_s": summary["samples_per_s"],
        "samples_per_s_first_tenth": float(np.mean(rates[:tenth])) if rates else None,
        "samples_per_s_last_tenth": float(np.mean(rates[-tenth:])) if rates else None,
        "window_steps": steps[-1] if steps else 0,
        "writeback_rows": written,  # the final flush included
        "writeback_rows_in_fit": written_in_fit,
        "writeback_rows_per_s": written_in_fit / wall,
        "disk": disk,
        "disk_write_bytes_per_row_byte": min(disk["wchar"], disk.get("dev_write_bytes", disk["wchar"]))
        / payload,
        # the fit and the final flush (VmHWM before the check reopens the store and rebuilds its index)
        "peak_rss_gib": fit_hwm / GIB,
        "peak_rss_sampled_gib": {k: v / GIB for k, v in train_peak.items()},
        "peak_rss_sampled_in": peak_in,
        "peak_rss_with_check_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "host_budget_gib": budget / GIB,
        "rss_limit_gib": budget / GIB + 3,
        "checked_rows": checked,
        "rows_exact": exact,
        "all_exact": checked > 0 and exact == checked,
    }


ENV: Any = None


def main() -> None:
    global ENV
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-ids", type=int, default=100_000_000, help="distinct ids the run must touch")
    parser.add_argument("--steps", type=int, default=1700, help="training steps (~100 M ids at the defaults)")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--host-rows", type=int, default=1_000_000, help="host-tier rows per table")
    parser.add_argument("--device-rows", type=int, default=262_144, help="device-tier slots per table")
    parser.add_argument("--check", type=int, default=1000, help="sampled rows compared with the replay")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_scale"))
    parser.add_argument("--keep", action="store_true", help="keep the store")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)"
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 tables, 6 steps of 512, tiny tiers")
    args = parser.parse_args()
    if args.smoke:
        args.target_ids, args.steps, args.batch, args.tables, args.check = 1000, 6, 512, 2, 50
        args.host_rows, args.device_rows = 1024, 2048
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    quiet()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    ENV = init_distributed(threads_per_rank=1)
    emit(
        {
            **machine_info("torch", "torchrec", "fbgemm_gpu", "numpy", "lmdb"),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
    )
    try:
        result = run(args)
    finally:
        torch.distributed.destroy_process_group()
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    emit(result)
    if not result["all_exact"]:
        print(json.dumps({"error": "sampled rows differ from the replay"}), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
