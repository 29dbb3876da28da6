"""DistributedModelParallel for our models: plan, fused optimizer, deterministic rows, local shards.

Tables are sharded table-wise (with TorchRec's planner) or row-wise (an explicit plan: on CPU the
planner only proposes data-parallel, table-wise and column-wise). The fused FBGEMM optimizer updates rows
inside the backward; its per-row state lives next to the weights in the local shards, which
:func:`local_shards` exposes as aliases of the live storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embedding_store import OptimizerKind, WeightsPrecision
from embedding_store.init import init_rows
from recsys.sparse import ShardingKind, SparseConfig
from recsys.train_config import DenseOptimizer, TrainConfig

__all__ = [
    "LocalShard",
    "embedding_sharder",
    "sharding_plan",
    "shard_model",
    "build_optimizer",
    "local_shards",
    "init_embedding_rows",
    "ebc_path",
]

# The TorchRec binding's one mapping: the store's optimizer kinds to FBGEMM's fused optimizers.
_FUSED_OPT = {
    OptimizerKind.EXACT_ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    OptimizerKind.EXACT_ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    OptimizerKind.EXACT_SGD: EmbOptimType.EXACT_SGD,
}


@dataclass(frozen=True, slots=True)
class LocalShard:
    """One rank's block of one table: rows [row_offset, row_offset + n) of columns [col_offset, + d)."""

    table: str
    row_offset: int
    col_offset: int
    weight: torch.Tensor  # (n, d), aliases the live table
    state: torch.Tensor | None  # (n,) row-wise Adagrad, (n, d) Adagrad, None for SGD; aliases live state


def ebc_path(model: nn.Module) -> str:
    """Dotted path of the model's single EmbeddingBagCollection."""
    paths = [name for name, mod in model.named_modules() if isinstance(mod, EmbeddingBagCollection)]
    if len(paths) != 1:
        raise ValueError(f"expected exactly one EmbeddingBagCollection, found {paths}")
    return paths[0]


def shard_model(
    model: nn.Module,
    tables: list[EmbeddingBagConfig],
    *,
    sparse: SparseConfig,
    device: torch.device,
    pg: dist.ProcessGroup | None = None,
    fused_extra: dict[str, Any] | None = None,
) -> DistributedModelParallel:
    """Shard ``model``'s tables over the process group with the fused optimizer of ``sparse``;
    ``fused_extra``: more keyword arguments for FBGEMM's table-batched modules (``TrainSpec.fused_params``)."""
    pg = pg or dist.group.WORLD
    sharder = embedding_sharder(sparse, fused_extra)
    plan = sharding_plan(
        model,
        tables,
        sparse=sparse,
        sharder=sharder,
        world_size=dist.get_world_size(pg),
        device_type=device.type,
        pg=pg,
    )
    return DistributedModelParallel(module=model, device=device, plan=plan, sharders=[sharder])


def embedding_sharder(
    sparse: SparseConfig, fused_extra: dict[str, Any] | None = None
) -> EmbeddingBagCollectionSharder:
    """The sharder of the model's EmbeddingBagCollection: FBGEMM's fused optimizer of ``sparse`` (the
    planner sizes the optimizer state from it), plus ``fused_extra``."""
    # FBGEMM's fp16 tables (sparse.fp16_rounding = nearest) round their updates to nearest even: its CUDA
    # kernels would otherwise round them stochastically, from a random stream a tiered run (rows at other
    # slots) would not reproduce; its CPU kernels round to nearest even whatever this says. Stochastic
    # rounding that a tiered run reproduces is recsys.rounding's, on float32 tables.
    fused_params: dict[str, object] = {
        "optimizer": _FUSED_OPT[sparse.optimizer],
        "learning_rate": sparse.learning_rate,
        "stochastic_rounding": False,
    }
    if sparse.optimizer is not OptimizerKind.EXACT_SGD:
        fused_params["eps"] = sparse.eps
    fused_params.update(fused_extra or {})
    return EmbeddingBagCollectionSharder(fused_params=fused_params)


def sharding_plan(
    model: nn.Module,
    tables: list[EmbeddingBagConfig],
    *,
    sparse: SparseConfig,
    sharder: EmbeddingBagCollectionSharder,
    world_size: int,
    device_type: str,
    pg: dist.ProcessGroup | None = None,
) -> ShardingPlan:
    """Where ``tables`` live on ``world_size`` ranks: row-wise, TorchRec's even blocks; table-wise, TorchRec's
    planner. ``pg`` None: planned in this process, without a process group (``recsys plan-exchange`` plans
    world sizes it does not run so); otherwise rank 0 plans and the others receive its plan, the same one."""
    path = ebc_path(model)
    if sparse.sharding is ShardingKind.ROW_WISE:
        per_table = {t.name: row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for t in tables}
        module_plan = construct_module_sharding_plan(
            model.get_submodule(path),
            per_table,
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type=device_type,
        )
        return ShardingPlan({path: module_plan})
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device_type), constraints=constraints
    )
    return planner.plan(model, [sharder]) if pg is None else planner.collective_plan(model, [sharder], pg)


def build_optimizer(dmp: DistributedModelParallel, train: TrainConfig) -> CombinedOptimizer:
    """The fused embedding optimizer combined with the dense optimizer over the remaining parameters."""
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    lr = train.dense_learning_rate
    factory = {
        DenseOptimizer.ADAGRAD: lambda params: torch.optim.Adagrad(params, lr=lr),
        DenseOptimizer.ADAM: lambda params: torch.optim.Adam(params, lr=lr),
        DenseOptimizer.SGD: lambda params: torch.optim.SGD(params, lr=lr),
    }[train.dense_optimizer]
    return CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(dense_params, factory)])


def _local_tensors(value: object) -> list[tuple[list[int], torch.Tensor]]:
    if hasattr(value, "local_shards"):
        return [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    assert isinstance(value, torch.Tensor)
    return [([0] * value.dim(), value)]


def local_shards(dmp: DistributedModelParallel, tables: list[EmbeddingBagConfig]) -> Iterator[LocalShard]:
    """This rank's shards of every table with their optimizer state, as aliases of live storage."""
    model_sd = dmp.state_dict()
    opt_state = dmp.fused_optimizer.state_dict()["state"]
    for table in tables:
        (key,) = [k for k in model_sd if k.endswith(f"embedding_bags.{table.name}.weight")]
        weights = _local_tensors(model_sd[key])
        states: list[tuple[list[int], torch.Tensor]] = []
        for state_name, value in opt_state.get(key, {}).items():
            if state_name.startswith(f"{table.name}.momentum"):
                states = _local_tensors(value)
        for index, (offsets, weight) in enumerate(weights):
            state = states[index][1] if states else None
            if state is not None:
                assert states[index][0][0] == offsets[0], "weight and state shards disagree"
            yield LocalShard(table.name, offsets[0], offsets[1], weight, state)


@torch.no_grad()
def init_embedding_rows(
    dmp: DistributedModelParallel,
    tables: list[EmbeddingBagConfig],
    *,
    seed: int,
    scale: float,
    precision: WeightsPrecision = WeightsPrecision.FP32,
) -> None:
    """Give every row its deterministic initial value (a function of seed, table and id, rounded to
    ``precision`` to nearest even) and zero state."""
    for shard in local_shards(dmp, tables):
        n, d = shard.weight.shape
        ids = torch.arange(shard.row_offset, shard.row_offset + n, dtype=torch.int64)
        full = init_rows(ids, dim=shard.col_offset + d, seed=seed, table=shard.table, scale=scale)
        shard.weight.copy_(full[:, shard.col_offset :].to(getattr(torch, precision.dtype)))
        if shard.state is not None:
            shard.state.zero_()
