"""``sparse.fp16_rounding = stochastic``: fp16 tables trained as float32 slot tables whose touched rows are
rounded to float16 values after every step.

FBGEMM's CPU kernels round an fp16 table's updates to nearest even, which loses every update smaller than
half a float16 step; its CUDA kernels round stochastically, but from a random stream tied to where a row
sits, which a tiered run (rows at other slots) would not reproduce. Here the slot tables are float32 and
:class:`StepRounding` rounds, after the step's backward and fused optimizer update, exactly the rows the
step's lookups read, with random bits that are a function of (seed, table, id, step, column) only
(:mod:`embedding_store.rounding`): a tiered run and an in-memory run hold the same float16 values after
every step, bit for bit, and the tiers below the slot tables store them losslessly in 16 bits.

The rows a step read are taken from the FBGEMM modules' own inputs (a forward pre-hook on each of them
records its indices and offsets during training forwards); their ids are the rows' ids in an in-memory
table (row offset + local row) and the slots' ids in a tiered one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embedding_store.rounding import round_rows_, step_key
from recsys.sharding import local_shards

if TYPE_CHECKING:
    from recsys.binding import TableBinding

__all__ = ["StepRounding"]


class _Table(NamedTuple):
    name: str
    weight: torch.Tensor  # (S, D) float32, this rank's shard or slot table (live storage)
    row_offset: int  # the shard's first row id (in-memory tables)
    col_offset: int
    tiered: bool


def _fbgemm_modules(model: nn.Module) -> Iterator[SplitTableBatchedEmbeddingBagsCodegen]:
    """The FBGEMM table-batched modules under TorchRec's sharded collections (held outside ``modules()``:
    a sharded collection keeps its lookups in plain lists)."""
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or []:
            for batched in getattr(lookup, "_emb_modules", []):
                inner = getattr(batched, "_emb_module", None)
                if isinstance(inner, SplitTableBatchedEmbeddingBagsCodegen):
                    yield inner


class StepRounding:
    """Rounds the rows each training step read to float16 values, after its update (one rank's part).

    Args:
        dmp: the sharded model, whose FBGEMM tables hold float32 weights.
        tables: every table config of the model.
        seed: the run's seed.
        binding: the rank's tables' binding (the ids its store tables' slots hold); None: every table in
            memory.
    """

    def __init__(
        self,
        dmp: DistributedModelParallel,
        tables: list[EmbeddingBagConfig],
        *,
        seed: int,
        binding: TableBinding | None = None,
    ) -> None:
        self.seed = seed
        self._binding = binding
        tiered_names = set() if binding is None else set(binding.store_tables)
        by_storage = {
            s.weight.data_ptr(): _Table(
                s.table, s.weight, s.row_offset, s.col_offset, s.table in tiered_names
            )
            for s in local_shards(dmp, tables)
        }
        # per FBGEMM module (by id): its tables' targets and each feature's table index
        self._targets: dict[int, tuple[list[_Table], list[int]]] = {}
        for module in _fbgemm_modules(dmp):
            targets = []
            for weight in module.split_embedding_weights():
                target = by_storage.get(weight.data_ptr())
                if target is None or target.weight.shape != weight.shape or weight.dtype != torch.float32:
                    raise RuntimeError(
                        "stochastic rounding needs float32 FBGEMM tables it can match to shards"
                    )
                targets.append(target)
            self._targets[id(module)] = (targets, list(module.feature_table_map))
            module.register_forward_pre_hook(self._record, with_kwargs=True)
        self._read: list[tuple[list[_Table], list[int], torch.Tensor, torch.Tensor]] = []

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: keep a training forward's indices and offsets (evaluation updates nothing)."""
        if not (module.training and torch.is_grad_enabled()):
            return
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        targets, feature_tables = self._targets[id(module)]
        self._read.append((targets, feature_tables, indices, offsets))

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Round the rows step ``step`` (0-based) read; call after its optimizer update, before its slots
        are released."""
        read, self._read = self._read, []
        for targets, feature_tables, indices, offsets in read:
            features = len(feature_tables)
            batch = (offsets.numel() - 1) // features
            bounds = offsets[::batch].tolist()  # each feature's first index, then the end
            by_table: dict[int, list[torch.Tensor]] = {}
            for f, table in enumerate(feature_tables):
                if bounds[f + 1] > bounds[f]:
                    by_table.setdefault(table, []).append(indices[bounds[f] : bounds[f + 1]])
            for table, parts in by_table.items():
                self._round(targets[table], torch.unique(torch.cat(parts)).to(torch.int64), step)

    def _round(self, target: _Table, rows: torch.Tensor, step: int) -> None:
        if target.tiered:
            assert self._binding is not None
            ids = torch.from_numpy(self._binding.slot_ids(target.name, rows.cpu().numpy()))
        else:
            ids = rows.cpu() + target.row_offset
        key = step_key(self.seed, target.name, step)
        round_rows_(target.weight, rows, ids, key=key, col_offset=target.col_offset)
