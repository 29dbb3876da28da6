"""Embedding tables: optimizer, sharding and initialisation (section ``[sparse]``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["SparseOptimizer", "ShardingKind", "SparseConfig"]


class SparseOptimizer(enum.Enum):
    """Fused FBGEMM optimizers that run on CPU and GPU; each keeps its state per row."""

    EXACT_ROWWISE_ADAGRAD = "exact_rowwise_adagrad"  # one float of state per row
    EXACT_ADAGRAD = "exact_adagrad"  # embedding_dim floats of state per row
    EXACT_SGD = "exact_sgd"  # no state


class ShardingKind(enum.Enum):
    TABLE_WISE = "table_wise"  # each table lives whole on one rank
    ROW_WISE = "row_wise"  # each table's rows are split in blocks across ranks


@dataclass(kw_only=True, frozen=True, slots=True)
class SparseConfig:
    """Embedding tables (section ``[sparse]``).

    Attributes:
        optimizer: fused optimizer applied inside the backward of the embedding lookups.
        learning_rate: learning rate of the fused optimizer.
        eps: epsilon of the Adagrad variants.
        sharding: ``table_wise`` or ``row_wise`` placement across ranks.
        init_scale: rows start uniform in [-init_scale, init_scale), a function of (seed, table, id).
        max_rows_per_table: rows of an in-memory table; ids of a larger id space are taken modulo this.
    """

    optimizer: SparseOptimizer = SparseOptimizer.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.05
    eps: float = 1e-8
    sharding: ShardingKind = ShardingKind.TABLE_WISE
    init_scale: float = 0.01
    max_rows_per_table: int = 1_000_000

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.init_scale >= 0:
            raise ValueError(f"init_scale must be >= 0, got {self.init_scale}")
        if self.max_rows_per_table < 1:
            raise ValueError(f"max_rows_per_table must be >= 1, got {self.max_rows_per_table}")
