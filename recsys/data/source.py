"""What the trainer needs from a dataset, and how ``[data] source`` picks one.

A dataset gives each rank a disjoint share of every global batch, deterministically for a seed, and can
start at any step (the data position of a checkpoint). Its schema — dense features, sparse features and
their id spaces — sizes the model's tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from recsys.data.batch import Batch
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.errors import UserError

__all__ = ["Dataset", "DataConfig", "build_dataset"]


@runtime_checkable
class Dataset(Protocol):
    """A source of training and held-out batches."""

    @property
    def feature_names(self) -> list[str]:
        """Sparse feature names, in KJT key order."""
        ...

    @property
    def id_spaces(self) -> list[int]:
        """Per sparse feature, ids lie in [0, id_space) (up to 2**63 for raw hashed ids)."""
        ...

    @property
    def num_dense(self) -> int: ...

    def train_batches(
        self, *, rank: int, world_size: int, batch_size: int, start_step: int
    ) -> Iterator[Batch]:
        """This rank's share of global batches ``start_step, start_step + 1, ...`` (``batch_size`` is global)."""
        ...

    def eval_batches(self, *, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """This rank's disjoint share of the held-out split (``batch_size`` samples per rank per batch)."""
        ...


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """Where the data comes from (section ``[data]``).

    Attributes:
        source: ``synthetic`` (configured in ``[synthetic]``).
    """

    source: str = "synthetic"

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("source must not be empty")


def build_dataset(config: DataConfig, *, synthetic: SyntheticConfig, seed: int) -> Dataset:
    """The dataset named by ``config.source``."""
    if config.source == "synthetic":
        return SyntheticCriteo(synthetic, seed=seed)
    raise UserError(f"unknown data source {config.source!r}; valid: synthetic")
