"""Replay the id stream a training run sends to its stores, without training (and without
torch.distributed): every rank's share of every batch is read in one process, in the run's order, and
routed to its owner by the rule :meth:`recsys.tiered.TieredTables.route` uses (:mod:`recsys.routing`).

Each rank deduplicates its batch's ids per tiered table; the owner (table-wise: the table's one rank;
row-wise: :func:`recsys.routing.owner_of_ids`) receives one copy per sending rank. The result is one
:class:`~recsys.tune.trace.Trace` per (table, owner): its batches' distinct ids weighted by the number of
ranks that sent them. Evaluations (``eval.every``, and the final one after ``train.steps``) are replayed
where the run does them, as unweighted batches, because they pass through the same caches.

Bounded tables (``[store.bounds]``): an id without a row of its own reads its table's default row, so it
needs no cache room of its own. Each bounded table's rule runs here as in the run (:class:`BoundsReplay`:
one :class:`~embedding_store.bounds.TableBounds` per owner, fed each training step's unique ids with their
occurrences in the step's batch over all ranks, in step order), and an id that reads the default row
enters the trace as the default row's id; every rank's batch holds the default row once, as
:meth:`recsys.tiered.TieredTables.route` routes it. Evaluation batches look the ids up without changing
the rule's state. Expiry and the cap only remove rows, which a cache need not model: a removed id simply
reads the default row again until it is admitted anew.

Batches in flight (:func:`batches_in_flight`): TorchRec's ``TrainPipelineSparseDist`` takes batch i + 2
from the feed while it computes batch i, and the training loop releases batch i's pins after that step.
In ``pipeline.mode = "sequential"`` taking batch i + 2 fills it there and then, beside batches i and
i + 1: three batches. In ``pipelined`` mode the fill stage (capacity 1) may fill batch i + 3 as soon as
batch i + 2 is taken — before batch i is released — so a fill can find four batches pinned (itself
included); whether it does depends on thread timing, so the minimum counts four. An evaluation after
step s runs beside the training batches already filled and not released: s, s + 1 (and s + 2 when
pipelined), never more than the run has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from embedding_store.bounds import TableBounds
from embedding_store.bounds_rule import BoundsRule
from pipelines import PipelineMode
from recsys.bounded import default_id
from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.data.source import build_dataset
from recsys.errors import UserError
from recsys.routing import Ownership, tiered_features, values_by_feature
from recsys.sparse import ShardingKind
from recsys.table_names import table_name
from recsys.tune.trace import Trace, TraceBuilder

__all__ = ["BoundsReplay", "Replay", "batches_in_flight", "replay"]

# Training batches pinned when a batch is filled, itself included (see the module docstring).
PIPELINED_BATCHES_IN_FLIGHT = 4
SEQUENTIAL_BATCHES_IN_FLIGHT = 3


def batches_in_flight(config: RunConfig) -> int:
    """Training batches whose rows can be pinned at once when a training batch is filled (itself
    included); an evaluation after step s runs beside the one fewer batches from s on."""
    if config.pipeline.mode is PipelineMode.SEQUENTIAL:
        return SEQUENTIAL_BATCHES_IN_FLIGHT
    return PIPELINED_BATCHES_IN_FLIGHT


class BoundsReplay:
    """One bounded table's rule, run on each of its owners as the training run runs it.

    Args:
        name: the table (``t_<feature>``).
        rule: its bounds rule.
        default: the default row's id (:func:`recsys.bounded.default_id` of the table's id space).
        ownership: who owns which ids (the replay's: table-wise owner 0, row-wise by hash over the ranks).
    """

    def __init__(self, name: str, rule: BoundsRule, *, default: int, ownership: Ownership) -> None:
        self.name = name
        self.default = default
        self.ownership = ownership
        self.owners = [TableBounds(rule) for _ in range(ownership.world_size if ownership.hashed else 1)]

    def map(self, step: int, values: list[torch.Tensor], *, train: bool) -> list[torch.Tensor]:
        """Each rank's (n_r,) ids of one batch with those that read the default row replaced by its id,
        and the default row's id once at the end; a training batch (``train``) decides ``step`` first."""
        uniq, counts = np.unique(torch.cat(values).numpy(), return_counts=True)
        own = uniq == self.default  # the default row's own id is never counted
        counted = np.flatnonzero(~own)
        owner = self.ownership.owners(self.name, torch.from_numpy(uniq[counted])).numpy()
        for o, bounds in enumerate(self.owners):
            mine = counted[owner == o]
            if train:
                own[mine] = bounds.decide(step, uniq[mine], counts[mine]).own
            else:
                own[mine] = bounds.lookup(uniq[mine])
        out = []
        tail = torch.tensor([self.default], dtype=torch.int64)
        for v in values:
            ids = v.numpy()
            mapped = np.where(own[np.searchsorted(uniq, ids)], ids, self.default)
            out.append(torch.cat([torch.from_numpy(mapped), tail]))
        return out

    @property
    def rows(self) -> int:
        """Ids with a row of their own now, over every owner."""
        return sum(b.rows for b in self.owners)


@dataclass(frozen=True)
class Replay:
    """Traces of one run's tiered tables.

    Attributes:
        traces: ``traces[table][owner]``; table names are ``t_<feature>``; one owner for table-wise.
        features: table name -> sparse feature.
        train_batches: training batches replayed.
        world_size: ranks of the run.
        row_wise: whether tables are sharded row-wise (each rank owns a hash share of every table).
        pinned_batches: :func:`batches_in_flight` of the run.
        bounded_rows: per bounded table, the ids with a row of their own after the replayed steps (the
            others read the default row); empty without ``[store.bounds]``.
    """

    traces: dict[str, list[Trace]]
    features: dict[str, str]
    train_batches: int
    world_size: int
    row_wise: bool
    pinned_batches: int
    bounded_rows: dict[str, int] = field(default_factory=dict)


def replay(
    config: RunConfig,
    *,
    batches: int | None = None,
    world_size: int | None = None,
    features: list[str] | None = None,
) -> Replay:
    """Read ``batches`` training steps (default ``train.steps``) of every rank and route them to owners.

    ``world_size`` overrides ``train.nproc``; ``features`` limits the traces to some tiered features
    (default: every tiered one). The final evaluation is replayed when the steps reach ``train.steps``.
    Bounded tables' ids without a row are replayed as their default row (the module docstring).

    Raises:
        UserError: no tiered tables, ``batches`` < 1, a feature of ``features`` that is not tiered, or an
            invalid ``[store.bounds]``.
    """
    cfg = config
    if not cfg.store.tiered:
        raise UserError("tune-cache needs tiered tables: set store.tiered = true (and store.tables)")
    steps = cfg.train.steps if batches is None else batches
    if steps < 1:
        raise UserError(f"--batches must be >= 1, got {steps}")
    world = cfg.train.nproc if world_size is None else world_size
    row_wise = cfg.sparse.sharding is ShardingKind.ROW_WISE
    owners = world if row_wise else 1
    data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
    tiered = tiered_features(cfg.store, data.feature_names)
    if features is not None:
        untiered = [f for f in features if f not in tiered]
        if untiered:
            raise UserError(f"features {untiered} have no tiered table; tiered features are {tiered}")
        tiered = [f for f in tiered if f in features]
    features = tiered
    pinned = batches_in_flight(cfg)
    # Tiered tables keep raw ids (train.py folds only plain tables whose id space exceeds the table).
    builders = {f: [TraceBuilder() for _ in range(owners)] for f in features}
    # Table-wise, each table's one owner is trace 0 (whichever rank the planner picks, it gets every id).
    ownership = Ownership(
        world_size=world, row_wise=row_wise, table_owner=dict.fromkeys((table_name(f) for f in features), 0)
    )

    try:
        rules = cfg.store.bounds_rules(data.feature_names)
    except ValueError as err:
        raise UserError(f"store.{err}") from None
    spaces = dict(zip(data.feature_names, data.id_spaces, strict=True))
    bounds = {
        f: BoundsReplay(table_name(f), rules[f], default=default_id(spaces[f]), ownership=ownership)
        for f in features
        if f in rules
    }

    def add(rank_batches: list[Batch], *, train: bool, held: int = -1, step: int = -1) -> None:
        per_rank = [values_by_feature(b.sparse) for b in rank_batches]
        for f in features:
            values = [v[f] for v in per_rank]
            if f in bounds:
                values = bounds[f].map(step, values, train=train)
            # shares[r][o]: the distinct ids rank r sends owner o
            shares = [ownership.split(table_name(f), torch.unique(v)) for v in values]
            for owner, builder in enumerate(builders[f]):
                _add_merged(builder, [share[owner] for share in shares], train=train, held=held)

    def evaluate(held: int) -> None:
        for parts in zip(
            *(
                data.eval_batches(rank=r, world_size=world, batch_size=cfg.eval.batch_size)
                for r in range(world)
            ),
            strict=True,
        ):
            add(list(parts), train=False, held=held)

    sources: list[Iterator[Batch]] = [
        data.train_batches(rank=r, world_size=world, batch_size=cfg.train.batch_size, start_step=0)
        for r in range(world)
    ]
    # The evaluation after step s runs once batches s .. s + pinned - 2 are filled (those that exist), and
    # beside them: it goes after them in the trace, holding them. Several may go after the last batch.
    evals: dict[int, list[int]] = {}
    for s in range(cfg.eval.every, steps, cfg.eval.every) if cfg.eval.every else ():
        evals.setdefault(min(s + pinned - 1, steps), []).append(s)
    if steps >= cfg.train.steps:
        evals.setdefault(steps, []).append(steps)  # the final evaluation: nothing left in flight
    for step in range(steps):
        add([next(src) for src in sources], train=True, step=step)
        for s in evals.get(step + 1, []):
            evaluate(held=step + 1 - s)
    traces = {table_name(f): [b.build() for b in builders[f]] for f in features}
    return Replay(
        traces=traces,
        features={table_name(f): f for f in features},
        train_batches=steps,
        world_size=world,
        row_wise=row_wise,
        pinned_batches=pinned,
        bounded_rows={table_name(f): b.rows for f, b in bounds.items()},
    )


def _add_merged(builder: TraceBuilder, parts: list[torch.Tensor], *, train: bool, held: int) -> None:
    """One owner's batch: the union of the senders' distinct ids, weighted by how many sent each."""
    if len(parts) == 1:
        ids = parts[0].numpy()
        builder.add(ids, np.ones(ids.shape[0], np.int64), train=train, held=held)
        return
    ids, counts = np.unique(torch.cat(parts).numpy(), return_counts=True)
    builder.add(ids, counts, train=train, held=held)
