"""Embedding tables: optimizer, sharding and initialisation (section ``[sparse]``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from embedding_store import OptimizerKind, WeightsPrecision

__all__ = ["ShardingKind", "SparseConfig"]


class ShardingKind(enum.Enum):
    TABLE_WISE = "table_wise"  # each table lives whole on one rank
    ROW_WISE = "row_wise"  # each table's rows are split in blocks across ranks


@dataclass(kw_only=True, frozen=True, slots=True)
class SparseConfig:
    """Embedding tables (section ``[sparse]``).

    Attributes:
        optimizer: fused optimizer applied inside the backward of the embedding lookups, one the store
            knows (``embedding_store.OptimizerKind``: its state per row travels with the row); FBGEMM runs
            all three on CPU and GPU (``recsys.sharding`` maps them to FBGEMM's ``EmbOptimType``).
        learning_rate: learning rate of the fused optimizer.
        eps: epsilon of the Adagrad variants.
        sharding: ``table_wise`` or ``row_wise`` placement across ranks.
        init_scale: rows start uniform in [-init_scale, init_scale), a function of (seed, table, id).
        max_rows_per_table: rows of an in-memory table; ids of a larger id space are taken modulo this.
        weights_precision: ``fp32`` or ``fp16``: how the embedding weights are stored and trained, in
            FBGEMM's tables and on every tier (optimizer state stays float32). FBGEMM's CPU kernels round
            fp16 updates to nearest even; bf16 is not offered (they do not train bf16 weights).
    """

    optimizer: OptimizerKind = OptimizerKind.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.05
    eps: float = 1e-8
    sharding: ShardingKind = ShardingKind.TABLE_WISE
    init_scale: float = 0.01
    max_rows_per_table: int = 1_000_000
    weights_precision: WeightsPrecision = WeightsPrecision.FP32

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.init_scale >= 0:
            raise ValueError(f"init_scale must be >= 0, got {self.init_scale}")
        if self.max_rows_per_table < 1:
            raise ValueError(f"max_rows_per_table must be >= 1, got {self.max_rows_per_table}")
