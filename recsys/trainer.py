"""One rank's trainer, assembled from parts: the model, the tiers, the feed, evaluation, checkpoints.

:func:`~recsys.build.build_parts` builds the model's parts from the config (:class:`~recsys.build.TrainSpec`
says with which builders); :class:`~recsys.loop.TrainLoop` runs the steps and advances the run's progress
(:class:`~recsys.train_state.TrainState`); :class:`~recsys.evaluation.Evaluator` scores the held-out split.
This class holds the parts together and answers what a run, ``recsys evaluate`` and the tests ask of it.
Its checkpoint is the parts' (:class:`~recsys.checkpoint.Checkpointable`): the model, the run's record,
its progress, the config, the tiered store and the digest (:mod:`recsys.checkpoint.parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipelines import StagedPipeline
from recsys.build import ModelParts, TrainSpec, build_parts, fold_source
from recsys.checkpoint import (
    Checkpoint,
    Checkpointable,
    ModelState,
    checkpoint_meta,
    fingerprint_mismatch,
    fixed_setting_change,
    model_fingerprint,
    resumable_checkpoint,
    save_checkpoint,
)
from recsys.checkpoint.parts import ConfigRecord, DigestRecord, RunRecord
from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.digest import dense_rows, model_digest
from recsys.distributed import DistEnv
from recsys.errors import UserError
from recsys.evaluation import Evaluator
from recsys.health import StepHealth
from recsys.metrics import MetricsLog, rewind_metrics
from recsys.pipeline_config import ClusterKind
from recsys.rounding import StepRounding
from recsys.selection import BestTracker
from recsys.train_state import TrainState
from recsys.writing import writing

__all__ = ["Trainer"]

log = logging.getLogger("recsys")


class Trainer:
    """Builds the sharded model for a config and trains, evaluates, checkpoints and digests it.

    Args:
        config: the run's config.
        env: this process's place in the job.
        out_dir: the run directory.
        spec: the builders of the replaceable parts and the capacity advice (default: the real builders,
            no advice).

    Raises:
        UserError: a setting does not fit the data or the ranks, or the store is in use; whatever the
            parts opened is closed again first.
    """

    def __init__(
        self, config: RunConfig, env: DistEnv, *, out_dir: Path, spec: TrainSpec | None = None
    ) -> None:
        self.config = config
        self.env = env
        self.out_dir = out_dir
        self.spec = spec or TrainSpec()
        parts = build_parts(config, env, out_dir=out_dir, spec=self.spec)
        try:
            self._assemble(parts)
        except BaseException:
            parts.binding.close(flush=False)  # a tiered store's shard is claimed (locked)
            raise

    def _assemble(self, parts: ModelParts) -> None:
        """The parts around the model (health, tier metrics, evaluation, checkpoint parts) and the progress."""
        config, env = self.config, self.env
        self.parts = parts
        self.data, self.fold, self.tables = parts.data, parts.fold, parts.tables
        self.dmp, self.optimizer, self.dense_optimizer = parts.dmp, parts.optimizer, parts.dense_optimizer
        self.capacities, self.binding, self.tiered = parts.capacities, parts.binding, parts.tiered
        # the pipeline of the last fit's feed (benchmarks read its per-batch spans)
        self.last_feed: StagedPipeline | None = None
        # The run's progress: advanced by the loop (recsys.loop), loaded by a restore.
        self.state = TrainState(
            selection=BestTracker(select=config.eval.select, patience=config.eval.patience)
        )
        tiered = self.binding.store_tables
        self.health = StepHealth(
            self.dmp, self.tables, tiered=tiered, config=config, world_size=env.world_size
        )
        # fp16 tables with stochastic rounding: the rows each step read, rounded after its update.
        self.rounding = (
            StepRounding(self.dmp, self.tables, seed=config.train.seed, binding=self.binding)
            if config.sparse.stochastic_rounding
            else None
        )
        self.tier_metrics = self.binding.tier_metrics(self.capacities, env.world_size)  # None in memory
        self.evaluator = Evaluator(
            parts,
            env=env,
            batch_size=config.eval.batch_size,
            tier_metrics=self.tier_metrics,
            group_by=config.eval.group_by,
        )
        # meta.json's entries in this order: the run's record, then its progress ("trainer").
        self.checkpoint_parts: dict[str, Checkpointable] = {
            "model": ModelState(self.dmp, self.dense_optimizer, skip_tables=tiered),
            "run": RunRecord(config, parts),
            "state": self.state,
            "config": ConfigRecord(config),
            **self.binding.checkpoint_parts(),  # the tiered store, the bounded tables' state
        }
        # Last: it reads what the others wrote.
        self.checkpoint_parts["digest"] = DigestRecord(self.digest, enabled=config.train.checkpoint_digest)

    @property
    def step(self) -> int:
        """The steps trained so far (``state.step``)."""
        return self.state.step

    @property
    def pipeline_stats(self) -> dict[str, Any]:
        """The pipeline's statistics after the last fit (``state.pipeline_stats``)."""
        return self.state.pipeline_stats

    # -- data -------------------------------------------------------------------------------------

    def feed(self, start: int, stop: int) -> tuple[Iterator[Batch], StagedPipeline]:
        """The batches of steps [start, stop) that TorchRec's pipeline consumes, and the pipeline that
        yields them (for its statistics): the load stage alone in memory, the nested tiered pipeline
        when tiered (the binding's ``feed``)."""
        batches = self.data.train_batches(
            rank=self.env.rank,
            world_size=self.env.world_size,
            batch_size=self.config.train.batch_size,
            start_step=start,
        )
        pipeline = self.config.pipeline
        windows = pipeline.frozen_windows if pipeline.cluster is ClusterKind.KEYS else 1
        source = fold_source(batches, self.fold, (start, stop), cluster_windows=windows)
        batches_out, self.last_feed = self.binding.feed(
            source, section=self.config.pipeline, device=self.env.device, rank=self.env.rank
        )
        return batches_out, self.last_feed

    def baseline(self) -> dict[str, Any]:
        """The splits and the constant predictor's held-out log loss (:meth:`Evaluator.baseline
        <recsys.evaluation.Evaluator.baseline>`), the held-out split as the last evaluation counted it."""
        return self.evaluator.baseline(self.state.held_out)

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def best_root(self) -> Path:
        """Where the checkpoint of the best evaluation is kept (``eval.every > 0``)."""
        return self.out_dir / "best"

    def _check_fingerprint(self, path: Path, saved: dict[str, Any] | None, *, allow_change: bool) -> bool:
        """Refuse to resume with config values that change the trained model (unless ``allow_change``);
        returns whether they differ (allowed)."""
        current = model_fingerprint(self.config)
        changes = fingerprint_mismatch(saved, current)
        if not changes:
            return False
        fixed = fixed_setting_change(path, saved, current)  # the seed, store.bounds, weights_precision
        if fixed is not None:
            raise UserError(fixed)
        if not allow_change:
            raise UserError(
                f"--resume: {path} was trained with other settings that change the model: {'; '.join(changes)}; "
                "restore them, or pass --allow-config-change to continue with the new ones"
            )
        if self.env.is_main:
            log.warning("resuming with changed settings (--allow-config-change): %s", "; ".join(changes))
        return True

    def restore(
        self, path: Path, *, check_fingerprint: bool = True, allow_config_change: bool = False
    ) -> int:
        """Load verified checkpoint ``path`` into every part (collective); returns its step.

        ``check_fingerprint``: refuse a checkpoint trained with settings that change the model (resume),
        unless ``allow_config_change`` (``--allow-config-change``).
        """
        meta = checkpoint_meta(path)
        changed = False  # settings allowed to differ: the digest compares rows with initial values they move
        if check_fingerprint:
            changed = self._check_fingerprint(path, meta.get("fingerprint"), allow_change=allow_config_change)
        self._check_store_tables(path, meta.get("store_tables"))
        source = Checkpoint(
            path=path, step=int(meta["step"]), rank=self.env.rank, world_size=self.env.world_size, meta=meta
        )
        for part in self.checkpoint_parts.values():
            part.restore(source)
        saved = meta.get("digest")
        if saved is not None and self.config.train.checkpoint_digest and not changed:
            restored = self.digest()  # collective: every rank raises alike
            if restored != saved:
                raise UserError(
                    f"checkpoint {path} was saved with model digest {saved}, but the model restored from it "
                    f"has digest {restored}: the restore did not reproduce it, so the run stops rather than "
                    "train another model (please report it; train.checkpoint_digest = false skips this check)"
                )
        return self.state.step

    def _check_store_tables(self, path: Path, saved: list[str] | None) -> None:
        """Refuse a restore that would have to move rows between tiered and in-memory tables."""
        if saved is None:  # a checkpoint from before store_tables: the digest check still applies
            return
        now = self.binding.store_tables
        if now == saved:
            return
        store = self.config.store
        held = f"its tiered store holds {', '.join(saved)}" if saved else "it holds every table in memory"
        tiers = ", ".join(now) if now else "no table"
        raise UserError(
            f"checkpoint {path}: {held}, but this run (store.tiered={str(store.tiered).lower()}, "
            f"store.tables={list(store.tables)}) tiers {tiers}; rows do not move between the tiered store "
            "and in-memory tables on a restore: resume with the checkpoint's store.tiered and store.tables"
        )

    def start(self, *, resume: bool, allow_config_change: bool = False) -> None:
        """Restore the newest complete, intact checkpoint (``resume``) or start from the initial model
        with an empty store (collective). ``allow_config_change``: resume even when settings that change
        the model differ from the checkpoint's."""
        if not resume:
            self.binding.open()
            return
        path = resumable_checkpoint(self.checkpoint_root)
        if path is None:
            raise UserError(f"--resume: no complete, intact checkpoint under {self.checkpoint_root}")
        old_world = checkpoint_meta(path)["world_size"]
        step = self.restore(path, allow_config_change=allow_config_change)
        if self.env.is_main:
            with writing(self.out_dir / "metrics.jsonl"):
                rewind_metrics(self.out_dir / "metrics.jsonl", step)  # steps after it run again
            log.info("resumed from %s (step %d)", path, step)
            if old_world != self.env.world_size:
                log.info("re-partitioned a checkpoint of %d ranks onto %d", old_world, self.env.world_size)

    def save(self, *, best: bool = False) -> Path:
        """Checkpoint the current state under ``checkpoints/`` (or, ``best``, as the only one in ``best/``);
        returns its folder (collective)."""
        root = self.best_root if best else self.checkpoint_root
        keep = 1 if best else self.config.train.keep_checkpoints
        with writing(root):
            return save_checkpoint(root, step=self.state.step, parts=self.checkpoint_parts, keep=keep)

    def close(self, *, flush: bool = True) -> None:
        """Close the tables' binding: a tiered store is closed and its lock released (idempotent).

        ``flush=False`` is the failure path: rows held above LMDB are dropped (the last checkpoint has
        them) and a second failure while closing is logged, not raised over the first.
        """
        if flush:
            self.binding.close()
            return
        try:
            self.binding.close(flush=False)
        except Exception as err:  # noqa: BLE001 - the error that stopped the run is the one to report
            log.debug("closing the store after a failure: %s", err)

    def digest(self, checkpoint: Path | None = None) -> str:
        """The model digest (collective); tiered rows from the live store, or from ``checkpoint``'s
        snapshot of it when that was just written (the dense state and plain tables are the live ones)."""
        stored = set(self.binding.store_tables)
        plain = [t for t in self.tables if t.name not in stored]
        rows = list(dense_rows(self.dmp, plain)) + self.binding.digest_rows(checkpoint, self.env.rank)
        return model_digest(
            self.dmp,
            [t.name for t in self.tables],
            rows,
            seed=self.config.train.seed,
            init_scale=self.config.sparse.init_scale,
            dtype=getattr(torch, self.config.sparse.weights_precision.dtype),
        )

    def fit(self, metrics: MetricsLog) -> dict[str, Any]:
        """Train from ``self.step`` to ``train.steps``; returns the summary (meaningful on rank 0)."""
        from recsys.loop import TrainLoop

        return TrainLoop(self, feed=self.feed, progress=self.spec.progress, metrics=metrics).run()
