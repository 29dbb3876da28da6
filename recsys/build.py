"""Assembling a trainer from its config: the dataset, the sharded model, its optimizers and the tiers.

:class:`TrainSpec` names the builders a :class:`~recsys.trainer.Trainer` is assembled with, so that a
benchmark or a test replaces one part (a tier binding that records what it fills, a silent progress
bar) instead of patching the project's modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchrec import EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from tqdm import tqdm

from recsys.binding import TableBinding
from recsys.bounded import default_id
from recsys.bounded_memory import InMemoryTables
from recsys.capacities import Capacities, mismatch_warning
from recsys.capacity_advice import SlotsAdvice
from recsys.clustering import cluster_order, permute_batch
from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.data.source import Dataset, build_dataset
from recsys.distributed import DistEnv
from recsys.errors import UserError
from recsys.exchange import AUTO_TRACE_BATCHES, ExchangeMeter, SparseExchange, choose_exchange
from recsys.models import TrainModel, build_model, table_configs
from recsys.pipeline_config import ClusterKind
from recsys.routing import tiered_features
from recsys.sharding import build_optimizer, init_embedding_rows, shard_model
from recsys.sparse import ExchangeKind, ShardingKind
from recsys.table_names import table_name
from recsys.tiered import TieredTables, TierPlan, row_bytes, slot_row_bytes
from recsys.windows import enable_frozen_windows

__all__ = ["ModelParts", "TrainSpec", "build_parts", "fold_ids", "progress_bar"]

log = logging.getLogger("recsys")


def progress_bar(*, total: int, initial: int, enabled: bool) -> Any:
    """The training progress bar (tqdm, rank 0 only); ``write`` prints a line above it."""
    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=1.0,
    )


@dataclass(kw_only=True, frozen=True)
class TrainSpec:
    """The builders of a trainer's replaceable parts.

    Attributes:
        tables: builds the tier binding of one rank when some table is tiered:
            ``tables(dmp, table_configs, plan=TierPlan)``, as :class:`~recsys.tiered.TieredTables` is
            called (its ``feed`` builds the nested pipeline).
        progress: builds the progress bar of a fit; called as :func:`progress_bar` is.
        capacity_advice: the device slots a run needed, for the error of a device tier too small
            (:class:`~recsys.capacity_advice.SlotsAdvice`); ``recsys train`` passes the tuner's replay
            (:func:`recsys.capacity_replay.replay_advice`). None: the error gives the store's own figure.
        fused_params: builds extra keyword arguments for FBGEMM's table-batched modules from the table
            configs (None: none); e.g. ``preallocated_host_buffers`` to put an in-memory table's weights over
            a memory-mapped file, as ``benchmarks/bench_alternatives.py``'s baseline does. Not a setting:
            the model trained is the same only if the arguments change where weights live, not how they
            train.
    """

    tables: Callable[..., TieredTables] = TieredTables
    progress: Callable[..., Any] = progress_bar
    capacity_advice: SlotsAdvice | None = None
    fused_params: Callable[[list[EmbeddingBagConfig]], dict[str, Any]] | None = None


@dataclass(kw_only=True)
class ModelParts:
    """What :func:`build_parts` assembles for one rank.

    Attributes:
        data: the dataset.
        fold: per feature, the modulus its ids are folded by into an in-memory table (0: not folded).
        tables: every table config (a tiered one has its device slots per owner x owners as rows).
        dmp: the sharded model.
        optimizer: TorchRec's combined optimizer (fused sparse + dense).
        dense_optimizer: the dense part of it.
        capacities: the tiers' sizes per tiered feature (empty without tiers).
        binding: the tables' binding (:class:`~recsys.binding.TableBinding`): the tiered tables, or the
            in-memory ones.
        exchange: what training batches send between ranks (:class:`~recsys.exchange.ExchangeMeter`).
    """

    data: Dataset
    fold: list[int]
    tables: list[EmbeddingBagConfig]
    dmp: DistributedModelParallel
    optimizer: Any
    dense_optimizer: Any
    capacities: Capacities
    binding: TableBinding
    exchange: ExchangeMeter

    @property
    def tiered(self) -> TieredTables | None:
        """The tiered tables (their store, counters and slots), or None when every table is in memory."""
        return self.binding if isinstance(self.binding, TieredTables) else None


def fold_ids(batch: Batch, modulus: list[int]) -> Batch:
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


def _warn_folded(cfg: RunConfig, features: list[str], spaces: list[int], fold: list[int]) -> None:
    """One warning when an untiered run folds ids that its tiered twin would keep apart, with what the
    folded tables weigh: their ids' space is unknown or larger than ``max_rows_per_table``, so each gets
    that many rows, however few distinct ids it holds."""
    if cfg.store.tiered:
        return
    candidates = set(cfg.store.tables) or set(features)
    folded = [
        f"{f} ({space:,} ids)"
        for f, space, m in zip(features, spaces, fold, strict=True)
        if m and f in candidates
    ]
    if folded:
        rows = cfg.sparse.max_rows_per_table
        mib = rows * row_bytes(cfg.sparse, cfg.model.table_dim) / 2**20
        log.warning(
            "store.tiered=false: the in-memory tables of %s fold ids modulo sparse.max_rows_per_table=%d (hash collisions), so "
            "this run trains a different model than store.tiered=true and the digests differ; digests agree "
            "when every id space fits in sparse.max_rows_per_table. Each of these tables holds %s rows "
            "(%.1f MiB with its optimizer state; %.1f MiB in all): declare a feature's id_space in the "
            "dataset spec, or lower sparse.max_rows_per_table, where it has fewer distinct ids",
            ", ".join(folded),
            rows,
            f"{rows:,}",
            mib,
            mib * len(folded),
        )


@dataclass(frozen=True)
class TableLayout:
    """The tables of a run's features on ``world_size`` ranks (:func:`table_layout`).

    Attributes:
        tiered: the tiered features.
        capacities: the tiers' sizes of each tiered feature.
        owners: ranks holding a part of each table (row-wise: all of them; table-wise: one).
        num_embeddings: rows of each feature's table: a tiered table's slots per owner times its owners;
            in memory, its id space, at most ``sparse.max_rows_per_table`` (a bounded table's default
            row not counted).
        fold: per feature, the modulus its ids are folded by into an in-memory table (0: not folded).
    """

    tiered: list[str]
    capacities: Capacities
    owners: int
    num_embeddings: list[int]
    fold: list[int]


def table_layout(
    cfg: RunConfig, features: list[str], id_spaces: list[int], *, world_size: int
) -> TableLayout:
    """The tables ``cfg`` gives ``features`` of ``id_spaces`` on ``world_size`` ranks: what a run builds
    (:func:`build_parts`) and what ``recsys plan-exchange`` replays."""
    tiered = tiered_features(cfg.store, features)
    dim = cfg.model.table_dim
    capacities = Capacities.resolve(
        cfg.store,
        tiered,
        row_bytes=row_bytes(cfg.sparse, dim),
        slot_row_bytes=slot_row_bytes(cfg.sparse, dim),
    )
    owners = world_size if cfg.sparse.sharding is ShardingKind.ROW_WISE else 1
    num_embeddings = [
        capacities.device_rows[f] * owners if f in tiered else min(space, cfg.sparse.max_rows_per_table)
        for f, space in zip(features, id_spaces, strict=True)
    ]
    fold = [
        0 if f in tiered or space <= rows else rows
        for f, space, rows in zip(features, id_spaces, num_embeddings, strict=True)
    ]
    return TableLayout(tiered, capacities, owners, num_embeddings, fold)


def build_parts(config: RunConfig, env: DistEnv, *, out_dir: Path, spec: TrainSpec) -> ModelParts:
    """The dataset, model, optimizers and tier binding of this rank for ``config`` (collective).

    Raises:
        UserError: a setting does not fit the data or the ranks (named in the message).
    """
    cfg = config
    data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
    data_spec = getattr(data, "spec", None)
    if data_spec is not None and not data_spec.read.has_label:
        raise UserError(
            f"{data_spec.path}: [read] has_label = false (data without labels) cannot be trained on"
        )
    features = data.feature_names
    layout = table_layout(cfg, features, data.id_spaces, world_size=env.world_size)
    tiered, capacities, owners = layout.tiered, layout.capacities, layout.owners
    num_embeddings, fold = layout.num_embeddings, layout.fold
    if env.is_main:
        for note in capacities.notes:
            log.info(note)
        planned = {
            table_name(f): {"device_rows": d, "host_rows": capacities.host_rows[f], "owners": owners}
            for f, d in capacities.device_rows.items()
        }
        for table, differ in capacities.mismatches(planned).items():
            log.warning(mismatch_warning(table, differ))  # summary.json repeats it with what ran
    try:
        rules = cfg.store.bounds_rules(features)
    except ValueError as err:
        raise UserError(f"store.{err}") from None
    # a bounded table's default row: the id past its ids (tiered: its id space; in memory: its rows)
    spaces = dict(zip(features, data.id_spaces, strict=True))
    default_ids = {
        table_name(f): default_id(spaces[f] if f in tiered else rows)
        for f, rows in zip(features, num_embeddings, strict=True)
        if f in rules
    }
    num_embeddings = [
        rows + 1 if f in rules and f not in tiered else rows
        for f, rows in zip(features, num_embeddings, strict=True)
    ]
    if env.is_main:
        _warn_folded(cfg, features, data.id_spaces, fold)
    tables = table_configs(
        features, dim=cfg.model.table_dim, num_embeddings=num_embeddings, fp16=cfg.sparse.fp16_tables
    )
    torch.manual_seed(cfg.train.seed)
    windows = cfg.pipeline.frozen_windows
    if windows > cfg.train.batch_size // env.world_size:
        raise UserError(
            f"pipeline.frozen_windows={windows} is more than the "
            f"{cfg.train.batch_size // env.world_size} samples of a rank's batch"
        )
    model = TrainModel(
        build_model(cfg.model, tables, num_dense=data.num_dense, device=env.device),
        windows=windows,
    )
    extra = None if spec.fused_params is None else spec.fused_params(tables)
    dmp = shard_model(model, tables, sparse=cfg.sparse, device=env.device, fused_extra=extra)
    exchange = _install_exchange(cfg, env, dmp, data=data, fold=fold, tiered=[f in tiered for f in features])
    if windows > 1 and exchange.kind == ExchangeKind.POOLED.value:
        enable_frozen_windows(dmp, windows, env.world_size)
    init_embedding_rows(
        dmp, tables, seed=cfg.train.seed, scale=cfg.sparse.init_scale, precision=cfg.sparse.weights_precision
    )
    optimizer = build_optimizer(dmp, cfg.train)
    binding: TableBinding
    if tiered:
        store_path = Path(cfg.store.path) if cfg.store.path else out_dir / "store"
        plan = TierPlan.from_config(
            cfg,
            id_spaces={
                table_name(f): min(n + 1, 1 << 63) if f in rules else n
                for f, n in zip(features, data.id_spaces, strict=True)
                if f in tiered
            },
            capacities=capacities,
            path=store_path,
            bounds=({table_name(f): r for f, r in rules.items()}, default_ids),
        )
        binding = spec.tables(dmp, tables, plan=plan)
    else:
        binding = InMemoryTables(
            dmp,
            tables,
            ({table_name(f): r for f, r in rules.items()}, default_ids),
            cfg.sparse.sharding is ShardingKind.ROW_WISE,
            (cfg.train.seed, cfg.sparse.init_scale, getattr(torch, cfg.sparse.weights_precision.dtype)),
        )
    return ModelParts(
        data=data,
        fold=fold,
        tables=tables,
        dmp=dmp,
        optimizer=optimizer,
        dense_optimizer=optimizer.optimizers[1][1],
        capacities=capacities,
        binding=binding,
        exchange=exchange,
    )


def _install_exchange(
    cfg: RunConfig,
    env: DistEnv,
    dmp: DistributedModelParallel,
    *,
    data: Dataset,
    fold: list[int],
    tiered: list[bool],
) -> ExchangeMeter:
    """Each table's exchange (``sparse.exchange``, ``sparse.exchange_tables``), ``auto`` resolved from this
    run's first training batches as the training will send them (collective)."""
    features = data.feature_names
    try:
        kinds = cfg.sparse.exchange_kinds(features)
    except ValueError as err:
        raise UserError(f"sparse.{err}") from None
    windows = cfg.pipeline.frozen_windows
    exchange = SparseExchange(dmp, dmp.plan, features, windows=windows)
    detail = None
    if ExchangeKind.AUTO in kinds:
        batches = data.train_batches(
            rank=env.rank, world_size=env.world_size, batch_size=cfg.train.batch_size, start_step=0
        )
        cluster = windows if cfg.pipeline.cluster is ClusterKind.KEYS else 1
        trace = [
            exchange.slotted(batch.sparse, tiered)
            for _, batch in fold_source(batches, fold, (0, AUTO_TRACE_BATCHES), cluster_windows=cluster)
        ]
        chosen, detail = choose_exchange(exchange, trace)
        kinds = [c if k is ExchangeKind.AUTO else k for k, c in zip(kinds, chosen, strict=True)]
    meter = exchange.install(kinds)
    meter.auto = detail
    return meter


def fold_source(
    batches: Iterable[Batch], fold: list[int], span: tuple[int, int], *, cluster_windows: int = 1
) -> Any:
    """``(step, batch)`` for steps ``span`` = [start, stop) of a rank's batches, ids folded where needed;
    ``cluster_windows`` > 1: each batch reordered so that samples sharing ids share one of that many
    windows (``pipeline.cluster = "keys"``)."""
    for step, batch in zip(range(*span), batches, strict=False):
        folded = fold_ids(batch, fold)
        if cluster_windows > 1:
            folded = permute_batch(folded, cluster_order(folded.sparse, cluster_windows))
        yield step, folded
