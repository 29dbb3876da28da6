"""Helpers of the embedding_store tests: the lazy-init oracle and slot-table tensors."""

from __future__ import annotations

import numpy as np
import torch

from embedding_store import OptimizerKind, TableSpec, init_rows


def init_packed(spec: TableSpec, seed: int, ids: np.ndarray) -> np.ndarray:
    """(N,) ids -> (N, R) packed rows as the store must create them: init weights, zero state."""
    rows = np.zeros((len(ids), spec.row_floats), dtype=np.float32)
    rows[:, : spec.dim] = init_rows(
        np.asarray(ids, dtype=np.int64), dim=spec.dim, seed=seed, table=spec.name, scale=spec.init_scale
    ).numpy()
    return rows


def slot_tensors(spec: TableSpec, num_slots: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A slot table's weights (S, D) and optimizer state in FBGEMM's shapes, filled with garbage."""
    weights = torch.full((num_slots, spec.dim), float("nan"))
    if spec.optimizer is OptimizerKind.EXACT_SGD:
        return weights, None
    if spec.optimizer is OptimizerKind.EXACT_ROWWISE_ADAGRAD:
        return weights, torch.full((num_slots,), float("nan"))
    return weights, torch.full((num_slots, spec.dim), float("nan"))


def packed_at(weights: torch.Tensor, state: torch.Tensor | None, slots: torch.Tensor | slice) -> np.ndarray:
    """(N,) slots (or a slice) -> (N, R) packed rows read from slot-table-shaped tensors."""
    w = weights[slots].numpy()
    parts = [w]
    if state is not None:
        s = state[slots]
        parts.append((s.unsqueeze(1) if s.dim() == 1 else s).numpy())
    return np.concatenate(parts, axis=1)


def bits(a: np.ndarray) -> np.ndarray:
    """float32 (or float16) array -> its bit patterns, for bitwise comparisons."""
    if a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint16)
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
