"""Tiered tables inside TorchRec: slot tables sharded by DMP, rows in the store, ids routed to owners.

For each tiered table the model holds an ordinary EmbeddingBagConfig whose ``num_embeddings`` is the
slot capacity, sharded by DistributedModelParallel (table-wise: the whole slot table on one rank;
row-wise: ``device_rows`` slots on every rank). Before TorchRec sees a batch its raw ids become slot ids:

1. every rank deduplicates its batch's ids per tiered table (:meth:`TieredTables.route`);
2. key routing (:mod:`recsys.routing`): an all-to-all on its own process group sends each unique id to
   its owner (table-wise: the rank holding the table; row-wise: a hash of the id), which announces them
   to its store;
3. the owner prefetches the rows from LMDB into DRAM (:meth:`prefetch`), then makes them resident in its
   local shard of the slot table and pins them (:meth:`fill`);
4. a second all-to-all (another process group, so the two stages may run on different threads) returns
   the slot ids — row-wise slots are offset into the owner's row block, so TorchRec's input distribution
   sends each lookup back to its owner — and the rank rewrites its KJT values.

After the batch's backward the owner releases its pins (:meth:`release`). Rows keep their optimizer
state in the store, so training is bitwise identical to the untiered model. The store's lifecycle (its
directory, lock, restores and close) is :class:`recsys.tier_shard.TierShard`'s, over
:class:`embedding_store.ShardDirectory`; its counters are :class:`recsys.tier_counters.TierCounters`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreConfig,
    TableSpec,
    TieredStore,
    WeightsPrecision,
    num_embeddings_for,
)
from embedding_store.bounds_rule import BoundsRule
from pipelines import DeviceContext, Stage, StagedPipeline, StageSpec
from recsys.binding import EVAL, TRAIN, OwnerRouting
from recsys.bounded import DEFAULT
from recsys.capacities import Capacities
from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.pipeline_config import PipelineSection
from recsys.routing import RoutedIds, values_by_feature, with_values
from recsys.sharding import local_shards
from recsys.sparse import ShardingKind, SparseConfig
from recsys.tier_counters import COUNTERS, TierCounters
from recsys.tier_metrics import TierMetrics
from recsys.tier_shard import Rows, TierShard, claim_shard

__all__ = ["EVAL", "TRAIN", "TierPlan", "TieredTables", "RoutedBatch", "row_bytes", "tiered_feed"]


def row_bytes(sparse: SparseConfig, dim: int) -> int:
    """Bytes of one row of a tiered table: ``dim`` weights of ``sparse.weights_precision`` plus the
    optimizer's per-row float32 state (``TableSpec.row_bytes``)."""
    return _packed_bytes(sparse, dim, sparse.weights_precision)


def slot_row_bytes(sparse: SparseConfig, dim: int) -> int:
    """Bytes of one slot of a tiered table's device tier: as :func:`row_bytes`, but with float32 weights
    unless FBGEMM's tables are float16 (``fp16`` rounded to nearest): stochastic rounding trains float32
    slot tables that hold float16 values."""
    return _packed_bytes(sparse, dim, WeightsPrecision.FP16 if sparse.fp16_tables else WeightsPrecision.FP32)


def _packed_bytes(sparse: SparseConfig, dim: int, precision: WeightsPrecision) -> int:
    return TableSpec(name="t", dim=dim, optimizer=sparse.optimizer, weights_precision=precision).row_bytes


def _lmdb_options(max_bytes: int, unmap_every_rows: int) -> LmdbOptions:
    """LMDB options with the map capped at ``max_bytes`` (0: no cap) and mapped pages dropped after every
    ``unmap_every_rows`` rows (0: never)."""
    unmap = unmap_every_rows or None
    if not max_bytes:
        return LmdbOptions(unmap_every_rows=unmap)
    return LmdbOptions(
        initial_map_size_bytes=min(LmdbOptions().initial_map_size_bytes, max_bytes),
        max_map_size_bytes=max_bytes,
        unmap_every_rows=unmap,
    )


@dataclass
class RoutedBatch:
    """One batch between the routing and the fill stage: its ``ids`` routed on ``channel``'s groups."""

    batch_id: int
    batch: Batch
    channel: str
    ids: RoutedIds
    # per bounded table held here (training and evaluation), the rows leaving before the batch (may be empty)
    removed: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def owner_ids(self) -> dict[str, torch.Tensor]:
        """Per table this rank holds, the ids of the batch it owns that have rows here (see
        :class:`RoutedIds`; a bounded table's ids that read the default row are left out)."""
        if not self.removed:  # no bounded table: nothing to leave out
            return self.ids.owner_ids
        return {
            name: ids[ids != DEFAULT] if name in self.removed else ids
            for name, ids in self.ids.owner_ids.items()
        }


@dataclass(kw_only=True, frozen=True, slots=True)
class TierPlan:
    """What a run's tiered tables are, resolved once from the config (:meth:`from_config`).

    Attributes:
        id_spaces: the tiered tables (one feature each, ``t_<feature>``) with their id spaces, from which
            the store picks each table's index (``embedding_store.num_embeddings_for``).
        capacities: each tiered feature's device slots and host rows per owner.
        store: the store's settings (seed, policy, lookahead, LMDB options).
        optimizer: the fused optimizer (decides the optimizer state a row carries).
        init_scale: rows start uniform in [-init_scale, init_scale).
        row_wise: tables are sharded row-wise (else table-wise).
        weights_precision: how every tier stores the weights (the slot tables may hold them as float32:
            ``sparse.fp16_rounding = stochastic``).
        path: this job's store directory; rank r keeps its LMDB in ``path/rank_r``, locked by
            ``path/rank_r.lock`` while the tables are open.
        bounds: the bounded tables' rules (:mod:`recsys.bounded`); their ``id_spaces`` include the
            default row.
        default_ids: each bounded table's default row id.
    """

    id_spaces: dict[str, int]
    capacities: Capacities
    store: StoreConfig
    optimizer: OptimizerKind
    init_scale: float
    row_wise: bool
    weights_precision: WeightsPrecision
    path: Path
    bounds: dict[str, BoundsRule] = field(default_factory=dict)
    default_ids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        *,
        id_spaces: dict[str, int],
        capacities: Capacities,
        path: Path,
        bounds: tuple[dict[str, BoundsRule], dict[str, int]] = ({}, {}),
    ) -> TierPlan:
        """The plan of ``config``'s ``[store]`` and ``[sparse]`` sections for these tables."""
        section, sparse = config.store, config.sparse
        return cls(
            id_spaces=id_spaces,
            capacities=capacities,
            store=StoreConfig(
                seed=config.train.seed,
                device_capacity_rows=section.device_rows,
                host_capacity_rows=section.host_rows,
                policy=section.policy,
                lookahead_batches=section.lookahead,
                lmdb=_lmdb_options(section.max_lmdb_bytes, section.unmap_every_rows),
            ),
            optimizer=sparse.optimizer,
            init_scale=sparse.init_scale,
            row_wise=sparse.sharding is ShardingKind.ROW_WISE,
            weights_precision=sparse.weights_precision,
            path=path,
            bounds=bounds[0],
            default_ids=bounds[1],
        )


class TieredTables:
    """The tiered tables of one rank: the stages that bind its store to the pipeline.

    Three parts, each complete once constructed: the store shard's lifecycle (:attr:`shard`, a
    :class:`~recsys.tier_shard.TierShard`: open fresh, from a snapshot or re-partitioned, close), the
    stage binding (this class: which ids a batch routes where, and the store calls of each pipeline
    stage) and the counters (:attr:`tallies`, a :class:`~recsys.tier_counters.TierCounters`, which
    :class:`~recsys.tier_metrics.TierMetrics` turns into hit rates).

    Args:
        dmp: the sharded model; the local shards of the tiered slot tables are bound to the store.
        tables: every table config of the model (tiered ones have ``num_embeddings`` = slot capacity).
        plan: the tiered tables, their tiers' sizes and the store's settings.

    Raises:
        UserError: another process holds a rank's shard of the store (every rank raises it).
    """

    COUNTERS = COUNTERS

    def __init__(
        self, dmp: DistributedModelParallel, tables: list[EmbeddingBagConfig], *, plan: TierPlan
    ) -> None:
        tiered = plan.id_spaces
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.row_wise = plan.row_wise
        self.names = list(tiered)
        self.store_tables = sorted(self.names)
        self.feature = {t.name: t.feature_names[0] for t in tables if t.name in tiered}
        configs = {t.name: t for t in tables if t.name in tiered}
        shards = {s.table: s for s in local_shards(dmp, [configs[n] for n in self.names])}
        self.row_offset = {name: shard.row_offset for name, shard in shards.items()}
        # Two training stages exchange ids (routing, fill), each on its own thread and process group.
        self.routing = OwnerRouting(
            shards,
            names=self.names,
            row_wise=self.row_wise,
            bounds=(plan.bounds, plan.default_ids),
            train_stages=2,
        )
        self.bounded = self.routing.bounded
        self.changes = self.routing.changes
        specs = [
            TableSpec(
                name=name,
                dim=configs[name].embedding_dim,
                optimizer=plan.optimizer,
                init_scale=plan.init_scale,
                num_embeddings=num_embeddings_for(tiered[name]),
                device_capacity_rows=shards[name].weight.shape[0],
                host_capacity_rows=plan.capacities.host_rows[self.feature[name]],
                expected_max_rows=(plan.bounds[name].max_rows or None) if name in plan.bounds else None,
                weights_precision=plan.weights_precision,
            )
            for name in sorted(shards)
        ]
        self.lookahead = plan.store.lookahead_batches  # batches the routing stage runs ahead
        # Last: nothing after the claim (collective) can fail, so no path leaves the lock held.
        directory = claim_shard(
            plan.path / f"rank_{self.rank}", exchange=self.routing.world, world_size=self.world_size
        )
        self.shard = TierShard(directory, config=plan.store, tables=specs, slots=shards, owns=self.owns)
        self.tallies = TierCounters(self.shard)

    def slot_ids(self, name: str, slots: np.ndarray) -> np.ndarray:
        """(N,) ids held by slots of table ``name`` that the batch in training pinned."""
        store = self.shard.store
        assert store is not None, "the store is closed"
        return store.slot_ids(name, slots)

    def owns(self, name: str, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids of table ``name`` this rank owns now."""
        return self.routing.owns(name, ids)

    # -- the shard's lifecycle and counters (entry points of :attr:`shard` and :attr:`tallies`) ---

    @property
    def store(self) -> TieredStore | None:
        """This rank's open store (None while closed, or when the rank holds no tiered table)."""
        return self.shard.store

    @property
    def path(self) -> Path:
        """This rank's store directory (``<store.path>/rank_r``)."""
        return self.shard.path

    def open(self, *, snapshot: Path | None = None, reshard_from: list[Path] | None = None) -> None:
        """Open this rank's store (:meth:`TierShard.open <recsys.tier_shard.TierShard.open>`)."""
        self.shard.open(snapshot=snapshot, reshard_from=reshard_from)

    def close(self, *, flush: bool = True) -> None:
        """Close the store (flushing it, unless ``flush=False`` after a failure) and release the lock."""
        self.routing.forget()
        self.shard.close(flush=flush)

    def tier_metrics(self, capacities: Capacities, world_size: int) -> TierMetrics:
        """The tiers' hit rates and sizes over this binding's counters."""
        return TierMetrics(self.tallies, capacities=capacities, world_size=world_size)

    def checkpoint_parts(self) -> dict[str, Any]:
        """The store's snapshot, then (bounded tables) their state: meta.json's ``store`` and ``bounds``."""
        from recsys.checkpoint.parts import BoundsState, StoreState  # they name this class

        parts: dict[str, Any] = {"store": StoreState(self)}
        if self.bounded is not None:
            parts["bounds"] = BoundsState(self.bounded, self.owns)
        return parts

    def digest_rows(self, checkpoint: Path | None, rank: int) -> list[tuple[str, Any]]:
        """This rank's stored rows per table, live or from ``checkpoint``'s snapshot of this rank."""
        rows: list[tuple[str, Any]] = []
        for name in self.names:
            if checkpoint is None:
                rows += [(name, block) for block in self.shard.local_rows(name)]
            else:
                snapshot = checkpoint / f"store_rank_{rank}"
                rows += [(name, block) for block in self.shard.snapshot_rows(name, snapshot)]
        return rows

    def snapshot(self, dest: Path) -> list[Path]:
        """Flush and copy this rank's store into ``dest`` (part of a checkpoint); returns what it wrote."""
        return self.shard.snapshot(dest)

    def local_rows(self, name: str) -> Rows:
        """Every row of ``name`` this rank's store holds, ascending ids, in bounded chunks."""
        return self.shard.local_rows(name)

    def counters(self) -> dict[str, torch.Tensor]:
        """Per owned table, the monotonic counters named by ``COUNTERS`` as a float64 vector."""
        return self.tallies.counters()

    # -- the stages of one batch ------------------------------------------------------------------

    def route(self, batch_id: int, batch: Batch, *, channel: str = TRAIN) -> RoutedBatch:
        """Deduplicate the batch's ids per tiered table and send each unique id to its owner.

        ``channel`` (``train`` or ``eval``) picks the process groups: each channel's collectives are
        issued in the same order on every rank.
        """
        values = values_by_feature(batch.sparse)
        ids = {name: values[self.feature[name]] for name in self.names}
        if self.bounded is not None:  # every batch routes each default row once: its slot comes back last
            for name, d in self.bounded.default_ids.items():
                ids[name] = torch.cat([ids[name], torch.tensor([d], dtype=torch.int64)])
        routed, removed = self.routing.route(batch_id, ids, channel=channel)
        return RoutedBatch(batch_id, batch, channel, routed, removed)

    def announce(self, routed: RoutedBatch) -> None:
        """Tell the store which rows this batch will need (lookahead and prefetch planning)."""
        if self.store is not None:
            self.store.lookahead(routed.batch_id, routed.owner_ids)

    def prefetch(self, routed: RoutedBatch) -> None:
        """Read the batch's rows that only LMDB holds into host DRAM."""
        if self.store is not None:
            self.store.prefetch(routed.batch_id)

    def fill(self, routed: RoutedBatch) -> Batch:
        """Make the batch's rows resident and pinned, return slot ids to their senders, rewrite the KJT."""
        slots: dict[str, torch.Tensor] = {}
        if self.store is not None:
            for name, gone in routed.removed.items():
                if gone.shape[0]:
                    self.store.delete(name, gone)  # before the batch: a re-admitted id starts fresh
            local = self.store.make_resident(routed.batch_id, routed.owner_ids)
            for name, s in local.items():
                owned = routed.ids.owner_ids[name]
                if s.shape[0] == owned.shape[0]:
                    slots[name] = s + self.row_offset[name]
                else:  # DEFAULT stays where the default row goes
                    slots[name] = torch.full_like(owned, DEFAULT)
                    slots[name][owned != DEFAULT] = s + self.row_offset[name]
        value_slots = self.routing.return_slots(routed.ids, slots, channel=routed.channel)
        if self.bounded is not None:
            for name in self.bounded.default_ids:
                got = value_slots[name]
                value_slots[name] = torch.where(got[:-1] == DEFAULT, got[-1], got[:-1])
        return with_values(routed.batch, {self.feature[name]: value_slots[name] for name in self.names})

    def release(self, batch_id: int) -> None:
        """Unpin a batch's rows after its backward and optimizer step; emit its row changes."""
        if self.store is not None:
            self.store.release(batch_id)
        self.routing.finish(batch_id)

    def remap(self, batch_id: int, batch: Batch, *, channel: str = TRAIN) -> Batch:
        """All stages of one batch in sequence (no overlap)."""
        routed = self.route(batch_id, batch, channel=channel)
        self.announce(routed)
        self.prefetch(routed)
        return self.fill(routed)

    def feed(
        self,
        source: Iterable[tuple[int, Batch]],
        *,
        section: PipelineSection,
        device: torch.device,
        rank: int,
    ) -> tuple[Iterator[Batch], StagedPipeline]:
        """The nested tiered pipeline over ``(step, batch)`` items (:func:`tiered_feed`)."""
        pipeline = tiered_feed(self, source, section=section, device=device, rank=rank)
        return iter(pipeline), pipeline


def tiered_feed(
    tables: TieredTables,
    source: Iterable[tuple[int, Batch]],
    *,
    section: PipelineSection,
    device: torch.device,
    rank: int,
) -> StagedPipeline:
    """The nested pipeline's inter-batch stages for tiered tables, over ``(step, batch)`` items.

    load (the source worker) → route (key routing, announce) → prefetch (SSD → DRAM) → fill (slots, pins,
    remap). The routing stage runs ``lookahead`` batches ahead of the prefetch stage, and the prefetch and
    fill of batch i wait until batch i + ``lookahead`` is announced (or the stream has ended), so the store
    sees exactly that many future batches whenever it picks victims: the rows it keeps, its counters and
    the hit rates ``tune-cache`` predicts do not depend on how fast the loader runs. The fill stage runs
    one batch ahead of the consumer, whose pins (and TorchRec's own two batches in flight) keep every slot
    in use out of its reach.
    """
    lookahead = tables.lookahead

    def route(item: tuple[int, Batch]) -> RoutedBatch:
        routed = tables.route(*item)
        tables.announce(routed)
        return routed

    def prefetch(routed: RoutedBatch) -> RoutedBatch:
        tables.prefetch(routed)
        return routed

    window = (Stage.ROUTE, lookahead) if lookahead else None
    stages = [
        StageSpec(name=Stage.ROUTE, fn=route, capacity=max(1, lookahead)),
        # load and route keep the training thread's priority: they must run far ahead to feed the lookahead
        StageSpec(
            name=Stage.PREFETCH, fn=prefetch, capacity=1, on_start=section.lower_worker_priority, lead=window
        ),
        StageSpec(
            name=Stage.FILL,
            fn=tables.fill,
            capacity=1,
            sync_with_consumer=True,
            on_start=section.lower_worker_priority,
            lead=window,
        ),
    ]
    config = section.staged_config()
    return StagedPipeline(source, stages, config=config, device=DeviceContext(device), rank=rank)
