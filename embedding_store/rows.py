"""Rows handed out by the store and its snapshots: packed float32 rows split into weights and state."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from embedding_store.config import TableSpec

__all__ = ["RowChunk", "row_chunk"]


class RowChunk(NamedTuple):
    """Rows of one table in ascending id order.

    Attributes:
        ids: (n,) int64.
        weights: (n, D) float32.
        state: optimizer state, (n,) for EXACT_ROWWISE_ADAGRAD, (n, D) for EXACT_ADAGRAD, None for EXACT_SGD.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor | None


def row_chunk(spec: TableSpec, ids: np.ndarray, rows: np.ndarray) -> RowChunk:
    """(n,) ids and their (n, R) packed rows of ``spec`` as a RowChunk of views into ``rows``."""
    rows_t = torch.from_numpy(np.ascontiguousarray(rows))  # (n, R)
    weights = rows_t[:, : spec.dim]  # (n, D)
    state: torch.Tensor | None = None
    if spec.state_floats == 1:
        state = rows_t[:, spec.dim]  # (n,)
    elif spec.state_floats:
        state = rows_t[:, spec.dim :]  # (n, D)
    return RowChunk(torch.from_numpy(np.ascontiguousarray(ids)), weights, state)
