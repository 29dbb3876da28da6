"""One measured fit of a :class:`~recsys.trainer.Trainer` in this process, and the settings and the
alternation of runs that the experiments share.

The trainer is built with a :class:`~recsys.build.TrainSpec` of this program's parts: a progress bar that
shows nothing (its warnings go to stderr, so stdout stays one JSON record per line) and the experiment's
tier binding (``TieredTables`` or a subclass of it). The per-batch spans come from the pipeline of the
fit's feed (``Trainer.last_feed``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from harness import CpuProbe, ThreadCpu, alternate, emit, paired_ratios, window_rate

from pipelines import StagedPipeline
from recsys.build import TrainSpec
from recsys.config import RunConfig, config_from_dict
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.distributed import DistEnv
from recsys.tiered import TieredTables
from recsys.trainer import Trainer

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

Runs = dict[str, list[dict[str, Any]]]


def make_config(overrides: list[str]) -> RunConfig:
    return config_from_dict({}, [*COMMON, *overrides])


def sized(args: argparse.Namespace, steps: int) -> int:
    """``steps``, or a handful under ``--smoke`` (a run of the code path, not a measurement)."""
    return 6 if args.smoke else steps


def zipf_space(args: argparse.Namespace) -> int:
    """Ids per Zipf table: ``ZIPF_SPACE``, or 20,000 under ``--smoke``."""
    return 20_000 if args.smoke else ZIPF_SPACE


def zipf_base(steps: int, space: int = ZIPF_SPACE) -> list[str]:
    """The large Zipf(1.05) tables of ssd_bound and cold."""
    return [
        *MODEL,
        f"synthetic.num_sparse={ZIPF_TABLES}",
        f"synthetic.id_space={space}",
        "synthetic.zipf_alpha=1.05",
        f"sparse.max_rows_per_table={space}",  # untiered: every id has its own row, as when tiered
        f"train.batch_size={ZIPF_BATCH}",
        f"train.steps={steps}",
        "train.log_every=2" if steps < 20 else "train.log_every=10",
    ]


def touched_rows(space: int, *, batch: int, steps: int, start: int = 0) -> int:
    """Distinct ids of one synthetic Zipf feature over ``steps`` batches (the rows a table touches)."""
    data = SyntheticCriteo(SyntheticConfig(num_sparse=1, id_space=space), seed=0)
    parts = [
        np.unique(data.batch(step=s, rank=0, world_size=1, batch_size=batch).sparse.values().numpy())
        for s in range(start, start + steps)
    ]
    return int(np.unique(np.concatenate(parts)).shape[0])


class SilentProgress:
    """The progress bar of a fit (``TrainSpec.progress``): shows nothing; the lines the loop writes above
    it (warnings, evaluations) go to stderr."""

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        del total, initial, enabled

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def write(self, text: str, *args: Any, **kwargs: Any) -> None:
        print(text, file=sys.stderr)

    def close(self) -> None:
        pass


class Windows:
    """The metrics sink of a fit: keeps the train records (samples/s per ``log_every`` window), writes
    nothing."""

    def __init__(self, start_step: int, path: Path) -> None:
        self.start_step = start_step  # a resumed fit starts here
        self.path = path  # named in a full-disk error only
        self.rows: list[dict[str, Any]] = []

    def write(self, **record: Any) -> None:
        if record.get("kind") == "train":
            self.rows.append(record)

    def steady_rate(self, warmup_steps: int) -> float:
        """Samples/s over the windows that start ``warmup_steps`` or more after the fit's first step
        (weighted by their steps, i.e. total samples over total time: :func:`harness.window_rate`); all of
        them when none does."""
        starts = [self.start_step] + [r["step"] for r in self.rows[:-1]]
        first = next((i for i, s in enumerate(starts) if s - self.start_step >= warmup_steps), 0)
        return window_rate(self.rows, self.start_step, part=slice(first, None))


class StampedWindows(Windows):
    """:class:`Windows` that also keeps when each train record arrived (``perf_counter`` seconds)."""

    def __init__(self, start_step: int, path: Path) -> None:
        super().__init__(start_step, path)
        self.stamps: list[float] = []

    def write(self, **record: Any) -> None:
        super().write(**record)
        if record.get("kind") == "train":
            self.stamps.append(time.perf_counter())


def span_stats(feed: StagedPipeline, warmup: int) -> dict[str, Any]:
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


def _training_hit_rate(rates: dict[str, dict[str, float]]) -> float | None:
    """Device hit rate of the training batches over all tables (``TierMetrics.over_training``'s rates)."""
    requests = sum(r["device_requests"] for r in rates.values())
    hits = sum(r["device_hit_rate"] * r["device_requests"] for r in rates.values())
    return hits / requests if requests else None


def train_once(
    env: DistEnv,
    overrides: list[str],
    *,
    out_dir: Path,
    warmup_steps: int,
    resume: bool = False,
    tables: type[TieredTables] = TieredTables,
    prepare: Callable[[Trainer], None] | None = None,
) -> dict[str, Any]:
    """Build a Trainer (tier binding ``tables``), fit it, return throughput, CPU, tier and pipeline
    statistics; closes the trainer. ``prepare`` sees the started trainer before the fit."""
    cfg = make_config(overrides)
    spec = TrainSpec(tables=tables, progress=SilentProgress)
    trainer = Trainer(cfg, env, out_dir=out_dir, spec=spec)
    try:
        trainer.start(resume=resume)
        if prepare is not None:
            prepare(trainer)
        windows = Windows(trainer.step, out_dir / "metrics.jsonl")
        with CpuProbe() as cpu, ThreadCpu(groups=("tierrec-pipeline",)) as threads:
            summary = trainer.fit(windows)
        metrics = trainer.tier_metrics
        tiers = {} if metrics is None else metrics.store_stats()
        training = {} if metrics is None else metrics.over_training(summary["steps"])[0]
    finally:
        trainer.close()
    assert cpu.share is not None
    device = [t["device"] for t in tiers.values()]
    hits, misses = sum(d["hits"] for d in device), sum(d["misses"] for d in device)
    steady = windows.steady_rate(warmup_steps)
    pipe = trainer.pipeline_stats or {}
    # ms per step of this fit, from seconds (a resumed fit's "samples" count the steps before it too)
    per_step = 1e3 * cfg.train.batch_size / max(1, summary["samples_this_process"])
    return {
        "samples_per_s": steady,
        "step_s": cfg.train.batch_size / steady,
        "fit_samples_per_s": summary["samples_per_s"],
        "steps": summary["steps"],
        # CPU seconds of all this process's threads per second of training: > 1 only if stages overlap
        "cores_used": cpu.share.cores_used(summary["train_seconds"]),
        # the rest of the machine meanwhile: other processes' CPU (in cores) and time the hypervisor took
        "other_processes_cores": cpu.share.other_processes_cores,
        "steal_fraction": cpu.share.steal_fraction,
        "cpu_ms_per_step": cpu.share.cpu_s * per_step,
        # per thread (pipeline stage threads together): where the CPU time of a step goes
        "thread_cpu_ms_per_step": {k: v * per_step for k, v in threads.per_name().items()},
        # all batches, evaluation included; train_device_hit_rate: the training batches only
        "device_hit_rate": hits / (hits + misses) if hits + misses else None,
        "train_device_hit_rate": _training_hit_rate(training),
        "ssd_rows_read": sum(t["ssd"]["hits"] for t in tiers.values()),
        "ssd_rows_written": sum(t["ssd"]["rows_in"] for t in tiers.values()),
        "bound_by": pipe.get("bound_by"),
        "consumer_wait_fraction": pipe.get("consumer_wait_fraction"),
        "stage_ms": {k: 1e3 * v["busy_per_item_s"] for k, v in pipe.get("stages", {}).items()},
        **(span_stats(trainer.last_feed, warmup_steps) if trainer.last_feed is not None else {}),
    }


def alternate_runs(
    env: DistEnv,
    name: str,
    variants: dict[str, list[str]],
    *,
    repeats: int,
    warmup_steps: int,
    root: Path,
    **kwargs: Any,
) -> Runs:
    """Every variant ``repeats`` times in alternating order (``harness.alternate``), each in a fresh run
    directory under ``root``, printing each run."""

    def run(variant: str, repeat: int) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            result = train_once(
                env, variants[variant], out_dir=Path(tmp), warmup_steps=warmup_steps, **kwargs
            )
        emit({"experiment": name, "variant": variant, "repeat": repeat, **result})
        return result

    return alternate(list(variants), repeats, run)


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def paired(candidate: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput ratios of each repeat's candidate run over the baseline run next to it, with their
    quartiles (``harness.paired_ratios``)."""
    return paired_ratios([c["samples_per_s"] for c in candidate], [b["samples_per_s"] for b in baseline])
