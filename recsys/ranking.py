"""Ranking metrics over groups of held-out samples (``[eval] group_by``: the samples of one user, say).

- ``gauc``: the AUC of each group that holds both labels, averaged with each group weighted by its
  samples (impressions); tied scores count half, as in :func:`recsys.metrics.auc_logloss`.
- ``ndcg_at_10``: per group with a positive, the DCG of its 10 best-scored samples (a positive at rank
  ``r``, from 0, adds ``1 / log2(r + 2)``) over the best DCG its positives allow; the mean over groups.
- ``recall_at_10``: per group with a positive, the share of its positives among its 10 best-scored
  samples; the mean over groups.

Within a group, samples of equal score rank in the order they were evaluated. Groups without a positive
(or, for ``gauc``, without a negative) are left out and counted. Every figure is NaN when no group counts.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["TOP_K", "ranking_metrics"]

TOP_K = 10


def ranking_metrics(
    scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, *, k: int = TOP_K
) -> dict[str, float | int]:
    """``gauc``, ``ndcg_at_10``, ``recall_at_10`` of (N,) scores (any monotone score: logits or
    probabilities), 0/1 labels and int64 group keys; and ``groups`` (distinct keys), ``gauc_groups``
    (groups with both labels), ``ranked_groups`` (groups with a positive)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    n = scores.shape[0]
    if n == 0:
        nan = math.nan
        return {"gauc": nan, "ndcg_at_10": nan, "recall_at_10": nan, "groups": 0, "gauc_groups": 0,
                "ranked_groups": 0}  # fmt: skip
    # gauc: sort by group, then score; average ranks over ties inside a group
    order = np.lexsort((scores, groups))
    g, s, y = groups[order], scores[order], labels[order]
    new_group = np.r_[True, g[1:] != g[:-1]]
    group_id = np.cumsum(new_group) - 1  # (N,) 0..G-1 in sorted order
    starts = np.flatnonzero(new_group)
    num_groups = starts.shape[0]
    position = np.arange(n) - starts[group_id] + 1.0  # 1-based rank inside the group
    new_tie = new_group | np.r_[True, s[1:] != s[:-1]]
    tie_id = np.cumsum(new_tie) - 1
    tie_rank = np.bincount(tie_id, weights=position) / np.bincount(tie_id)  # mean rank of each tie run
    rank = tie_rank[tie_id]
    size = np.bincount(group_id, minlength=num_groups).astype(np.float64)
    pos = np.bincount(group_id, weights=y, minlength=num_groups)
    neg = size - pos
    pos_rank_sum = np.bincount(group_id, weights=rank * y, minlength=num_groups)
    both = (pos > 0) & (neg > 0)
    auc = (pos_rank_sum[both] - pos[both] * (pos[both] + 1) / 2) / (pos[both] * neg[both])
    gauc = float(np.sum(auc * size[both]) / np.sum(size[both])) if both.any() else math.nan

    # top k: sort by group, then score descending, then evaluation order
    top = np.lexsort((np.arange(n), -scores, groups))
    g2, y2 = groups[top], labels[top]
    first = np.r_[True, g2[1:] != g2[:-1]]
    gid = np.cumsum(first) - 1
    place = np.arange(n) - np.flatnonzero(first)[gid]  # 0-based rank inside the group
    in_top = place < k
    discount = 1.0 / np.log2(place + 2.0)
    dcg = np.bincount(gid, weights=y2 * discount * in_top, minlength=num_groups)
    hits = np.bincount(gid, weights=y2 * in_top, minlength=num_groups)
    positives = np.bincount(gid, weights=y2, minlength=num_groups)
    ranked = positives > 0
    ideal_cum = np.cumsum(1.0 / np.log2(np.arange(k) + 2.0))  # best DCG with 1..k positives
    ideal = ideal_cum[np.minimum(positives[ranked], k).astype(np.int64) - 1]
    ndcg = float(np.mean(dcg[ranked] / ideal)) if ranked.any() else math.nan
    recall = float(np.mean(hits[ranked] / positives[ranked])) if ranked.any() else math.nan
    return {
        "gauc": gauc,
        "ndcg_at_10": ndcg,
        "recall_at_10": recall,
        "groups": int(num_groups),
        "gauc_groups": int(both.sum()),
        "ranked_groups": int(ranked.sum()),
    }
