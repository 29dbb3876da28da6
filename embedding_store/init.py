"""Deterministic row initialisation.

A row's initial value is a pure function of ``(seed, table, id)``: it does not depend on cache sizes,
tiers, ranks, sharding or the order in which ids are first touched. The store uses it to create rows
lazily on first access, and untiered reference tables use the very same function, which is what makes
"tiered training is bitwise identical to untiered training" checkable.

Each value is drawn from a counter-based generator (a 64-bit mixing hash of seed, table, id and
column: :mod:`embedding_store.hashing`), so any subset of rows can be produced without producing the
others.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from embedding_store.hashing import mix64_inplace

__all__ = ["init_rows", "table_key"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_VALUES = 1 << 22  # bound the temporary uint64 buffers (~32 MiB each)


@functools.lru_cache(maxsize=1024)
def table_key(seed: int, table: str) -> np.uint64:
    """The 64-bit stream key of one table under one seed."""
    name_hash = zlib.crc32(table.encode("utf-8"))
    x = np.array([(seed & 0xFFFFFFFF) << 32 | name_hash], dtype=np.uint64)
    return mix64_inplace(mix64_inplace(x))[0]


def init_rows(
    ids: torch.Tensor | np.ndarray,
    *,
    dim: int,
    seed: int,
    table: str,
    scale: float,
) -> torch.Tensor:
    """Initial weights of the rows ``ids`` of ``table``: uniform in ``[-scale, scale)``.

    Args:
        ids: (N,) int64 ids, any order, duplicates allowed; must be non-negative.
        dim: embedding dimension D.
        seed: the run's seed.
        table: the table's name.
        scale: half-width of the uniform distribution.

    Returns:
        (N, D) float32 tensor on the CPU.

    Example:
        >>> rows = init_rows(torch.tensor([3, 1 << 62]), dim=4, seed=0, table="t0", scale=0.01)
        >>> rows.shape
        torch.Size([2, 4])
    """
    ids_np = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    ids_np = ids_np.astype(np.int64, copy=False).reshape(-1)
    n = ids_np.shape[0]
    out = np.empty((n, dim), dtype=np.float32)
    if n == 0:
        return torch.from_numpy(out)
    key = table_key(seed, table)
    cols = (np.arange(dim, dtype=np.uint64) + np.uint64(1)) * _GOLDEN  # (D,)
    rows_per_chunk = max(1, _CHUNK_VALUES // dim)
    two_scale = np.float32(2.0 * scale)
    f_scale = np.float32(scale)
    for start in range(0, n, rows_per_chunk):
        chunk = ids_np[start : start + rows_per_chunk].view(np.uint64)
        base = mix64_inplace(chunk ^ key)  # (n,)
        h = mix64_inplace(base[:, None] + cols[None, :])  # (n, D)
        unit = (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1), exact
        out[start : start + rows_per_chunk] = unit * two_scale - f_scale
    return torch.from_numpy(out)
