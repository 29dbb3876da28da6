"""Ranking metrics (recsys/ranking.py) against plain Python loops over each group."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recsys.ranking import ranking_metrics


def _auc(scores: list[float], labels: list[float]) -> float:
    """Pairwise: a positive above a negative counts 1, a tie 1/2."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def _reference(scores, labels, groups, k=10):
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(int(g), []).append(i)  # evaluation order
    aucs, weights, ndcgs, recalls = [], [], [], []
    for rows in by_group.values():
        s = [float(scores[i]) for i in rows]
        y = [float(labels[i]) for i in rows]
        if 0 < sum(y) < len(y):
            aucs.append(_auc(s, y))
            weights.append(len(rows))
        if sum(y) > 0:
            ranked = sorted(range(len(rows)), key=lambda j: -s[j])  # stable: ties in evaluation order
            top = [y[j] for j in ranked[:k]]
            dcg = sum(rel / math.log2(r + 2) for r, rel in enumerate(top))
            ideal = sum(1 / math.log2(r + 2) for r in range(min(int(sum(y)), k)))
            ndcgs.append(dcg / ideal)
            recalls.append(sum(top) / sum(y))
    gauc = sum(a * w for a, w in zip(aucs, weights, strict=True)) / sum(weights)
    return gauc, sum(ndcgs) / len(ndcgs), sum(recalls) / len(recalls), len(by_group), len(aucs), len(ndcgs)


def test_a_fixed_small_case() -> None:
    # group 7: positives ranked 1st and 3rd of 4; group 3: one positive below both negatives; group 5:
    # all negative (in no metric); group 9: all positive (in ndcg and recall, not in gauc)
    groups = np.array([7, 7, 7, 7, 3, 3, 3, 5, 5, 9])
    scores = np.array([0.9, 0.8, 0.7, 0.1, 0.2, 0.5, 0.6, 0.3, 0.4, 0.1])
    labels = np.array([1, 0, 1, 0, 1, 0, 0, 0, 0, 1])
    got = ranking_metrics(scores, labels, groups)
    assert got["gauc"] == pytest.approx((0.75 * 4 + 0.0 * 3) / 7)
    ndcg_7 = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    ndcg_3 = (1 / math.log2(4)) / 1.0  # its positive third
    assert got["ndcg_at_10"] == pytest.approx((ndcg_7 + ndcg_3 + 1.0) / 3)
    assert got["recall_at_10"] == pytest.approx(1.0)
    assert (got["groups"], got["gauc_groups"], got["ranked_groups"]) == (4, 2, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_groups_with_ties_match_the_reference(seed) -> None:
    rng = np.random.default_rng(seed)
    n = 600
    groups = rng.integers(0, 40, n) * 1_000_003 - 5  # any int64 keys
    scores = np.round(rng.normal(size=n), 1)  # many ties
    labels = (rng.random(n) < 0.3).astype(np.float32)
    got = ranking_metrics(scores, labels, groups)
    gauc, ndcg, recall, num, gauc_groups, ranked = _reference(scores, labels, groups)
    assert got["gauc"] == pytest.approx(gauc, rel=1e-12)
    assert got["ndcg_at_10"] == pytest.approx(ndcg, rel=1e-12)
    assert got["recall_at_10"] == pytest.approx(recall, rel=1e-12)
    assert (got["groups"], got["gauc_groups"], got["ranked_groups"]) == (num, gauc_groups, ranked)


def test_no_group_with_a_positive_gives_nan() -> None:
    got = ranking_metrics(np.array([0.1, 0.2]), np.array([0, 0]), np.array([1, 2]))
    assert math.isnan(got["gauc"]) and math.isnan(got["ndcg_at_10"]) and math.isnan(got["recall_at_10"])
    assert got["groups"] == 2 and got["ranked_groups"] == 0
