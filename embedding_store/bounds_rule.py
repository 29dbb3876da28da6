"""A bounded table's rule (:class:`BoundsRule`), apart from the state machine that applies it
(:mod:`embedding_store.bounds`), so that reading a config that sets bounds loads neither numba nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding_store.bounds_state import COUNT_MAX

__all__ = ["DEFAULT_ADMIT_WINDOW_STEPS", "PROTECT_STEPS", "BoundsRule"]

PROTECT_STEPS = 8  # rows used in the last 8 steps are never capped or expired: batches in flight hold them
DEFAULT_ADMIT_WINDOW_STEPS = 1000


@dataclass(kw_only=True, frozen=True, slots=True)
class BoundsRule:
    """A table's bounds (see the module docstring for the rules).

    Attributes:
        admit_after: occurrences within the window that give an id a row (1: at once, no admission).
        admit_window_steps: a candidate's count restarts when its last occurrence is more than this many
            steps old; the candidates held are at most the distinct unadmitted ids of this many steps.
        expire_after_steps: a row unused for more than this many steps is deleted (0: never; else at
            least ``PROTECT_STEPS``).
        max_rows: rows per table and owner at most (0: no cap).
    """

    admit_after: int = 1
    admit_window_steps: int = DEFAULT_ADMIT_WINDOW_STEPS
    expire_after_steps: int = 0
    max_rows: int = 0

    def __post_init__(self) -> None:
        for name, low, high in (
            ("admit_after", 1, COUNT_MAX),
            ("admit_window_steps", 1, None),
            ("expire_after_steps", 0, None),
            ("max_rows", 0, None),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"BoundsRule.{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"BoundsRule.{name} must be {bounds}, got {value}")
        if 0 < self.expire_after_steps < PROTECT_STEPS:
            raise ValueError(
                f"BoundsRule.expire_after_steps must be 0 (never) or >= PROTECT_STEPS ({PROTECT_STEPS}), "
                f"got {self.expire_after_steps}"
            )

    @property
    def active(self) -> bool:
        """Whether any rule is on (admission, expiry or a cap); when not, every id simply gets a row."""
        return self.admit_after > 1 or self.expire_after_steps > 0 or self.max_rows > 0
