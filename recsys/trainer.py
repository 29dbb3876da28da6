"""One rank's trainer, assembled from parts: the model, the tiers, the feed, checkpoints and the digest.

:func:`~recsys.build.build_parts` builds the parts from the config (:class:`~recsys.build.TrainSpec`
says with which builders); :class:`~recsys.loop.TrainLoop` runs the steps; this class holds the parts
together and answers what a run, ``recsys evaluate`` and the tests ask of it. Its checkpoint is the
parts' (:class:`~recsys.checkpoint.Checkpointable`): the model, the tiered store, the run's position and
evaluation record, and the config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from embedding_store import StoreCapacityError
from pipelines import StagedPipeline
from recsys.build import TrainSpec, build_parts, fold_ids, fold_source
from recsys.checkpoint import (
    Checkpoint,
    Checkpointable,
    ModelState,
    checkpoint_meta,
    fingerprint_mismatch,
    model_fingerprint,
    resumable_checkpoint,
    save_checkpoint,
)
from recsys.config import RunConfig, config_to_dict
from recsys.data.batch import Batch
from recsys.data.spec import spec_to_dict
from recsys.data.stats import SplitStats, constant_logloss, split_stats_of
from recsys.digest import dense_rows, model_digest
from recsys.distributed import DistEnv
from recsys.errors import UserError
from recsys.health import StepHealth
from recsys.metrics import MetricsLog, auc_logloss, rewind_metrics, write_json
from recsys.models import interaction_order
from recsys.selection import BestTracker
from recsys.tier_metrics import TierMetrics
from recsys.tiered import EVAL, TieredTables
from recsys.writing import writing

__all__ = ["EVAL_BATCH_BASE", "Trainer"]

log = logging.getLogger("recsys")

# Batch ids of evaluation batches in the store, apart from training steps.
EVAL_BATCH_BASE = 1 << 40


class StoreState:
    """The checkpoint part of the tiered store: this rank's snapshot, ``store_rank_<r>/``."""

    def __init__(self, tables: TieredTables) -> None:
        self.tables = tables

    def save(self, into: Checkpoint) -> list[Path]:
        return self.tables.snapshot(into.path / f"store_rank_{into.rank}")

    def restore(self, source: Checkpoint) -> None:
        if source.meta["world_size"] == source.world_size:
            self.tables.open(snapshot=source.path / f"store_rank_{source.rank}")
        else:  # rows re-partitioned by this run's ownership
            self.tables.open(reshard_from=sorted(source.path.glob("store_rank_*")))


class RunState:
    """The checkpoint part of the run's position (the step, hence the next batch of the data) and its
    evaluation record (the best so far, early stopping, the held-out split's size), in ``meta.json``."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def save(self, into: Checkpoint) -> list[Path]:
        t = self.trainer
        into.meta["fingerprint"] = model_fingerprint(t.config)
        # The order of the sparse features in the model's interaction: serving stacks them so.
        into.meta["features"] = interaction_order(t.dmp, t.tables)
        # The dataset spec's field transforms, which serving applies to raw records (recsys export).
        spec = getattr(t.data, "spec", None)
        into.meta["spec"] = None if spec is None else spec_to_dict(spec)
        # Which tables' rows are in the store snapshots (the others are in the rank files): a resume
        # does not move rows between the two (Trainer.restore refuses a change).
        into.meta["store_tables"] = [] if t.tiered is None else sorted(t.tiered.names)
        into.meta["trainer"] = {"selection": t.selection.state(), "held_out": t.held_out}
        return []

    def restore(self, source: Checkpoint) -> None:
        t = self.trainer
        state = source.meta.get("trainer") or {}
        t.selection.load(state.get("selection"))
        t.held_out = state.get("held_out")
        t.step = int(source.meta["step"])


class DigestRecord:
    """The checkpoint part that records the model digest (``train.checkpoint_digest``), in ``meta.json``;
    :meth:`Trainer.restore` checks the restored model against it. Saved after the store: the digest of
    tiered tables is read from the snapshot just written."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def save(self, into: Checkpoint) -> list[Path]:
        if self.trainer.config.train.checkpoint_digest:
            into.meta["digest"] = self.trainer.digest(checkpoint=into.path)  # collective
        return []

    def restore(self, source: Checkpoint) -> None:
        """Nothing: the check needs every part restored (Trainer.restore)."""


class ConfigRecord:
    """The checkpoint part that records the resolved config (rank 0), for ``recsys evaluate``/``export``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def save(self, into: Checkpoint) -> list[Path]:
        if into.rank != 0:
            return []
        write_json(into.path / "config.json", config_to_dict(self.config))
        return [into.path / "config.json"]

    def restore(self, source: Checkpoint) -> None:
        """Nothing: the run's own config is the one that applies (the fingerprint is checked first)."""


class Trainer:
    """Builds the sharded model for a config and trains, evaluates, checkpoints and digests it.

    Args:
        config: the run's config.
        env: this process's place in the job.
        out_dir: the run directory.
        spec: the builders of the replaceable parts (default: the real ones).
    """

    def __init__(
        self, config: RunConfig, env: DistEnv, *, out_dir: Path, spec: TrainSpec | None = None
    ) -> None:
        self.config = config
        self.env = env
        self.out_dir = out_dir
        self.spec = spec or TrainSpec()
        parts = build_parts(config, env, out_dir=out_dir, spec=self.spec)
        self.data, self.fold, self.tables = parts.data, parts.fold, parts.tables
        self.dmp, self.optimizer, self.dense_optimizer = parts.dmp, parts.optimizer, parts.dense_optimizer
        self.capacities, self.tiered = parts.capacities, parts.tiered
        self.step = 0
        self.saved_step = -1  # the step of the last checkpoint this process wrote
        self.allow_config_change = False  # resume even when model-changing settings differ
        self._config_changed = False  # a resume allowed them to differ (the digest check is then skipped)
        self.selection = BestTracker(select=config.eval.select, patience=config.eval.patience)
        # Held-out rows and positives (counted by the first evaluation) and the training split's.
        self.held_out: dict[str, int] | None = None
        self._train_split: SplitStats | None = None
        tiered = [] if self.tiered is None else self.tiered.names
        self.health = StepHealth(
            self.dmp, self.tables, tiered=tiered, config=config, world_size=env.world_size
        )
        self.tier_metrics = (
            None
            if self.tiered is None
            else TierMetrics(self.tiered, capacities=self.capacities, world_size=env.world_size)
        )
        self.checkpoint_parts: dict[str, Checkpointable] = {
            "model": ModelState(self.dmp, self.dense_optimizer, skip_tables=tiered),
            "run": RunState(self),
            "config": ConfigRecord(config),
        }
        if self.tiered is not None:
            self.checkpoint_parts["store"] = StoreState(self.tiered)
        self.checkpoint_parts["digest"] = DigestRecord(self)  # last: it reads what the others wrote
        self.pipeline_stats: dict[str, Any] = {}

    # -- data -------------------------------------------------------------------------------------

    def feed(self, start: int, stop: int) -> tuple[Iterator[Batch], StagedPipeline | None]:
        """The batches of steps [start, stop) that TorchRec's pipeline consumes: as read, or through the
        nested tiered pipeline (returned too, for its statistics)."""
        batches = self.data.train_batches(
            rank=self.env.rank,
            world_size=self.env.world_size,
            batch_size=self.config.train.batch_size,
            start_step=start,
        )
        source = fold_source(batches, self.fold, start, stop)
        if self.tiered is None:
            return (batch for _, batch in source), None
        feed = self.spec.feed(
            self.tiered,
            source,
            section=self.config.pipeline,
            device=self.env.device,
            rank=self.env.rank,
        )
        return iter(feed), feed

    # -- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, pipeline: TrainPipelineSparseDist | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits (N,) and labels (N,) of its share of the held-out split (collective).

        A train pipeline rewrites the sparse modules' forward; it is detached for the evaluation (its
        in-flight batches are kept) and re-attaches itself on its next ``progress``.
        """
        if pipeline is not None:
            pipeline.detach()
        if self.tier_metrics is not None:
            self.tier_metrics.evaluation_started()
        self.dmp.eval()
        logits, labels = [], []
        batches = self.data.eval_batches(
            rank=self.env.rank, world_size=self.env.world_size, batch_size=self.config.eval.batch_size
        )
        for index, batch in enumerate(batches):
            batch = fold_ids(batch, self.fold)
            if self.tiered is not None:
                batch = self.tiered.remap(EVAL_BATCH_BASE + index, batch, channel=EVAL)
            _, (_, out, lab) = self.dmp(batch.to(self.env.device))
            if self.tiered is not None:
                self.tiered.release(EVAL_BATCH_BASE + index)
            logits.append(out.cpu())
            labels.append(lab.cpu())
        self.dmp.train()
        if self.tier_metrics is not None:
            self.tier_metrics.evaluation_done()
        return torch.cat(logits), torch.cat(labels)

    def evaluate(self, pipeline: TrainPipelineSparseDist | None = None) -> tuple[float, float]:
        """AUC and log loss over the whole held-out split (every rank scores its share; collective)."""
        mine = self.predict(pipeline)
        parts = [mine]
        if self.env.world_size > 1:
            parts = [None] * self.env.world_size  # type: ignore[list-item]
            dist.all_gather_object(parts, mine)
        labels_all = torch.cat([p[1] for p in parts])
        self.held_out = {"rows": int(labels_all.numel()), "positives": int(labels_all.sum())}
        return auc_logloss(torch.cat([p[0] for p in parts]), labels_all)

    def baseline(self) -> dict[str, Any]:
        """Rows and positive rates of both splits, and the held-out log loss of the constant predictor
        (the training split's positive rate); a split is None while unknown (the held-out one until the
        first evaluation has counted it, the training one when the dataset does not report it)."""
        train = self.train_split()
        held = None if self.held_out is None else SplitStats(**self.held_out)
        out: dict[str, Any] = {
            "splits": {
                name: None if s is None else s.as_dict() for name, s in (("train", train), ("eval", held))
            },
            "constant_logloss": None,
        }
        if train is not None and held is not None:
            constant = constant_logloss(train, held)
            out["constant_logloss"] = None if math.isnan(constant) else constant
        return out

    def train_split(self) -> SplitStats | None:
        """Rows and positives of the training split as the dataset reports them (None: it does not)."""
        if self._train_split is None:
            found = split_stats_of(self.data)
            self._train_split = None if not found else found.get("train")
        return self._train_split

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def best_root(self) -> Path:
        """Where the checkpoint of the best evaluation is kept (``eval.every > 0``)."""
        return self.out_dir / "best"

    def _check_fingerprint(self, path: Path, saved: dict[str, Any] | None) -> None:
        """Refuse to resume with config values that change the trained model (unless allowed)."""
        current = model_fingerprint(self.config)
        changes = fingerprint_mismatch(saved, current)
        if not changes:
            return
        if saved is not None and saved.get("train.seed") != current.get("train.seed"):
            raise UserError(
                f"--resume: {path} was trained with train.seed={saved.get('train.seed')}, this run has "
                f"train.seed={current.get('train.seed')}; the seed cannot change on resume (the embedding rows' "
                "initial values depend on it)"
            )
        if not self.allow_config_change:
            raise UserError(
                f"--resume: {path} was trained with other settings that change the model: {'; '.join(changes)}; "
                "restore them, or pass --allow-config-change to continue with the new ones"
            )
        self._config_changed = True  # the digest compares rows with initial values the change may move
        if self.env.is_main:
            log.warning("resuming with changed settings (--allow-config-change): %s", "; ".join(changes))

    def restore(self, path: Path, *, check_fingerprint: bool = True) -> int:
        """Load verified checkpoint ``path`` into every part (collective); returns its step.

        ``check_fingerprint``: refuse a checkpoint trained with settings that change the model (resume).
        """
        meta = checkpoint_meta(path)
        if check_fingerprint:
            self._check_fingerprint(path, meta.get("fingerprint"))
        self._check_store_tables(path, meta.get("store_tables"))
        source = Checkpoint(
            path=path, step=int(meta["step"]), rank=self.env.rank, world_size=self.env.world_size, meta=meta
        )
        for part in self.checkpoint_parts.values():
            part.restore(source)
        saved = meta.get("digest")
        if saved is not None and self.config.train.checkpoint_digest and not self._config_changed:
            restored = self.digest()  # collective: every rank raises alike
            if restored != saved:
                raise UserError(
                    f"checkpoint {path} was saved with model digest {saved}, but the model restored from it "
                    f"has digest {restored}: the restore did not reproduce it, so the run stops rather than "
                    "train another model (please report it; train.checkpoint_digest = false skips this check)"
                )
        return self.step

    def _check_store_tables(self, path: Path, saved: list[str] | None) -> None:
        """Refuse a restore that would have to move rows between tiered and in-memory tables."""
        if saved is None:  # a checkpoint from before store_tables: the digest check still applies
            return
        now = [] if self.tiered is None else sorted(self.tiered.names)
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

    def start(self, *, resume: bool) -> None:
        """Restore the newest complete, intact checkpoint (``resume``) or start from the initial model
        with an empty store (collective)."""
        if not resume:
            if self.tiered is not None:
                self.tiered.open()
            return
        path = resumable_checkpoint(self.checkpoint_root)
        if path is None:
            raise UserError(f"--resume: no complete, intact checkpoint under {self.checkpoint_root}")
        old_world = checkpoint_meta(path)["world_size"]
        self.restore(path)
        if self.env.is_main:
            with writing(self.out_dir / "metrics.jsonl"):
                rewind_metrics(self.out_dir / "metrics.jsonl", self.step)  # steps after it run again
            log.info("resumed from %s (step %d)", path, self.step)
            if old_world != self.env.world_size:
                log.info("re-partitioned a checkpoint of %d ranks onto %d", old_world, self.env.world_size)

    def save(self, *, best: bool = False) -> Path:
        """Checkpoint the current state under ``checkpoints/`` (or, ``best``, as the only one in ``best/``)."""
        root = self.best_root if best else self.checkpoint_root
        keep = 1 if best else self.config.train.keep_checkpoints
        with writing(root):
            path = save_checkpoint(root, step=self.step, parts=self.checkpoint_parts, keep=keep)
        if not best:
            self.saved_step = self.step
        return path

    def close(self, *, flush: bool = True) -> None:
        """Close the tiered store and release its lock (idempotent).

        ``flush=False`` is the failure path: rows held above LMDB are dropped (the last checkpoint has
        them) and a second failure while closing is logged, not raised over the first.
        """
        if self.tiered is None:
            return
        if flush:
            self.tiered.close()
            return
        try:
            self.tiered.close(flush=False)
        except Exception as err:  # noqa: BLE001 - the error that stopped the run is the one to report
            log.debug("closing the store after a failure: %s", err)

    def digest(self, checkpoint: Path | None = None) -> str:
        """The model digest (collective); tiered rows from the live store, or from ``checkpoint``'s
        snapshot of it when that was just written (the dense state and plain tables are the live ones)."""
        tiered = set() if self.tiered is None else set(self.tiered.names)
        plain = [t for t in self.tables if t.name not in tiered]
        rows = list(dense_rows(self.dmp, plain))
        if self.tiered is not None:
            tt = self.tiered
            for name in tt.names:
                if checkpoint is None:
                    rows += [(name, block) for block in tt.local_rows(name)]
                else:
                    snapshot = checkpoint / f"store_rank_{self.env.rank}"
                    rows += [(name, block) for block in tt.snapshot_rows(name, snapshot)]
        return model_digest(
            self.dmp,
            [t.name for t in self.tables],
            rows,
            seed=self.config.train.seed,
            init_scale=self.config.sparse.init_scale,
        )

    def too_few_slots(self, cause: StoreCapacityError) -> str:
        """The device-tier error: each tiered table's minimum slots per owner for the steps run so far and
        the batches in flight (one replay of them: what `recsys tune-cache --batches` states), where its
        capacity is below that; the store's own message when the replay finds none."""
        from recsys.tune.replay import batches_in_flight
        from recsys.tune.tuner import min_device_rows_by_feature

        cfg = self.config
        in_flight = batches_in_flight(cfg)
        # Steps [0, step + in_flight): the batches trained and those being filled (an evaluation after this
        # step runs beside the latter), so the replay costs a fraction of the training so far.
        batches = min(cfg.train.steps, self.step + in_flight)
        try:
            need = min_device_rows_by_feature(cfg, world_size=self.env.world_size, batches=batches)
        except Exception as err:  # noqa: BLE001 - the capacity error is the one to report
            log.debug("replaying the run for the minimum device slots: %s", err)
            need = {}
        slots = self.capacities.device_rows
        short = [
            f"table t_{f} needs at least {n:,} device slots per owner ({self.capacities.device_key(f)} is {slots[f]:,})"
            for f, n in need.items()
            if n > slots[f]
        ]
        return (
            f"the device tier is too small for the batches in flight (up to {in_flight} training batches, or "
            f"an evaluation batch beside those still pinned): {'; '.join(short) or cause}; raise "
            f"store.capacity.<feature>.device or store.device_rows (now {cfg.store.device_rows:,}); "
            f"`recsys tune-cache` states the minimum for all {cfg.train.steps:,} steps"
        )

    def fit(self, metrics: MetricsLog) -> dict[str, Any]:
        """Train from ``self.step`` to ``train.steps``; returns the summary (meaningful on rank 0)."""
        from recsys.loop import TrainLoop

        return TrainLoop(self, feed=self.feed, progress=self.spec.progress, metrics=metrics).run()
