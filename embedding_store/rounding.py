"""Deterministic stochastic rounding of float32 rows to float16 values.

An ``fp16`` table trained with ``stochastic`` rounding keeps float32 slot rows whose values are always
float16 numbers: after every optimizer step the rows the step touched are rounded to float16, up or down
with probability given by the distance to the two neighbours (unbiased: small updates are not lost to
rounding as they are when rounding to nearest). The random bits are a pure function of ``(seed, table, id,
step, column)`` — a SplitMix64 hash as in :mod:`embedding_store.init` — so a row's rounding does not depend
on where the row sits (slot, rank, tier) or on what else the step touched: a tiered run and an in-memory
run round the same values the same way, and every tier below the slot table stores them losslessly in 16
bits.

Two implementations of the one definition: a compiled loop that rounds rows of a CPU table in place, and
torch operations for tables on another device (``tests/embedding_store/test_rounding.py`` holds them equal
bit for bit, and both against numpy's float16 for the values they may give).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from embedding_store.hashing import _M1, _M2, mix64_inplace
from embedding_store.init import _GOLDEN, _mix64, table_key

__all__ = ["round_rows_", "round_values", "step_key"]

_DROP = 13  # float32 mantissa bits below float16's
_SUBNORMAL = np.float32(2.0**-14)  # float16's smallest normal; below it its step is 2^-24
_MAX_EXP_BITS = np.uint32((127 + 15) << 23)  # float32 exponent field of float16's largest binade


def step_key(seed: int, table: str, step: int) -> int:
    """The 64-bit stream key of one table's rounding at one step (0-based)."""
    x = np.array(
        [int(table_key(seed, table)) ^ ((step + 1) * int(_GOLDEN) & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64
    )
    return int(mix64_inplace(x)[0])


@numba.njit("void(float32[:, :], uint32[:, :], int64[:], uint64[:], uint64, int64)", nogil=True, cache=True)
def _round_rows(
    weights: np.ndarray,
    bits: np.ndarray,
    rows: np.ndarray,
    ids: np.ndarray,
    key: np.uint64,
    col_offset: np.int64,
) -> None:  # pragma: no cover - compiled
    """Round ``rows`` of ``weights`` in place (``bits``: the same storage as uint32); non-finite values
    and zeros stay as they are."""
    exp_mask = np.uint32(0x7F800000)
    for i in range(rows.shape[0]):
        x = _mix64(ids[i] ^ key)
        row = rows[i]
        for j in range(weights.shape[1]):
            b = bits[row, j]
            if b & exp_mask == exp_mask or b & np.uint32(0x7FFFFFFF) == 0:  # non-finite, or a zero
                continue
            h = _mix64(x + np.uint64(j + col_offset + 1) * _GOLDEN)
            r = np.uint32(h >> np.uint64(64 - _DROP))
            v = weights[row, j]
            if abs(v) < _SUBNORMAL:  # float16 subnormals: a fixed step of 2^-24
                u = np.float32(r) * np.float32(2.0**-13)
                weights[row, j] = np.float32(np.floor(np.float32(v * np.float32(2.0**24)) + u)) * np.float32(
                    2.0**-24
                )
                continue
            out = np.uint32((b + r) & np.uint32(0xFFFFE000))  # the magnitude up with the dropped bits' odds
            if out & exp_mask > _MAX_EXP_BITS:  # past float16's largest finite value: infinite
                out = np.uint32((out & np.uint32(0x80000000)) | exp_mask)
            bits[row, j] = out


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping products; shifts made logical by masking)."""
    m1, m2 = (int(m) - (1 << 64) for m in (_M1, _M2))  # the same bits as int64
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * m1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * m2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def round_values(values: torch.Tensor, ids: torch.Tensor, *, key: int, col_offset: int = 0) -> torch.Tensor:
    """(n, D) float32 ``values`` of rows ``ids`` (n,) rounded to float16 values, as float32, on their device.

    Args:
        values: (n, D) float32.
        ids: (n,) int64 row ids (non-negative).
        key: :func:`step_key` of the table and step.
        col_offset: the first column's index in the full row (column shards).
    """
    device = values.device
    x = _mix_torch(ids.to(device=device, dtype=torch.int64) ^ _signed(key))  # (n,)
    cols = torch.arange(col_offset + 1, col_offset + 1 + values.shape[1], device=device, dtype=torch.int64)
    h = _mix_torch(x[:, None] + cols[None, :] * _signed(int(_GOLDEN)))  # (n, D)
    r = ((h >> (64 - _DROP)) & ((1 << _DROP) - 1)).to(torch.int32)
    bits = values.contiguous().view(torch.int32)
    out = (bits + r) & ~((1 << _DROP) - 1)
    exponent = out & 0x7F800000
    inf = (out & ~0x7FFFFFFF) | 0x7F800000  # the sign with an infinite magnitude
    out = torch.where(exponent > int(_MAX_EXP_BITS), inf, out).view(torch.float32)
    u = r.to(torch.float32) * 2.0**-13
    small = torch.floor(values * 2.0**24 + u) * 2.0**-24
    out = torch.where(values.abs() < float(_SUBNORMAL), small, out)
    return torch.where(torch.isfinite(values) & (values != 0), out, values)


@torch.no_grad()
def round_rows_(
    weights: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, *, key: int, col_offset: int = 0
) -> None:
    """Round rows ``rows`` (n,) of the float32 table ``weights`` (S, D) in place; ``ids`` (n,) are their
    row ids (the hash's input, wherever the rows sit). Rows must be distinct."""
    if rows.numel() == 0:
        return
    if weights.device.type == "cpu":
        w = weights.detach().numpy()  # a view of the same storage
        r = np.ascontiguousarray(rows.cpu().numpy(), dtype=np.int64)
        i = np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int64).view(np.uint64)
        _round_rows(w, w.view(np.uint32), r, i, np.uint64(key), np.int64(col_offset))
        return
    index = rows.to(weights.device)
    values = weights.index_select(0, index)
    weights.index_copy_(0, index, round_values(values, ids, key=key, col_offset=col_offset))
