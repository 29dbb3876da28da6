"""Bounded tables kept in memory (``store.tiered = false``): the same routing and decisions as tiered
tables (:mod:`recsys.bounded`), with the model's own tables as the rows.

Each batch's ids of a bounded table go to their owners with their occurrences (the tiered tables'
ownership rule over the in-memory sharding: table-wise the rank holding the table, row-wise a hash of
the id), the owners decide, and the ids come back as themselves or as the default row's id. A removed
row is reset to its initial value with zero optimizer state by the rank holding it — exactly what a
tiered run's deleted row reads as when the id comes back — so both runs train the same model.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store.bounds_rule import BoundsRule
from embedding_store.init import init_rows
from recsys.bounded import DEFAULT, BoundedTables
from recsys.data.batch import Batch
from recsys.distributed import collective_timeout
from recsys.routing import DistExchange, Exchange, Ownership, Router, values_by_feature, with_values
from recsys.sharding import LocalShard, local_shards

__all__ = ["InMemoryBounds"]

TRAIN, EVAL = "train", "eval"


class InMemoryBounds:
    """One rank's bounded in-memory tables: remaps each batch, resets removed rows.

    Args:
        dmp: the sharded model (its local shards are reset in place).
        tables: the bounded tables' configs (``num_embeddings`` includes the default row).
        rules: table name -> its rule, and the default row ids (``(rules, default_ids)``).
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
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.names = sorted(rules[0])
        self.feature = {t.name: t.feature_names[0] for t in tables}
        self.shards: dict[str, LocalShard] = {s.table: s for s in local_shards(dmp, tables)}
        world = DistExchange()
        self.ownership = Ownership.agree(
            self.shards, world_size=self.world_size, row_wise=row_wise, exchange=world
        )
        held = {n for n in self.names if n in self.shards} if not self.ownership.hashed else set(self.names)
        self._router = Router(self.ownership, names=self.names, held=held)
        self.bounded = BoundedTables(rules[0], rules[1], held)
        self.seed, self.scale, self.dtype = init
        self._exchanges: dict[str, Exchange] = {TRAIN: world, EVAL: world}
        if self.world_size > 1:
            groups = [dist.new_group(backend="gloo", timeout=collective_timeout()) for _ in range(2)]
            self._exchanges = {TRAIN: DistExchange(groups[0]), EVAL: DistExchange(groups[1])}

    def owns(self, name: str, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids of bounded table ``name`` this rank decides for."""
        return self.ownership.owns(name, ids, self.rank)

    def remap(self, step: int, batch: Batch, *, channel: str = TRAIN) -> Batch:
        """The batch with every bounded table's ids that read the default row replaced by its id; for a
        training batch, decide step ``step`` and reset the rows it removes first (collective)."""
        values = values_by_feature(batch.sparse)
        ids = {name: values[self.feature[name]] for name in self.names}
        exchange = self._exchanges[channel]
        train = channel == TRAIN
        routed = self._router.route(ids, exchange, counts=train)
        if train:
            assert routed.owner_counts is not None
            decided = self.bounded.decide(step, routed.owner_ids, routed.owner_counts)
            mapped, removed = decided.owner_ids, decided.removed
            if self.ownership.hashed:  # row-wise: the row may live on another rank than its owner
                gathered = exchange.all_gather(removed)
                removed = {
                    n: torch.cat([torch.from_numpy(g[n]) for g in gathered if n in g]).numpy()
                    for n in self.names
                }
            self._reset(removed)
        else:
            mapped = self.bounded.lookup(routed.owner_ids)
        back = self._router.return_slots(routed, mapped, exchange)
        defaults = self.bounded.default_ids
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
