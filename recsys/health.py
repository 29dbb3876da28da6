"""After every step: a non-finite loss, gradient or embedding row stops the run; so does SIGTERM/SIGINT.

One collective per step (an ``all_reduce`` of two flags) keeps the ranks together: when one rank sees a
problem or a signal, every rank stops after the same step (``docs/reliability.md``).
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

__all__ = ["StepHealth"]


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

    def dense_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._dense is None:
            self._dense = [
                (name, p) for name, p in self.dmp.named_parameters() if "embedding_bags." not in name
            ]
        return self._dense

    @torch.no_grad()
    def nonfinite(self, loss: float, *, rows: bool) -> str:
        """The first non-finite quantity of this rank after a step ('' when all are finite).

        Every step: the loss, then the dense gradients (their largest magnitudes, one fused op). With
        ``rows`` (every ``train.log_every`` steps and before a checkpoint) also every embedding row held
        in memory on this rank: plain tables and the tiered tables' device slots.
        """
        if not math.isfinite(loss):
            return f"the loss ({loss})"
        grads = [(n, p.grad) for n, p in self.dense_params() if p.grad is not None]
        if grads:
            peaks = torch.stack(torch._foreach_norm([g for _, g in grads], math.inf))
            if not bool(torch.isfinite(peaks).all()):
                bad = int((~torch.isfinite(peaks)).nonzero()[0, 0])
                return f"the gradient of dense parameter {grads[bad][0]}"
        if rows:
            for shard in local_shards(self.dmp, self.tables):
                bad_rows = (~torch.isfinite(shard.weight)).any(dim=1).nonzero()
                if bad_rows.numel():
                    kind = "slot" if shard.table in self.tiered else "row"
                    return f"{kind} {int(bad_rows[0, 0]) + shard.row_offset} of embedding table {shard.table}"
        return ""

    def check(self, loss: float, *, step: int) -> int:
        """After ``step`` steps (collective): raise on a non-finite value on any rank; return the stop
        signal's number when any rank caught SIGTERM/SIGINT (0: go on).

        Raises:
            UserError: one line naming the step, the quantity, the rank and the way out.
        """
        tcfg = self.config.train
        rows = step % tcfg.log_every == 0 or bool(tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0)
        problem = self.nonfinite(loss, rows=rows or bool(stop_signal.signum))
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
