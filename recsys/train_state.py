"""The progress of a training run: the one mutable record of a fit, checkpointed as a part of its own.

:class:`~recsys.loop.TrainLoop` is the one that advances it (the step, the last checkpoint written, the
evaluation record, the nested pipeline's statistics); a restore loads it from a checkpoint
(:meth:`TrainState.restore`); the trainer and the run's summary only read it.

On disk it is the ``trainer`` entry of ``meta.json`` (the best evaluation so far and the evaluations
since, the held-out split's size), beside the checkpoint's ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys.checkpoint import Checkpoint
from recsys.selection import BestTracker

__all__ = ["TrainState"]


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Where a fit stands.

    Attributes:
        selection: the best evaluation so far and early stopping (checkpointed).
        step: the steps trained (checkpointed as the checkpoint's ``step``); the next batch of the data.
        saved_step: the step of the last checkpoint this process wrote (-1: none).
        held_out: rows and positives of the held-out split, counted by the first evaluation (checkpointed).
        pipeline_stats: the pipeline's statistics after the last fit (``summary.json``; in memory: loading only).
    """

    selection: BestTracker
    step: int = 0
    saved_step: int = -1
    held_out: dict[str, int] | None = None
    pipeline_stats: dict[str, Any] = field(default_factory=dict)

    def save(self, into: Checkpoint) -> list[Path]:
        """The evaluation record into ``meta.json`` (the step is the checkpoint's own)."""
        into.meta["trainer"] = {"selection": self.selection.state(), "held_out": self.held_out}
        return []

    def restore(self, source: Checkpoint) -> None:
        """The step and the evaluation record of ``source`` (an older checkpoint without the record leaves
        the tracker empty)."""
        state = source.meta.get("trainer") or {}
        self.selection.load(state.get("selection"))
        self.held_out = state.get("held_out")
        self.step = int(source.meta["step"])
