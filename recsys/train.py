"""``recsys train`` in one worker process: build the trainer, fit, and write the run directory.

``run(config, out_dir)`` is called in every worker process (spawned by ``recsys train`` or by torchrun).
Rank 0 owns the run directory: ``metrics.jsonl``, ``summary.json`` and the checkpoint manifests. The
trainer is assembled from parts (``recsys/trainer.py``, ``recsys/build.py``) and its loop is
``recsys/loop.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embedding_store import StoreFullError
from recsys.build import TrainSpec
from recsys.capacity_replay import replay_advice
from recsys.config import RunConfig, config_to_dict
from recsys.distributed import DistEnv, init_distributed, launched_by_torchrun
from recsys.errors import UserError, no_space_left
from recsys.failures import record_failure
from recsys.lifetime import RunStopped, die_with_parent, stop_signal
from recsys.metrics import MetricsLog, write_json
from recsys.runlock import lock_run_dir
from recsys.trainer import Trainer
from recsys.writing import disk_full, writing

__all__ = ["run"]

log = logging.getLogger("recsys")


def _start_fresh(out_dir: Path) -> None:
    """A new (not resumed) run replaces the metrics and checkpoints of an earlier run in the same place."""
    stale = [p for p in (out_dir / "metrics.jsonl", out_dir / "summary.json") if p.exists()]
    folders = [p for p in (out_dir / "checkpoints", out_dir / "best") if p.exists()]
    if stale or folders:
        log.warning(
            "starting a fresh run in %s: replacing the earlier run's metrics and checkpoints", out_dir
        )
    for path in stale:
        path.unlink()
    for folder in folders:
        shutil.rmtree(folder)


def _lock_run_dir(out_dir: Path, env: DistEnv) -> contextlib.AbstractContextManager[Any]:
    """Rank 0 locks the run directory; every rank fails together when it is in use (collective)."""
    lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    refusal = None
    if env.is_main:
        try:
            lock = lock_run_dir(out_dir)
        except UserError as err:
            refusal = str(err)
    refusals = [refusal]
    if env.world_size > 1:
        refusals = [None] * env.world_size
        dist.all_gather_object(refusals, refusal)
    if refusals[0] is not None:
        raise UserError(refusals[0])
    return lock


def _summary(trainer: Trainer, fit: dict[str, Any], *, started: float, resumed: bool) -> dict[str, Any]:
    """The run's ``summary.json`` after a fit: the last and best models, the baselines, what the tiers
    and the pipeline did, and the warnings (collective; closes the store)."""
    config, env = trainer.config, trainer.env
    digest = trainer.digest()
    tiers: dict[str, Any] = {}
    warnings: list[str] = []
    capacities: dict[str, dict[str, Any]] = {}
    differ: dict[str, Any] | None = None
    if trainer.tier_metrics is not None:
        tiers = trainer.tier_metrics.store_stats()
        rates, warnings = trainer.tier_metrics.over_training(trainer.step)
        for name, values in rates.items():
            tiers.setdefault(name, {}).update(values)
        capacities, differ, differ_warnings = trainer.tier_metrics.capacities_run()
        warnings += differ_warnings
        if env.is_main:
            for message in warnings:
                log.warning(message)
    trainer.close()
    summary = {**fit, **trainer.baseline()}
    constant = summary["constant_logloss"]
    if constant is not None and not summary["logloss"] < constant:
        message = (
            f"THE MODEL IS NO BETTER THAN A CONSTANT: held-out logloss {summary['logloss']:.4f} is not below "
            f"{constant:.4f}, the logloss of always predicting the training split's positive rate"
        )
        warnings.append(message)
        if env.is_main:
            log.warning(message)
    best = trainer.state.selection.best
    summary.update(
        last={"step": trainer.step, "auc": summary["auc"], "logloss": summary["logloss"], "digest": digest},
        best=None
        if not config.eval.every or best is None
        else {**dataclasses.asdict(best), "checkpoint": str(trainer.best_root)},
        model=config.model.name.value,
        world_size=env.world_size,
        backend=env.backend,
        device=env.device.type,
        model_digest=digest,
        tiered=bool(trainer.binding.store_tables),
        tiers=tiers,
        capacities=capacities,
        capacities_differ_from_tune=differ,
        warnings=warnings,
        pipeline=trainer.pipeline_stats,
        wall_seconds=time.perf_counter() - started,
        resumed=resumed,
        config=config_to_dict(config),
        versions={"torch": torch.__version__},
    )
    return summary


def run(
    config: RunConfig,
    out_dir: Path,
    *,
    resume: bool = False,
    lock_run: bool = True,
    allow_config_change: bool = False,
) -> dict[str, Any] | None:
    """Train on this process's rank; rank 0 writes the run directory and returns the summary.

    ``lock_run``: rank 0 takes the run directory's lock (False when the launcher holds it). SIGTERM and
    SIGINT stop the run after the current step, with a checkpoint, by raising :class:`RunStopped`.
    ``allow_config_change``: resume even when settings that change the model differ from the checkpoint's.
    """
    if launched_by_torchrun():
        die_with_parent()  # torchrun's agent: an orphaned worker would keep training and the store locked
    env = init_distributed(
        threads_per_rank=config.train.threads_per_rank, timeout_s=config.train.collective_timeout_s
    )
    trainer: Trainer | None = None
    try:
        with _lock_run_dir(out_dir, env) if lock_run else contextlib.nullcontext(), stop_signal.catching():
            started = time.perf_counter()
            # The tuner's replay words a device tier too small (training itself imports no tuner).
            trainer = Trainer(config, env, out_dir=out_dir, spec=TrainSpec(capacity_advice=replay_advice))
            if env.is_main:
                log.info(
                    "%s on %d rank(s) [%s, %s], %d tables, %s sharding, %s",
                    config.model.name.value,
                    env.world_size,
                    env.backend,
                    env.device.type,
                    len(trainer.tables),
                    config.sparse.sharding.value,
                    config.sparse.optimizer.value,
                )
            if not resume and env.is_main:
                _start_fresh(out_dir)
            if env.world_size > 1:
                dist.barrier()
            trainer.start(resume=resume, allow_config_change=allow_config_change)
            metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=env.is_main)
            summary = trainer.fit(metrics)
            summary = _summary(trainer, summary, started=started, resumed=resume)
            if not env.is_main:
                return None
            with writing(out_dir / "summary.json"):
                write_json(out_dir / "summary.json", summary)
            return summary
    except RunStopped:
        raise
    except StoreFullError as err:  # outside the training loop: a final flush, or the digest's read
        full = UserError(f"{err}; raise store.max_lmdb_bytes or free disk space")
        record_failure(out_dir, env.rank, full)
        raise full from err
    except BaseException as err:
        if (cause := no_space_left(err)) is not None and not isinstance(err, UserError):
            full = disk_full(cause.filename or out_dir)
            record_failure(out_dir, env.rank, full)
            raise full from err
        record_failure(out_dir, env.rank, err)  # before the teardown makes the other ranks fail too
        raise
    finally:
        if trainer is not None:
            trainer.close(flush=False)  # a no-op after the clean close above
        if dist.is_initialized():
            dist.destroy_process_group()
