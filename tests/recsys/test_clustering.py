"""Key-centric sample clustering (recsys/clustering.py), checked against plain Python oracles.

Oracles: a batch re-assembled sample by sample from Python lists (permute_batch); the windows' distinct
ids counted with Python sets, window sizes from divmod (distinct_per_window, and the gain of
cluster_order); requests and bags tracked by hand (which windows a request's samples land in, whether
the samples with one bag are contiguous).

The structured batch is a rank's share of a step of a recommender fed by requests: 64 requests of 16
samples, 13 "user" features whose ids are drawn once per request, 13 "item" features drawn per sample
from a Zipf law, the requests' samples interleaved in arrival order. Clustered (W = 4) its windows hold
7,814 distinct ids against 10,291 in arrival order (W = 2: 7,053 / 7,894; W = 8: 8,653 / 13,735); the
bounds below leave a margin of a few percent.
"""

from __future__ import annotations

import copy
from itertools import pairwise

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.clustering import cluster_order, distinct_per_window, permute_batch
from recsys.data.batch import Batch

Bags = list[list[list[int]]]  # bags[f][i]: the ids of sample i for feature f


def _kjt(bags: Bags, *, weights: list[list[list[float]]] | None = None, lengths_dtype=torch.int32):
    """A feature-major KJT of ``bags`` (and per-id ``weights``), built from flat Python lists."""
    values = [i for feature in bags for bag in feature for i in bag]
    lengths = [len(bag) for feature in bags for bag in feature]
    flat_weights = None
    if weights is not None:
        flat_weights = torch.tensor(
            [w for feature in weights for bag in feature for w in bag], dtype=torch.float32
        )
    return KeyedJaggedTensor(
        keys=[f"cat_{f}" for f in range(len(bags))],
        values=torch.tensor(values, dtype=torch.int64),
        weights=flat_weights,
        lengths=torch.tensor(lengths, dtype=lengths_dtype),
        stride=len(bags[0]),
    )


def _unpack(kjt: KeyedJaggedTensor) -> tuple[Bags, list[list[list[float]]] | None]:
    """The bags (and weights) of a KJT as Python lists, read bag by bag from its flat tensors."""
    values, lengths = kjt.values().tolist(), kjt.lengths().tolist()
    weights = kjt.weights_or_none()
    flat_weights = weights.tolist() if weights is not None else None
    batch, out, out_weights, at = kjt.stride(), [], [], 0
    for f in range(len(kjt.keys())):
        out.append([])
        out_weights.append([])
        for i in range(batch):
            n = lengths[f * batch + i]
            out[f].append(values[at : at + n])
            if flat_weights is not None:
                out_weights[f].append(flat_weights[at : at + n])
            at += n
    return out, (out_weights if flat_weights is not None else None)


def _sizes(batch: int, windows: int) -> list[int]:
    base, extra = divmod(batch, windows)
    return [base + (1 if w < extra else 0) for w in range(windows)]


def _oracle_distinct(bags: Bags, order: list[int], windows: int, keep=None) -> int:
    """Sum over windows and features of the distinct ids in the window (``keep(f, id)`` filters ids)."""
    total, start = 0, 0
    for size in _sizes(len(order), windows):
        window = order[start : start + size]
        for f, feature in enumerate(bags):
            total += len({i for s in window for i in feature[s] if keep is None or keep(f, i)})
        start += size
    return total


def _requests_batch(seed: int = 0, low_cardinality: tuple[int, ...] = ()) -> tuple[Bags, list[int]]:
    """The structured batch (module docstring): one-hot bags of 26 features (+ one per-sample feature per
    entry of ``low_cardinality``, with that many values), and each sample's request."""
    rng = np.random.default_rng(seed)
    batch, per_request = 1024, 16
    requests = batch // per_request
    request = rng.permutation(np.repeat(np.arange(requests), per_request))  # arrival order, interleaved
    users = [rng.integers(0, 100_000, requests)[request] for _ in range(13)]
    items = [(rng.zipf(1.2, batch) - 1) % 100_000 for _ in range(13)]
    low = [rng.integers(0, k, batch) for k in low_cardinality]
    return [[[int(i)] for i in column] for column in users + items + low], request.tolist()


def _independent_batch(seed: int = 0) -> Bags:
    """26 independent one-hot Zipf features: nothing for clustering to find but chance repeats."""
    rng = np.random.default_rng(seed)
    return [[[int(i)] for i in (rng.zipf(1.2, 1024) - 1) % 100_000] for _ in range(26)]


def _multi_hot_batch(seed: int = 0, batch: int = 96) -> Bags:
    """3 features with bags of 0 to 3 ids from a small vocabulary (so bags repeat), one one-hot feature."""
    rng = np.random.default_rng(seed)
    bags = [
        [[int(i) for i in rng.integers(0, 4, rng.integers(0, 4))] for _ in range(batch)] for _ in range(3)
    ]
    return [*bags, [[int(i)] for i in rng.integers(0, 20, batch)]]


def _is_permutation(order: torch.Tensor, batch: int) -> bool:
    return order.dtype == torch.int64 and sorted(order.tolist()) == list(range(batch))


# permute_batch


@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
def test_permute_batch_matches_a_sample_by_sample_reassembly(multi_hot, with_weights, lengths_dtype):
    rng = np.random.default_rng(1)
    batch = 37
    bags = (
        _multi_hot_batch(batch=batch)
        if multi_hot
        else [[[int(i)] for i in rng.integers(0, 50, batch)] for _ in range(3)]
    )
    weights = (
        [[[float(rng.random()) for _ in bag] for bag in feature] for feature in bags]
        if with_weights
        else None
    )
    dense = torch.from_numpy(rng.random((batch, 4), dtype=np.float32))
    labels = torch.from_numpy((rng.random(batch) < 0.5).astype(np.float32))
    original = Batch(
        dense=dense, sparse=_kjt(bags, weights=weights, lengths_dtype=lengths_dtype), labels=labels
    )
    order = [int(i) for i in rng.permutation(batch)]

    permuted = permute_batch(original, torch.tensor(order))

    got_bags, got_weights = _unpack(permuted.sparse)
    assert got_bags == [[feature[s] for s in order] for feature in bags]
    if with_weights:
        assert got_weights == [[[pytest.approx(w) for w in feature[s]] for s in order] for feature in weights]
    else:
        assert got_weights is None
    assert permuted.sparse.keys() == original.sparse.keys() and permuted.sparse.stride() == batch
    for j, s in enumerate(order):
        assert torch.equal(permuted.dense[j], dense[s]) and permuted.labels[j] == labels[s]


def test_permute_batch_rejects_an_order_of_the_wrong_length():
    bags = [[[1], [2], [3]]]
    original = Batch(dense=torch.zeros(3, 1), sparse=_kjt(bags), labels=torch.zeros(3))
    with pytest.raises(ValueError, match=r"order must have shape \(3,\)"):
        permute_batch(original, torch.tensor([0, 1]))


# cluster_order


@pytest.mark.parametrize("windows", [2, 3, 4, 8])
@pytest.mark.parametrize("make", [lambda: _requests_batch()[0], _independent_batch, _multi_hot_batch])
def test_cluster_order_is_a_deterministic_permutation(make, windows):
    bags = make()
    kjt = _kjt(bags)
    order = cluster_order(kjt, windows)
    assert _is_permutation(order, len(bags[0]))
    assert torch.equal(cluster_order(kjt, windows), order)
    assert torch.equal(cluster_order(_kjt(copy.deepcopy(bags)), windows), order)  # a copy of the input


def test_cluster_order_is_the_identity_for_one_window_or_one_sample():
    bags, _ = _requests_batch()
    assert torch.equal(cluster_order(_kjt(bags), 1), torch.arange(1024))
    assert torch.equal(cluster_order(_kjt([[[5]], [[7, 8]]]), 4), torch.tensor([0]))


def test_cluster_order_rejects_zero_windows():
    with pytest.raises(ValueError, match="windows must be >= 1, got 0"):
        cluster_order(_kjt([[[1], [2]]]), 0)


@pytest.mark.parametrize(
    ("windows", "low_cardinality", "bound"),
    [
        (2, (), 7_300),  # arrival 7,894, clustered 7,053 (features by gain alone: 7,839)
        (4, (), 8_100),  # arrival 10,291, clustered 7,814
        (8, (), 9_000),  # arrival 13,735, clustered 8,653
        # Three per-sample features with 3, 4 and 24 values: ordering features by fewest distinct keys
        # would make them the primary keys and save nothing (W = 4: 10,451); clustered 7,938.
        (2, (3, 4, 24), 7_400),  # arrival 7,956, clustered 7,115 (by gain alone: 7,901)
        (4, (3, 4, 24), 8_200),
    ],
)
def test_clustering_a_batch_of_requests_keeps_requests_whole(windows, low_cardinality, bound):
    bags, request = _requests_batch(low_cardinality=low_cardinality)
    order = cluster_order(_kjt(bags), windows).tolist()
    arrival = list(range(len(order)))
    assert _oracle_distinct(bags, arrival, windows) > bound
    assert _oracle_distinct(bags, order, windows) <= bound
    # Every request is in one window, except the few (at most one per boundary) that a boundary cuts.
    window_of, start = {}, 0
    for w, size in enumerate(_sizes(len(order), windows)):
        window_of.update((s, w) for s in order[start : start + size])
        start += size
    spans = {}
    for s, r in enumerate(request):
        spans.setdefault(r, set()).add(window_of[s])
    assert sum(len(ws) > 1 for ws in spans.values()) <= windows - 1


@pytest.mark.parametrize("windows", [2, 4, 8])
def test_clustering_independent_features_yields_a_valid_order_and_objective(windows):
    bags = _independent_batch()
    kjt = _kjt(bags)
    order = cluster_order(kjt, windows)
    assert _is_permutation(order, 1024)
    assert distinct_per_window(kjt, windows, order=order) == _oracle_distinct(bags, order.tolist(), windows)


def test_samples_with_the_same_bag_become_contiguous_and_id_order_matters():
    # [1, 2] and [2, 1] are different bags: an order-blind key would merge them and, the sort being
    # stable, leave them interleaved.
    pattern = [[1, 2], [2, 1], [], [1, 2, 2]]
    bags = [[list(pattern[i % 4]) for i in range(16)]]
    order = cluster_order(_kjt(bags), 4).tolist()
    runs = [tuple(bags[0][s]) for s in order]
    changes = sum(a != b for a, b in pairwise(runs))
    assert changes == len(pattern) - 1  # each bag's samples form one run


@pytest.mark.parametrize("ids", [[-5, 2**62], [-(2**63), 2**63 - 1]])
def test_one_hot_ids_beyond_the_key_range_are_grouped_too(ids):
    bags = [[[ids[i % 2]] for i in range(12)], [[i] for i in range(12)]]
    order = cluster_order(_kjt(bags), 2).tolist()
    firsts = [bags[0][s][0] for s in order]
    assert sum(a != b for a, b in pairwise(firsts)) == 1


# distinct_per_window


@pytest.mark.parametrize("windows", [1, 2, 3, 5, 200])
@pytest.mark.parametrize("with_order", [False, True])
@pytest.mark.parametrize("with_remote", [False, True])
def test_distinct_per_window_matches_the_set_oracle(windows, with_order, with_remote):
    bags = _multi_hot_batch(seed=3)
    batch = len(bags[0])
    order = (
        [int(i) for i in np.random.default_rng(4).permutation(batch)] if with_order else list(range(batch))
    )
    remote = (lambda f, ids: ids % 3 == f % 3) if with_remote else None
    keep = (lambda f, i: i % 3 == f % 3) if with_remote else None
    got = distinct_per_window(
        _kjt(bags), windows, order=torch.tensor(order) if with_order else None, remote=remote
    )
    assert got == _oracle_distinct(bags, order, windows, keep)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("windows", [2, 3, 5])
def test_each_window_holds_the_samples_of_the_full_lexicographic_sort(seed, windows):
    # cluster_order re-sorts only the groups a window boundary cuts; the windows must still hold what a
    # lexicographic sort by all the keys puts there (Python's stable sort by key tuples is the oracle).
    from recsys.clustering import _refine

    rng = np.random.default_rng(seed)
    batch = 60
    keys = rng.integers(0, 3, (6, batch)) * 1024  # few values: large groups, and ties several keys deep
    features = [int(f) for f in rng.permutation(6)]
    primary = sorted(range(batch), key=lambda i: keys[features[0], i])
    full = sorted(range(batch), key=lambda i: tuple(keys[f, i] for f in features))

    order = _refine(keys, np.array(features), np.array(primary), windows).tolist()

    assert sorted(order) == list(range(batch))
    start = 0
    for size in _sizes(batch, windows):
        assert set(order[start : start + size]) == set(full[start : start + size])
        start += size
