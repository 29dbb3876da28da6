"""Deterministic, stateful-looking stages with injectable delays and faults, for pipeline tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipelines import StageSpec

MOD = (1 << 61) - 1


class Mixer:
    """A stage with state: its output depends on every item it saw before, in order.

    Run in any other order (or twice on one item, or concurrently), the outputs differ from the reference.
    """

    def __init__(self, seed: int, delays_s: Sequence[float] = (), fail_at: int | None = None) -> None:
        self.state = seed
        self.calls = 0
        self.delays_s = list(delays_s)
        self.fail_at = fail_at
        self.busy = threading.Lock()

    def __call__(self, item: tuple[int, int]) -> tuple[int, int]:
        if not self.busy.acquire(blocking=False):
            raise AssertionError("a stage ran two batches at once")
        try:
            batch, value = item
            if self.delays_s:
                time.sleep(self.delays_s[self.calls % len(self.delays_s)])
            if batch == self.fail_at:
                raise InjectedFault(f"fault in batch {batch}")
            self.calls += 1
            self.state = (self.state * 6364136223846793005 + value + 1442695040888963407) % MOD
            return batch, (value * 31 + self.state) % MOD
        finally:
            self.busy.release()


class InjectedFault(Exception):
    pass


def mixer_stages(
    num_stages: int,
    *,
    capacities: Sequence[int] | None = None,
    delays_s: Sequence[Sequence[float]] | None = None,
    fail: tuple[int, int] | None = None,
) -> list[StageSpec]:
    """``num_stages`` Mixers named s0, s1, ...; ``fail=(stage, batch)`` injects a fault there."""
    specs = []
    for k in range(num_stages):
        fn = Mixer(
            seed=1000 + k,
            delays_s=delays_s[k] if delays_s else (),
            fail_at=fail[1] if fail and fail[0] == k else None,
        )
        specs.append(StageSpec(name=f"s{k}", fn=fn, capacity=capacities[k] if capacities else 1))
    return specs


def source(num_items: int, *, fail_at: int | None = None, delay_s: float = 0.0) -> Any:
    for batch in range(num_items):
        if delay_s:
            time.sleep(delay_s)
        if batch == fail_at:
            raise InjectedFault(f"fault in batch {batch}")
        yield batch, batch * 7919 + 1


def sleeper(delay_s: float) -> Callable[[Any], Any]:
    def fn(item: Any) -> Any:
        time.sleep(delay_s)
        return item

    return fn
