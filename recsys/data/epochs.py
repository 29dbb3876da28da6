"""Epochs, rank shares and the data position of a split's rows (any :class:`RowSource`).

Global batch ``s`` is rows ``[s*B, (s+1)*B)`` of the training split read as an endless sequence of
epochs; rank r of W takes the r-th slice of it, so ranks read disjoint rows, their union is the batch,
and the rows a step sees do not depend on the world size. Epochs follow each other; a split held in
memory with ``shuffle`` makes each epoch a permutation drawn from ``(seed, epoch)``, otherwise every
epoch reads the rows in order (streaming, bounded memory). Either way ``train_batches(start_step=k)``
yields exactly what an uninterrupted iterator yields from step k on.

The held-out split is read once, in order; rank r takes the r-th contiguous share of each block of
``batch_size × W`` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from recsys.data.block import Block
from recsys.data.row_sources import MemorySource, RowSource, rebatch
from recsys.errors import UserError

if TYPE_CHECKING:  # batches need torch and TorchRec, imported when batches are made: the readers do not
    from recsys.data.batch import Batch

__all__ = ["SplitDataset", "train_batches_of", "eval_batches_of"]


def _local(rank: int, world_size: int, rows: int) -> tuple[int, int]:
    return rows * rank // world_size, rows * (rank + 1) // world_size


def train_batches_of(
    source: RowSource,
    feature_names: list[str],
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    start_step: int,
    seed: int,
    shuffle: bool,
) -> Iterator[Batch]:
    """This rank's slice of global batches ``start_step, start_step + 1, ...`` of a training split."""
    if batch_size % world_size:
        raise UserError(
            f"the global batch size {batch_size} must be divisible by the world size {world_size}"
        )
    from recsys.data.batch import block_batch

    lo, hi = _local(rank, world_size, batch_size)
    if isinstance(source, MemorySource):
        yield from _memory_batches(source.block, feature_names, lo, hi, batch_size, start_step, seed, shuffle)
        return
    total = source.num_rows()
    if total == 0:
        raise UserError("the training split has no rows")
    skip = start_step * batch_size % total

    def endless() -> Iterator[Block]:  # epochs follow each other, each a pass in file order
        first = skip
        while True:
            rows = 0
            for block in source.blocks(skip_rows=first):
                rows += block.num_rows
                yield block
            if rows == 0 and first == 0:  # a source that counts rows but yields none would loop forever
                raise UserError(f"the training split should have {total} rows but reading it gave none")
            first = 0

    for block in rebatch(endless(), batch_size):
        yield block_batch(block.slice(lo, hi), feature_names)


def _memory_batches(
    block: Block,
    feature_names: list[str],
    lo: int,
    hi: int,
    batch_size: int,
    start_step: int,
    seed: int,
    shuffle: bool,
) -> Iterator[Batch]:
    from recsys.data.batch import block_batch

    # Training has no use for the rows' origins: not gathering them keeps every step's take() as cheap.
    block = Block(block.dense, block.ids, block.labels)
    total = block.num_rows
    if total == 0:
        raise UserError("the training split has no rows")
    perms: dict[int, np.ndarray] = {}

    def perm(epoch: int) -> np.ndarray:
        if epoch not in perms:
            if len(perms) > 2:
                perms.clear()
            perms[epoch] = np.random.default_rng([seed, epoch, 0xDA7A]).permutation(total)
        return perms[epoch]

    step = start_step
    while True:
        pos = step * batch_size + np.arange(lo, hi, dtype=np.int64)
        epoch, offset = np.divmod(pos, total)
        if shuffle:
            index = np.empty_like(pos)
            for e in np.unique(epoch):
                sel = epoch == e
                index[sel] = perm(int(e))[offset[sel]]
        else:
            index = offset
        yield block_batch(block.take(index), feature_names)
        step += 1


def eval_batches_of(
    source: RowSource, feature_names: list[str], *, rank: int, world_size: int, batch_size: int
) -> Iterator[Batch]:
    """This rank's disjoint share of the held-out split: the r-th slice of each block of B × W rows."""
    from recsys.data.batch import block_batch

    for block in rebatch(source.blocks(), batch_size * world_size):
        lo, hi = _local(rank, world_size, block.num_rows)
        if hi > lo:
            yield block_batch(block.slice(lo, hi), feature_names)


class SplitDataset:
    """The Dataset methods of a dataset whose two splits are row sources (subclasses set the attributes).

    Attributes:
        _train, _eval: the training and held-out splits.
        _names, _spaces: per sparse feature, its name and id space.
        seed: fixes the per-epoch shuffle.
        shuffle: shuffle the training rows each epoch (a split held in memory).
    """

    _train: RowSource
    _eval: RowSource
    _names: list[str]
    _spaces: list[int]
    seed: int
    shuffle: bool

    @property
    def feature_names(self) -> list[str]:
        return self._names

    @property
    def id_spaces(self) -> list[int]:
        return self._spaces

    def train_batches(
        self, *, rank: int, world_size: int, batch_size: int, start_step: int
    ) -> Iterator[Batch]:
        return train_batches_of(
            self._train,
            self._names,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            start_step=start_step,
            seed=self.seed,
            shuffle=self.shuffle,
        )

    def eval_batches(self, *, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        return eval_batches_of(
            self._eval, self._names, rank=rank, world_size=world_size, batch_size=batch_size
        )
