"""The error of a device tier too small for the batches in flight, and the advice it may carry.

Training words the error; how many slots each table would have needed is the tuner's to say (a replay
of the run, :mod:`recsys.capacity_replay`). The caller that assembles a trainer passes that advice in
(:attr:`recsys.build.TrainSpec.capacity_advice`), so that the training modules import no tuner; without
it the error carries the store's own figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from embedding_store import StoreCapacityError
from recsys.capacities import Capacities
from recsys.config import RunConfig

__all__ = ["SlotsAdvice", "SlotsNeeded", "too_few_slots"]


@dataclass(kw_only=True, frozen=True, slots=True)
class SlotsNeeded:
    """What a run needed of its device tier up to the step it failed at.

    Attributes:
        in_flight: training batches whose rows can be pinned at once when one is filled.
        need: per tiered feature, the fewest device slots per owner that the steps so far and the batches
            in flight need (empty when the replay could not tell).
    """

    in_flight: int
    need: dict[str, int] = field(default_factory=dict)


class SlotsAdvice(Protocol):
    """``advice(config, step=, world_size=)``: the slots ``config`` needed on ``world_size`` ranks for its
    first ``step`` steps and the batches then in flight."""

    def __call__(self, config: RunConfig, *, step: int, world_size: int) -> SlotsNeeded: ...


def too_few_slots(
    cause: StoreCapacityError,
    *,
    config: RunConfig,
    capacities: Capacities,
    needed: SlotsNeeded | None,
) -> str:
    """The device-tier error: each tiered table's minimum slots per owner (``needed``, where its capacity is
    below that), else the store's own message, and the settings that raise it."""
    slots = capacities.device_rows
    short = (
        []
        if needed is None
        else [
            f"table t_{f} needs at least {n:,} device slots per owner ({capacities.device_key(f)} is {slots[f]:,})"
            for f, n in needed.need.items()
            if n > slots[f]
        ]
    )
    batches = "" if needed is None else f"up to {needed.in_flight} training batches, or "
    return (
        f"the device tier is too small for the batches in flight ({batches}an evaluation batch beside those "
        f"still pinned): {'; '.join(short) or cause}; raise store.capacity.<feature>.device or "
        f"store.device_rows (now {config.store.device_rows:,}); `recsys tune-cache` states the minimum for "
        f"all {config.train.steps:,} steps"
    )
