"""After every step: a non-finite loss, gradient or embedding row stops the run; so does SIGTERM/SIGINT.

Embedding rows are scanned every ``train.log_every`` steps (``ROWS_PER_CHECK`` of each shard) and all of
them before a checkpoint and after the last step. One collective per step (an ``all_reduce`` of two
flags) keeps the ranks together: when one rank sees a problem or a signal, every rank stops after the
same step (``docs/reliability.md``).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig

from recsys.config import RunConfig
from recsys.errors import UserError
from recsys.lifetime import stop_signal
from recsys.sharding import local_shards

__all__ = ["ROWS_PER_CHECK", "StepHealth"]

# Rows of each shard that a logging step scans for non-finite values (a checkpoint, a stop and the last
# step scan them all): a table of millions of rows in memory would otherwise cost a pass over gigabytes
# every ``train.log_every`` steps (~1.7 s for 4 tables of 2M rows of dim 64 here).
ROWS_PER_CHECK = 1 << 16


def _first_nonfinite_row(weight: torch.Tensor) -> int | None:
    """The first row of (n, d) ``weight`` holding a NaN or an infinity, None if there is none.

    One pass of row sums (a non-finite value makes its row's sum non-finite) instead of a mask of every
    value; only rows whose sum is not finite, overflows of large finite values included, are checked
    value by value.
    """
    suspects = (~torch.isfinite(weight.sum(dim=1))).nonzero()[:, 0]
    if not suspects.numel():
        return None
    bad = (~torch.isfinite(weight[suspects])).any(dim=1).nonzero()
    return int(suspects[bad[0, 0]]) if bad.numel() else None


class StepHealth:
    """The checks of one rank's model after a step.

    Args:
        dmp: the sharded model.
        tables: every table config of the model.
        tiered: names of the tiered slot tables (their rows are called slots in messages).
        config: the run's config (the advice names its learning rates).
        world_size: ranks of the run.
    """

    def __init__(
        self,
        dmp: torch.nn.Module,
        tables: list[EmbeddingBagConfig],
        *,
        tiered: Collection[str],
        config: RunConfig,
        world_size: int,
    ) -> None:
        self.dmp = dmp
        self.tables = tables
        self.tiered = set(tiered)
        self.config = config
        self.world_size = world_size
        self._dense: list[tuple[str, torch.nn.Parameter]] | None = None
        self._scan_from: dict[tuple[str, int, int], int] = {}  # shard -> first row of its next partial scan

    def dense_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._dense is None:
            self._dense = [
                (name, p) for name, p in self.dmp.named_parameters() if "embedding_bags." not in name
            ]
        return self._dense

    @torch.no_grad()
    def nonfinite(self, loss: float, *, rows: bool, budget: int | None = None) -> str:
        """The first non-finite quantity of this rank after a step ('' when all are finite).

        Every step: the loss, then the dense gradients (their largest magnitudes, one fused op). With
        ``rows`` also the embedding rows held in memory on this rank: plain tables and the tiered tables'
        device slots; all of them, or with ``budget`` the next ``budget`` rows of each shard, round robin
        (a row only changes when a batch uses it, and a used non-finite row makes the loss non-finite).
        """
        if not math.isfinite(loss):
            return f"the loss ({loss})"
        # a layer over no inputs (a model without dense features) has an empty weight: nothing to check
        grads = [(n, p.grad) for n, p in self.dense_params() if p.grad is not None and p.grad.numel()]
        if grads:
            peaks = torch.stack(torch._foreach_norm([g for _, g in grads], math.inf))
            if not bool(torch.isfinite(peaks).all()):
                bad = int((~torch.isfinite(peaks)).nonzero()[0, 0])
                return f"the gradient of dense parameter {grads[bad][0]}"
        if rows:
            for shard in local_shards(self.dmp, self.tables):
                weight, first = shard.weight, 0
                if budget is not None and budget < weight.shape[0]:
                    key = (shard.table, shard.row_offset, shard.col_offset)
                    first = self._scan_from.get(key, 0) % weight.shape[0]
                    self._scan_from[key] = first + budget
                    weight = weight[first : first + budget]  # the wrap-around part waits for the next scan
                bad = _first_nonfinite_row(weight)
                if bad is not None:
                    kind = "slot" if shard.table in self.tiered else "row"
                    return f"{kind} {first + bad + shard.row_offset} of embedding table {shard.table}"
        return ""

    def check(self, loss: float, *, step: int) -> int:
        """After ``step`` steps (collective): raise on a non-finite value on any rank; return the stop
        signal's number when any rank caught SIGTERM/SIGINT (0: go on).

        Raises:
            UserError: one line naming the step, the quantity, the rank and the way out.
        """
        tcfg = self.config.train
        every = (  # before a checkpoint, a stop's included, and after the last step: all rows
            bool(tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0)
            or bool(stop_signal.signum)
            or step >= tcfg.steps
        )
        problem = self.nonfinite(
            loss, rows=every or step % tcfg.log_every == 0, budget=None if every else ROWS_PER_CHECK
        )
        flags = torch.tensor([stop_signal.signum, int(bool(problem))], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1]:
            found = [problem]
            if self.world_size > 1:
                found = [""] * self.world_size
                dist.all_gather_object(found, problem)
            rank, what = next((r, p) for r, p in enumerate(found) if p)
            raise UserError(
                f"training diverged at step {step}: {what} on rank {rank} is not finite; lower "
                f"train.dense_learning_rate ({tcfg.dense_learning_rate}) or "
                f"sparse.learning_rate ({self.config.sparse.learning_rate}), or check the input data"
            )
        return int(flags[0])
