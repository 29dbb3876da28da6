"""What crosses the wire between ranks in training: ``sparse.exchange`` per table, and its byte counters.

``pooled`` keeps TorchRec's EmbeddingBagCollection exchange: every id to the owner of its row, one pooled
vector per sample and table back, ``B x F x D`` values whatever the batch's ids are. ``rows`` sends each
distinct id of a rank's batch once, gets each row once per frozen window that uses it, pools locally and
returns each distinct id's gradient once per batch (:mod:`recsys.exchange_rows`; what is sent:
:mod:`recsys.exchange_plan`). ``auto`` picks, per table, the one that sends fewer bytes over the first
batches of the run (:func:`choose_exchange`). When some table goes as rows, the rows exchange carries the
pooled tables too, over the collection's own FBGEMM modules; tables, optimizer state, checkpoints and
bundles are the collection's in every case.

TorchRec's EmbeddingCollection with ``use_index_dedup`` does not serve (``docs/design.md``): it
deduplicates per batch, not per window, hands one vector per id occurrence back instead of pooling, and
would replace the model's EmbeddingBagCollection and its checkpoint keys. Evaluation runs the collection
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.errors import UserError
from recsys.exchange_plan import ExchangeCounts, Ownership, batch_counts
from recsys.exchange_rows import RowsExchange
from recsys.routing import owner_of_ids
from recsys.sparse import ExchangeKind

__all__ = ["ExchangeMeter", "SparseExchange", "choose_exchange", "ownership_of", "sharded_collection"]

AUTO_TRACE_BATCHES = 16  # training batches ``auto`` replays to choose each table's exchange


def ownership_of(configs: list[EmbeddingBagConfig], plan: dict[str, Any], features: list[str]) -> Ownership:
    """The id-to-owner map of ``features`` (tables ``configs``) from a module's sharding plan
    (``{table: ParameterSharding}``)."""
    by_feature = {cfg.feature_names[0]: cfg for cfg in configs}
    starts, ranks, dims = [], [], []
    for f in features:
        cfg = by_feature[f]
        shards = sorted((s.shard_offsets[0], s.placement.rank()) for s in plan[cfg.name].sharding_spec.shards)
        starts.append([s for s, _ in shards])
        ranks.append([r for _, r in shards])
        dims.append(cfg.embedding_dim)
    return Ownership(features=list(features), starts=starts, ranks=ranks, dims=dims)


class ExchangeMeter:
    """What a run's training batches sent between ranks (:class:`~recsys.exchange_plan.ExchangeCounts`),
    counted as each batch's ids are sent (TorchRec's pipeline sends them a batch ahead).

    ``window`` and ``over_run`` are collective: they add up every rank's counts.
    """

    _FIELDS = ("ids", "lengths", "rows", "grad_rows", "pooled")

    def __init__(self, kinds: list[ExchangeKind], dims: list[int], tables: list[str]) -> None:
        self.kinds, self.dims, self.tables = kinds, dims, tables
        self.total = torch.zeros((len(self._FIELDS), len(tables)), dtype=torch.int64)  # (fields, F)
        self.header = self.samples = 0
        self.auto: dict[str, dict[str, float]] | None = None  # bytes per sample each exchange would send
        self._since = (self.total.clone(), 0, 0)

    def record(self, counts: ExchangeCounts, samples: int) -> None:
        self.total += torch.tensor([getattr(counts, name) for name in self._FIELDS], dtype=torch.int64)
        self.header += counts.header
        self.samples += samples

    @property
    def kind(self) -> str:
        """``pooled``, ``rows``, or ``mixed`` when tables differ."""
        kinds = {k.value for k in self.kinds}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def _report(self, counts: torch.Tensor, header: int, samples: int, *, tables: bool) -> dict[str, Any]:
        summed = torch.cat([counts.reshape(-1), torch.tensor([header, samples])])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(summed)
        counts, header, samples = summed[:-2].view_as(self.total), int(summed[-2]), int(summed[-1])
        total = ExchangeCounts(*[c.tolist() for c in counts], dims=self.dims, header=header)
        per_table = total.bytes_per_feature()
        report: dict[str, Any] = {"kind": self.kind}
        report.update({name: int(counts[i].sum()) for i, name in enumerate(self._FIELDS)})
        report.update(header=header, bytes=total.total_bytes())
        report["bytes_per_sample"] = total.total_bytes() / samples if samples else 0.0
        if tables:
            report["tables"] = {
                t: {"kind": k.value, "bytes_per_sample": b / samples if samples else 0.0}
                for t, k, b in zip(self.tables, self.kinds, per_table, strict=True)
            }
            if self.auto is not None:
                report["auto"] = self.auto
        return report

    def window(self) -> dict[str, Any]:
        """Since the last window: counts and bytes per sample over every rank (collective)."""
        counts, header, samples = (
            self.total - self._since[0],
            self.header - self._since[1],
            self.samples - self._since[2],
        )
        self._since = (self.total.clone(), self.header, self.samples)
        return self._report(counts, header, samples, tables=False)

    def over_run(self) -> dict[str, Any]:
        """The whole run (this process's part of it), with each table's exchange and bytes per sample
        (collective)."""
        return self._report(self.total, self.header, self.samples, tables=True)


def sharded_collection(model: torch.nn.Module) -> ShardedEmbeddingBagCollection:
    """The DMP-wrapped ``model``'s one sharded EmbeddingBagCollection."""
    sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    if len(sharded) != 1:
        raise UserError(f"sparse.exchange needs one sharded EmbeddingBagCollection, found {len(sharded)}")
    return sharded[0]


class SparseExchange:
    """The training exchange of a DMP-wrapped model's sharded collection, table by table.

    Args:
        model: the DMP-wrapped model.
        plan: its sharding plan (``dmp.plan``).
        features: the batch's features, in key order.
        windows: frozen windows per training batch.
    """

    def __init__(self, model: torch.nn.Module, plan: Any, features: list[str], *, windows: int) -> None:
        self.ebc = sharded_collection(model)
        self.configs = {cfg.feature_names[0]: cfg for cfg in self.ebc._embedding_bag_configs}
        (module_plan,) = [p for p in plan.plan.values() if {c.name for c in self.configs.values()} <= set(p)]
        self.ownership = ownership_of(self.ebc._embedding_bag_configs, dict(module_plan), features)
        self.features, self.windows = list(features), windows
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def counts(self, batch: KeyedJaggedTensor, rows: torch.Tensor) -> ExchangeCounts:
        """What ``batch`` (this rank's) sends between ranks with the features ``rows`` (F,) as rows."""
        counts, _ = batch_counts(
            batch.values(),
            batch.lengths(),
            lengths_per_key=batch.length_per_key(),
            batch=batch.stride(),
            windows=self.windows,
            ownership=self.ownership,
            rank=self.rank,
            world_size=self.world_size,
            rows=rows,
        )
        return counts

    def slotted(self, kjt: KeyedJaggedTensor, tiered: list[bool]) -> KeyedJaggedTensor:
        """``kjt`` with each tiered feature's ids replaced as the tiers would: by one slot per distinct id
        on the rank that owns the id (``recsys.routing``'s rule), so that it sends what training sends."""
        if not any(tiered):
            return kjt
        values = list(torch.split(kjt.values(), kjt.length_per_key()))
        for f, is_tiered in enumerate(tiered):
            if not is_tiered or not values[f].numel():
                continue
            distinct, inverse = torch.unique(values[f], return_inverse=True)
            starts, ranks = self.ownership.starts[f], self.ownership.ranks[f]
            if len(ranks) > 1:
                owner = owner_of_ids(distinct, self.world_size)
            else:
                owner = torch.full_like(distinct, ranks[0])
            order = torch.sort(owner, stable=True).indices
            index_in_owner = torch.empty_like(order)
            counts = torch.bincount(owner, minlength=self.world_size)
            index_in_owner[order] = torch.arange(order.numel()) - torch.repeat_interleave(
                torch.cumsum(counts, 0) - counts, counts
            )
            start_of = torch.zeros(self.world_size, dtype=torch.int64)
            start_of[torch.tensor(ranks)] = torch.tensor(starts)
            values[f] = (start_of[owner] + index_in_owner)[inverse]
        return KeyedJaggedTensor(
            keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths(), stride=kjt.stride()
        )

    def install(self, kinds: list[ExchangeKind]) -> ExchangeMeter:
        """Install ``kinds`` (one per feature, ``pooled`` or ``rows``) and return the meter counting them."""
        meter = ExchangeMeter(kinds, self.ownership.dims, [self.configs[f].name for f in self.features])
        rows = torch.tensor([k is ExchangeKind.ROWS for k in kinds])
        for f, k in zip(self.features, kinds, strict=True):
            if k is ExchangeKind.ROWS and self.configs[f].pooling is not PoolingType.SUM:
                raise UserError(
                    f"sparse.exchange=rows pools by sum only; table {self.configs[f].name} pools by {self.configs[f].pooling.name}"
                )
        if bool(rows.any()):
            RowsExchange(self.ebc, self.ownership, rows, meter.record, windows=self.windows).install()
        else:
            _count_pooled(self, meter)
        return meter


def choose_exchange(
    exchange: SparseExchange, batches: Iterable[KeyedJaggedTensor]
) -> tuple[list[ExchangeKind], dict[str, dict[str, float]]]:
    """``auto``: per table, the exchange that sends fewer bytes between ranks over ``batches`` (this rank's
    first training batches, as training will see them), summed over every rank (collective), and each
    table's bytes per sample under both. A tie goes to ``pooled``; the rows exchange's header (a few
    int64 per rank and batch) belongs to no table and is left out of the choice."""
    num = len(exchange.features)
    totals = torch.zeros((2, num), dtype=torch.float64)
    samples = 0
    for kjt in batches:
        for row, rows in enumerate((torch.zeros(num, dtype=torch.bool), torch.ones(num, dtype=torch.bool))):
            totals[row] += torch.tensor(exchange.counts(kjt, rows).bytes_per_feature(), dtype=torch.float64)
        samples += kjt.stride()
    summed = torch.cat([totals.reshape(-1), torch.tensor([float(samples)], dtype=torch.float64)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed)
    totals, samples = summed[:-1].view(2, num) / max(summed[-1].item(), 1.0), 0
    kinds = [
        ExchangeKind.ROWS if rows < pooled else ExchangeKind.POOLED for pooled, rows in totals.T.tolist()
    ]
    detail = {
        exchange.configs[f].name: {"pooled": pooled, "rows": rows}
        for f, (pooled, rows) in zip(exchange.features, totals.T.tolist(), strict=True)
    }
    return kinds, detail


def _count_pooled(exchange: SparseExchange, meter: ExchangeMeter) -> None:
    """Count what TorchRec's pooled exchange sends for each training batch, leaving it as it is."""
    ebc, original = exchange.ebc, exchange.ebc.input_dist
    none = torch.zeros(len(exchange.features), dtype=torch.bool)

    def input_dist(ctx: Any, features: KeyedJaggedTensor) -> Any:
        if ebc.training:
            meter.record(exchange.counts(features, none), features.stride())
        return original(ctx, features)

    ebc.input_dist = input_dist  # type: ignore[method-assign]
