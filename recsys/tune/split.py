"""Split a memory budget across tables: a multiple-choice knapsack solved exactly on a grid.

Each table offers a few candidate capacities, each with a cost (bytes) and a value (bytes of rows it
saves from moving, i.e. hits weighted by the table's row size). The dynamic program over budget units
picks one candidate per table to maximise the total value; costs are rounded *up* to units, so the
chosen capacities never exceed the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["split_budget"]


def split_budget(
    costs: Sequence[np.ndarray], values: Sequence[np.ndarray], budget: float, *, units: int = 2048
) -> list[int] | None:
    """Pick one candidate per table maximising ``sum(values[t][k_t])`` with ``sum(costs[t][k_t]) <= budget``.

    Args:
        costs: per table, (K_t,) non-negative costs of its candidates.
        values: per table, (K_t,) values of its candidates.
        budget: the total cost allowed.
        units: resolution of the budget grid (costs round up to ``budget / units``).

    Returns:
        the chosen candidate index of each table, or None when even the cheapest choices exceed the budget.

    Example:
        >>> split_budget([np.array([1, 2]), np.array([1, 2])], [np.array([0, 5]), np.array([0, 3])], 3)
        [1, 0]
    """
    if budget < 0:
        return None
    integral = all(np.all(np.asarray(c) == np.round(np.asarray(c))) for c in costs)
    unit = 1.0 if integral and budget <= units else max(budget / units, 1e-12)  # small integer cases: exact
    units = int(budget // unit)
    weights = [np.ceil(np.asarray(c, dtype=np.float64) / unit - 1e-9).astype(np.int64) for c in costs]
    neg = -np.inf
    best = np.zeros(units + 1)  # best[u]: best value using at most u units
    choice: list[np.ndarray] = []
    for w, v in zip(weights, values, strict=True):
        new = np.full(units + 1, neg)
        pick = np.full(units + 1, -1, dtype=np.int64)
        for k, (wk, vk) in enumerate(zip(w.tolist(), np.asarray(v, dtype=np.float64).tolist(), strict=True)):
            if wk > units:
                continue
            cand = np.full(units + 1, neg)
            cand[wk:] = best[: units + 1 - wk] + vk
            better = cand > new
            new[better] = cand[better]
            pick[better] = k
        best = new
        choice.append(pick)
    if not np.isfinite(best[units]):
        return None
    out: list[int] = []
    u = units
    for w, pick in zip(reversed(weights), reversed(choice), strict=True):
        k = int(pick[u])
        out.append(k)
        u -= int(w[k])
    return out[::-1]
