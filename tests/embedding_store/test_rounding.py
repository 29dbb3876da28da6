"""Stochastic rounding to float16 values (embedding_store.rounding): the compiled in-place loop and the
torch operations give the same bits; every result is one of the value's two float16 neighbours, chosen
without bias; the choice is a function of (key, id, column) only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding_store.rounding import round_rows_, round_values, step_key


def _values(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Values from float16's subnormals to past its largest, both signs, and the special cases."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-9, 5, n, dtype=torch.float64)[:, None]
    w = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).float()
    w[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 65504.0])
    w[1, :4] = torch.tensor([65519.0, -65520.0, 2.0**-24, -(2.0**-14)])
    return w


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float16 values just below-or-at and just above-or-at each float32 value (as float64)."""
    with np.errstate(over="ignore"):
        near = x.astype(np.float16)
        below = np.where(near.astype(np.float64) > x, np.nextafter(near, np.float16(-np.inf)), near)
        above = np.where(near.astype(np.float64) < x, np.nextafter(near, np.float16(np.inf)), near)
    return below.astype(np.float64), above.astype(np.float64)


def test_compiled_loop_equals_torch_operations():
    w = _values(64, 24)
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:48]
    ids = rows * 104729 + (1 << 40)
    key = step_key(3, "t_user", 17)
    expected = round_values(w[rows], ids, key=key, col_offset=5)
    rounded = w.clone()
    round_rows_(rounded, rows, ids, key=key, col_offset=5)
    got = rounded[rows]
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(rounded[untouched].view(torch.int32), w[untouched].view(torch.int32))


def test_results_are_float16_neighbours():
    w = _values(256, 32)
    ids = torch.arange(256)
    out = round_values(w, ids, key=step_key(0, "t", 0)).numpy()
    x = w.numpy()
    finite = np.isfinite(x) & (np.abs(x) <= 65504)
    as_half = out.astype(np.float16).astype(np.float32)
    assert np.array_equal(as_half[finite].view(np.int32), out[finite].view(np.int32))  # float16 values
    below, above = _neighbours(x[finite])
    o = out[finite].astype(np.float64)
    assert np.all((o == below) | (o == above))
    assert np.array_equal(np.isnan(out), np.isnan(x))
    assert np.array_equal(out[np.isinf(x)], x[np.isinf(x)])
    # past float16's largest finite value: rounds to it or to infinity, never to a wrong finite value
    big = out[1, :2]
    assert big[0] in (65504.0, np.inf) and big[1] in (-65504.0, -np.inf)


@pytest.mark.parametrize("value", [1.0 + 2.0**-12, -3.0e-7, 1234.567, -(2.0**-14) * 1.3])
def test_unbiased(value):
    """The mean of many roundings of one value is the value (to the sampling error), unlike rounding to
    nearest, which would return one neighbour every time."""
    n = 40_000
    x = torch.full((n, 1), value, dtype=torch.float32)
    out = round_values(x, torch.arange(n), key=step_key(1, "t_item", 2)).double()
    below, above = _neighbours(np.array([np.float32(value)]))
    spread = above[0] - below[0]
    assert set(torch.unique(out).tolist()) == {below[0], above[0]}
    share_up = (float(np.float32(value)) - below[0]) / spread
    assert abs(float((out == above[0]).double().mean()) - share_up) < 0.01


def test_a_function_of_key_id_and_column_only():
    w = _values(32, 16)
    ids = torch.arange(32) * 7
    key = step_key(0, "t_a", 5)
    a = round_values(w, ids, key=key)
    # the same rows in another order and in other company round the same way
    order = torch.randperm(32, generator=torch.Generator().manual_seed(3))
    b = round_values(w[order], ids[order], key=key)
    assert torch.equal(a[order].view(torch.int32), b.view(torch.int32))
    # another step, table or seed draws other bits: see test_every_normal_value_draws_with_the_key
    # a column shard rounds its columns as the whole row does
    whole = round_values(w, ids, key=key)
    part = round_values(w[:, 6:], ids, key=key, col_offset=6)
    assert torch.equal(whole[:, 6:].view(torch.int32), part.view(torch.int32))


def _midpoints(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """(n, d) float32 values halfway between two neighbouring normal float16 values, both signs: each rounds
    up or down with probability 1/2, so any two independent draws differ half of the time."""
    g = np.random.default_rng(seed)
    low = g.uniform(2.0**-14, 60000.0, (n, d)).astype(np.float16)  # normal float16 values (rounded)
    high = np.nextafter(low, np.float16(np.inf))
    mid = (low.astype(np.float32) + high.astype(np.float32)) / 2  # exact in float32
    sign = np.where(g.random((n, d)) < 0.5, -1.0, 1.0).astype(np.float32)
    return torch.from_numpy(mid * sign)


def test_every_normal_value_draws_with_the_key():
    """Each normal-range value's draw depends on the key: another step, table or seed rounds about half of
    the values at a midpoint the other way, and across 8 keys almost every value takes both neighbours (a
    rounding that ignored the key for normal values passed the old any-value-differs check)."""
    w = _midpoints(64, 32)
    ids = torch.arange(64) * 7 + 3
    base = round_values(w, ids, key=step_key(0, "t_a", 5))
    for other in (step_key(0, "t_a", 6), step_key(0, "t_b", 5), step_key(1, "t_a", 5)):
        differs = (round_values(w, ids, key=other) != base).double().mean().item()
        assert 0.44 < differs < 0.56, differs  # 2,048 fair draws: 0.5 +- 0.011
    draws = torch.stack([round_values(w, ids, key=step_key(0, "t_a", s)) for s in range(8)])
    both = (draws.amax(0) != draws.amin(0)).double().mean().item()
    assert both > 0.97, both  # 1 - 2**-7 = 0.992 expected


def test_float16_values_stay_as_they_are():
    with np.errstate(over="ignore"):
        x = torch.from_numpy(_values(128, 16).numpy().astype(np.float16).astype(np.float32))
    out = round_values(x, torch.arange(128), key=step_key(0, "t", 3))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))
