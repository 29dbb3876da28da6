"""The rows exchange on ``torch.distributed``: the training exchange of a sharded EmbeddingBagCollection
when some of its tables go as rows (``recsys.exchange``; what is sent: ``recsys.exchange_plan``).

One batch, seen from a rank (``B`` samples, ``W`` windows, ``D`` the embedding dimension):

- ``input_dist`` (a batch ahead under TorchRec's pipeline): one all-to-all of a header per rank (a count
  per feature, and ``B``), then one of the payload: per owner, the distinct ids of its rows tables (each
  with its window mask), then for each pooled table it holds a shard of, the ``B`` bag lengths and the
  ids it owns;
- ``compute_and_output_dist``: the owner runs each FBGEMM module of its shards once over every rank's
  requests (a rows request is a bag of one row), then for each window sends every requester the rows
  whose mask has the window's bit and the pooled vectors of the window's samples (one all-to-all per
  window, asynchronous); the requester pools each window's rows bags itself and adds the owners' pooled
  parts (row-wise: one partial sum per shard, added in rank order);
- backward: the requester adds each request's gradients over all windows (a row used by three windows
  gets one sum) and sends them in one all-to-all; the owner's FBGEMM module applies the fused optimizer
  once, as with TorchRec's exchange. The gradients are divided by the world size where TorchRec divides
  its own (``get_gradient_division``).

Sums run in occurrence order (``index_add``), so a tiered run, whose ids are slots, adds the same numbers
in the same order as an in-memory one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.errors import UserError
from recsys.exchange_kernels import lookup_layout
from recsys.exchange_plan import ID_BITS, Ownership, RowRequests, batch_counts, value_features
from recsys.exchange_windows import by_sample, rows_pooling, rows_window_plan, window_pooler
from recsys.exchange_wire import Ready, VectorsAllToAll, WindowOutput, WindowPlan
from recsys.windows import window_sizes

__all__ = ["RowsExchange"]

_LOW = (1 << ID_BITS) - 1


@dataclass
class _Incoming:
    """A batch's id exchange in flight: this rank's requests and what the other ranks ask of it."""

    features: KeyedJaggedTensor
    requests: RowRequests
    asked: torch.Tensor  # (world, F + 1) what each rank sends here: a count per feature, and its batch size
    received: torch.Tensor  # (sum,) int64 payloads, rank-major
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


class RowsExchange:
    """The training exchange of a sharded EmbeddingBagCollection, tables ``rows`` as rows, others pooled.

    Args:
        ebc: the sharded collection (its FBGEMM modules hold the rows and the fused optimizer).
        ownership: the id-to-owner map of every feature, in the batch's key order.
        rows: (F,) bool, the features exchanged as rows (at least one).
        record: called with each batch's counts and samples (:class:`~recsys.exchange.ExchangeMeter`).
        windows: frozen windows per training batch (1: one).
    """

    def __init__(
        self,
        ebc: ShardedEmbeddingBagCollection,
        ownership: Ownership,
        rows: torch.Tensor,
        record: Any,
        *,
        windows: int,
    ) -> None:
        self.ebc, self.ownership, self.rows, self.record, self.windows = ebc, ownership, rows, record, windows
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
        num_features = len(ownership.features)
        # per rank, the pooled features it holds a shard of, in feature order
        self.pooled_of = [
            [f for f in range(num_features) if not rows[f] and r in ownership.ranks[f]]
            for r in range(self.world_size)
        ]
        self.any_pooled = not bool(rows.all())
        grouped: dict[int, list[_LocalTable]] = {}
        for t in self.local:
            grouped.setdefault(id(t.module), []).append(t)
        self._modules = [
            (ts[0].module, sorted(ts, key=lambda t: t.position)) for ts in grouped.values()
        ]  # each FBGEMM module with its tables in the module's order
        module_of = np.full(num_features, -1, dtype=np.int64)
        position_of = np.zeros(num_features, dtype=np.int64)
        for m, (_, tables) in enumerate(self._modules):
            for k, t in enumerate(tables):
                module_of[t.feature], position_of[t.feature] = m, k
        self._layout = (
            module_of,
            position_of,
            np.array([len(ts) for _, ts in self._modules], dtype=np.int64),
        )
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
        and ``ShardedModule.forward`` both call them); evaluation keeps TorchRec's."""
        self.ebc.input_dist = self.input_dist  # type: ignore[method-assign]
        self.ebc.compute_and_output_dist = self.compute_and_output_dist  # type: ignore[method-assign]

    # -- the id exchange ------------------------------------------------------------------------------
    def input_dist(self, ctx: Any, features: KeyedJaggedTensor) -> Any:
        if not self.ebc.training:
            return self._input_dist(ctx, features)
        if features.weights_or_none() is not None:
            raise UserError("sparse.exchange=rows does not take per-sample weights")
        if list(features.keys()) != self.ownership.features:
            raise UserError(
                f"sparse.exchange=rows: batch features {features.keys()} are not the tables' "
                f"{self.ownership.features}"
            )
        if self.ebc._has_uninitialized_input_dist:  # evaluation's exchange is TorchRec's: set it up once
            self.ebc._create_input_dist(features.keys())
            self.ebc._has_uninitialized_input_dist = False
        batch, num_features, world = features.stride(), len(self.ownership.features), self.world_size
        values, lengths, per_key = features.values(), features.lengths(), features.length_per_key()
        counts, requests = batch_counts(
            values,
            lengths,
            lengths_per_key=per_key,
            batch=batch,
            windows=self.windows,
            ownership=self.ownership,
            rank=self.rank,
            world_size=world,
            rows=self.rows,
        )
        assert requests is not None
        self.record(counts, batch)
        header = torch.zeros((world, num_features + 1), dtype=torch.int64)
        header[:, :num_features] = requests.asked
        header[:, num_features] = batch
        if self.any_pooled:
            payload, sizes = self._with_pooled(features, requests, header)
        else:
            payload, sizes = requests.sent, requests.per_owner
        asked = torch.empty_like(header)
        work = None
        if world == 1:
            asked.copy_(header)
            received = payload
        else:
            dist.all_to_all_single(asked, header, group=self.group)
            held = len(self.pooled_of[self.rank])  # pooled tables here: B lengths from each rank for each
            per_rank = [
                int(asked[r, :num_features].sum()) + held * int(asked[r, num_features]) for r in range(world)
            ]
            received = torch.empty(sum(per_rank), dtype=torch.int64)
            work = dist.all_to_all_single(
                received,
                payload,
                output_split_sizes=per_rank,
                input_split_sizes=sizes,
                group=self.group,
                async_op=True,
            )
        incoming = _Incoming(features, requests, asked, received, work)
        return KJTListSplitsAwaitable([Ready(Ready(incoming))], ctx)

    def _with_pooled(
        self, features: KeyedJaggedTensor, requests: RowRequests, header: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """The payload per owner (rows requests, then for each pooled table it holds the batch's bag lengths
        and ids) and its sizes; ``header`` gains the pooled ids."""
        batch, num_features, world = features.stride(), len(self.ownership.features), self.world_size
        values, lengths, per_key = features.values(), features.lengths(), features.length_per_key()
        feature = value_features(per_key)
        pooled = ~self.rows[feature]
        owner, local = self.ownership.locate((feature << ID_BITS) | values)
        sample = torch.repeat_interleave(torch.arange(num_features * batch), lengths) % batch
        slot = (owner * num_features + feature) * batch + sample
        bag_lengths = torch.bincount(slot[pooled], minlength=world * num_features * batch).view(
            world, num_features, batch
        )
        order = torch.sort(owner[pooled], stable=True).indices
        pooled_local = local[pooled][order]
        pooled_per_owner = torch.bincount(owner[pooled], minlength=world).tolist()
        header[:, :num_features] += torch.bincount(
            owner[pooled] * num_features + feature[pooled], minlength=world * num_features
        ).view(world, num_features)
        parts, sizes, rows_start, pooled_start = [], [], 0, 0
        for o in range(world):
            rows_n, pooled_n, held = requests.per_owner[o], pooled_per_owner[o], self.pooled_of[o]
            parts += [
                requests.sent[rows_start : rows_start + rows_n],
                bag_lengths[o, held].reshape(-1),
                pooled_local[pooled_start : pooled_start + pooled_n],
            ]
            sizes.append(rows_n + len(held) * batch + pooled_n)
            rows_start, pooled_start = rows_start + rows_n, pooled_start + pooled_n
        return torch.cat(parts), sizes

    # -- lookup, vector exchange, pooling ------------------------------------------------------------------
    def compute_and_output_dist(self, ctx: Any, dist_input: Any) -> Any:
        incoming = dist_input[0] if isinstance(dist_input, KJTList | list) else dist_input
        if not isinstance(incoming, _Incoming):
            return self._compute_and_output_dist(ctx, dist_input)
        incoming.wait()
        if self.any_pooled:
            served, blocks = self._lookup(incoming)
        else:
            served, blocks = self._lookup_rows(incoming), []
        if self.any_pooled:
            plan = self._plan(incoming, blocks)
        else:
            counts = incoming.asked[:, : len(self.ownership.features)]
            plan = rows_window_plan(incoming.received >> ID_BITS, counts, incoming.requests, self.group)
        vectors = VectorsAllToAll.apply(served, plan)
        if self.any_pooled:
            pool = self._pooler(incoming, plan)
        else:
            pool = window_pooler(
                rows_pooling(incoming.features, incoming.requests, self.windows), incoming.features, self.dim
            )
        outs = [WindowOutput(pool, plan, vectors[w], w) for w in range(self.windows)]
        return outs if self.windows > 1 else outs[0]

    def _segments(self, incoming: _Incoming) -> list[dict[str, Any]]:
        """Each requester's payload cut up: rows ids per rows feature, lengths and ids per pooled one."""
        num_features = len(self.ownership.features)
        held = self.pooled_of[self.rank]
        out, start = [], 0
        for r in range(self.world_size):
            counts, batch = incoming.asked[r, :num_features].tolist(), int(incoming.asked[r, num_features])
            seg: dict[str, Any] = {"batch": batch, "rows": {}, "lengths": {}, "ids": {}}
            for f in range(num_features):
                if self.rows[f] and counts[f]:
                    seg["rows"][f] = incoming.received[start : start + counts[f]] & _LOW
                    start += counts[f]
            for f in held:
                seg["lengths"][f] = incoming.received[start : start + batch]
                start += batch
            for f in held:
                seg["ids"][f] = incoming.received[start : start + counts[f]]
                start += counts[f]
            out.append(seg)
        return out

    def _lookup_rows(self, incoming: _Incoming) -> torch.Tensor:
        """:meth:`_lookup` when every table goes as rows: (S, D) the rows asked of this rank, in the order
        asked (requester, then feature, then first use); each FBGEMM module looks up its tables' rows
        once, as bags of one row, tables padded with empty bags to the longest
        (:func:`~recsys.exchange_kernels.lookup_layout`)."""
        num_features = len(self.ownership.features)
        if incoming.received.numel() == 0:  # still a node: its backward joins the exchange
            return torch.zeros((0, self.dim), requires_grad=True)
        values, lengths, bags, index = lookup_layout(
            np.ascontiguousarray(incoming.asked[:, :num_features].numpy()),
            (incoming.received & _LOW).numpy(),
            *self._layout,
        )
        outs, value_at, length_at = [], 0, 0
        for (module, tables), n in zip(self._modules, bags.tolist(), strict=True):
            size = len(tables) * n
            count = int(lengths[length_at : length_at + size].sum())
            kjt = KeyedJaggedTensor(
                keys=[str(t.position) for t in tables],
                values=torch.from_numpy(values[value_at : value_at + count]),
                lengths=torch.from_numpy(lengths[length_at : length_at + size]),
                stride=n,
            )
            outs.append(module(kjt).view(-1, self.dim))  # a bag of one row is the row itself
            value_at, length_at = value_at + count, length_at + size
        stacked = outs[0] if len(outs) == 1 else torch.cat(outs)
        return stacked.index_select(0, torch.from_numpy(index))

    def _lookup(self, incoming: _Incoming) -> tuple[torch.Tensor, list[list[int]]]:
        """(V, D) the vectors this rank serves, requester-major (its rows requests, then each pooled
        table's samples), and per requester the sizes of those blocks."""
        segs = self._segments(incoming)
        by_module: dict[int, list[_LocalTable]] = {}
        for table in self.local:
            by_module.setdefault(id(table.module), []).append(table)
        pieces: dict[int, list[torch.Tensor]] = {}  # feature -> per requester, its vectors
        for tables in by_module.values():
            ordered = sorted(tables, key=lambda t: t.position)
            bags_per_table, values, lengths = [], [], []
            for table in ordered:
                f, n = table.feature, 0
                for seg in segs:
                    if self.rows[f]:
                        ids = seg["rows"].get(f, torch.zeros(0, dtype=torch.int64))
                        values.append(ids)
                        lengths.append(torch.ones(ids.numel(), dtype=torch.int64))
                        n += ids.numel()
                    else:
                        values.append(seg["ids"][f])
                        lengths.append(seg["lengths"][f])
                        n += seg["batch"]
                bags_per_table.append(n)
            bags = max(bags_per_table)
            padded = []
            for k, n in enumerate(bags_per_table):  # each table's bags, then empty ones up to ``bags``
                padded += [
                    *lengths[k * self.world_size : (k + 1) * self.world_size],
                    torch.zeros(bags - n, dtype=torch.int64),
                ]
            kjt = KeyedJaggedTensor(
                keys=[str(t.position) for t in ordered],
                values=torch.cat(values),
                lengths=torch.cat(padded),
                stride=bags,
            )
            out = ordered[0].module(kjt)  # (bags, module columns); a bag of one row is the row itself
            for table, n in zip(ordered, bags_per_table, strict=True):
                vectors = out[:n, table.columns[0] : table.columns[1]]
                if self.rows[table.feature]:
                    sizes = [
                        int(seg["rows"][table.feature].numel()) if table.feature in seg["rows"] else 0
                        for seg in segs
                    ]
                else:
                    sizes = [seg["batch"] for seg in segs]
                pieces[table.feature] = list(torch.split(vectors, sizes))
        parts, blocks = [], []
        held = self.pooled_of[self.rank]
        for r, seg in enumerate(segs):
            rows_part = [pieces[f][r] for f in sorted(seg["rows"])]
            pooled_part = [pieces[f][r] for f in held]
            parts += rows_part + pooled_part
            blocks.append([sum(p.shape[0] for p in rows_part), seg["batch"]])
        if (
            not parts or sum(p.shape[0] for p in parts) == 0
        ):  # still a node of the graph: its backward joins in
            return torch.zeros((0, self.dim), requires_grad=True), blocks
        return torch.cat(parts), blocks

    def _plan(self, incoming: _Incoming, blocks: list[list[int]]) -> WindowPlan:
        requests, world, held_here = incoming.requests, self.world_size, self.pooled_of[self.rank]
        # serving side: per requester r, its rows requests (masks in the payload) then |held| x B_r vectors
        num_features = len(self.ownership.features)
        served_masks, start = [], 0
        for r in range(world):
            counts, batch_r = incoming.asked[r, :num_features], int(incoming.asked[r, num_features])
            n_rows = int(counts[self.rows].sum())
            served_masks.append(incoming.received[start : start + n_rows] >> ID_BITS)
            start += n_rows + len(held_here) * batch_r + int(counts[~self.rows].sum())
        serve, serve_sizes, get, get_sizes = [], [], [], []
        batch = incoming.features.stride()
        mine_sizes = window_sizes(batch, self.windows)
        # requesting side: per owner o, G holds its rows requests then |pooled_of[o]| x B vectors
        g_start, total = [], 0
        for o in range(world):
            g_start.append(total)
            total += requests.per_owner[o] + len(self.pooled_of[o]) * batch
        request_g = torch.arange(requests.sent.numel()) + torch.repeat_interleave(
            torch.tensor([g_start[o] - sum(requests.per_owner[:o]) for o in range(world)]),
            torch.tensor(requests.per_owner),
        )
        served_per = [rows_n + len(held_here) * batch_r for rows_n, batch_r in blocks]
        served_base = [sum(served_per[:r]) for r in range(world)]
        held_k = torch.arange(len(held_here))[:, None]  # (H, 1)
        owner_of_request = requests.owner
        for w in range(self.windows):
            idx, sizes = [], []
            for r in range(world):  # requester by requester: its rows with bit w, then its pooled vectors
                rows_n, batch_r = blocks[r]
                on = torch.nonzero((served_masks[r] >> w) & 1).flatten() + served_base[r]
                b_sizes = window_sizes(batch_r, self.windows)
                lo, hi = sum(b_sizes[:w]), sum(b_sizes[: w + 1])
                pooled_idx = (served_base[r] + rows_n + held_k * batch_r + torch.arange(lo, hi)).reshape(-1)
                idx += [on, pooled_idx]
                sizes.append(int(on.numel()) + int(pooled_idx.numel()))
            serve.append(torch.cat(idx))
            serve_sizes.append(sizes)
            lo, hi = sum(mine_sizes[:w]), sum(mine_sizes[: w + 1])
            mine = ((requests.mask >> w) & 1).bool()
            g_idx, g_sizes = [], []
            for o in range(world):  # owner by owner: its rows requests with bit w, then its pooled blocks
                rows_g = request_g[mine & (owner_of_request == o)]
                held_o = torch.arange(len(self.pooled_of[o]))[:, None]
                first = g_start[o] + requests.per_owner[o]
                pooled_g = (first + held_o * batch + torch.arange(lo, hi)).reshape(-1)
                g_idx += [rows_g, pooled_g]
                g_sizes.append(int(rows_g.numel()) + int(pooled_g.numel()))
            get.append(torch.cat(g_idx))  # ascending: owners in order, each owner's rows before its blocks
            get_sizes.append(g_sizes)
        return WindowPlan(
            windows=self.windows,
            serve=serve,
            serve_sizes=serve_sizes,
            get=get,
            get_sizes=get_sizes,
            requested=total,
            asked_of=[requests.per_owner[o] + len(self.pooled_of[o]) * batch for o in range(world)],
            served=sum(served_per),
            served_from=served_per,
            request_g=request_g,
            group=self.group,
            world_size=world,
            works=[],
        )

    def _pooler(self, incoming: _Incoming, plan: WindowPlan) -> Any:
        """``pool(vectors, w)``: window ``w``'s pooled embeddings from its received vectors."""
        kjt, requests = incoming.features, incoming.requests
        num_features, batch = len(self.ownership.features), kjt.stride()
        sizes = window_sizes(batch, self.windows)
        lengths = kjt.lengths()
        value_feature = value_features(kjt.length_per_key())  # (N,)
        value_sample = torch.repeat_interleave(torch.arange(num_features * batch), lengths) % batch  # (N,)
        window_of_sample = torch.repeat_interleave(torch.arange(self.windows), torch.tensor(sizes))
        value_window = window_of_sample[value_sample]
        is_rows = self.rows[value_feature]
        value_g = torch.where(is_rows, plan.request_g[requests.occurrence.clamp(min=0)], -1)
        # pooled blocks: for each owner in rank order, each pooled table it holds (row-wise partial sums are
        # added in that order)
        firsts, block_features, g_at = [], [], 0
        for o in range(self.world_size):
            for k, f in enumerate(self.pooled_of[o]):
                firsts.append(g_at + requests.per_owner[o] + k * batch)
                block_features.append(f)
            g_at += requests.per_owner[o] + len(self.pooled_of[o]) * batch
        first = torch.tensor(firsts, dtype=torch.int64)[:, None]  # (P, 1)
        block_feature = torch.tensor(block_features, dtype=torch.int64)[:, None]
        plans = []
        for w in range(self.windows):
            start, size = sum(sizes[:w]), sizes[w]
            chosen = torch.nonzero(is_rows & (value_window == w)).flatten()  # occurrence order
            within = torch.arange(size)[None, :]
            g = torch.cat([value_g[chosen], (first + start + within).reshape(-1)])
            bag = torch.cat(
                [
                    value_feature[chosen] * size + value_sample[chosen] - start,
                    (block_feature * size + within).reshape(-1),
                ]
            )
            plans.append(by_sample(torch.searchsorted(plan.get[w], g), bag, size, num_features))
        return window_pooler(plans, kjt, self.dim)
