"""Packed rows and what they hold: :func:`pack_weights` and :func:`weights_of` convert a table's
weights to and from the weight words of its packed rows (float32 words; ``fp16`` weights two to a word),
and :class:`RowChunk` is the rows that the store and its snapshots hand out, split into weights and state.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from embedding_store.config import TableSpec, WeightsPrecision

__all__ = ["RowChunk", "pack_weights", "row_chunk", "weights_of"]


def pack_weights(spec: TableSpec, weights: np.ndarray, out: np.ndarray) -> None:
    """Write (n, D) weights into ``out``, the (n, W) weight words of packed rows (``spec.weight_words``;
    a column slice of the rows is fine). float32 weights of an ``fp16`` table are rounded to nearest even
    (numpy's conversion, as FBGEMM's CPU kernels round); an odd D's last half-word is zero."""
    if spec.weights_precision is WeightsPrecision.FP32:
        out[:] = weights
        return
    halves = out.view(np.float16)  # (n, 2W): the words' last axis is contiguous
    halves[:, : spec.dim] = weights
    if spec.dim % 2:
        halves[:, spec.dim] = 0


def weights_of(spec: TableSpec, rows: np.ndarray) -> np.ndarray:
    """(n, D) weights, of the table's precision, of (n, R) packed rows: a view, no copy."""
    words = rows[:, : spec.weight_words]
    if spec.weights_precision is WeightsPrecision.FP32:
        return words
    return words.view(np.float16)[:, : spec.dim]


class RowChunk(NamedTuple):
    """Rows of one table in ascending id order.

    Attributes:
        ids: (n,) int64.
        weights: (n, D), float32 or float16 (the table's ``weights_precision``).
        state: optimizer state, (n,) for EXACT_ROWWISE_ADAGRAD, (n, D) for EXACT_ADAGRAD, None for EXACT_SGD.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor | None


def row_chunk(spec: TableSpec, ids: np.ndarray, rows: np.ndarray) -> RowChunk:
    """(n,) ids and their (n, R) packed rows of ``spec`` as a RowChunk of views into ``rows``."""
    rows = np.ascontiguousarray(rows)
    rows_t = torch.from_numpy(rows)  # (n, R)
    weights = torch.from_numpy(weights_of(spec, rows))  # (n, D), of the table's precision
    state: torch.Tensor | None = None
    w = spec.weight_words
    if spec.state_floats == 1:
        state = rows_t[:, w]  # (n,)
    elif spec.state_floats:
        state = rows_t[:, w:]  # (n, D)
    return RowChunk(torch.from_numpy(np.ascontiguousarray(ids)), weights, state)
