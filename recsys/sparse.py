"""Embedding tables: optimizer, sharding and initialisation (section ``[sparse]``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from embedding_store import OptimizerKind, WeightsPrecision

__all__ = ["ExchangeKind", "Fp16Rounding", "ShardingKind", "SparseConfig"]


class ShardingKind(enum.Enum):
    TABLE_WISE = "table_wise"  # each table lives whole on one rank
    ROW_WISE = "row_wise"  # each table's rows are split in blocks across ranks


class ExchangeKind(enum.Enum):
    """What crosses the wire between a rank and a table's owner in training (``recsys.exchange``)."""

    POOLED = "pooled"  # TorchRec's EmbeddingBagCollection: ids there, one pooled vector per sample back
    ROWS = "rows"  # each distinct id there once, its row back once per window, pooled by the requester
    AUTO = "auto"  # per table, whichever sends fewer bytes over the run's first batches


class Fp16Rounding(enum.Enum):
    """How an ``fp16`` table's updated weights become float16 values again."""

    STOCHASTIC = "stochastic"  # float32 slot tables, touched rows rounded after each step (recsys.rounding)
    NEAREST = "nearest"  # FBGEMM's float16 tables: its kernels round each update to nearest even


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
            the host and disk tiers, checkpoints and bundles (optimizer state stays float32); bf16 is not
            offered (FBGEMM's CPU kernels do not train bf16 weights).
        fp16_rounding: ``stochastic`` (default): the slot tables hold float32 values that are float16
            numbers, and after each step the rows it touched are rounded to float16 up or down at random,
            the odds given by the distance, the random bits a function of (seed, table, id, step, column)
            only, so tiered and in-memory runs round alike; ``nearest``: FBGEMM's own float16 tables, whose
            kernels round each update to nearest even (half the slot memory; small updates can vanish).
            Ignored at ``fp32``.
        exchange: ``pooled`` (default): TorchRec's exchange of pooled outputs, ``B x F x D`` values per
            batch whatever its ids; ``rows``: each rank sends each distinct id of its batch once, gets each
            row once per frozen window that uses it, pools locally and returns each distinct id's gradient
            once per batch (``recsys/exchange.py``; it pays when a batch repeats ids, ``docs/design.md``);
            ``auto``: per table, whichever sends fewer bytes between ranks over the run's first 16
            batches (recorded in ``summary.json``). Rows need sum pooling, one embedding dimension and no
            per-sample weights.
        exchange_tables: per feature, an exchange overriding ``exchange`` for its table.
    """

    optimizer: OptimizerKind = OptimizerKind.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.05
    eps: float = 1e-8
    sharding: ShardingKind = ShardingKind.TABLE_WISE
    init_scale: float = 0.01
    max_rows_per_table: int = 1_000_000
    weights_precision: WeightsPrecision = WeightsPrecision.FP32
    fp16_rounding: Fp16Rounding = Fp16Rounding.STOCHASTIC
    exchange: ExchangeKind = ExchangeKind.POOLED
    exchange_tables: dict[str, ExchangeKind] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.init_scale >= 0:
            raise ValueError(f"init_scale must be >= 0, got {self.init_scale}")
        if self.max_rows_per_table < 1:
            raise ValueError(f"max_rows_per_table must be >= 1, got {self.max_rows_per_table}")

    def exchange_kinds(self, features: list[str]) -> list[ExchangeKind]:
        """Each feature's exchange as configured (``auto`` not yet resolved).

        Raises:
            ValueError: ``exchange_tables`` names a feature the data does not have.
        """
        unknown = sorted(set(self.exchange_tables) - set(features))
        if unknown:
            raise ValueError(f"exchange_tables names unknown features {unknown}; features are {features}")
        return [self.exchange_tables.get(f, self.exchange) for f in features]

    @property
    def fp16_tables(self) -> bool:
        """FBGEMM's tables hold float16 weights (``fp16`` rounded to nearest); otherwise float32."""
        return self.weights_precision is WeightsPrecision.FP16 and self.fp16_rounding is Fp16Rounding.NEAREST

    @property
    def stochastic_rounding(self) -> bool:
        """``fp16`` weights held as float32 and rounded stochastically after each step."""
        return (
            self.weights_precision is WeightsPrecision.FP16 and self.fp16_rounding is Fp16Rounding.STOCHASTIC
        )
