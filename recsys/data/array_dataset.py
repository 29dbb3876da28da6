"""A Dataset over numpy arrays in memory — the quickest way to plug in data from a factory.

Its splits are two :class:`~recsys.data.block.Block` held in memory; :mod:`recsys.data.epochs` turns
them into epochs and rank shares like those of a spec's dataset.
"""

from __future__ import annotations

import numpy as np

from recsys.data.block import Block, Jagged
from recsys.data.epochs import SplitDataset
from recsys.data.row_sources import MemorySource
from recsys.data.stats import SplitStats, stats_of_source

__all__ = ["ArrayDataset"]


class ArrayDataset(SplitDataset):
    """A Dataset over numpy arrays in memory — the quickest way to plug in data from a factory.

    Args:
        train, eval: the splits as :class:`Block` (or use :meth:`from_arrays`).
        features: each sparse feature's id space, in the order of the blocks' id columns.
        seed: fixes the per-epoch shuffle.
        shuffle: shuffle the training rows each epoch.

    Example:
        >>> ds = ArrayDataset.from_arrays(
        ...     dense=np.zeros((100, 2), np.float32), ids={"user": np.arange(100) % 7},
        ...     labels=np.arange(100) % 2, id_spaces={"user": 7}, eval_fraction=0.2)
        >>> next(ds.train_batches(rank=0, world_size=1, batch_size=8, start_step=0)).dense.shape
        torch.Size([8, 2])
    """

    def __init__(
        self,
        train: Block,
        eval: Block,
        *,
        features: dict[str, int],
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self._train: MemorySource = MemorySource(train)
        self._eval = MemorySource(eval)
        self._names, self._spaces = list(features), list(features.values())
        self.seed, self.shuffle = seed, shuffle

    @classmethod
    def from_arrays(
        cls,
        *,
        dense: np.ndarray,
        ids: dict[str, np.ndarray],
        labels: np.ndarray,
        id_spaces: dict[str, int],
        eval_fraction: float = 0.1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> ArrayDataset:
        """Single-hot ids (N,) per feature; the last ``eval_fraction`` of rows are held out."""
        n = labels.shape[0]
        block = Block(
            np.asarray(dense, np.float32).reshape(n, -1),
            tuple(Jagged.single(np.asarray(v, np.int64)) for v in ids.values()),
            np.asarray(labels, np.float32),
        )
        cut = n - round(n * eval_fraction)
        return cls(
            block.slice(0, cut),
            block.slice(cut, n),
            features={k: id_spaces[k] for k in ids},
            seed=seed,
            shuffle=shuffle,
        )

    @property
    def num_dense(self) -> int:
        return int(self._train.block.dense.shape[1])

    def split_stats(self) -> dict[str, SplitStats]:
        """Rows and positives of the training and held-out arrays (exact)."""
        return {"train": stats_of_source(self._train), "eval": stats_of_source(self._eval)}
