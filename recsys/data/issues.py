"""What a reader does with malformed input: the ``on_error`` policy, issue counts and bad fields.

A reader reports malformed lines to :class:`Issues` with file, line and field: with ``on_error =
"raise"`` the first one stops the run with a one-line :class:`MalformedInputError`; with ``"skip"``
those lines are dropped and counted by reason (:func:`log_issues`). Bad fields found while a chunk's
rows are converted gather in :class:`Problems`, which raises or drops them the same way.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from recsys.errors import UserError

if TYPE_CHECKING:
    from recsys.data.fields import Fields

__all__ = ["NOT_FINITE", "Issues", "MalformedInputError", "OnError", "Problems", "log_issues"]

log = logging.getLogger("recsys")

NOT_FINITE = "not a finite number"  # the reason every reader gives for NaN and ±inf


class OnError(enum.Enum):
    """What a reader does with a malformed line."""

    RAISE = "raise"  # stop with one line naming file, line and field
    SKIP = "skip"  # drop the line, count it by reason, and log the counts


class MalformedInputError(UserError):
    """A malformed line in an input file (the message names file, line and field)."""


@dataclass
class Issues:
    """Malformed lines found in one file: raise on the first, or count them by reason."""

    path: str
    on_error: OnError
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # parser threads share it

    def report(self, lines: np.ndarray, reason: str, detail: str = "") -> None:
        """``lines`` (file line numbers, 1-based) are malformed because of ``reason``."""
        if lines.size == 0:
            return
        if self.on_error is OnError.RAISE:
            raise MalformedInputError(f"{self.path}:{int(lines.min())}: {reason}{detail}")
        with self._lock:
            self.counts[reason] += int(lines.size)

    def merge(self, counts: dict[str, int]) -> None:
        """Add counts found elsewhere (by a parser process) for this file."""
        if counts:
            with self._lock:
                self.counts.update(counts)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        reasons = "; ".join(f"{n} × {why}" for why, n in self.counts.most_common())
        return f"skipped {self.skipped} malformed line(s) of {self.path}: {reasons}"


class Problems:
    """Bad fields found while converting the rows of one chunk; :meth:`resolve` raises or drops them."""

    def __init__(self, num_rows: int) -> None:
        self.bad = np.zeros(num_rows, dtype=bool)
        self._found: list[tuple[np.ndarray, str, int, str]] = []  # (mask, reason, first line, detail)

    def add(self, f: Fields, col: int, bad: np.ndarray, reason: str) -> None:
        if not bad.any():
            return
        row = int(np.flatnonzero(bad)[0])
        self._found.append((bad, reason, int(f.lines[row]), f": {f.text(row, col)!r}"))
        self.bad |= bad

    def add_rows(
        self, lines: np.ndarray, bad: np.ndarray, reason: str, values: np.ndarray | None = None
    ) -> None:
        """Bad rows that have no text field (Parquet, npy); ``values`` (N,) names the first one's value."""
        if not bad.any():
            return
        row = int(np.flatnonzero(bad)[0])
        detail = "" if values is None else f": {values[row].item()!r}"
        self._found.append((bad, reason, int(lines[row]), detail))
        self.bad |= bad

    def resolve(self, lines: np.ndarray, issues: Issues) -> np.ndarray | None:
        """Raise for the earliest bad line (``raise``), or count bad rows once each; the rows to keep."""
        if not self._found:
            return None
        if issues.on_error is OnError.RAISE:
            _, reason, line, detail = min(self._found, key=lambda item: item[2])
            raise MalformedInputError(f"{issues.path}:{line}: {reason}{detail}")
        seen = np.zeros_like(self.bad)
        for mask, reason, _, _ in self._found:
            new = mask & ~seen
            issues.report(lines[new], reason)
            seen |= mask
        return ~self.bad


def log_issues(issues: Issues) -> None:
    if issues.skipped:
        log.warning("%s", issues.summary())
