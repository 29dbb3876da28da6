"""Model selection during training: the best evaluation so far and early stopping.

With ``eval.every > 0`` the trainer evaluates on the held-out split every ``eval.every`` steps; the
evaluation with the best ``eval.select`` metric (lowest log loss, or highest AUC) is kept as a checkpoint
of its own in ``<run>/best/``, and after ``eval.patience`` evaluations in a row without improvement the run
stops. The tracker's state goes into every checkpoint (``meta.json``), so a resumed run selects exactly
what the uninterrupted run would have.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BestTracker", "Evaluation"]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation: the step it followed and its held-out metrics (``auc`` None when undefined)."""

    step: int
    auc: float | None
    logloss: float
    digest: str = ""  # of the model at ``step``, when it was kept as the best


class BestTracker:
    """The best evaluation by ``select`` and the evaluations since it (``bad``)."""

    def __init__(self, *, select: str, patience: int) -> None:
        self.select = select
        self.patience = patience
        self.best: Evaluation | None = None
        self.bad = 0

    def _score(self, e: Evaluation) -> float:
        """Lower is better."""
        if self.select == "auc":
            return -e.auc if e.auc is not None and math.isfinite(e.auc) else math.inf
        return e.logloss if math.isfinite(e.logloss) else math.inf

    def improves(self, e: Evaluation) -> bool:
        """True when ``e`` is strictly better than the best so far (the first evaluation always is)."""
        return self.best is None or self._score(e) < self._score(self.best)

    def update(self, e: Evaluation) -> bool:
        """Record ``e``; returns True when it is the new best."""
        if self.improves(e):
            self.best, self.bad = e, 0
            return True
        self.bad += 1
        return False

    @property
    def exhausted(self) -> bool:
        """True when ``patience`` evaluations in a row have not improved on the best."""
        return bool(self.patience) and self.bad >= self.patience

    def state(self) -> dict[str, Any]:
        """JSON-safe state for a checkpoint."""
        return {"best": None if self.best is None else asdict(self.best), "bad": self.bad}

    def load(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state` (a checkpoint without one leaves the tracker empty)."""
        if not state:
            return
        best = state.get("best")
        self.best = None if best is None else Evaluation(**best)
        self.bad = int(state.get("bad", 0))
