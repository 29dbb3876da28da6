"""The ``rows`` exchange (``sparse.exchange = "rows"``): rows cross the wire instead of pooled outputs.

TorchRec's EmbeddingBagCollection sends every id of a rank's batch to the owner of its row and gets one
pooled vector per sample and table back: ``B x F x D`` values whatever the batch's ids are. With ``rows``
(:mod:`recsys.exchange_plan` says exactly what is sent) each rank sends each distinct id of its batch
once, gets each row once per window that uses it, pools its bags itself, and sends each distinct id's
gradient once per batch. The owner looks the rows up with its own FBGEMM table (the sharded collection's
table-batched module, bags of one row), and its fused optimizer applies the summed gradients once per
batch, as with ``pooled``. Tables, optimizer state, checkpoints and bundles are the collection's own, so
nothing else changes.

It is built on ``torch.distributed`` from the same KeyedJaggedTensor the collection receives, inside the
sharded collection's ``input_dist`` (the id exchange, run a batch ahead by TorchRec's pipeline) and
``compute_and_output_dist`` (lookup, row exchange, local pooling). TorchRec's EmbeddingCollection with
``use_index_dedup`` does not serve (``docs/design.md``): it deduplicates per batch only, returns one
vector per id occurrence to its caller instead of pooling, and would change the model's tables and
checkpoint keys.

Evaluation runs the collection unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import Awaitable, LazyAwaitable
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys.errors import UserError
from recsys.exchange_plan import (
    ID_BITS,
    ExchangeCounts,
    Ownership,
    RowRequests,
    plan_rows,
    pooled_counts,
    rows_counts,
)
from recsys.sparse import ExchangeKind

__all__ = ["ExchangeMeter", "RowsExchange", "install_exchange", "ownership_of"]

_LOW = (1 << ID_BITS) - 1


class _Ready(Awaitable[Any]):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> Any:
        return self._value


@dataclass
class _Incoming:
    """A batch's id exchange in flight: this rank's requests and what the other ranks ask of it."""

    features: KeyedJaggedTensor
    requests: RowRequests
    asked: torch.Tensor  # (world, F) requests each rank sends here, per feature
    received: torch.Tensor  # (sum(asked),) int64 ``local row | mask << ID_BITS``, rank-major
    work: Any  # the payload all-to-all, or None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


@dataclass(frozen=True)
class _LocalTable:
    """One feature's table shard on this rank: its FBGEMM module and columns in that module's output."""

    feature: int
    module: torch.nn.Module
    position: int  # the table's index among the module's features
    columns: tuple[int, int]


def ownership_of(
    ebc: ShardedEmbeddingBagCollection, plan: dict[str, Any], features: list[str], *, rows: bool
) -> Ownership:
    """The id-to-owner map of ``features`` from the module's sharding plan (``{table: ParameterSharding}``);
    ``rows``: refuse tables the rows exchange cannot pool."""
    by_feature = {cfg.feature_names[0]: cfg for cfg in ebc._embedding_bag_configs}
    starts, ranks, dims = [], [], []
    for f in features:
        cfg = by_feature[f]
        shards = sorted((s.shard_offsets[0], s.placement.rank()) for s in plan[cfg.name].sharding_spec.shards)
        starts.append([s for s, _ in shards])
        ranks.append([r for _, r in shards])
        dims.append(cfg.embedding_dim)
        if rows and cfg.pooling is not PoolingType.SUM:
            raise UserError(
                f"sparse.exchange=rows pools by sum only; table {cfg.name} pools by {cfg.pooling.name}"
            )
    return Ownership(features=list(features), starts=starts, ranks=ranks, dims=dims)


class ExchangeMeter:
    """What a run's training batches sent between ranks (:class:`~recsys.exchange_plan.ExchangeCounts`),
    counted by the exchange as each batch's ids are sent (TorchRec's pipeline sends them a batch ahead).

    ``window`` and ``over_run`` are collective: they add up every rank's counts.
    """

    _FIELDS = ("ids", "lengths", "rows", "grad_rows", "pooled")

    def __init__(self, kind: ExchangeKind, ownership: Ownership, tables: list[str]) -> None:
        self.kind = kind
        self.tables = tables
        self.dims = list(ownership.dims)
        self.total = torch.zeros((len(self._FIELDS), len(tables)), dtype=torch.int64)  # (fields, F)
        self.samples = 0
        self._since = (self.total.clone(), 0)

    def record(self, counts: ExchangeCounts, samples: int) -> None:
        self.total += torch.tensor([getattr(counts, name) for name in self._FIELDS], dtype=torch.int64)
        self.samples += samples

    def _report(self, counts: torch.Tensor, samples: int, *, tables: bool) -> dict[str, Any]:
        summed = torch.cat([counts.reshape(-1), torch.tensor([samples])])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(summed)
        counts, samples = summed[:-1].view_as(self.total), int(summed[-1])
        per_table = ExchangeCounts(*[c.tolist() for c in counts], dims=self.dims).bytes_per_feature()
        report: dict[str, Any] = {"kind": self.kind.value}
        report.update({name: int(counts[i].sum()) for i, name in enumerate(self._FIELDS)})
        report["bytes"] = sum(per_table)
        report["bytes_per_sample"] = sum(per_table) / samples if samples else 0.0
        if tables:
            report["tables"] = {
                t: {"bytes_per_sample": b / samples if samples else 0.0}
                for t, b in zip(self.tables, per_table, strict=True)
            }
        return report

    def window(self) -> dict[str, Any]:
        """Since the last window: counts and bytes per sample over every rank (collective)."""
        counts, samples = self.total - self._since[0], self.samples - self._since[1]
        self._since = (self.total.clone(), self.samples)
        return self._report(counts, samples, tables=False)

    def over_run(self) -> dict[str, Any]:
        """The whole run (this process's part of it), with bytes per sample per table (collective)."""
        return self._report(self.total, self.samples, tables=True)


class _RowsAllToAll(torch.autograd.Function):
    """Rows to their requesters, one all-to-all per window; their gradients back in one, per batch.

    ``rows`` (R, D): the rows this rank serves, in the order requested (requesting rank, then its send
    order). Forward returns one (R_w, D) tensor per window: the rows this rank asked for whose mask has
    bit ``w``, in its send order. Backward adds each window's gradient into its request and sends the sums.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, plan: _WindowPlan) -> tuple[torch.Tensor, ...]:  # noqa: ANN401
        ctx.plan = plan
        outs = []
        for w in range(plan.windows):
            send = rows.index_select(0, plan.serve[w])
            out = rows.new_empty((sum(plan.get_sizes[w]), rows.shape[1]))
            plan.works.append(plan.all_to_all(out, send, plan.get_sizes[w], plan.serve_sizes[w]))
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan: _WindowPlan = ctx.plan
        dim = grads[0].shape[1]
        summed = grads[0].new_zeros((plan.requested, dim))  # one gradient per distinct request
        for w, grad in enumerate(grads):
            summed.index_add_(0, plan.get[w], grad)
        if get_gradient_division() and plan.world_size > 1:
            # as TorchRec's pooled exchange does: the dense gradients are averaged over ranks, so the rows'
            # are too (each rank's loss is its own batch's mean)
            summed.div_(plan.world_size)
        out = summed.new_empty((plan.served, dim))
        work = plan.all_to_all(out, summed, plan.served_from, plan.asked_of)
        if work is not None:
            work.wait()
        return out, None


@dataclass
class _WindowPlan:
    """Indices and split sizes of one batch's row exchange (``serve``: rows this rank sends; ``get``:
    where the rows it receives sit among its own requests)."""

    windows: int
    serve: list[torch.Tensor]  # per window, (R_w,) indices into the served rows
    serve_sizes: list[list[int]]  # per window, rows sent to each rank
    get: list[torch.Tensor]  # per window, (Q_w,) indices into this rank's requests
    get_sizes: list[list[int]]  # per window, rows received from each rank
    requested: int  # this rank's requests
    asked_of: list[int]  # this rank's requests per owner
    served: int  # rows this rank serves
    served_from: list[int]  # rows this rank serves per requester
    group: Any
    world_size: int
    works: list[Any]

    def all_to_all(
        self, out: torch.Tensor, send: torch.Tensor, out_rows: list[int], send_rows: list[int]
    ) -> Any:
        if self.world_size == 1:
            out.copy_(send)
            return None
        return dist.all_to_all_single(
            out,
            send,
            output_split_sizes=out_rows,
            input_split_sizes=send_rows,
            group=self.group,
            async_op=True,
        )


class _WindowOutput(LazyAwaitable[KeyedTensor]):
    """One window's pooled embeddings: waits for its rows, then pools its bags locally."""

    def __init__(
        self, exchange: RowsExchange, incoming: _Incoming, plan: _WindowPlan, rows: torch.Tensor, w: int
    ) -> None:
        super().__init__()
        self._exchange, self._incoming, self._plan, self._rows, self._w = exchange, incoming, plan, rows, w

    def _wait_impl(self) -> KeyedTensor:
        work = self._plan.works[self._w]
        if work is not None:
            work.wait()
        return self._exchange.pool(self._incoming, self._rows, self._plan, self._w)


class RowsExchange:
    """The ``rows`` exchange of one sharded EmbeddingBagCollection (every feature exchanged as rows).

    Args:
        ebc: the sharded collection (its FBGEMM modules hold the rows and the fused optimizer).
        ownership: the id-to-owner map of every feature (:func:`ownership_of`).
        windows: frozen windows per training batch (1: one).
    """

    def __init__(
        self, ebc: ShardedEmbeddingBagCollection, ownership: Ownership, meter: ExchangeMeter, *, windows: int
    ) -> None:
        self.ebc = ebc
        self.meter = meter
        self.ownership = ownership
        self.windows = windows
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.group.WORLD if dist.is_initialized() else None
        dims = set(ownership.dims)
        if len(dims) != 1:
            raise UserError(
                f"sparse.exchange=rows needs one embedding dimension for every table, got {sorted(dims)}"
            )
        self.dim = dims.pop()
        self.local = self._local_tables()
        self._input_dist = ebc.input_dist
        self._compute_and_output_dist = ebc.compute_and_output_dist

    def _local_tables(self) -> list[_LocalTable]:
        index = {f: i for i, f in enumerate(self.ownership.features)}
        out = []
        for lookup in self.ebc._lookups:
            for module in getattr(lookup, "_emb_modules", []):
                column = 0
                for position, table in enumerate(module.config.embedding_tables):
                    width = table.local_cols
                    out.append(
                        _LocalTable(index[table.feature_names[0]], module, position, (column, column + width))
                    )
                    column += width
        return out

    def install(self) -> None:
        """Take over the collection's training exchange (instance attributes: TorchRec's pipelined forward
        and ``ShardedModule.forward`` both call them)."""
        self.ebc.input_dist = self.input_dist  # type: ignore[method-assign]
        self.ebc.compute_and_output_dist = self.compute_and_output_dist  # type: ignore[method-assign]

    # -- the id exchange ------------------------------------------------------------------------------
    def input_dist(self, ctx: Any, features: KeyedJaggedTensor) -> Any:
        if not self.ebc.training:
            return self._input_dist(ctx, features)
        if features.weights_or_none() is not None:
            raise UserError("sparse.exchange=rows does not take per-sample weights yet")
        if self.ebc._has_uninitialized_input_dist:  # evaluation's exchange is TorchRec's: set it up once
            self.ebc._create_input_dist(features.keys())
            self.ebc._has_uninitialized_input_dist = False
        batch = features.stride()
        requests = plan_rows(
            features.values(),
            features.lengths(),
            lengths_per_key=features.length_per_key(),
            batch=batch,
            windows=self.windows,
            ownership=self.ownership,
            world_size=self.world_size,
        )
        num_features = len(self.ownership.features)
        sent_per_feature = torch.bincount(
            requests.owner * num_features + requests.feature, minlength=self.world_size * num_features
        )
        asked = torch.empty_like(sent_per_feature)
        received: torch.Tensor
        work = None
        if self.world_size == 1:
            asked.copy_(sent_per_feature)
            received = requests.sent
        else:
            dist.all_to_all_single(asked, sent_per_feature, group=self.group)
            per_rank = asked.view(self.world_size, num_features).sum(dim=1).tolist()
            received = torch.empty(sum(per_rank), dtype=torch.int64)
            work = dist.all_to_all_single(
                received,
                requests.sent,
                output_split_sizes=per_rank,
                input_split_sizes=requests.per_owner,
                group=self.group,
                async_op=True,
            )
        incoming = _Incoming(features, requests, asked.view(self.world_size, num_features), received, work)
        counts = rows_counts(requests, rank=self.rank, num_features=num_features, dims=self.ownership.dims)
        counts.lengths = [
            self.world_size - 1
        ] * num_features  # the per-feature request counts each rank sends
        self.meter.record(counts, batch)
        return KJTListSplitsAwaitable([_Ready(_Ready(incoming))], ctx)

    # -- lookup, row exchange, pooling -------------------------------------------------------------------
    def compute_and_output_dist(self, ctx: Any, dist_input: Any) -> Any:
        incoming = dist_input[0] if isinstance(dist_input, KJTList | list) else dist_input
        if not isinstance(incoming, _Incoming):
            return self._compute_and_output_dist(ctx, dist_input)
        if list(incoming.features.keys()) != self.ownership.features:
            raise UserError(
                f"sparse.exchange=rows: batch features {incoming.features.keys()} are not the tables' {self.ownership.features}"
            )
        incoming.wait()
        served = self._lookup(incoming)  # (R, D)
        plan = self._plan(incoming)
        rows = _RowsAllToAll.apply(served, plan)
        outs = [_WindowOutput(self, incoming, plan, rows[w], w) for w in range(self.windows)]
        return outs if self.windows > 1 else outs[0]

    def _lookup(self, incoming: _Incoming) -> torch.Tensor:
        """(R, D) the rows asked of this rank, rank-major then feature then id (the received order)."""
        asked = incoming.asked  # (world, F)
        local_ids = incoming.received & _LOW
        starts = torch.cumsum(asked.reshape(-1), 0) - asked.reshape(-1)  # segment start of (rank, feature)
        by_module: dict[int, list[_LocalTable]] = {}
        for table in self.local:
            by_module.setdefault(id(table.module), []).append(table)
        pieces: dict[int, torch.Tensor] = {}  # feature -> (rows of every requester, D)
        for tables in by_module.values():
            module = tables[0].module
            ordered = sorted(tables, key=lambda t: t.position)
            counts = [int(asked[:, t.feature].sum()) for t in ordered]
            bags = max(counts)
            values, lengths = [], []
            for table, count in zip(ordered, counts, strict=True):
                for r in range(self.world_size):
                    start = int(starts[r * asked.shape[1] + table.feature])
                    values.append(local_ids[start : start + int(asked[r, table.feature])])
                lengths.append(torch.ones(count, dtype=torch.int64))
                lengths.append(torch.zeros(bags - count, dtype=torch.int64))
            kjt = KeyedJaggedTensor(
                keys=[str(t.position) for t in ordered],
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                stride=bags,
            )
            out = module(kjt)  # (bags, module columns): bags of one row are the rows themselves
            for table, count in zip(ordered, counts, strict=True):
                pieces[table.feature] = out[:count, table.columns[0] : table.columns[1]]
        parts = []
        for r in range(self.world_size):
            for f in range(asked.shape[1]):
                n = int(asked[r, f])
                if n:
                    before = int(asked[:r, f].sum())
                    parts.append(pieces[f][before : before + n])
        if not parts:  # asked nothing: still a node of the graph, so its backward joins the all-to-all
            return torch.zeros((0, self.dim), requires_grad=True)
        return torch.cat(parts)

    def _plan(self, incoming: _Incoming) -> _WindowPlan:
        requests = incoming.requests
        asked_per_rank = incoming.asked.sum(dim=1)
        served_mask = incoming.received >> ID_BITS
        serve, serve_sizes, get, get_sizes = [], [], [], []
        requester = torch.repeat_interleave(torch.arange(self.world_size), asked_per_rank)
        for w in range(self.windows):
            on = ((served_mask >> w) & 1).bool()
            serve.append(torch.nonzero(on).flatten())
            serve_sizes.append(torch.bincount(requester[on], minlength=self.world_size).tolist())
            mine = ((requests.mask >> w) & 1).bool()
            get.append(torch.nonzero(mine).flatten())
            get_sizes.append(torch.bincount(requests.owner[mine], minlength=self.world_size).tolist())
        return _WindowPlan(
            windows=self.windows,
            serve=serve,
            serve_sizes=serve_sizes,
            get=get,
            get_sizes=get_sizes,
            requested=int(requests.sent.numel()),
            asked_of=requests.per_owner,
            served=int(incoming.received.numel()),
            served_from=asked_per_rank.tolist(),
            group=self.group,
            world_size=self.world_size,
            works=[],
        )

    def pool(self, incoming: _Incoming, rows: torch.Tensor, plan: _WindowPlan, w: int) -> KeyedTensor:
        """Window ``w``'s pooled embeddings from its rows (R_w, D), as the collection pools them: sums."""
        kjt = incoming.features
        batch = kjt.stride()
        num_features = len(self.ownership.features)
        sizes = incoming.requests.windows
        start = sum(sizes[:w])
        size = sizes[w]
        lengths = kjt.lengths().view(num_features, batch)
        offsets = kjt.offsets()
        # where each request sits among window w's rows (-1: not in the window)
        position = torch.full((plan.requested,), -1, dtype=torch.int64)
        position[plan.get[w]] = torch.arange(plan.get[w].numel())
        first = offsets[torch.arange(num_features) * batch + start]
        last = offsets[torch.arange(num_features) * batch + start + size]
        spans = [torch.arange(int(a), int(b)) for a, b in zip(first.tolist(), last.tolist(), strict=True)]
        occurrences = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.int64)
        index = position[incoming.requests.occurrence[occurrences]]
        bag_lengths = lengths[:, start : start + size].reshape(-1)  # (F * b,)
        bag = torch.repeat_interleave(torch.arange(bag_lengths.numel()), bag_lengths)
        # Sums in occurrence order, and so are their gradients (index_select's backward is an index_add in
        # source order): the same bits whatever ids the rows carry (slots in a tiered run, ids without).
        # F.embedding_bag's backward sorts the indices without a stable order, so it is not used.
        pooled = rows.new_zeros((bag_lengths.numel(), self.dim)).index_add(
            0, bag, rows.index_select(0, index)
        )
        values = (
            pooled.view(num_features, size, self.dim).transpose(0, 1).reshape(size, num_features * self.dim)
        )
        return KeyedTensor(keys=list(kjt.keys()), length_per_key=[self.dim] * num_features, values=values)


def install_exchange(
    model: torch.nn.Module, plan: Any, *, kind: ExchangeKind, windows: int, features: list[str]
) -> ExchangeMeter:
    """Install the exchange ``kind`` on the DMP-wrapped ``model``'s sharded collection and return its
    meter (``plan``: the DMP's sharding plan). ``pooled`` keeps TorchRec's exchange and only counts it."""
    sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    if len(sharded) != 1:
        raise UserError(f"sparse.exchange needs one sharded EmbeddingBagCollection, found {len(sharded)}")
    ebc = sharded[0]
    names = {cfg.feature_names[0]: cfg.name for cfg in ebc._embedding_bag_configs}
    (module_plan,) = [p for p in plan.plan.values() if set(names.values()) <= set(p)]
    ownership = ownership_of(ebc, dict(module_plan), features, rows=kind is ExchangeKind.ROWS)
    meter = ExchangeMeter(kind, ownership, [names[f] for f in features])
    if kind is ExchangeKind.ROWS:
        RowsExchange(ebc, ownership, meter, windows=windows).install()
    else:
        _count_pooled(ebc, ownership, meter)
    return meter


def _count_pooled(ebc: ShardedEmbeddingBagCollection, ownership: Ownership, meter: ExchangeMeter) -> None:
    """Count what TorchRec's pooled exchange sends for each training batch, leaving it as it is."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    original = ebc.input_dist

    def input_dist(ctx: Any, features: KeyedJaggedTensor) -> Any:
        if ebc.training:
            counts = pooled_counts(
                features.values(),
                features.lengths(),
                lengths_per_key=features.length_per_key(),
                batch=features.stride(),
                ownership=ownership,
                rank=rank,
            )
            meter.record(counts, features.stride())
        return original(ctx, features)

    ebc.input_dist = input_dist  # type: ignore[method-assign]
