"""The windows of the rows exchange (:mod:`recsys.exchange_rows`) when every table goes as rows: which rows
each window sends and receives, and how each window's bags are pooled from them.

Shapes: ``S`` rows asked of this rank, ``U`` this rank's requests, ``W`` windows, ``D`` the dimension.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys.exchange_plan import RowRequests, value_features
from recsys.exchange_wire import WindowPlan
from recsys.windows import window_sizes

__all__ = ["rows_pooling", "rows_window_plan", "window_pooler"]

Pooling = list[tuple[torch.Tensor, torch.Tensor, int]]  # per window: (index, bag, samples)


def rows_window_plan(
    served: torch.Tensor, asked: torch.Tensor, requests: RowRequests, group: Any
) -> WindowPlan:
    """The window plan when the vectors are the rows requests, in order: ``served`` (S,) the window masks
    of the rows asked of this rank (rank-major), ``asked`` (world, F) how many each rank asked per table."""
    world, windows = asked.shape[0], len(requests.windows)
    served_from = asked.sum(dim=1)  # (world,)
    served_bits = (served[:, None] >> torch.arange(windows)) & 1  # (S, W)
    mine_bits = (requests.mask[:, None] >> torch.arange(windows)) & 1  # (U, W)

    def per_rank(bits: torch.Tensor, rank: torch.Tensor) -> list[list[int]]:  # (W, world) counts
        slots = (rank[:, None] * windows + torch.arange(windows)).reshape(-1)
        counts = torch.bincount(slots, weights=bits.reshape(-1).double(), minlength=world * windows)
        return counts.view(world, windows).T.long().tolist()

    requester = torch.repeat_interleave(torch.arange(world), served_from)
    return WindowPlan(
        windows=windows,
        serve=[torch.nonzero(served_bits[:, w]).flatten() for w in range(windows)],
        serve_sizes=per_rank(served_bits, requester),
        get=[torch.nonzero(mine_bits[:, w]).flatten() for w in range(windows)],
        get_sizes=per_rank(mine_bits, requests.owner),
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
    num_features, batch = len(kjt.keys()), kjt.stride()
    sizes = window_sizes(batch, windows)
    value_feature = value_features(kjt.length_per_key())
    value_sample = torch.repeat_interleave(torch.arange(num_features * batch), kjt.lengths()) % batch
    value_window = torch.repeat_interleave(torch.arange(windows), torch.tensor(sizes))[value_sample]
    # where request u sits among window w's received rows: the requests before it that w uses
    place = ((requests.mask[:, None] >> torch.arange(windows)) & 1).cumsum(dim=0) - 1  # (U, W)
    by_window = torch.split(
        torch.sort(value_window, stable=True).indices,  # occurrence order within each window
        torch.bincount(value_window, minlength=windows).tolist(),
    )
    plans = []
    for w, chosen in enumerate(by_window):
        start, size = sum(sizes[:w]), sizes[w]
        index = place[requests.occurrence[chosen], w]
        bag = value_feature[chosen] * size + value_sample[chosen] - start
        plans.append((index, bag, size))
    return plans


def window_pooler(plans: Pooling, kjt: KeyedJaggedTensor, dim: int) -> Any:
    """``pool(vectors, w)``: window ``w``'s pooled embeddings (a KeyedTensor of (b, F * D)) from its
    received vectors (R_w, D)."""
    num_features, keys = len(kjt.keys()), list(kjt.keys())
    one_each = [bool(torch.equal(bag, torch.arange(num_features * size))) for _, bag, size in plans]

    def pool(vectors: torch.Tensor, w: int) -> KeyedTensor:
        index, bag, size = plans[w]
        # sums in occurrence order, and so are the gradients (index_select's backward is an index_add in
        # source order): F.embedding_bag's backward sorts indices without a stable order. Where every bag
        # holds one id (one-hot features), the pooled vectors are the rows themselves.
        gathered = vectors.index_select(0, index)
        if one_each[w]:
            pooled = gathered  # (F * b, D)
        else:
            pooled = vectors.new_zeros((num_features * size, dim)).index_add(0, bag, gathered)
        values = pooled.view(num_features, size, dim).transpose(0, 1).reshape(size, -1)  # (b, F * D)
        return KeyedTensor(keys=keys, length_per_key=[dim] * num_features, values=values)

    return pool
