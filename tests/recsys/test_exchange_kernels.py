"""The rows exchange's compiled planning loops (recsys/exchange_kernels.py) against plain Python loops over
the same batch."""

from __future__ import annotations

import numpy as np
import pytest

from recsys.exchange_kernels import lookup_layout, pooling_plan, window_members


def _window_starts(batch: int, windows: int) -> np.ndarray:
    base, extra = divmod(batch, windows)
    sizes = [base + (1 if w < extra else 0) for w in range(windows)]
    return np.cumsum([0, *sizes]).astype(np.int64)


@pytest.mark.parametrize(("multi_hot", "rows_features"), [(1, 3), (1, 2), (3, 3), (0, 3)])
def test_pooling_plan_matches_a_python_reference(multi_hot, rows_features) -> None:
    rng = np.random.default_rng(multi_hot * 10 + rows_features)
    features, batch, windows, requests = 3, 11, 3, 9
    if multi_hot == 0:  # lengths of 0 to 2: no window is one-hot
        lengths = rng.integers(0, 3, features * batch)
    else:
        lengths = np.full(features * batch, multi_hot, dtype=np.int64)
    lengths = lengths.astype(np.int64)
    occurrence = rng.integers(0, requests, int(lengths.sum())).astype(np.int64)
    feature_of = np.repeat(
        np.arange(features), [lengths[f * batch : (f + 1) * batch].sum() for f in range(3)]
    )
    occurrence[feature_of >= rows_features] = -1  # the last feature goes pooled, when rows_features is 2
    starts = _window_starts(batch, windows)
    window_of_sample = np.repeat(np.arange(windows), np.diff(starts)).astype(np.int64)
    sample_of = np.repeat(np.tile(np.arange(batch), features), lengths)
    mask = np.zeros(requests, dtype=np.int64)  # the windows that use each request
    for u, s in zip(occurrence, sample_of, strict=True):
        if u >= 0:
            mask[u] |= 1 << int(window_of_sample[s])
    index, bag, offsets, one_hot = pooling_plan(occurrence, lengths, batch, window_of_sample, starts, mask)

    # the reference: window w receives the requests with bit w, in order
    place = {
        w: {u: k for k, u in enumerate(u for u in range(requests) if mask[u] >> w & 1)}
        for w in range(windows)
    }
    expected: dict[int, list[tuple[int, int, int, int]]] = {
        w: [] for w in range(windows)
    }  # (f, s, index, bag)
    i = 0
    for f in range(features):
        for s in range(batch):
            for _ in range(lengths[f * batch + s]):
                w = int(window_of_sample[s])
                if occurrence[i] >= 0:
                    size = int(starts[w + 1] - starts[w])
                    expected[w].append((f, s, place[w][int(occurrence[i])], f * size + s - int(starts[w])))
                i += 1
    for w in range(windows):
        got_index = index[offsets[w] : offsets[w + 1]].tolist()
        hot = multi_hot == 1 and rows_features == features
        assert bool(one_hot[w]) == hot
        if hot:  # sample by sample: the (b, F * D) output's row order
            assert got_index == [x for _, _, x, _ in sorted(expected[w], key=lambda e: (e[1], e[0]))]
        else:
            assert got_index == [x for _, _, x, _ in expected[w]]
            assert bag[offsets[w] : offsets[w + 1]].tolist() == [b for *_, b in expected[w]]


def test_window_members_match_a_python_reference() -> None:
    rng = np.random.default_rng(3)
    windows, world = 4, 3
    mask = rng.integers(0, 1 << windows, 50).astype(np.int64)
    rank = np.sort(rng.integers(0, world, 50)).astype(np.int64)
    members, counts = window_members(mask, rank, windows, world)
    expected = [[u for u in range(50) if mask[u] >> w & 1] for w in range(windows)]
    assert members.tolist() == [u for per_window in expected for u in per_window]
    assert counts.tolist() == [
        [sum(1 for u in expected[w] if rank[u] == r) for r in range(world)] for w in range(windows)
    ]


def test_lookup_layout_matches_a_python_reference() -> None:
    # 4 features: 0 and 2 in module 0 (tables 0 and 1), 3 in module 1, 1 held by no module here
    asked = np.array([[3, 0, 1, 2], [2, 0, 4, 0]], dtype=np.int64)
    local = np.arange(100, 100 + int(asked.sum()), dtype=np.int64)
    module_of = np.array([0, -1, 0, 1], dtype=np.int64)
    position_of = np.array([0, 0, 1, 0], dtype=np.int64)
    tables = np.array([2, 1], dtype=np.int64)
    values, lengths, bags, index = lookup_layout(asked, local, module_of, position_of, tables)

    requests = [(r, f) for r in range(2) for f in range(4) for _ in range(asked[r, f])]  # in the order asked
    per_table: dict[tuple[int, int], list[int]] = {}
    for k, (_, f) in enumerate(requests):
        per_table.setdefault((int(module_of[f]), int(position_of[f])), []).append(k)
    expected_bags = [max(len(per_table.get((m, t), [])) for t in range(tables[m])) for m in range(2)]
    assert bags.tolist() == expected_bags == [5, 2]
    order = [k for m in range(2) for t in range(tables[m]) for k in per_table.get((m, t), [])]
    assert values.tolist() == [int(local[k]) for k in order]
    assert lengths.tolist() == [
        int(b < len(per_table.get((m, t), [])))
        for m in range(2)
        for t in range(tables[m])
        for b in range(bags[m])
    ]
    base = [0, expected_bags[0] * 2]
    for k, (_, f) in enumerate(requests):
        m, t = int(module_of[f]), int(position_of[f])
        assert index[k] == base[m] + per_table[(m, t)].index(k) * tables[m] + t

    asked[0, 1] = 1  # a row of a table this rank holds no shard of
    with pytest.raises(ValueError, match="holds no shard of"):
        lookup_layout(asked, np.zeros(int(asked.sum()), dtype=np.int64), module_of, position_of, tables)
