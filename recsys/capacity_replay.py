"""The tuner's advice for a device-tier error: the run replayed up to the failing step
(:class:`recsys.capacity_advice.SlotsAdvice`), which the caller of a training run passes in."""

from __future__ import annotations

import logging

from recsys.capacity_advice import SlotsNeeded
from recsys.config import RunConfig

__all__ = ["replay_advice"]

log = logging.getLogger("recsys")


def replay_advice(config: RunConfig, *, step: int, world_size: int) -> SlotsNeeded:
    """Each tiered table's minimum slots per owner for the steps run so far and the batches in flight
    (one replay of them: what `recsys tune-cache --batches` states); no minimum when the replay fails."""
    from recsys.tune.replay import batches_in_flight
    from recsys.tune.tuner import min_device_rows_by_feature

    in_flight = batches_in_flight(config)
    # Steps [0, step + in_flight): the batches trained and those being filled (an evaluation after this
    # step runs beside the latter), so the replay costs a fraction of the training so far.
    batches = min(config.train.steps, step + in_flight)
    try:
        need = min_device_rows_by_feature(config, world_size=world_size, batches=batches)
    except Exception as err:  # noqa: BLE001 - the capacity error is the one to report
        log.debug("replaying the run for the minimum device slots: %s", err)
        need = {}
    return SlotsNeeded(in_flight=in_flight, need=need)
