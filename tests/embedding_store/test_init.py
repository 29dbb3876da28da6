"""Row initialisation: the compiled fill gives, bit for bit, the documented numpy construction."""

from __future__ import annotations

import numpy as np
import torch

from embedding_store.hashing import mix64_inplace
from embedding_store.init import init_rows, table_key

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _reference(ids: np.ndarray, *, dim: int, seed: int, table: str, scale: float) -> np.ndarray:
    """The construction in numpy ops: SplitMix64 of mix64(id ^ key) + (column + 1) * golden, its top 24
    bits as a unit float32, scaled to [-scale, scale) with float32 rounding at each operation."""
    base = mix64_inplace(ids.astype(np.int64).view(np.uint64) ^ table_key(seed, table))
    cols = (np.arange(dim, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    h = mix64_inplace(base[:, None] + cols[None, :])
    unit = (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    return unit * np.float32(2.0 * scale) - np.float32(scale)


def test_init_rows_equals_the_numpy_construction_bitwise() -> None:
    rng = np.random.default_rng(0)
    for trial in range(120):
        n, dim = int(rng.integers(0, 2_000)), int(rng.integers(1, 130))
        high = 1 << 63 if trial % 2 else 10_000
        ids = rng.integers(0, high, size=n, dtype=np.int64)
        seed = int(rng.integers(0, 1 << 40))
        scale = float(rng.random()) * float(10.0 ** rng.integers(-4, 2))
        got = init_rows(ids, dim=dim, seed=seed, table=f"t{trial}", scale=scale).numpy()
        want = _reference(ids, dim=dim, seed=seed, table=f"t{trial}", scale=scale)
        assert got.tobytes() == want.tobytes(), f"trial {trial}"


def test_init_rows_is_a_function_of_seed_table_and_id_only() -> None:
    """A row's value does not depend on the other ids asked for, their order or the input type; the
    values lie in [-scale, scale)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 1 << 62, size=500, dtype=np.int64)
    whole = init_rows(ids, dim=8, seed=3, table="a", scale=0.05)
    sub = rng.permutation(500)[:77]
    strided = init_rows(torch.from_numpy(ids)[sub], dim=8, seed=3, table="a", scale=0.05)
    assert torch.equal(strided, whole[sub])
    assert bool((whole >= -0.05).all()) and bool((whole < 0.05).all())
    assert not torch.equal(init_rows(ids, dim=8, seed=4, table="a", scale=0.05), whole)
    assert not torch.equal(init_rows(ids, dim=8, seed=3, table="b", scale=0.05), whole)
    assert init_rows(ids[::2], dim=8, seed=3, table="a", scale=0.05).shape == (250, 8)
