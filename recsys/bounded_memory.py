"""In-memory tables (``store.tiered = false``) bound to training: the model's own tables hold the rows.

Plain tables need nothing between the loader and TorchRec. Bounded tables take the same routing and
decisions as tiered ones (:mod:`recsys.bounded`, through :class:`~recsys.binding.OwnerRouting`): each
batch's ids of a bounded table go to their owners with their occurrences (the tiered tables' ownership
rule over the in-memory sharding: table-wise the rank holding the table, row-wise a hash of the id), the
owners decide, and the ids come back as themselves or as the default row's id. A removed row is reset to
its initial value with zero optimizer state by the rank holding it — exactly what a tiered run's deleted
row reads as when the id comes back — so both runs train the same model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store.bounds_rule import BoundsRule
from embedding_store.init import init_rows
from pipelines import DeviceContext, StagedPipeline
from recsys.binding import EVAL, TRAIN, OwnerRouting, RowChanges
from recsys.bounded import DEFAULT, BoundedTables
from recsys.capacities import Capacities
from recsys.data.batch import Batch
from recsys.pipeline_config import PipelineSection
from recsys.routing import values_by_feature, with_values
from recsys.sharding import LocalShard, local_shards

__all__ = ["EVAL", "TRAIN", "InMemoryTables"]


class InMemoryTables:
    """One rank's in-memory tables: remaps each batch of the bounded ones, resets their removed rows.

    Collective to construct when some table is bounded (:class:`~recsys.binding.OwnerRouting`).

    Args:
        dmp: the sharded model (its local shards of bounded tables are reset in place).
        tables: every table config of the model (a bounded table's ``num_embeddings`` includes the
            default row).
        rules: table name -> its rule, and the default row ids (``(rules, default_ids)``; empty: no table
            is bounded).
        row_wise: the tables are sharded row-wise.
        init: the rows' initial values: ``(seed, scale, dtype)`` (dtype: the weights' storage precision,
            to which they are rounded).
    """

    def __init__(
        self,
        dmp: DistributedModelParallel,
        tables: list[EmbeddingBagConfig],
        rules: tuple[dict[str, BoundsRule], dict[str, int]],
        row_wise: bool,
        init: tuple[int, float, torch.dtype],
    ) -> None:
        self.names = sorted(rules[0])
        bounded = [t for t in tables if t.name in rules[0]]
        self.feature = {t.name: t.feature_names[0] for t in bounded}
        self.shards: dict[str, LocalShard] = (
            {s.table: s for s in local_shards(dmp, bounded)} if bounded else {}
        )
        self.seed, self.scale, self.dtype = init
        self.routing = (
            OwnerRouting(self.shards, names=self.names, row_wise=row_wise, bounds=rules)
            if self.names
            else None
        )
        self.changes = RowChanges() if self.routing is None else self.routing.changes

    @property
    def store_tables(self) -> list[str]:
        """None: every row is in the model's tables."""
        return []

    def tier_metrics(self, capacities: Capacities, world_size: int) -> None:
        """None: there are no tiers to count."""
        return None

    @property
    def bounded(self) -> BoundedTables | None:
        """The bounded tables' state this rank decides for (None: no table is bounded)."""
        return None if self.routing is None else self.routing.bounded

    def owns(self, name: str, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids of bounded table ``name`` this rank decides for."""
        assert self.routing is not None, f"{name} is not routed: no table is bounded"
        return self.routing.owns(name, ids)

    def slot_ids(self, name: str, slots: np.ndarray) -> np.ndarray:
        """In memory a row's id is its place in the table: no table has slots."""
        raise KeyError(f"{name}: in-memory tables have no slots")

    def open(self, *, snapshot: Path | None = None, reshard_from: list[Path] | None = None) -> None:
        """Nothing to open: the model's state holds the rows (a checkpoint restores them with it)."""

    def close(self, *, flush: bool = True) -> None:
        """Forget the row changes of unfinished batches."""
        if self.routing is not None:
            self.routing.forget()

    def checkpoint_parts(self) -> dict[str, Any]:
        """The bounded tables' state (meta.json's ``bounds``), when some table is bounded."""
        from recsys.checkpoint.parts import BoundsState

        return {} if self.bounded is None else {"bounds": BoundsState(self.bounded, self.owns)}

    def digest_rows(self, checkpoint: Path | None, rank: int) -> list[tuple[str, Any]]:
        """None: every row is in the model's state, which the digest reads itself."""
        return []

    def feed(
        self,
        source: Iterable[tuple[int, Batch]],
        *,
        section: PipelineSection,
        device: torch.device,
        rank: int,
    ) -> tuple[Iterator[Batch], StagedPipeline]:
        """Only the load stage, on the pipeline's source worker in pipelined mode, so that reading and
        folding batch i+1 overlaps batch i's compute as in tiered runs. A bounded table's remap (which
        resets the rows of new ids) stays on the consumer's thread, in step order."""
        loads = StagedPipeline(
            source, [], config=section.staged_config(), device=DeviceContext(device), rank=rank
        )
        if self.routing is None:
            return (batch for _, batch in loads), loads
        return (self.remap(step, batch) for step, batch in loads), loads

    def release(self, batch_id: int) -> None:
        """The batch's optimizer step is done: emit its row changes."""
        if self.routing is not None:
            self.routing.finish(batch_id)

    def remap(self, batch_id: int, batch: Batch, *, channel: str = TRAIN) -> Batch:
        """The batch with every bounded table's ids that read the default row replaced by its id; for a
        training batch, decide step ``batch_id`` and reset the rows it removes first (collective)."""
        routing = self.routing
        if routing is None:
            return batch
        values = values_by_feature(batch.sparse)
        ids = {name: values[self.feature[name]] for name in self.names}
        routed, removed = routing.route(batch_id, ids, channel=channel)
        if channel == TRAIN:
            if routing.ownership.hashed:  # row-wise: the row may live on another rank than its owner
                gathered = routing.exchange(TRAIN).all_gather(removed)
                removed = {
                    n: torch.cat([torch.from_numpy(g[n]) for g in gathered if n in g]).numpy()
                    for n in self.names
                }
            self._reset(removed)
        back = routing.return_slots(routed, routed.owner_ids, channel=channel)
        assert routing.bounded is not None
        defaults = routing.bounded.default_ids
        return with_values(
            batch,
            {self.feature[n]: torch.where(back[n] == DEFAULT, defaults[n], back[n]) for n in self.names},
        )

    @torch.no_grad()
    def _reset(self, removed: dict) -> None:
        """Give the removed rows this rank holds their initial value and zero optimizer state."""
        for name, gone in removed.items():
            shard = self.shards.get(name)
            if shard is None or not len(gone):
                continue
            ids = torch.from_numpy(gone)
            n, d = shard.weight.shape
            mine = ids[(ids >= shard.row_offset) & (ids < shard.row_offset + n)]
            if not mine.shape[0]:
                continue
            rows = mine - shard.row_offset
            full = init_rows(mine, dim=shard.col_offset + d, seed=self.seed, table=name, scale=self.scale)
            shard.weight[rows] = (
                full[:, shard.col_offset :].to(self.dtype).to(shard.weight.device, shard.weight.dtype)
            )
            if shard.state is not None:
                shard.state[rows] = 0
