"""The unit of work of every reader: one rank's share of one training step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from recsys.data.block import Block

__all__ = ["Batch", "block_batch"]


@dataclass
class Batch(Pipelineable):
    """Dense features, sparse features (raw ids) and labels of B samples.

    Shapes: ``dense`` (B, num_dense) float32; ``sparse`` a KJT with one key per sparse feature and
    int64 ids; ``labels`` (B,) float32 in {0, 1}.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            dense=self.dense.pin_memory(), sparse=self.sparse.pin_memory(), labels=self.labels.pin_memory()
        )

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])


def block_batch(block: Block, feature_names: list[str]) -> Batch:
    """A trainer :class:`Batch` of a block's samples; the KJT is feature-major, one key per sparse feature."""
    ids = block.ids
    values = np.concatenate([j.values for j in ids]) if ids else np.zeros(0, np.int64)
    lengths = np.concatenate([j.lengths for j in ids]) if ids else np.zeros(0, np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=feature_names,
        values=torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int32)),
    )
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(block.dense, dtype=np.float32)),
        sparse=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(block.labels, dtype=np.float32)),
    )
