"""Training-loop and evaluation settings (sections ``[train]`` and ``[eval]``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DenseOptimizer", "TrainConfig", "EvalConfig"]


class DenseOptimizer(enum.Enum):
    ADAGRAD = "adagrad"
    ADAM = "adam"
    SGD = "sgd"


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """The training loop (section ``[train]``).

    Attributes:
        steps: optimizer steps to run (global batches).
        batch_size: global batch size; each of ``nproc`` ranks takes ``batch_size / nproc`` samples.
        seed: fixes data, initial weights and the hidden model of synthetic data.
        nproc: local worker processes to spawn when not launched by torchrun.
        dense_optimizer: optimizer of the dense (MLP) parameters.
        dense_learning_rate: its learning rate.
        log_every: steps between progress records in metrics.jsonl.
        checkpoint_every: steps between checkpoints (0: only at the end).
        final_checkpoint: write a checkpoint when training ends (whatever ``checkpoint_every`` is), so
            that every run can be evaluated, exported and resumed; false: none at the end (then
            ``checkpoint_every = 0`` writes no checkpoint at all).
        checkpoint_digest: record the model digest in each checkpoint and check, right after a resume
            (or an evaluation) restored it, that the restored model has it; a mismatch stops the run. It
            costs one pass over every touched row per checkpoint and per restore.
        keep_checkpoints: how many of the newest checkpoints to keep.
        threads_per_rank: intra-op threads per rank (0: cores divided by local ranks).
        collective_timeout_s: how long a rank waits in a collective (all-to-all, barrier) for its peers
            before it fails instead of hanging; it must exceed the longest checkpoint of any rank.
    """

    steps: int = 200
    batch_size: int = 1024
    seed: int = 0
    nproc: int = 1
    dense_optimizer: DenseOptimizer = DenseOptimizer.ADAGRAD
    dense_learning_rate: float = 0.05
    log_every: int = 20
    checkpoint_every: int = 0
    final_checkpoint: bool = True
    checkpoint_digest: bool = True
    keep_checkpoints: int = 2
    threads_per_rank: int = 0
    collective_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if not self.dense_learning_rate > 0:
            raise ValueError(f"dense_learning_rate must be > 0, got {self.dense_learning_rate}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not isinstance(self.checkpoint_digest, bool):
            raise ValueError(f"checkpoint_digest must be true or false, got {self.checkpoint_digest!r}")
        if not isinstance(self.final_checkpoint, bool):
            raise ValueError(f"final_checkpoint must be true or false, got {self.final_checkpoint!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.threads_per_rank < 0:
            raise ValueError(f"threads_per_rank must be >= 0, got {self.threads_per_rank}")
        if not 0 < self.collective_timeout_s < 1e7:
            raise ValueError(f"collective_timeout_s must be in (0, 1e7), got {self.collective_timeout_s}")


@dataclass(kw_only=True, frozen=True, slots=True)
class EvalConfig:
    """Evaluation on the held-out split (section ``[eval]``).

    Attributes:
        every: steps between evaluations (0: only at the end). With ``every > 0`` the run also keeps the
            checkpoint of its best evaluation in ``<run>/best/``.
        batch_size: samples per rank per evaluation batch.
        select: the held-out metric that picks the best evaluation: ``logloss`` (lower is better) or
            ``auc`` (higher is better).
        patience: stop training after this many evaluations in a row without a better ``select`` metric
            (0: never stop early).
        group_by: a sparse feature whose id groups the held-out samples (the user, say); each evaluation
            then adds ``gauc``, ``ndcg_at_10`` and ``recall_at_10`` (``recsys/ranking.py``). "": none.
    """

    every: int = 0
    batch_size: int = 4096
    select: str = "logloss"
    patience: int = 0
    group_by: str = ""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.select not in ("logloss", "auc"):
            raise ValueError(f"select must be 'logloss' or 'auc', got {self.select!r}")
        if self.patience < 0:
            raise ValueError(f"patience must be >= 0, got {self.patience}")
        if self.patience and not self.every:
            raise ValueError("patience needs every > 0 (evaluations during training)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
