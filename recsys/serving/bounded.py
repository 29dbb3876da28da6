"""Bounded tables at serving time: an id without a row of its own scores with its table's default row.

A bounded table (``[store.bounds]``, ``docs/tiers.md`` "Bounded tables") keeps rows only for the ids its
rules admitted and have not expired or capped; every other id reads the table's one shared, trained
default row, in training and in its evaluation (:mod:`recsys.bounded`). ``recsys export`` writes exactly
those rows and the default row (whose id each bounded feature of ``model.json`` records as
``default_id``), so that "this id has no row" stays visible in the bundle:

- a tiered bounded table's rows are in the bundle's LMDB like any tiered table's; an id missing there
  reads the default row (not its initial row);
- an in-memory bounded table is a plain table of its rows only: ``<table>.weight`` (rows, dim) and
  ``<table>.ids`` (rows,) int64 ascending, the default row's id (the table's rows in training, which
  its ids are folded modulo) last. :class:`BoundedPlain` maps ids to positions in it.

Both count the lookups that read the default row (:class:`DefaultStats`), which ``recsys predict``
reports.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from recsys.serving.bundle import BundleError

__all__ = ["BoundedPlain", "DefaultStats"]


@dataclass(frozen=True, slots=True)
class DefaultStats:
    """Lookups of one bounded feature: ``lookups`` (each id occurrence) and ``defaults`` (those that read
    the default row: the id has no row in the bundle)."""

    lookups: int
    defaults: int

    @property
    def share(self) -> float:
        """The share of lookups that read the default row (0.0 before any lookup)."""
        return self.defaults / self.lookups if self.lookups else 0.0


class BoundedPlain:
    """The ids of an in-memory bounded table's exported rows, and the position of each id's row (the
    default row's for an id without one); counts the lookups. Thread-safe.

    Args:
        ids: ``<table>.ids`` of the bundle: (rows,) int64, strictly ascending, the default id last.
        default_id: the feature's ``default_id`` (ids are folded modulo it, as training folded them).
        where: the bundle and table, for errors.

    Raises:
        BundleError: the ids are not such an array (the default row missing included).
    """

    def __init__(self, ids: torch.Tensor, default_id: int, where: str) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.shape[0] < 1:
            raise BundleError(
                f"{where}: its ids are {ids.dtype} of shape {tuple(ids.shape)}, not (rows,) int64"
            )
        arr = ids.numpy()
        if int(arr[-1]) != default_id:
            raise BundleError(f"{where}: its last row is id {int(arr[-1])}, not its default row {default_id}")
        if int(arr[0]) < 0 or (arr.shape[0] > 1 and not (np.diff(arr) > 0).all()):
            raise BundleError(f"{where}: its ids are not ascending non-negative ids (altered?)")
        self.ids = arr
        self.default_id = default_id
        self._lock = threading.Lock()
        self._lookups = self._defaults = 0

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """(N,) int64 positions of the rows of (N,) ids >= 0: the id's row (folded modulo the default id)
        where it has one, else the default row's (the last)."""
        folded = ids % self.default_id
        pos = np.minimum(np.searchsorted(self.ids, folded), self.ids.shape[0] - 1)
        own = self.ids[pos] == folded
        missed = int(ids.shape[0] - np.count_nonzero(own))
        with self._lock:
            self._lookups += int(ids.shape[0])
            self._defaults += missed
        return np.where(own, pos, self.ids.shape[0] - 1)

    def stats(self) -> DefaultStats:
        """The lookups so far and those that read the default row."""
        with self._lock:
            return DefaultStats(self._lookups, self._defaults)
