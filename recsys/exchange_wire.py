"""The all-to-alls of the rows exchange (:mod:`recsys.exchange_rows`): vectors to their requesters one
window at a time, their gradients back once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.types import Awaitable, LazyAwaitable
from torchrec.sparse.jagged_tensor import KeyedTensor

__all__ = ["Ready", "VectorsAllToAll", "WindowOutput", "WindowPlan"]


class Ready(Awaitable[Any]):
    """An awaitable whose value is already there (the id exchange's, for TorchRec's two waits)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> Any:
        return self._value


@dataclass
class WindowPlan:
    """One batch's vector exchange. ``serve``: per window, indices into the vectors this rank serves
    (rank-major); ``get``: per window, where each received vector goes among this rank's requests
    (owner-major: its rows requests, then each pooled table's ``B`` samples)."""

    windows: int
    serve: list[torch.Tensor]
    serve_sizes: list[list[int]]
    get: list[torch.Tensor]
    get_sizes: list[list[int]]
    requested: int
    asked_of: list[int]  # this rank's requests per owner
    served: int
    served_from: list[int]  # vectors this rank serves per requester
    request_g: torch.Tensor  # (U,) where each rows request sits among this rank's requests
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


class VectorsAllToAll(torch.autograd.Function):
    """Vectors to their requesters, one all-to-all per window; their gradients back in one, per batch."""

    @staticmethod
    def forward(ctx: Any, served: torch.Tensor, plan: WindowPlan) -> tuple[torch.Tensor, ...]:  # noqa: ANN401
        ctx.plan = plan
        outs = []
        for w in range(plan.windows):
            send = served.index_select(0, plan.serve[w])
            out = served.new_empty((sum(plan.get_sizes[w]), served.shape[1]))
            plan.works.append(plan.all_to_all(out, send, plan.get_sizes[w], plan.serve_sizes[w]))
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan: WindowPlan = ctx.plan
        summed = grads[0].new_zeros((plan.requested, grads[0].shape[1]))  # one gradient per request
        for w, grad in enumerate(grads):
            summed.index_add_(0, plan.get[w], grad)
        if get_gradient_division() and plan.world_size > 1:
            # as TorchRec's pooled exchange: the dense gradients are averaged over ranks, so these are too
            summed.div_(plan.world_size)
        out = summed.new_empty((plan.served, summed.shape[1]))
        work = plan.all_to_all(out, summed, plan.served_from, plan.asked_of)
        if work is not None:
            work.wait()
        return out, None


class WindowOutput(LazyAwaitable[KeyedTensor]):
    """One window's pooled embeddings: waits for its vectors, then pools its rows bags locally."""

    def __init__(self, pool: Any, plan: WindowPlan, vectors: torch.Tensor, w: int) -> None:
        super().__init__()
        self._pool, self._plan, self._vectors, self._w = pool, plan, vectors, w

    def _wait_impl(self) -> KeyedTensor:
        work = self._plan.works[self._w]
        if work is not None:
            work.wait()
        return self._pool(self._vectors, self._w)
