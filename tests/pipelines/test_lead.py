"""``StageSpec.lead``: a stage starts batch i only once an earlier stage has finished batch i + n.

The oracle is the window a sequential reader of the earlier stage's output would see: batches i .. i + n,
cut at the stream's end. The tiered feed relies on it (the store picks victims among the batches the
routing stage announced), so it must hold whatever the loader's speed: the source here is slow and
uneven, which without the lead leaves the later stages with fewer batches announced than n.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from pipelines import DeviceContext, PipelineConfig, PipelineMode, StagedPipeline, StageFailed, StageSpec
from tests.pipelines.conftest import pipeline_threads
from tests.pipelines.helpers import InjectedFault, source

CPU = DeviceContext("cpu")


class Announcer:
    """The earlier stage: records each batch it finished, as the routing stage announces to the store."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[int] = []

    def __call__(self, item: tuple[int, int]) -> tuple[int, int]:
        with self.lock:
            self.done.append(item[0])
        return item


def window_reader(announced: Announcer, n: int, seen: dict[int, list[int]]):
    """A later stage: what it sees of batches i .. i + n when it runs batch i."""

    def fn(item: tuple[int, int]) -> tuple[int, int]:
        with announced.lock:
            seen[item[0]] = [b for b in announced.done if b >= item[0]][: n + 1]
        return item

    return fn


def slow_uneven_source(num_items: int, seed: int):
    rng = random.Random(seed)
    for batch, value in source(num_items):
        time.sleep(rng.choice([0.0, 0.0005, 0.003]))
        yield batch, value


def run_with_lead(num_items: int, n: int, mode: PipelineMode, seed: int, lead: bool = True):
    announced = Announcer()
    seen_b: dict[int, list[int]] = {}
    seen_c: dict[int, list[int]] = {}
    window = ("a", n) if lead else None
    stages = [
        StageSpec(name="a", fn=announced, capacity=max(1, n)),
        StageSpec(name="b", fn=window_reader(announced, n, seen_b), capacity=1, lead=window),
        StageSpec(name="c", fn=window_reader(announced, n, seen_c), capacity=1, lead=window),
    ]
    with StagedPipeline(
        slow_uneven_source(num_items, seed), stages, config=PipelineConfig(mode=mode), device=CPU
    ) as pipe:
        out = [batch for batch, _ in pipe]
    return out, seen_b, seen_c


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_items, n, seed", [(0, 2, 0), (1, 3, 1), (5, 1, 2), (14, 3, 3), (14, 2, 4)])
def test_each_batch_sees_the_next_n_batches_whatever_the_sources_speed(num_items: int, n: int, seed: int):
    out, seen_b, seen_c = run_with_lead(num_items, n, PipelineMode.PIPELINED, seed)
    assert out == list(range(num_items))
    want = {i: list(range(i, min(i + n + 1, num_items))) for i in range(num_items)}
    assert seen_b == want
    assert seen_c == want


@pytest.mark.timeout(30)
def test_without_the_lead_a_slow_source_leaves_the_window_short():
    """The control: the same pipeline without ``lead`` runs its later stages before the window is there."""
    _, seen_b, _ = run_with_lead(14, 3, PipelineMode.PIPELINED, 3, lead=False)
    assert any(len(w) < min(4, 14 - i) for i, w in seen_b.items()), seen_b


def test_sequential_mode_ignores_the_lead():
    out, seen_b, _ = run_with_lead(6, 3, PipelineMode.SEQUENTIAL, 0)
    assert out == list(range(6))
    assert seen_b == {i: [i] for i in range(6)}  # one batch at a time through every stage


def test_a_lead_the_capacities_cannot_give_is_refused():
    def ident(x):
        return x

    a = StageSpec(name="a", fn=ident, capacity=2)
    with pytest.raises(ValueError, match=r"stage 'c': 'a' cannot run 4 batches ahead of it .*add up to 3"):
        StagedPipeline([], [a, StageSpec(name="b", fn=ident), StageSpec(name="c", fn=ident, lead=("a", 4))])
    with pytest.raises(ValueError, match=r"stage 'b': lead names 'c', which is not a stage before it"):
        StagedPipeline([], [a, StageSpec(name="b", fn=ident, lead=("c", 1)), StageSpec(name="c", fn=ident)])
    with pytest.raises(
        ValueError, match=r"StageSpec.lead must be None or \(stage name, int >= 0\), got \('a', -1\)"
    ):
        StageSpec(name="b", fn=ident, lead=("a", -1))
    StagedPipeline([], [a, StageSpec(name="b", fn=ident, lead=("a", 2))]).close()  # exactly enough room


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_fault_upstream_wakes_a_stage_waiting_for_its_lead(fail_at: int):
    """The source fails before the waiting stage's window is there: the error comes out, nothing hangs."""
    announced = Announcer()
    stages = [
        StageSpec(name="a", fn=announced, capacity=3),
        StageSpec(name="b", fn=window_reader(announced, 3, {}), lead=("a", 3)),
    ]
    start = time.monotonic()
    with (
        pytest.raises(StageFailed) as info,
        StagedPipeline(source(10, fail_at=fail_at), stages, device=CPU) as p,
    ):
        list(p)
    assert (info.value.stage, info.value.batch) == ("source", fail_at)
    assert isinstance(info.value.__cause__, InjectedFault)
    assert time.monotonic() - start < 5.0
    assert not pipeline_threads()


@pytest.mark.timeout(10)
def test_close_mid_stream_wakes_a_stage_waiting_for_its_lead():
    gate = threading.Event()

    def stalling():
        for batch in itertools.count():
            if batch == 3:
                gate.wait(5.0)  # the source stalls: batch 0's window (batches 1-3) never completes
            yield batch, batch

    announced = Announcer()
    stages = [
        StageSpec(name="a", fn=announced, capacity=3),
        StageSpec(name="b", fn=window_reader(announced, 3, {}), lead=("a", 3)),
    ]
    pipe = StagedPipeline(stalling(), stages, device=CPU)
    iter(pipe)
    time.sleep(0.05)
    start = time.monotonic()
    threading.Timer(0.2, gate.set).start()  # the source returns soon; the waiting stage only if woken
    pipe.close()
    assert time.monotonic() - start < 3.0  # join_timeout_s is 10 s: a stage left waiting would take that
    assert not pipeline_threads()
