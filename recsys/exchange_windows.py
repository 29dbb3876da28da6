"""The windows of the rows exchange (:mod:`recsys.exchange_rows`) when every table goes as rows: which rows
each window sends and receives, and how each window's bags are pooled from them.

Shapes: ``S`` rows asked of this rank, ``U`` this rank's requests, ``W`` windows, ``D`` the dimension.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys.exchange_kernels import pooling_plan, window_members
from recsys.exchange_plan import RowRequests
from recsys.exchange_wire import WindowPlan

__all__ = ["by_sample", "rows_pooling", "rows_window_plan", "window_pooler"]

# per window: (index, bag, samples, one_hot); a one-hot window's index is sample by sample and its bag
# unused (:func:`~recsys.exchange_kernels.pooling_plan`)
Pooling = list[tuple[torch.Tensor, torch.Tensor, int, bool]]


def rows_window_plan(
    served: torch.Tensor, asked: torch.Tensor, requests: RowRequests, group: Any
) -> WindowPlan:
    """The window plan when the vectors are the rows requests, in order: ``served`` (S,) the window masks
    of the rows asked of this rank (rank-major), ``asked`` (world, F) how many each rank asked per table."""
    world, windows = asked.shape[0], len(requests.windows)
    served_from = asked.sum(dim=1)  # (world,)
    requester = np.repeat(np.arange(world, dtype=np.int64), served_from.numpy())
    serve, serve_counts = window_members(served.numpy(), requester, windows, world)
    get, get_counts = window_members(requests.mask.numpy(), requests.owner.numpy(), windows, world)
    return WindowPlan(
        windows=windows,
        serve=list(torch.from_numpy(serve).split(serve_counts.sum(axis=1).tolist())),
        serve_sizes=serve_counts.tolist(),
        get=list(torch.from_numpy(get).split(get_counts.sum(axis=1).tolist())),
        get_sizes=get_counts.tolist(),
        requested=int(requests.sent.numel()),
        asked_of=requests.per_owner,
        served=int(served.numel()),
        served_from=served_from.tolist(),
        request_g=torch.arange(requests.sent.numel()),
        group=group,
        world_size=world,
        works=[],
    )


def rows_pooling(kjt: KeyedJaggedTensor, requests: RowRequests, windows: int) -> Pooling:
    """Per window, which received row each id occurrence reads and the bag it adds into (occurrence order)."""
    batch, sizes = kjt.stride(), requests.windows
    index, bag, offsets, one_hot = pooling_plan(
        requests.occurrence.numpy(),
        np.ascontiguousarray(kjt.lengths().to(torch.int64).numpy()),
        batch,
        np.repeat(np.arange(windows, dtype=np.int64), sizes),
        np.cumsum([0, *sizes], dtype=np.int64),
        requests.mask.numpy(),
    )
    parts = offsets[1:] - offsets[:-1]
    indices = torch.from_numpy(index).split(parts.tolist())
    bags = torch.from_numpy(bag).split(parts.tolist())
    return [
        (i, b, size, bool(hot))
        for i, b, size, hot in zip(indices, bags, sizes, one_hot.tolist(), strict=True)
    ]


def by_sample(index: torch.Tensor, bag: torch.Tensor, size: int, num_features: int) -> tuple[Any, ...]:
    """One window's pooling in occurrence order as :data:`Pooling` holds it: sample by sample where every
    bag holds one id."""
    if torch.equal(bag, torch.arange(num_features * size)):
        return index.view(num_features, size).T.reshape(-1), bag, size, True
    return index, bag, size, False


def window_pooler(plans: Pooling, kjt: KeyedJaggedTensor, dim: int) -> Any:
    """``pool(vectors, w)``: window ``w``'s pooled embeddings (a KeyedTensor of (b, F * D)) from its
    received vectors (R_w, D)."""
    num_features, keys = len(kjt.keys()), list(kjt.keys())

    def pool(vectors: torch.Tensor, w: int) -> KeyedTensor:
        index, bag, size, one_hot = plans[w]
        # sums in occurrence order, and so are the gradients (index_select's backward is an index_add in
        # source order): F.embedding_bag's backward sorts indices without a stable order. A one-hot
        # window's pooled vectors are its rows, gathered sample by sample into the (b, F * D) output; the
        # rows it reads twice (one feature's) are still added in occurrence order.
        if one_hot:
            values = vectors.index_select(0, index).view(size, num_features * dim)
        else:
            pooled = vectors.new_zeros((num_features * size, dim)).index_add(
                0, bag, vectors.index_select(0, index)
            )
            values = pooled.view(num_features, size, dim).transpose(0, 1).reshape(size, -1)  # (b, F * D)
        return KeyedTensor(keys=keys, length_per_key=[dim] * num_features, values=values)

    return pool
