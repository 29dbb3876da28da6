"""Per-split statistics: how many rows each split has and how many are positive.

A run logs them (``summary.json``) so that a split can be checked without opening the data, and
:func:`constant_logloss` turns them into the held-out logloss of the simplest model — always predicting
the training split's positive rate — the baseline any trained model has to beat.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from recsys.data.row_sources import MemorySource, RowSource

if TYPE_CHECKING:  # batches need torch and TorchRec; the readers' statistics do not
    from recsys.data.batch import Batch

__all__ = ["SplitStats", "constant_logloss", "split_stats_of", "stats_of_source", "stats_of_batches"]

# torch's binary_cross_entropy clamps each log term at -100, so a prediction of exactly 0 or 1 costs
# at most 100 per sample instead of infinity.
_LOG_FLOOR = -100.0


@dataclass(kw_only=True, frozen=True, slots=True)
class SplitStats:
    """Rows of one split and how many of them have label 1.

    Attributes:
        rows: samples in the split.
        positives: samples with label 1.
        sampled: True when ``rows`` are a sample of a split that has no end (the synthetic training
            stream), not the whole split.

    Example:
        >>> SplitStats(rows=8, positives=2).positive_rate
        0.25
    """

    rows: int
    positives: int
    sampled: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.positives <= self.rows:
            raise ValueError(f"positives must be in [0, rows={self.rows}], got {self.positives}")

    @property
    def positive_rate(self) -> float:
        """positives / rows; NaN for a split without rows."""
        return self.positives / self.rows if self.rows else math.nan

    def as_dict(self) -> dict[str, object]:
        """For ``summary.json``: rows, positives, positive_rate (None without rows), sampled."""
        rate = self.positive_rate
        return {
            "rows": self.rows,
            "positives": self.positives,
            "positive_rate": None if math.isnan(rate) else rate,
            "sampled": self.sampled,
        }


def constant_logloss(train: SplitStats, held: SplitStats) -> float:
    """Held-out logloss (mean binary cross-entropy, nats) of always predicting ``train``'s positive rate.

    Computed in float64. A training rate of exactly 0 or 1 is a prediction of 0 or 1: each log term is
    clamped at -100 as torch's ``binary_cross_entropy`` does, so a held-out sample of the other label
    costs 100, not infinity. NaN when either split has no rows.

    Example:
        >>> round(constant_logloss(SplitStats(rows=4, positives=1), SplitStats(rows=2, positives=1)), 6)
        0.836988
    """
    if not train.rows or not held.rows:
        return math.nan
    p = train.positives / train.rows
    log_p = max(math.log(p), _LOG_FLOOR) if p > 0 else _LOG_FLOOR
    log_q = max(math.log1p(-p), _LOG_FLOOR) if p < 1 else _LOG_FLOOR
    negatives = held.rows - held.positives
    return -(held.positives * log_p + negatives * log_q) / held.rows


def _count(labels: np.ndarray) -> int:
    # Labels are 0 or 1 (every reader checks): positives are the non-zero ones.
    return int(np.count_nonzero(labels))


def stats_of_source(source: RowSource) -> SplitStats:
    """Exact counts of a split: from memory when it is held there, else one pass over it (a full parse,
    so rows that ``on_error = "skip"`` drops are not counted, exactly as training does not see them)."""
    if isinstance(source, MemorySource):
        return SplitStats(rows=source.block.num_rows, positives=_count(source.block.labels))
    rows = positives = 0
    for block in source.blocks():
        rows += block.num_rows
        positives += _count(block.labels)
    return SplitStats(rows=rows, positives=positives)


def stats_of_batches(batches: Iterable[Batch]) -> SplitStats:
    """Counts of the samples in ``batches`` (a trainer's fallback for a dataset without ``split_stats``)."""
    rows = positives = 0
    for batch in batches:
        rows += int(batch.labels.shape[0])
        positives += int((batch.labels != 0).sum())
    return SplitStats(rows=rows, positives=positives)


def split_stats_of(dataset: object) -> dict[str, SplitStats] | None:
    """``dataset.split_stats()`` — ``{"train": ..., "eval": ...}`` — or None when it has no such method.

    ``split_stats`` is optional for datasets a ``module:function`` factory returns; the trainer counts
    the labels it reads itself (:func:`stats_of_batches`) when this returns None.
    """
    method = getattr(dataset, "split_stats", None)
    if not callable(method):
        return None
    return method()
