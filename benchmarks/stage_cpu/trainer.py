"""The tier stages timed inside a real :class:`~recsys.trainer.Trainer` (``bench_stage_cpu.py --trainer``)."""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from stage_cpu.driver import thread_cpu_ns, writer_tid

TRAINER_SHAPES = {
    "fits_cache": ["synthetic.num_sparse=8", "synthetic.id_space=10000", "store.device_rows=10240"],
    "ssd_bound": ["synthetic.num_sparse=4", "synthetic.id_space=2000000"],
}


def run_trainer(name: str, args: argparse.Namespace, root: Path) -> dict[str, object]:
    """The same calls made by the real stage threads: ``recsys.trainer.Trainer`` over synthetic data with
    a ``TrainSpec`` whose tier binding times ``TieredTables``' stage methods (batches from ``--warmup``
    on; evaluation batches are not counted)."""
    from recsys.build import TrainSpec
    from recsys.config import config_from_dict
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.tiered import TieredTables
    from recsys.trainer import Trainer

    timers: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    first, last = args.warmup, args.warmup + args.steps
    writer = {}

    def timed(
        method: Callable[..., object], label: str, batch_of: Callable[..., int]
    ) -> Callable[..., object]:
        def call(self: TieredTables, *a: object, **kw: object) -> object:
            batch = batch_of(*a)
            if label == "fill" and batch == first:
                writer["start"] = thread_cpu_ns(writer_tid())
            start = time.thread_time_ns()
            try:
                return method(self, *a, **kw)
            finally:
                spent = time.thread_time_ns() - start
                if first <= batch < last:
                    with lock:
                        timers[label] += spent
                if label == "release" and batch == last - 1:
                    writer["end"] = thread_cpu_ns(writer_tid())

        return call

    class TimedTables(TieredTables):
        route = timed(TieredTables.route, "route", lambda b, *_: b)
        announce = timed(TieredTables.announce, "lookahead", lambda r: r.batch_id)
        prefetch = timed(TieredTables.prefetch, "prefetch", lambda r: r.batch_id)
        fill = timed(TieredTables.fill, "fill", lambda r: r.batch_id)
        release = timed(TieredTables.release, "release", lambda b: b)

    dim = args.dim
    overrides = [
        *TRAINER_SHAPES[name],
        f"model.embedding_dim={dim}",
        "model.dense_arch=[32, 16]" if dim == 16 else f"model.dense_arch=[32, {dim}]",
        "model.over_arch=[32]",
        "synthetic.eval_samples=256",
        "train.batch_size=2048",
        f"train.steps={last + 2}",
        "train.log_every=1000000",
        "eval.batch_size=256",
        "store.tiered=true",
    ]
    if name == "ssd_bound":
        overrides += [f"store.device_rows={args.ssd_device_rows}", f"store.host_rows={args.ssd_host_rows}"]
    cfg = config_from_dict({}, overrides)
    env = init_distributed(threads_per_rank=1)
    out = root / f"trainer_{name}"
    trainer = Trainer(cfg, env, out_dir=out, spec=TrainSpec(tables=TimedTables))
    trainer.start(resume=False)
    proc0 = time.process_time_ns()
    trainer.fit(MetricsLog(out / "m.jsonl", enabled=False))
    proc_ns = time.process_time_ns() - proc0
    trainer.close(flush=False)
    ids = args.steps * cfg.synthetic.num_sparse * cfg.train.batch_size
    calls = {**timers, "writer": writer.get("end", 0) - writer.get("start", 0)}
    total = sum(calls.values())
    return {
        "stage_cpu_ns_per_id": round(total / ids, 1),
        "calls_ns_per_id": {k: round(v / ids, 1) for k, v in calls.items()},
        "stage_cpu_ms_per_step": round(total / args.steps / 1e6, 3),
        "process_cpu_ms_per_step_whole_run": round(proc_ns / (last + 2) / 1e6, 3),
    }
