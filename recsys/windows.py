"""Frozen windows: a training batch's pooled-embedding exchange split into micro-batch windows.

NestPipe's intra-batch overlap, on TorchRec. The embedding lookup of a batch runs once, as usual; its
output distribution (the all-to-all of table-wise sharding, the reduce-scatter of row-wise sharding) is
issued as ``W`` collectives, one per window of ``B / W`` samples of every rank's batch. All of them are
asynchronous, so while window ``w + 1``'s embeddings are in flight the dense part of the model — bottom
MLP, interaction, top MLP — already computes window ``w``. The embeddings are frozen for the whole batch
(every window reads the rows as they were before the batch), and the backward reaches the lookup once,
through one gradient that autograd assembles from the windows, so FBGEMM's fused optimizer makes one
sparse update per batch, as without windows.

What changes numerically: the windows' dense gradients are summed by autograd one window at a time, and
the matrix products run on ``B / W`` rows instead of ``B``, so the floating-point reduction order differs
from the unsplit batch. After 20 steps (tests/recsys/test_windows.py) dense parameters agree with the
unsplit run to ~3e-7 of their magnitude, embedding rows to ~1e-4 (element-wise Adagrad amplifies rounding
while a row's state is near zero) and the held-out loss to ~1e-9; the test's tolerance is 1e-3. They are
not bitwise equal, which is why the option is off by default and the exactness guarantee (tiered ==
untiered, bit for bit) is stated for ``frozen_windows = 1``.

Only training batches are split; evaluation runs the model unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM
from torchrec.sparse.jagged_tensor import KeyedTensor

from recsys.errors import UserError

__all__ = ["enable_frozen_windows", "sparse_module", "window_sizes", "windowed_rest"]

_SPLITTABLE = {ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value}


def window_sizes(batch: int, windows: int) -> list[int]:
    """``windows`` nearly equal sizes summing to ``batch`` (the first ones one larger)."""
    base, extra = divmod(batch, windows)
    return [base + (1 if w < extra else 0) for w in range(windows)]


def _window_rows(world: int, batch: int, windows: int) -> list[torch.Tensor]:
    """For each window, the rows of a rank-major ``(world * batch, D)`` lookup output that it covers."""
    out, start = [], 0
    for size in window_sizes(batch, windows):
        per_rank = torch.arange(start, start + size, dtype=torch.int64)
        out.append((per_rank[None, :] + batch * torch.arange(world)[:, None]).reshape(-1))
        start += size
    return out


def _windowed_output_dist(
    module: ShardedEmbeddingBagCollection, windows: int, world: int
) -> Callable[[Any, Any], Any]:
    """A ``compute_and_output_dist`` for ``module`` that returns one awaitable KeyedTensor per window."""
    unsplit = module.compute_and_output_dist
    cache: dict[int, list[torch.Tensor]] = {}

    def compute_and_output_dist(ctx: Any, dist_input: Any) -> Any:
        if not module.training:
            return unsplit(ctx, dist_input)
        if getattr(ctx, "variable_batch_per_feature", False) or module._has_mean_pooling_callback:
            raise UserError("pipeline.frozen_windows needs fixed batch sizes and sum pooling")
        per_window: list[list[Any]] = [[] for _ in range(windows)]
        for lookup, out_dist, sharding_ctx, features in zip(
            module._lookups, module._output_dists, ctx.sharding_contexts, dist_input, strict=True
        ):
            embs = lookup(features)  # (world * B, D_local), rows grouped by the rank that sent them
            rows_total = embs.shape[0]
            if rows_total not in cache:
                cache[rows_total] = _window_rows(world, rows_total // world, windows)
            for w, rows in enumerate(cache[rows_total]):
                part = embs.index_select(0, rows.to(embs.device))
                window_ctx = sharding_ctx
                if getattr(sharding_ctx, "batch_size_per_rank", None):  # table-wise: per-rank batch sizes
                    window_ctx = copy.copy(sharding_ctx)
                    window_ctx.batch_size_per_rank = [rows.shape[0] // world] * world
                per_window[w].append(out_dist(part, window_ctx))  # issued now, waited for later
        return [
            EmbeddingBagCollectionAwaitable(
                awaitables=parts,
                embedding_dims=module._embedding_dims,
                embedding_names=module._embedding_names,
            )
            for parts in per_window
        ]

    return compute_and_output_dist


def enable_frozen_windows(model: nn.Module, windows: int, world: int) -> None:
    """Split the output distribution of ``model``'s sharded EmbeddingBagCollection into ``windows``.

    ``model`` is the DMP-wrapped module tree (after sharding). Raises UserError for sharding types whose
    output cannot be split by sample (only table-wise and row-wise can).
    """
    sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    if len(sharded) != 1:
        raise UserError(
            f"pipeline.frozen_windows needs one sharded EmbeddingBagCollection, found {len(sharded)}"
        )
    ebc = sharded[0]
    kinds = sorted(set(ebc._sharding_types))
    if not set(kinds) <= _SPLITTABLE:
        raise UserError(
            f"pipeline.frozen_windows splits table-wise and row-wise sharding only, this model uses {kinds}"
        )
    # An instance attribute: TorchRec's pipelined forward and ShardedModule.forward both call it.
    ebc.compute_and_output_dist = _windowed_output_dist(ebc, windows, world)  # type: ignore[method-assign]


def _pooled(kt: KeyedTensor, names: list[str], dim: int) -> torch.Tensor:
    """(b, F, D) embeddings of ``names`` from one window's KeyedTensor."""
    values = kt.to_dict()
    return torch.cat([values[n] for n in names], dim=1).reshape(-1, len(names), dim)


def sparse_module(model: nn.Module) -> nn.Module:
    """The model's EmbeddingBagCollection (sharded or not), reached by attributes so fx sees the call."""
    return model.sparse_arch.embedding_bag_collection if isinstance(model, DLRM) else model.sparse_arch


def windowed_rest(model: nn.Module, dense: torch.Tensor, parts: list[Any], windows: int) -> torch.Tensor:
    """The model's logits ``(B, 1)`` computed window by window from per-window embeddings ``parts``.

    Each window's bottom MLP runs before its embeddings are waited for, so it overlaps the exchange of
    that window and of the later ones. (Wrapped as one node for TorchRec's fx tracer.)
    """
    logits, start = [], 0
    for w, size in enumerate(window_sizes(dense.shape[0], windows)):
        if isinstance(model, DLRM):  # DLRM and DLRM_DCN: dense arch, interaction, over arch
            bottom = model.dense_arch(dense[start : start + size])
            names, dim = model.sparse_arch.sparse_feature_names, model.sparse_arch.D
            mixed = model.inter_arch(dense_features=bottom, sparse_features=_pooled(parts[w], names, dim))
            logits.append(model.over_arch(mixed))
        else:  # the logistic model: a linear layer plus the sum of each id's row
            linear = model.dense_arch(dense[start : start + size])
            logits.append(linear + parts[w].values().sum(dim=1, keepdim=True))
        start += size
    return torch.cat(logits)
