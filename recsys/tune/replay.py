"""Replay the id stream a training run sends to its stores, without training (and without
torch.distributed): every rank's share of every batch is read in one process, in the run's order, and
routed to its owner exactly as :meth:`recsys.tiered.TieredTables.route` does.

Each rank deduplicates its batch's ids per tiered table; the owner (table-wise: the table's one rank;
row-wise: :func:`recsys.tiered.owner_of_ids`) receives one copy per sending rank. The result is one
:class:`~recsys.tune.trace.Trace` per (table, owner): its batches' distinct ids weighted by the number of
ranks that sent them. Evaluations (``eval.every``) are replayed where the run does them, as unweighted
batches, because they pass through the same caches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.data.source import build_dataset
from recsys.errors import UserError
from recsys.sparse import ShardingKind
from recsys.tiered import owner_of_ids
from recsys.tune.trace import Trace, TraceBuilder

__all__ = ["Replay", "replay", "tiered_features", "EVAL_LAG_BATCHES"]

# An evaluation starts after training step s; by then the pipeline has filled about two more batches.
EVAL_LAG_BATCHES = 2


@dataclass(frozen=True)
class Replay:
    """Traces of one run's tiered tables.

    Attributes:
        traces: ``traces[table][owner]``; table names are ``t_<feature>``; one owner for table-wise.
        features: table name -> sparse feature.
        train_batches: training batches replayed.
        world_size: ranks of the run.
        row_wise: whether tables are sharded row-wise (each rank owns a hash share of every table).
    """

    traces: dict[str, list[Trace]]
    features: dict[str, str]
    train_batches: int
    world_size: int
    row_wise: bool


def tiered_features(config: RunConfig, features: list[str]) -> list[str]:
    """The sparse features whose tables are tiered in ``config`` (in feature order)."""
    store = config.store
    unknown = sorted(set(store.tables) - set(features))
    if unknown:
        raise UserError(f"store.tables names unknown features {unknown}; features are {features}")
    chosen = set(store.tables) or set(features)
    return [f for f in features if f in chosen]


def _values(batch: Batch) -> dict[str, torch.Tensor]:
    kjt = batch.sparse
    return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()), strict=True))


def replay(config: RunConfig, *, batches: int | None = None) -> Replay:
    """Read ``batches`` training steps (default ``train.steps``) of every rank and route them to owners."""
    cfg = config
    if not cfg.store.tiered:
        raise UserError("tune-cache needs tiered tables: set store.tiered = true (and store.tables)")
    steps = cfg.train.steps if batches is None else batches
    if steps < 1:
        raise UserError(f"--batches must be >= 1, got {steps}")
    world = cfg.train.nproc
    row_wise = cfg.sparse.sharding is ShardingKind.ROW_WISE
    owners = world if row_wise else 1
    data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
    features = tiered_features(cfg, data.feature_names)
    # Tiered tables keep raw ids (train.py folds only plain tables whose id space exceeds the table).
    builders = {f: [TraceBuilder() for _ in range(owners)] for f in features}

    def add(rank_batches: list[Batch], *, train: bool) -> None:
        per_rank = [_values(b) for b in rank_batches]
        for f in features:
            uniq = [torch.unique(v[f]) for v in per_rank]
            if row_wise and world > 1:
                for owner in range(owners):
                    mine = [u[owner_of_ids(u, world) == owner] for u in uniq]
                    _add_merged(builders[f][owner], mine, train=train)
            else:
                _add_merged(builders[f][0], uniq, train=train)

    sources: list[Iterator[Batch]] = [
        data.train_batches(rank=r, world_size=world, batch_size=cfg.train.batch_size, start_step=0)
        for r in range(world)
    ]
    eval_at = (
        {s + EVAL_LAG_BATCHES for s in range(cfg.eval.every, steps, cfg.eval.every)}
        if cfg.eval.every
        else set()
    )
    for step in range(steps):
        add([next(src) for src in sources], train=True)
        if step + 1 in eval_at:
            for parts in zip(
                *(
                    data.eval_batches(rank=r, world_size=world, batch_size=cfg.eval.batch_size)
                    for r in range(world)
                ),
                strict=True,
            ):
                add(list(parts), train=False)
    traces = {f"t_{f}": [b.build() for b in builders[f]] for f in features}
    return Replay(
        traces=traces,
        features={f"t_{f}": f for f in features},
        train_batches=steps,
        world_size=world,
        row_wise=row_wise,
    )


def _add_merged(builder: TraceBuilder, parts: list[torch.Tensor], *, train: bool) -> None:
    """One owner's batch: the union of the senders' distinct ids, weighted by how many sent each."""
    if len(parts) == 1:
        ids = parts[0].numpy()
        builder.add(ids, np.ones(ids.shape[0], np.int64), train=train)
        return
    ids, counts = np.unique(torch.cat(parts).numpy(), return_counts=True)
    builder.add(ids, counts, train=train)
