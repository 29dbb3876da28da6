"""The training loop of one rank: TorchRec DMP driven by TrainPipelineSparseDist.

``run(config, out_dir)`` is called in every worker process (spawned by ``recsys train`` or by torchrun).
Rank 0 owns the run directory: ``metrics.jsonl``, ``summary.json`` and the checkpoint manifests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

from embedding_store import StoreCapacityError, StoreFullError
from pipelines import StagedPipeline, StageFailed
from recsys.checkpoint import (
    checkpoint_meta,
    fingerprint_mismatch,
    load_checkpoint,
    model_fingerprint,
    resumable_checkpoint,
    save_checkpoint,
)
from recsys.config import RunConfig, config_to_dict
from recsys.data.batch import Batch
from recsys.data.source import build_dataset
from recsys.data.stats import SplitStats, constant_logloss, split_stats_of
from recsys.digest import dense_rows, model_digest
from recsys.distributed import DistEnv, init_distributed, launched_by_torchrun
from recsys.errors import UserError, no_space_left
from recsys.failures import record_failure
from recsys.lifetime import RunStopped, die_with_parent, stop_signal
from recsys.metrics import MetricsLog, auc_logloss, rewind_metrics, write_json
from recsys.models import TrainModel, build_model, table_configs
from recsys.runlock import lock_run_dir
from recsys.selection import BestTracker, Evaluation
from recsys.sharding import build_optimizer, init_embedding_rows, local_shards, shard_model
from recsys.sparse import ShardingKind
from recsys.store_config import load_tune, resolve_capacities
from recsys.tiered import EVAL, TieredTables, row_bytes, tiered_feed
from recsys.windows import enable_frozen_windows

__all__ = ["run", "Trainer"]

log = logging.getLogger("recsys")


def _fold_ids(batch: Batch, modulus: list[int]) -> Batch:
    """Fold each feature's ids into its in-memory table (modulo, as hashed features do); 0 keeps them."""
    if not any(modulus):
        return batch
    kjt = batch.sparse
    lengths = torch.tensor(kjt.length_per_key())
    per_value = torch.repeat_interleave(torch.tensor(modulus, dtype=torch.int64), lengths)
    values = kjt.values()
    values = torch.where(per_value > 0, torch.remainder(values, per_value.clamp(min=1)), values)
    sparse = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths(), stride=kjt.stride())
    return Batch(dense=batch.dense, sparse=sparse, labels=batch.labels)


# A device tier that answers less than this share of a warm table's lookups thrashes.
THRASH_HIT_RATE = 0.5
# Warnings repeat at most every this many log points.
WARN_EVERY_LOGS = 10

# Measured hit rates this far below the predicted ones get a warning.
PREDICTION_TOLERANCE = 0.02

# Batch ids of evaluation batches in the store, apart from training steps.
EVAL_BATCH_BASE = 1 << 40


class Trainer:
    """Builds the sharded model for a config and trains, evaluates, checkpoints and digests it."""

    def __init__(self, config: RunConfig, env: DistEnv, *, out_dir: Path) -> None:
        self.config = config
        self.env = env
        self.out_dir = out_dir
        cfg = config
        self.data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
        features = self.data.feature_names
        tiered = self._tiered_features(features)
        # Per tiered feature: (device slots, host rows) on each owning rank.
        self.capacities = resolve_capacities(
            cfg.store, [f for f in features if f in tiered], row_bytes(cfg.sparse, cfg.model.table_dim)
        )
        owners = env.world_size if cfg.sparse.sharding is ShardingKind.ROW_WISE else 1
        num_embeddings = [
            self.capacities[f][0] * owners if f in tiered else min(space, cfg.sparse.max_rows_per_table)
            for f, space in zip(features, self.data.id_spaces, strict=True)
        ]
        self.fold = [
            0 if f in tiered or space <= rows else rows
            for f, space, rows in zip(features, self.data.id_spaces, num_embeddings, strict=True)
        ]
        if env.is_main:
            _warn_folded(cfg, features, self.data.id_spaces, self.fold)
        self.tables = table_configs(features, dim=cfg.model.table_dim, num_embeddings=num_embeddings)
        torch.manual_seed(cfg.train.seed)
        windows = cfg.pipeline.frozen_windows
        if windows > cfg.train.batch_size // env.world_size:
            raise UserError(
                f"pipeline.frozen_windows={windows} is more than the "
                f"{cfg.train.batch_size // env.world_size} samples of a rank's batch"
            )
        model = TrainModel(
            build_model(cfg.model, self.tables, num_dense=self.data.num_dense, device=env.device),
            windows=windows,
        )
        self.dmp = shard_model(model, self.tables, sparse=cfg.sparse, device=env.device)
        if windows > 1:
            enable_frozen_windows(self.dmp, windows, env.world_size)
        init_embedding_rows(self.dmp, self.tables, seed=cfg.train.seed, scale=cfg.sparse.init_scale)
        self.optimizer = build_optimizer(self.dmp, cfg.train)
        self.dense_optimizer = self.optimizer.optimizers[1][1]
        self.step = 0
        self._saved_step = -1  # the step of the last checkpoint this process wrote
        self.allow_config_change = False  # resume even when model-changing settings differ
        self.selection = BestTracker(select=cfg.eval.select, patience=cfg.eval.patience)
        # Held-out rows and positives (counted by the first evaluation) and the training split's.
        self.held_out: dict[str, int] | None = None
        self._train_split: SplitStats | None = None
        self._dense: list[tuple[str, torch.nn.Parameter]] | None = None
        # Store counters of evaluation batches and, at the end of training, of the training batches alone.
        self._eval_counters: dict[str, torch.Tensor] = {}
        self._train_counters: dict[str, torch.Tensor] = {}
        self.tiered: TieredTables | None = None
        self.pipeline_stats: dict[str, Any] = {}
        if tiered:
            store_path = Path(cfg.store.path) if cfg.store.path else out_dir / "store"
            self.tiered = TieredTables(
                self.dmp,
                self.tables,
                tiered={
                    f"t_{f}": space
                    for f, space in zip(features, self.data.id_spaces, strict=True)
                    if f in tiered
                },
                settings=(cfg.store, cfg.sparse, cfg.train.seed),
                path=store_path,
            )

    def _tiered_features(self, features: list[str]) -> set[str]:
        store = self.config.store
        if not store.tiered:
            return set()
        unknown = sorted(set(store.tables) - set(features))
        if unknown:
            raise UserError(f"store.tables names unknown features {unknown}; features are {features}")
        return set(store.tables) or set(features)

    # -- data -------------------------------------------------------------------------------------

    def _source(self, start: int, stop: int) -> Iterator[tuple[int, Batch]]:
        """``(step, batch)`` for global steps [start, stop) of this rank, ids folded where needed."""
        source = self.data.train_batches(
            rank=self.env.rank,
            world_size=self.env.world_size,
            batch_size=self.config.train.batch_size,
            start_step=start,
        )
        for step, batch in zip(range(start, stop), source, strict=False):
            yield step, _fold_ids(batch, self.fold)

    def _feed(self, start: int, stop: int) -> tuple[Iterator[Batch], StagedPipeline | None]:
        """The batches TorchRec's pipeline consumes: as read, or through the nested tiered pipeline."""
        if self.tiered is None:
            return (batch for _, batch in self._source(start, stop)), None
        feed = tiered_feed(
            self.tiered,
            self._source(start, stop),
            settings=(self.config.pipeline, self.config.store.lookahead),
            device=self.env.device,
            rank=self.env.rank,
        )
        return iter(feed), feed

    # -- evaluation -------------------------------------------------------------------------------

    @torch.no_grad()
    @torch.no_grad()
    def predict(self, pipeline: TrainPipelineSparseDist | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits (N,) and labels (N,) of its share of the held-out split (collective).

        A train pipeline rewrites the sparse modules' forward; it is detached for the evaluation (its
        in-flight batches are kept) and re-attaches itself on its next ``progress``.
        """
        if pipeline is not None:
            pipeline.detach()
        before = {} if self.tiered is None else self.tiered.counters()
        self.dmp.eval()
        logits, labels = [], []
        batches = self.data.eval_batches(
            rank=self.env.rank, world_size=self.env.world_size, batch_size=self.config.eval.batch_size
        )
        for index, batch in enumerate(batches):
            batch = _fold_ids(batch, self.fold)
            if self.tiered is not None:
                batch = self.tiered.remap(EVAL_BATCH_BASE + index, batch, channel=EVAL)
            _, (_, out, lab) = self.dmp(batch.to(self.env.device))
            if self.tiered is not None:
                self.tiered.release(EVAL_BATCH_BASE + index)
            logits.append(out.cpu())
            labels.append(lab.cpu())
        self.dmp.train()
        if self.tiered is not None:
            for name, value in self.tiered.counters().items():
                delta = value - before.get(name, torch.zeros_like(value))
                self._eval_counters[name] = self._eval_counters.get(name, torch.zeros_like(value)) + delta
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

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def best_root(self) -> Path:
        """Where the checkpoint of the best evaluation is kept (``eval.every > 0``)."""
        return self.out_dir / "best"

    def _store_snapshot(self, checkpoint: Path) -> Path:
        return checkpoint / f"store_rank_{self.env.rank}"

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
        if self.env.is_main:
            log.warning("resuming with changed settings (--allow-config-change): %s", "; ".join(changes))

    def start(self, *, resume: bool) -> None:
        """Restore the newest complete checkpoint (``resume``) or start fresh; open the tiered store."""
        snapshot, reshard = None, None
        if resume:
            path = resumable_checkpoint(self.checkpoint_root)
            if path is None:
                raise UserError(f"--resume: no complete, intact checkpoint under {self.checkpoint_root}")
            meta = checkpoint_meta(path)
            old_world = meta["world_size"]
            self._check_fingerprint(path, meta.get("fingerprint"))
            state = meta.get("trainer") or {}
            self.selection.load(state.get("selection"))
            self.held_out = state.get("held_out")
            tiered = [] if self.tiered is None else self.tiered.names
            self.step = load_checkpoint(
                path, dmp=self.dmp, dense_optimizer=self.dense_optimizer, skip_tables=tiered
            )
            if self.tiered is not None and old_world == self.env.world_size:
                snapshot = self._store_snapshot(path)
            elif self.tiered is not None:  # rows re-partitioned by this run's ownership
                reshard = sorted(path.glob("store_rank_*"))
            if self.env.is_main:
                with writing(self.out_dir / "metrics.jsonl"):
                    rewind_metrics(self.out_dir / "metrics.jsonl", self.step)  # steps after it run again
                log.info("resumed from %s (step %d)", path, self.step)
                if old_world != self.env.world_size:
                    log.info(
                        "re-partitioned a checkpoint of %d ranks onto %d", old_world, self.env.world_size
                    )
        if self.tiered is not None:
            self.tiered.open(snapshot=snapshot, reshard_from=reshard)

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

    def _checkpoint_extra(self, path: Path) -> list[Path]:
        """What a checkpoint holds beside the rank files: this rank's store snapshot, and (rank 0) the
        resolved config the checkpoint was trained with, for ``recsys evaluate`` and ``recsys export``."""
        out = [] if self.tiered is None else self.tiered.snapshot(self._store_snapshot(path))
        if self.env.is_main:
            write_json(path / "config.json", config_to_dict(self.config))
            out.append(path / "config.json")
        return out

    def save(self, *, best: bool = False) -> Path:
        """Checkpoint the current state under ``checkpoints/`` (or, ``best``, as the only one in ``best/``)."""
        root = self.best_root if best else self.checkpoint_root
        with writing(root):
            path = save_checkpoint(
                root,
                step=self.step,
                dmp=self.dmp,
                dense_optimizer=self.dense_optimizer,
                keep=1 if best else self.config.train.keep_checkpoints,
                extra=self._checkpoint_extra,
                fingerprint=model_fingerprint(self.config),
                trainer_state={"selection": self.selection.state(), "held_out": self.held_out},
            )
        if not best:
            self._saved_step = self.step
        return path

    def _too_few_slots(self, cause: StoreCapacityError) -> str:
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
        short = [
            f"table t_{f} needs at least {n:,} device slots per owner "
            f"(store.capacity.{f}.device is {self.capacities[f][0]:,})"
            for f, n in need.items()
            if n > self.capacities[f][0]
        ]
        return (
            f"the device tier is too small for the batches in flight (up to {in_flight} training batches, or "
            f"an evaluation batch beside those still pinned): {'; '.join(short) or cause}; raise "
            f"store.capacity.<feature>.device or store.device_rows (now {cfg.store.device_rows:,}); "
            f"`recsys tune-cache` states the minimum for all {cfg.train.steps:,} steps"
        )

    # -- health: non-finite values and stop signals -----------------------------------------------

    def _dense_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._dense is None:
            self._dense = [
                (name, p) for name, p in self.dmp.named_parameters() if "embedding_bags." not in name
            ]
        return self._dense

    @torch.no_grad()
    def _nonfinite(self, loss: float, *, rows: bool) -> str:
        """The first non-finite quantity of this rank after a step ('' when all are finite).

        Every step: the loss, then the dense gradients (their largest magnitudes, one fused op). With
        ``rows`` (every ``train.log_every`` steps and before a checkpoint) also every embedding row held
        in memory on this rank: plain tables and the tiered tables' device slots.
        """
        if not math.isfinite(loss):
            return f"the loss ({loss})"
        grads = [(n, p.grad) for n, p in self._dense_params() if p.grad is not None]
        if grads:
            peaks = torch.stack(torch._foreach_norm([g for _, g in grads], math.inf))
            if not bool(torch.isfinite(peaks).all()):
                bad = int((~torch.isfinite(peaks)).nonzero()[0, 0])
                return f"the gradient of dense parameter {grads[bad][0]}"
        if rows:
            for shard in local_shards(self.dmp, self.tables):
                bad_rows = (~torch.isfinite(shard.weight)).any(dim=1).nonzero()
                if bad_rows.numel():
                    kind = "slot" if self.tiered is not None and shard.table in self.tiered.names else "row"
                    return f"{kind} {int(bad_rows[0, 0]) + shard.row_offset} of embedding table {shard.table}"
        return ""

    def _check_step(self, loss: float) -> None:
        """After every step (collective): stop on a non-finite value, or on SIGTERM/SIGINT after a checkpoint."""
        tcfg = self.config.train
        rows = self.step % tcfg.log_every == 0 or bool(
            tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0
        )
        problem = self._nonfinite(loss, rows=rows or bool(stop_signal.signum))
        flags = torch.tensor([stop_signal.signum, int(bool(problem))], dtype=torch.int64)
        if self.env.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1]:
            found = [problem]
            if self.env.world_size > 1:
                found = [""] * self.env.world_size
                dist.all_gather_object(found, problem)
            rank, what = next((r, p) for r, p in enumerate(found) if p)
            raise UserError(
                f"training diverged at step {self.step}: {what} on rank {rank} is not finite; lower "
                f"train.dense_learning_rate ({self.config.train.dense_learning_rate}) or "
                f"sparse.learning_rate ({self.config.sparse.learning_rate}), or check the input data"
            )
        if flags[0]:
            if self._saved_step != self.step:
                self.save()
            raise RunStopped(int(flags[0]), self.step)

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
                    snapshot = self._store_snapshot(checkpoint)
                    rows += [(name, block) for block in tt.snapshot_rows(name, snapshot)]
        return model_digest(
            self.dmp,
            [t.name for t in self.tables],
            rows,
            seed=self.config.train.seed,
            init_scale=self.config.sparse.init_scale,
        )

    def _tier_window(self, last: dict[str, torch.Tensor]) -> tuple[dict[str, float], str | None]:
        """Hit rates over all ranks since the previous call, and a warning naming a thrashing table.

        Collective. ``last`` holds this rank's counters at the previous call and is updated in place.
        """
        assert self.tiered is not None
        now = self.tiered.counters()
        deltas = {name: value - last.get(name, torch.zeros_like(value)) for name, value in now.items()}
        last.update(now)
        total = sum(deltas.values(), torch.zeros(len(TieredTables.COUNTERS), dtype=torch.float64))
        if self.env.world_size > 1:
            dist.all_reduce(total)
        c = dict(zip(TieredTables.COUNTERS, total.tolist(), strict=True))
        device_hit = c["device_hits"] / max(1.0, c["device_hits"] + c["device_misses"])
        host_hit = c["host_hits"] / max(1.0, c["host_hits"] + c["host_misses"])
        window = {
            "device_hit_rate": device_hit,
            "host_hit_rate": host_hit,
            "ssd_rows_read": c["ssd_rows_read"],
            "ssd_rows_written": c["ssd_rows_written"],
            "rows_initialised": c["rows_initialised"],
        }
        warning = None
        rates = {
            name: float(d[0] / max(1.0, float(d[0] + d[1])))
            for name, d in deltas.items()
            if float(d[0] + d[1]) > 0
        }
        thrashing = {n: r for n, r in rates.items() if r < THRASH_HIT_RATE}
        if thrashing and self.step > 2 * self.config.train.log_every:  # the cache is warm by now
            worst = min(thrashing, key=thrashing.__getitem__)
            warning = (
                f"CACHE THRASHING: table {worst} device hit rate {thrashing[worst]:.2f} over the last "
                f"{self.config.train.log_every} steps ({len(thrashing)} table(s) below {THRASH_HIT_RATE}); "
                f"raise its device capacity (now {self.capacities[worst.removeprefix('t_')][0]} slots; "
                "`recsys tune-cache` recommends one)"
            )
        return window, warning

    def tier_stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per tiered table and tier, the store counters summed over ranks (collective)."""
        mine = {} if self.tiered is None else self.tiered.stats()
        parts = [mine]
        if self.env.world_size > 1:
            parts = [{} for _ in range(self.env.world_size)]
            dist.all_gather_object(parts, mine)
        total: dict[str, dict[str, dict[str, float]]] = {}
        for part in parts:
            for table, tiers in part.items():
                for tier, counters in tiers.items():
                    slot = total.setdefault(table, {}).setdefault(tier, {})
                    for key, value in counters.items():
                        if isinstance(value, int | float):
                            slot[key] = slot.get(key, 0) + value
        return total

    def tier_rates(self) -> tuple[dict[str, dict[str, float]], list[str]]:
        """Per tiered table, hit rates over the training batches (evaluations excluded), summed over
        ranks, beside the predictions of ``store.capacities_from``; and warnings (collective).

        ``device_hit_rate``: ids found in their owner's slots / ids requested (one per sending rank).
        ``host_hit_rate``: share of the rows filled into the device tier that came from host DRAM rather
        than from LMDB or a first initialisation: ``1 - (ssd_rows_read + rows_initialised) / device_rows_in``.
        ``device_requests``: the ids requested (weights of the table's share of a total hit rate).
        """
        mine = {name: value.tolist() for name, value in self._train_counters.items()}
        parts = [mine]
        if self.env.world_size > 1:
            parts = [{} for _ in range(self.env.world_size)]
            dist.all_gather_object(parts, mine)
        total: dict[str, dict[str, float]] = {}
        for part in parts:
            for name, values in part.items():
                slot = total.setdefault(name, dict.fromkeys(TieredTables.COUNTERS, 0.0))
                for key, value in zip(TieredTables.COUNTERS, values, strict=True):
                    slot[key] += value
        predicted = load_tune(self.config.store.capacities_from) if self.config.store.capacities_from else {}
        out: dict[str, dict[str, float]] = {}
        warnings: list[str] = []
        for name, c in sorted(total.items()):
            requests = c["device_hits"] + c["device_misses"]
            below = c["ssd_rows_read"] + c["rows_initialised"]
            rates = {
                "device_hit_rate": c["device_hits"] / requests if requests else 1.0,
                "host_hit_rate": 1.0 - below / c["device_rows_in"] if c["device_rows_in"] else 1.0,
                "ssd_rows_per_step": below / max(1, self.step),
                "device_requests": requests,
            }
            feature = name.removeprefix("t_")
            if feature in predicted:
                for key in ("predicted_device_hit_rate", "predicted_host_hit_rate"):
                    rates[key] = float(predicted[feature][key])  # type: ignore[arg-type]
            out[name] = rates
            if requests and rates["device_hit_rate"] < THRASH_HIT_RATE:
                warnings.append(
                    f"CACHE THRASHING: table {name} device hit rate {rates['device_hit_rate']:.3f} over training "
                    f"with {self.capacities[feature][0]} slots per owner; run `recsys tune-cache` or raise "
                    f"store.capacity.{feature}.device"
                )
            elif "predicted_device_hit_rate" in rates and (
                rates["device_hit_rate"] < rates["predicted_device_hit_rate"] - PREDICTION_TOLERANCE
            ):
                warnings.append(
                    f"table {name}: device hit rate {rates['device_hit_rate']:.3f} is below the predicted "
                    f"{rates['predicted_device_hit_rate']:.3f} (was the run tuned on the same config?)"
                )
        return out, warnings

    # -- evaluation during training ----------------------------------------------------------------

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

    def _evaluation(self, pipeline: TrainPipelineSparseDist, metrics: MetricsLog, bar: tqdm) -> Evaluation:
        """Evaluate, log beside the constant baseline, and keep the checkpoint of a new best (collective)."""
        auc, logloss = self.evaluate(pipeline)
        e = Evaluation(step=self.step, auc=None if math.isnan(auc) else auc, logloss=logloss)
        baseline = self.baseline()["constant_logloss"]
        keep = bool(self.config.eval.every) and self.selection.improves(e)
        if keep:
            path = self.save(best=True)
            e = Evaluation(step=e.step, auc=e.auc, logloss=e.logloss, digest=self.digest(checkpoint=path))
        self.selection.update(e)
        with writing(metrics.path):
            metrics.write(
                kind="eval", step=self.step, auc=auc, logloss=logloss, constant_logloss=baseline, best=keep
            )
        if self.env.is_main:
            shown = "n/a" if e.auc is None else f"{e.auc:.4f}"
            versus = "" if baseline is None else f" (constant predictor {baseline:.4f})"
            bar.write(
                f"step {self.step}: eval auc {shown} logloss {logloss:.4f}{versus}"
                + (" best" if keep else "")
            )
        return e

    # -- the loop ---------------------------------------------------------------------------------

    def _all_mean(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.env.world_size > 1:
            dist.all_reduce(t)
            t /= self.env.world_size
        return t.tolist()

    def fit(self, metrics: MetricsLog) -> dict[str, Any]:
        """Train from ``self.step`` to ``train.steps``; returns the summary (meaningful on rank 0)."""
        cfg = self.config
        tcfg = cfg.train
        pipeline = TrainPipelineSparseDist(
            self.dmp, self.optimizer, self.env.device, execute_all_batches=True
        )
        batches, feed = self._feed(self.step, tcfg.steps)
        bar = tqdm(
            total=tcfg.steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not self.env.is_main,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        try:
            return self._loop(pipeline, batches, feed, metrics, bar)
        except (StageFailed, StoreCapacityError, StoreFullError) as err:
            cause = err.__cause__ if isinstance(err, StageFailed) else err
            if isinstance(cause, StoreFullError):
                raise UserError(f"{cause}; raise store.max_lmdb_bytes or free disk space") from err
            if isinstance(cause, StoreCapacityError):
                raise UserError(self._too_few_slots(cause)) from err
            raise
        finally:
            bar.close()  # ends the bar's line before any error message
            if feed is not None:
                feed.close()
                if self.env.is_main and self.config.pipeline.trace_batches:
                    with writing(self.out_dir / "trace.json"):
                        feed.write_trace(self.out_dir / "trace.json")
                self.pipeline_stats = feed.stats()

    def _loop(
        self,
        pipeline: TrainPipelineSparseDist,
        batches: Iterator[Batch],
        feed: StagedPipeline | None,
        metrics: MetricsLog,
        bar: tqdm,
    ) -> dict[str, Any]:
        cfg = self.config
        tcfg = cfg.train
        train_time = 0.0
        trained_samples = 0
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        result: dict[str, Any] = {"stopped_early": False}
        last: Evaluation | None = None
        counters: dict[str, torch.Tensor] = {}
        warned: dict[str, int] = {}
        logs = 0
        while self.step < tcfg.steps:
            t0 = time.perf_counter()
            loss, _, _ = pipeline.progress(batches)
            if self.tiered is not None:
                self.tiered.release(self.step)  # its backward and optimizer step are done
            train_time += time.perf_counter() - t0
            self.step += 1
            trained_samples += tcfg.batch_size
            loss_value = float(loss)
            self._check_step(loss_value)
            window_loss += loss_value
            window_steps += 1
            bar.update(1)
            if self.step % tcfg.log_every == 0 or self.step == tcfg.steps:
                (mean_loss,) = self._all_mean([window_loss / window_steps])
                rate = window_steps * tcfg.batch_size / max(1e-9, time.perf_counter() - window_start)
                postfix = {"loss": f"{mean_loss:.4f}", "samples_per_s": f"{rate:,.0f}"}
                extra: dict[str, Any] = {}
                if self.tiered is not None and feed is not None:
                    tiers, thrash = self._tier_window(counters)
                    stats = feed.stats()
                    extra = {"tiers": tiers, "pipeline": {"bound_by": stats.get("bound_by")}}
                    postfix.update(hit=f"{tiers['device_hit_rate']:.3f}", bound=str(stats.get("bound_by")))
                    logs += 1
                    for message in (thrash, feed.stall_warning()):
                        if (
                            message
                            and self.env.is_main
                            and logs - warned.get(message[:12], -WARN_EVERY_LOGS) >= WARN_EVERY_LOGS
                        ):
                            warned[message[:12]] = logs
                            bar.write(f"WARNING: {message}")
                            log.warning(message)
                bar.set_postfix(postfix)
                with writing(metrics.path):
                    metrics.write(kind="train", step=self.step, loss=mean_loss, samples_per_s=rate, **extra)
                window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
            stop_early = False
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < tcfg.steps:
                last = self._evaluation(pipeline, metrics, bar)
                stop_early = self.selection.exhausted
                window_start = time.perf_counter()
            if tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0 and self.step < tcfg.steps:
                self.save()
                window_start = time.perf_counter()
            if stop_early:
                assert self.selection.best is not None
                message = (
                    f"stopping early at step {self.step}: {cfg.eval.patience} evaluation(s) without a better "
                    f"held-out {cfg.eval.select} than step {self.selection.best.step}'s"
                )
                if self.env.is_main:
                    bar.write(message)
                    log.info(message)
                result["stopped_early"] = True
                break
        bar.close()
        if self.tiered is not None:
            self._train_counters = {
                name: value - self._eval_counters.get(name, torch.zeros_like(value))
                for name, value in self.tiered.counters().items()
            }
        if not result.get("stopped_early") or last is None or last.step != self.step:
            # Drain the pipeline's prefetched batches (none remain: the iterator stops at train.steps).
            last = self._evaluation(pipeline, metrics, bar)
        if tcfg.checkpoint_every and self._saved_step != self.step:
            self.save()
        result.update(
            auc=last.auc,
            logloss=last.logloss,
            steps=self.step,
            samples=self.step * tcfg.batch_size,  # the whole run's, resumed parts included
            samples_this_process=trained_samples,
            samples_per_s=trained_samples / train_time if train_time else math.nan,
            train_seconds=train_time,
        )
        return result


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into one line naming it (exit 2 at the CLI)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if no_space_left(err) is None:
            raise
        raise _disk_full(path) from err


def _disk_full(path: Path | str) -> UserError:
    return UserError(f"no space left on device writing {path}; free disk space, then continue with --resume")


def _warn_folded(cfg: RunConfig, features: list[str], spaces: list[int], fold: list[int]) -> None:
    """One warning when an untiered run folds ids that its tiered twin would keep apart."""
    if cfg.store.tiered:
        return
    candidates = set(cfg.store.tables) or set(features)
    folded = [
        f"{f} ({space:,} ids)"
        for f, space, m in zip(features, spaces, fold, strict=True)
        if m and f in candidates
    ]
    if folded:
        log.warning(
            "store.tiered=false: the in-memory tables of %s fold ids modulo sparse.max_rows_per_table=%d (hash collisions), so "
            "this run trains a different model than store.tiered=true and the digests differ; digests agree "
            "when every id space fits in sparse.max_rows_per_table",
            ", ".join(folded),
            cfg.sparse.max_rows_per_table,
        )


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
            trainer = Trainer(config, env, out_dir=out_dir)
            trainer.allow_config_change = allow_config_change
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
            trainer.start(resume=resume)
            metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=env.is_main)
            summary = trainer.fit(metrics)
            digest = trainer.digest()
            tiers: dict[str, Any] = trainer.tier_stats()
            tier_warnings: list[str] = []
            if trainer.tiered is not None:
                rates, tier_warnings = trainer.tier_rates()
                for name, values in rates.items():
                    tiers.setdefault(name, {}).update(values)
                if env.is_main:
                    for message in tier_warnings:
                        log.warning(message)
            trainer.close()
            selection = trainer.selection
            summary.update(trainer.baseline())
            constant = summary["constant_logloss"]
            if constant is not None and not summary["logloss"] < constant:
                message = (
                    f"THE MODEL IS NO BETTER THAN A CONSTANT: held-out logloss {summary['logloss']:.4f} is not below "
                    f"{constant:.4f}, the logloss of always predicting the training split's positive rate"
                )
                tier_warnings.append(message)
                if env.is_main:
                    log.warning(message)
            summary.update(
                last={
                    "step": trainer.step,
                    "auc": summary["auc"],
                    "logloss": summary["logloss"],
                    "digest": digest,
                },
                best=None
                if not config.eval.every or selection.best is None
                else {**dataclasses.asdict(selection.best), "checkpoint": str(trainer.best_root)},
                model=config.model.name.value,
                world_size=env.world_size,
                backend=env.backend,
                device=env.device.type,
                model_digest=digest,
                tiered=trainer.tiered is not None,
                tiers=tiers,
                warnings=tier_warnings,
                pipeline=trainer.pipeline_stats,
                wall_seconds=time.perf_counter() - started,
                resumed=resume,
                config=config_to_dict(config),
                versions={"torch": torch.__version__},
            )
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
            full = _disk_full(cause.filename or out_dir)
            record_failure(out_dir, env.rank, full)
            raise full from err
        record_failure(out_dir, env.rank, err)  # before the teardown makes the other ranks fail too
        raise
    finally:
        if trainer is not None:
            trainer.close(flush=False)  # a no-op after the clean close above
        if dist.is_initialized():
            dist.destroy_process_group()
