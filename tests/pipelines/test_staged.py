"""The inter-batch pipeline against its oracle: the sequential mode.

Pipelined output must equal sequential output item for item (stages with order-dependent state and
random per-batch sleeps), the bounded hand-offs must really bound how far each stage runs ahead, a fault
anywhere must surface in the consumer with the stage's name without hanging, and close() must stop every
worker mid-stream.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines import (
    DeviceContext,
    PipelineConfig,
    PipelineMode,
    StagedPipeline,
    StageFailed,
    StageSpec,
)
from tests.pipelines.conftest import pipeline_threads
from tests.pipelines.helpers import InjectedFault, mixer_stages, sleeper, source

CPU = DeviceContext("cpu")
SEQ = PipelineConfig(mode=PipelineMode.SEQUENTIAL)


def run(num_items: int, stages: list[StageSpec], config: PipelineConfig) -> list[tuple[int, int]]:
    with StagedPipeline(source(num_items), stages, config=config, device=CPU) as pipe:
        return list(pipe)


def reference(num_items: int, num_stages: int) -> list[tuple[int, int]]:
    return run(num_items, mixer_stages(num_stages), SEQ)


@settings(max_examples=25, deadline=None)
@given(
    num_items=st.integers(0, 12),
    capacities=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    source_capacity=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_pipelined_equals_sequential(num_items: int, capacities: list[int], source_capacity: int, seed: int):
    rng = random.Random(seed)
    num_stages = len(capacities)
    # per-stage, per-batch sleeps of 0-2 ms reshuffle which stage is ahead from batch to batch
    delays = [[rng.choice([0.0, 0.0002, 0.001, 0.002]) for _ in range(num_items)] for _ in range(num_stages)]
    stages = mixer_stages(num_stages, capacities=capacities, delays_s=delays)
    config = PipelineConfig(source_capacity=source_capacity)
    got = run(num_items, stages, config)
    assert got == reference(num_items, num_stages)
    assert [batch for batch, _ in got] == list(range(num_items))  # order preserved


def test_sequential_mode_runs_inline_one_batch_at_a_time():
    seen: list[tuple[str, int, str]] = []

    def stage(name: str):
        def fn(item: tuple[int, int]) -> tuple[int, int]:
            seen.append((name, item[0], threading.current_thread().name))
            return item

        return fn

    stages = [StageSpec(name=n, fn=stage(n)) for n in ("a", "b")]
    with StagedPipeline(source(3), stages, config=SEQ, device=CPU) as pipe:
        for batch, _ in pipe:
            seen.append(("consumer", batch, threading.current_thread().name))
    main = threading.current_thread().name
    assert seen == [(n, b, main) for b in range(3) for n in ("a", "b", "consumer")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("mode", list(PipelineMode))
def test_on_start_runs_once_on_its_stage_thread_only(mode: PipelineMode):
    """Pipelined: stage "a"'s hook runs once, on a's worker before its first batch (here: nice + 3), so
    the source and stage "b" keep the consumer's priority; sequential runs every stage inline on the
    consumer's thread and never calls it; the consumer's priority never changes."""

    def nice_now() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = nice_now()
    seen: dict[str, set[int]] = {"source": set(), "a": set(), "b": set()}
    calls: list[int] = []  # the threads the hook ran on
    a_threads: set[int] = set()

    def lower_by_3() -> None:
        assert not a_threads  # before stage a's first batch
        calls.append(threading.get_ident())
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice_now() + 3))

    def src():
        for i in range(4):
            seen["source"].add(nice_now())
            yield (i, i)

    def stage(name: str):
        def fn(item: tuple[int, int]) -> tuple[int, int]:
            seen[name].add(nice_now())
            if name == "a":
                a_threads.add(threading.get_ident())
            return item

        return fn

    stages = [StageSpec(name="a", fn=stage("a"), on_start=lower_by_3), StageSpec(name="b", fn=stage("b"))]
    with StagedPipeline(src(), stages, config=PipelineConfig(mode=mode), device=CPU) as pipe:
        assert [b for b, _ in pipe] == list(range(4))
    pipelined = mode is PipelineMode.PIPELINED
    assert calls == ([*a_threads] if pipelined else [])
    assert seen == {"source": {base}, "a": {min(19, base + 3) if pipelined else base}, "b": {base}}
    assert nice_now() == base
    with pytest.raises(ValueError, match="StageSpec.on_start must be None or callable, got 3"):
        StageSpec(name="c", fn=stage("a"), on_start=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacities, source_capacity", [([1, 1, 1], 1), ([3, 1, 2], 2), ([1, 4], 3)])
def test_bounded_queues_bound_run_ahead(capacities: list[int], source_capacity: int):
    """Stage s starts batch j only after the consumer took batch j - (capacities from s to the end)."""
    num_items = 12
    lock = threading.Lock()
    started: dict[str, int] = {}

    def record(name: str, batch: int) -> None:
        with lock:
            started[name] = max(started.get(name, -1), batch)

    def counting_source():
        for batch in range(num_items):
            record("source", batch)
            yield batch

    def stage(name: str):
        def fn(batch: int) -> int:
            record(name, batch)
            return batch

        return fn

    names = [f"s{k}" for k in range(len(capacities))]
    stages = [StageSpec(name=n, fn=stage(n), capacity=c) for n, c in zip(names, capacities, strict=True)]
    caps = [source_capacity, *capacities]
    # how far ahead of the consumer each stage may start: the capacities from it to the consumer
    ahead = {name: sum(caps[i:]) for i, name in enumerate(["source", *names])}
    config = PipelineConfig(source_capacity=source_capacity)
    with StagedPipeline(counting_source(), stages, config=config, device=CPU) as pipe:
        for k in pipe:
            with lock:
                snapshot = dict(started)
            for name, limit in ahead.items():
                assert snapshot.get(name, -1) <= k + limit, (name, k, snapshot)
            # while the consumer sits on batch k, every stage fills its queue up to the bound: the
            # lookahead the capacities promise is really there
            deadline = time.monotonic() + 2.0
            want = {name: min(num_items - 1, k + limit) for name, limit in ahead.items()}
            while time.monotonic() < deadline:
                with lock:
                    if all(started.get(n, -1) == want[n] for n in want):
                        break
                time.sleep(0.001)
            with lock:
                assert {n: started.get(n, -1) for n in want} == want, k


FAULT_POSITIONS = ["source", "s0", "s1", "s2", "consumer"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", list(PipelineMode))
@pytest.mark.parametrize("fail_batch", [0, 3])
@pytest.mark.parametrize("position", FAULT_POSITIONS)
def test_fault_is_raised_with_stage_name(position: str, fail_batch: int, mode: PipelineMode):
    num_items = 10
    fail_stage = int(position[1:]) if position[0] == "s" and position[1:].isdigit() else None
    stages = mixer_stages(
        3,
        # a slow last stage keeps the others blocked on full queues when the fault hits
        delays_s=[[0.0], [0.0], [0.002]],
        fail=(fail_stage, fail_batch) if fail_stage is not None else None,
    )
    src = source(num_items, fail_at=fail_batch if position == "source" else None)
    received = []
    start = time.monotonic()
    pipe = StagedPipeline(src, stages, config=PipelineConfig(mode=mode), device=CPU)
    with pytest.raises((StageFailed, InjectedFault)) as info, pipe:
        for batch, _ in pipe:
            if position == "consumer" and batch == fail_batch:
                raise InjectedFault(f"fault in batch {batch}")
            received.append(batch)
    assert time.monotonic() - start < 5.0
    if position == "consumer":
        assert info.type is InjectedFault  # the consumer's own error passes through untouched
    else:
        err = info.value
        assert isinstance(err, StageFailed)
        assert (err.stage, err.batch) == (position, fail_batch)
        assert repr(position) in str(err) and f"batch {fail_batch}" in str(err)
        assert isinstance(err.__cause__, InjectedFault)
    # batches before the fault came out in order; the failed batch never did
    assert received == list(range(len(received)))
    assert len(received) <= fail_batch
    assert not pipeline_threads()


@pytest.mark.timeout(10)
def test_error_raised_again_after_failure_and_no_hang_without_with():
    stages = mixer_stages(2, fail=(1, 2))
    pipe = StagedPipeline(source(10), stages, device=CPU)
    with pytest.raises(StageFailed):
        for _ in pipe:
            pass
    assert not pipeline_threads()  # the failure closed the pipeline by itself
    with pytest.raises(StageFailed):
        next(pipe)


@pytest.mark.timeout(10)
def test_base_exception_in_a_worker_is_reported():
    class Abort(BaseException):
        pass

    def boom(item):
        raise Abort("stop")

    with pytest.raises(StageFailed) as info, StagedPipeline(range(5), [StageSpec(name="x", fn=boom)]) as pipe:
        list(pipe)
    assert isinstance(info.value.__cause__, Abort)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", list(PipelineMode))
def test_close_mid_stream_stops_every_worker_and_the_source(mode: PipelineMode):
    closed = threading.Event()

    def endless():
        try:
            for batch in itertools.count():
                yield batch, batch
        finally:
            closed.set()

    stages = mixer_stages(3, capacities=[2, 1, 3])
    with StagedPipeline(endless(), stages, config=PipelineConfig(mode=mode), device=CPU) as pipe:
        got = [batch for batch, _ in itertools.islice(pipe, 5)]
        if mode is PipelineMode.PIPELINED:
            assert len(pipeline_threads()) == 4  # source + 3 stages
    assert got == [0, 1, 2, 3, 4]
    assert not pipeline_threads()
    assert closed.is_set()  # the source generator ran its cleanup
    with pytest.raises(StopIteration):
        next(pipe)


@pytest.mark.timeout(10)
def test_close_before_iterating_and_twice():
    pipe = StagedPipeline(source(3), mixer_stages(1), device=CPU)
    pipe.close()
    pipe.close()
    assert list(pipe) == []


@pytest.mark.timeout(10)
def test_exhausted_pipeline_joins_its_workers_without_close():
    pipe = StagedPipeline(source(6), mixer_stages(2), device=CPU)
    assert len(list(pipe)) == 6
    assert not pipeline_threads()


def test_stage_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        StagedPipeline(range(1), [StageSpec(name="a", fn=abs), StageSpec(name="a", fn=abs)], device=CPU)
    with pytest.raises(ValueError, match="unique"):
        StagedPipeline(range(1), [StageSpec(name="compute", fn=abs)], device=CPU)


@pytest.mark.timeout(20)
def test_pipelined_overlaps_stages_sequential_adds_them():
    """5/10/20 ms stages and a 20 ms consumer: ~20 ms per step pipelined vs ~55 ms sequential.

    Only a loose bound is asserted (timing on a shared 2-core machine drifts); the benchmark
    benchmarks/bench_pipeline_core.py measures the ratios.
    """
    num_items = 12
    delays = [0.005, 0.010, 0.020]
    consumer_s = 0.020

    def timed(mode: PipelineMode) -> float:
        stages = [StageSpec(name=f"d{k}", fn=sleeper(d)) for k, d in enumerate(delays)]
        with StagedPipeline(range(num_items), stages, config=PipelineConfig(mode=mode), device=CPU) as pipe:
            start = time.perf_counter()
            for _ in pipe:
                time.sleep(consumer_s)
            return (time.perf_counter() - start) / num_items

    sequential = timed(PipelineMode.SEQUENTIAL)
    pipelined = timed(PipelineMode.PIPELINED)
    assert sequential >= sum(delays) + consumer_s
    assert pipelined >= consumer_s
    assert pipelined < 0.7 * sequential, (pipelined, sequential)
