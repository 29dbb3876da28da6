"""``recsys plan-exchange``: what the ``pooled`` and ``rows`` exchanges would send per sample on 2, 8, 64 and
512 ranks, replayed from the config's training batches through the code that counts a run's, in one
process.

For each world size ``N``:

- the batches: rank ``r``'s batches of steps ``[0, steps)`` as a run of ``N`` ranks reads them
  (``train_batches(rank=r, world_size=N, batch_size=b * N)``), ids folded and, for ``rows_clustered``,
  reordered by :func:`~recsys.clustering.cluster_order` (:func:`recsys.build.fold_source`, as the trainer's
  feed). ``b = train.batch_size / train.nproc`` is the config's per-rank batch: it stays, and the global
  batch grows with ``N``;
- the owners: the run's sharding plan for ``N`` ranks (:func:`recsys.sharding.sharding_plan`, on the
  model with its tables on the meta device and no process group), read as a run reads it
  (:func:`recsys.exchange.ownership_of`);
- the counts: :func:`~recsys.exchange_plan.batch_counts`, as :mod:`recsys.exchange` counts a run's
  batches.

``N = 2`` replays both ranks: its counts are a 2-rank run's ``summary.json["exchange"]`` to the byte
(``tests/recsys/test_exchange_replay.py``). A larger ``N`` replays at most 8 ranks spread evenly
(:func:`replayed_ranks`) and reports their mean.

Tiered tables: a run sends slots, not ids, and which slot an id gets depends on the store's state. The
replay keeps the ids, re-keyed in each batch by their owner (:func:`recsys.routing.Ownership.owners`, the
rule the tiers route by) and their rank among the batch's distinct ids: what a batch sends depends only on
which of its ids are equal and who owns each, and within a batch distinct ids hold distinct slots in their
owner's block of the slot table, so the bytes are the same (checked against tiered runs, table-wise and
row-wise, by the same test). Bounded tables (``store.bounds``) remap ids to their default row by a rule
with state: they are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.build import fold_source, table_layout
from recsys.config import RunConfig
from recsys.data.batch import Batch
from recsys.data.source import Dataset, build_dataset
from recsys.errors import UserError
from recsys.exchange import ownership_of
from recsys.exchange_plan import (
    ID_BITS,
    MAX_ROWS_WINDOWS,
    ExchangeCounts,
    Ownership,
    batch_counts,
)
from recsys.models import TrainModel, build_model, table_configs
from recsys.routing import Ownership as TierOwnership
from recsys.sharding import ebc_path, embedding_sharder, sharding_plan
from recsys.sparse import ShardingKind
from recsys.table_names import table_name

__all__ = [
    "EXCHANGES",
    "WORLD_SIZES",
    "ReplaySetup",
    "WorldOwnership",
    "WorldReplay",
    "plan_exchange",
    "replay_world",
    "replayed_ranks",
    "world_ownership",
]

WORLD_SIZES = (2, 8, 64, 512)
MAX_RANKS = 8  # ranks replayed per world size at most
EXCHANGES = ("pooled", "rows", "rows_clustered")
_FIELDS = ("ids", "lengths", "rows", "grad_rows", "pooled")


def replayed_ranks(world_size: int, most: int = MAX_RANKS) -> list[int]:
    """Every rank of a world of at most ``most``; else ``most`` ranks spread evenly, from rank 0."""
    if world_size <= most:
        return list(range(world_size))
    return [k * world_size // most for k in range(most)]


@dataclass(frozen=True)
class ReplaySetup:
    """What the replay takes from the config, the same at every world size.

    Attributes:
        config: the run's config.
        data: its dataset.
        tiered: the features whose tables are tiered.
        device_rows: per tiered feature, its slots per owning rank.
        fold: per feature, the modulus its ids are folded by (0: not folded), as a run's.
        batch: samples per rank and step (``train.batch_size / train.nproc``).
        windows: ``pipeline.frozen_windows``.
        device_type: the device the tables are planned for (a run's on this machine: ``cuda`` or ``cpu``).
    """

    config: RunConfig
    data: Dataset
    tiered: list[str]
    device_rows: dict[str, int]
    fold: list[int]
    batch: int
    windows: int
    device_type: str

    @classmethod
    def from_config(cls, config: RunConfig, *, device_type: str | None = None) -> ReplaySetup:
        """The setup of ``config`` (the sizes and folds of :func:`recsys.build.build_parts`).

        Raises:
            UserError: the config cannot run the rows exchange, or bounds its tables.
        """
        from recsys.distributed import compute_device

        cfg = config
        data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
        features = data.feature_names
        try:
            bounded = cfg.store.bounds_rules(features)
        except ValueError as err:
            raise UserError(f"store.{err}") from None
        if bounded:
            raise UserError(
                "recsys plan-exchange does not replay bounded tables (store.bounds): they remap ids to "
                "their default row by a rule with state"
            )
        layout = table_layout(cfg, features, data.id_spaces, world_size=cfg.train.nproc)
        batch, windows = cfg.train.batch_size // cfg.train.nproc, cfg.pipeline.frozen_windows
        if windows > batch:
            raise UserError(
                f"pipeline.frozen_windows={windows} is more than the {batch} samples of a rank's batch"
            )
        if windows > MAX_ROWS_WINDOWS:
            raise UserError(
                f"pipeline.frozen_windows={windows}: the rows exchange takes 1 to {MAX_ROWS_WINDOWS} windows"
            )
        return cls(
            config=cfg,
            data=data,
            tiered=layout.tiered,
            device_rows=dict(layout.capacities.device_rows),
            fold=layout.fold,
            batch=batch,
            windows=windows,
            device_type=device_type or compute_device(0).type,
        )

    @property
    def features(self) -> list[str]:
        return list(self.data.feature_names)

    def tables(self, world_size: int) -> list[EmbeddingBagConfig]:
        """The table configs a run of ``world_size`` ranks builds (a tiered table: its slots per owner x
        owners; in memory: its id space, at most ``sparse.max_rows_per_table`` rows)."""
        cfg = self.config
        num_embeddings = table_layout(
            cfg, self.features, self.data.id_spaces, world_size=world_size
        ).num_embeddings
        return table_configs(
            self.features, dim=cfg.model.table_dim, num_embeddings=num_embeddings, fp16=cfg.sparse.fp16_tables
        )


@dataclass(frozen=True)
class WorldOwnership:
    """Who owns what on ``world_size`` ranks, as the exchange reads it.

    Attributes:
        world_size: ranks of the run.
        ownership: the id-to-owner map of every feature; a tiered feature's shards re-keyed ``stride``
            apart (its ids are re-keyed per batch: :meth:`keyed_values`).
        tiers: the rule that gives a tiered id its owner.
        shard_of: per tiered feature index, its table name and the (world_size,) index of each rank's
            shard of its table (-1: none).
        stride: the key distance between the shards of a tiered feature.
    """

    world_size: int
    ownership: Ownership
    tiers: TierOwnership
    shard_of: dict[int, tuple[str, torch.Tensor]]
    stride: int

    def keyed_values(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """(N,) the KJT's values with each tiered feature's ids re-keyed ``shard * stride + k``, ``k`` the
        id's rank among the feature's distinct ids in the batch: equal ids stay equal, distinct ones
        distinct, each in its owner's shard."""
        if not self.shard_of:
            return sparse.values()
        parts = list(torch.split(sparse.values(), sparse.length_per_key()))
        for f, (name, shard_of_rank) in self.shard_of.items():
            ids = parts[f].to(torch.int64)
            distinct, inverse = torch.unique(ids, return_inverse=True)  # (U,), (n_f,)
            assert distinct.numel() <= self.stride, f"{distinct.numel()} distinct ids of {name} in a batch"
            shard = shard_of_rank[self.tiers.owners(name, ids)]  # (n_f,)
            assert bool((shard >= 0).all()), f"an id of {name} is owned by a rank without a shard of it"
            parts[f] = shard * self.stride + inverse
        return torch.cat(parts)


def world_ownership(setup: ReplaySetup, world_size: int) -> WorldOwnership:
    """The ownership of a run of ``setup``'s config on ``world_size`` ranks, planned without a process group."""
    cfg = setup.config
    tables = setup.tables(world_size)
    meta = torch.device("meta")
    model = TrainModel(
        build_model(cfg.model, tables, num_dense=setup.data.num_dense, device=meta), windows=setup.windows
    )
    plan = sharding_plan(
        model,
        tables,
        sparse=cfg.sparse,
        sharder=embedding_sharder(cfg.sparse),
        world_size=world_size,
        device_type=setup.device_type,
    )
    path = ebc_path(model)
    ebc = model.get_submodule(path)
    ownership = ownership_of(ebc.embedding_bag_configs(), dict(plan.plan[path]), setup.features)
    row_wise = cfg.sparse.sharding is ShardingKind.ROW_WISE
    stride = (1 << ID_BITS) // world_size
    starts, shard_of, table_owner = list(ownership.starts), {}, {}
    for f, feature in enumerate(setup.features):
        if feature not in setup.tiered:
            continue
        ranks = ownership.ranks[f]
        starts[f] = [k * stride for k in range(len(ranks))]
        shard_of_rank = torch.full((world_size,), -1, dtype=torch.int64)
        shard_of_rank[torch.tensor(ranks)] = torch.arange(len(ranks))
        shard_of[f] = (table_name(feature), shard_of_rank)
        table_owner[table_name(feature)] = ranks[-1]  # table-wise: its one rank (row-wise tiers hash ids)
    return WorldOwnership(
        world_size=world_size,
        ownership=replace(ownership, starts=starts),
        tiers=TierOwnership(world_size=world_size, row_wise=row_wise, table_owner=table_owner),
        shard_of=shard_of,
        stride=stride,
    )


@dataclass
class WorldReplay:
    """What the replayed ranks of one world size sent, per exchange (:data:`EXCHANGES`).

    Attributes:
        world_size: ranks of the run.
        ranks: the ranks replayed.
        samples: their training samples, all together.
        counts: per exchange, their counts summed, per feature.
        tables: the features' table names.
    """

    world_size: int
    ranks: list[int]
    samples: int
    counts: dict[str, ExchangeCounts]
    tables: list[str]

    def bytes(self, exchange: str) -> int:
        return self.counts[exchange].total_bytes()

    def bytes_per_sample(self, exchange: str) -> float:
        return self.bytes(exchange) / self.samples if self.samples else 0.0

    def summary(self, exchange: str) -> dict[str, Any]:
        """The exchange's counts with the keys of a run's ``summary.json["exchange"]``."""
        counts = self.counts[exchange]
        out: dict[str, Any] = {name: sum(getattr(counts, name)) for name in _FIELDS}
        out["header"] = counts.header
        out["bytes"] = self.bytes(exchange)
        out["bytes_per_sample"] = self.bytes_per_sample(exchange)
        per_table = counts.bytes_per_feature()
        out["tables"] = {
            t: {
                "kind": "pooled" if exchange == "pooled" else "rows",
                "bytes_per_sample": b / self.samples if self.samples else 0.0,
            }
            for t, b in zip(self.tables, per_table, strict=True)
        }
        return out


def _batch_counts(
    batch: Batch, owners: WorldOwnership, *, rank: int, windows: int
) -> tuple[ExchangeCounts, ExchangeCounts]:
    """(pooled, rows) counts of one rank's batch, as :mod:`recsys.exchange` records them."""
    sparse = batch.sparse
    values, lengths = owners.keyed_values(sparse), sparse.lengths()
    per_key, size, num_features = sparse.length_per_key(), sparse.stride(), len(sparse.keys())
    args = {
        "lengths_per_key": per_key,
        "batch": size,
        "windows": windows,
        "ownership": owners.ownership,
        "rank": rank,
        "world_size": owners.world_size,
    }
    pooled, _ = batch_counts(values, lengths, rows=torch.zeros(num_features, dtype=torch.bool), **args)
    rows, _ = batch_counts(values, lengths, rows=torch.ones(num_features, dtype=torch.bool), **args)
    return pooled, rows


def _rank_batches(
    setup: ReplaySetup, world_size: int, rank: int, steps: int
) -> Iterator[tuple[Batch, Batch]]:
    """(arrival order, clustered) of rank ``rank``'s batches of steps [0, steps) on ``world_size`` ranks."""
    batches = setup.data.train_batches(
        rank=rank, world_size=world_size, batch_size=setup.batch * world_size, start_step=0
    )
    arrival, clustered = itertools.tee(batches)
    span = (0, steps)
    yield from (
        (a, c)
        for (_, a), (_, c) in zip(
            fold_source(arrival, setup.fold, span),
            fold_source(clustered, setup.fold, span, cluster_windows=setup.windows),
            strict=True,
        )
    )


def replay_world(
    setup: ReplaySetup, world_size: int, *, steps: int, tick: Callable[[], None] = lambda: None
) -> WorldReplay:
    """Replay ``steps`` batches of each of :func:`replayed_ranks` on ``world_size`` ranks (``tick`` after each)."""
    owners = world_ownership(setup, world_size)
    dims = owners.ownership.dims
    counts = {
        name: ExchangeCounts(**{field: [0] * len(dims) for field in _FIELDS}, dims=list(dims))
        for name in EXCHANGES
    }
    ranks, samples = replayed_ranks(world_size), 0
    for rank in ranks:
        for arrival, clustered in _rank_batches(setup, world_size, rank, steps):
            pooled, rows = _batch_counts(arrival, owners, rank=rank, windows=setup.windows)
            counts["pooled"].add(pooled)
            counts["rows"].add(rows)
            if setup.windows > 1:
                _, rows = _batch_counts(clustered, owners, rank=rank, windows=setup.windows)
            counts["rows_clustered"].add(rows)
            samples += arrival.batch_size
            tick()
    tables = [table_name(f) for f in setup.features]
    return WorldReplay(world_size=world_size, ranks=ranks, samples=samples, counts=counts, tables=tables)


def plan_exchange(
    setup: ReplaySetup, *, steps: int, world_sizes: tuple[int, ...] = WORLD_SIZES, progress: bool = True
) -> list[WorldReplay]:
    """Replay ``steps`` training batches at each world size; a tqdm bar on stderr when ``progress``.

    Example::

        setup = ReplaySetup.from_config(load_config("configs/requests.toml"))
        for world in plan_exchange(setup, steps=20):
            print(world.world_size, world.bytes_per_sample("rows") / world.bytes_per_sample("pooled"))
    """
    from tqdm import tqdm

    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    total = sum(len(replayed_ranks(n)) for n in world_sizes) * steps
    threads = torch.get_num_threads()
    # A batch's tensors are small (tens of thousands of ids): on 2 shared cores one thread replayed a
    # batch in 0.02 s, two threads in 0.2 s (they wait for each other's core).
    torch.set_num_threads(1)
    try:
        with tqdm(
            total=total, desc="plan-exchange", unit="batch", disable=not progress, mininterval=1.0
        ) as bar:
            return [replay_world(setup, n, steps=steps, tick=lambda: bar.update(1)) for n in world_sizes]
    finally:
        torch.set_num_threads(threads)


def report_lines(setup: ReplaySetup, results: list[WorldReplay], *, steps: int) -> list[str]:
    """The printed report: what was replayed, a table of bytes per sample (world size x exchange, with the
    ratio to ``pooled``), notes, and last one JSON object ``{"world_N": {exchange: bytes per sample}}``."""
    cfg = setup.config
    cluster = "cluster_order" if setup.windows > 1 else "one window: the same as rows"
    lines = [
        f"replayed {steps} training steps of {setup.batch:,} samples per rank (train.batch_size / train.nproc, "
        "kept at every world size: the global batch is that times the world size), "
        f"{setup.windows} frozen window{'s' if setup.windows > 1 else ''}, {cfg.sparse.sharding.value} "
        f"tables as TorchRec plans them for {setup.device_type}",
        f"rows: windows in arrival order; rows_clustered: {cluster}; bytes per sample between different ranks",
        "",
        f"{'world':>5}  {'ranks replayed':<24}" + "".join(f"  {name:>22}" for name in EXCHANGES),
    ]
    for world in results:
        if len(world.ranks) == world.world_size:
            replayed = f"all {world.world_size}"
        else:
            replayed = f"{len(world.ranks)} (every {world.ranks[1]}th), mean"
        pooled = world.bytes_per_sample("pooled")
        cells = []
        for name in EXCHANGES:
            value = world.bytes_per_sample(name)
            ratio = f" ({value / pooled:.3f}x)" if pooled and name != "pooled" else ""
            cells.append(f"  {f'{value:,.1f}{ratio}':>22}")
        lines.append(f"{world.world_size:>5}  {replayed:<24}" + "".join(cells))
    lines.append("")
    if setup.tiered:
        lines.append(
            f"tiered tables ({', '.join(setup.tiered)}): counted with their ids in place of the slots a run "
            "sends: the same owners and the same equal ids per batch and window, so the same bytes"
        )
    lines.append(json_line(results))
    return lines


def json_line(results: list[WorldReplay]) -> str:
    """``{"world_N": {"pooled": ..., "rows": ..., "rows_clustered": ...}, ...}``: bytes per sample."""
    import json

    return json.dumps(
        {f"world_{w.world_size}": {name: w.bytes_per_sample(name) for name in EXCHANGES} for w in results}
    )
