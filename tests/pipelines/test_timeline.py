"""Counters, the Chrome trace and the stall warning, checked on pipelines with known delays."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pipelines import (
    DeviceContext,
    PipelineConfig,
    PipelineMode,
    StagedPipeline,
    StageSpec,
    Timeline,
    stall_warning,
)
from pipelines.config import TRACE_BATCHES
from tests.pipelines.helpers import sleeper

CPU = DeviceContext("cpu")
NUM_ITEMS = 8


def run(mode: PipelineMode, delays: dict[str, float], consumer_s: float, **config) -> StagedPipeline:
    stages = [StageSpec(name=name, fn=sleeper(d)) for name, d in delays.items()]
    pipe = StagedPipeline(
        range(NUM_ITEMS), stages, config=PipelineConfig(mode=mode, **config), device=CPU, rank=3
    )
    with pipe:
        for _ in pipe:
            time.sleep(consumer_s)
    return pipe


def x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def overlaps(a: dict, b: dict) -> bool:
    eps_us = 0.01  # spans that touch (one ends where the next starts) differ by float rounding only
    return a["ts"] < b["ts"] + b["dur"] - eps_us and b["ts"] < a["ts"] + a["dur"] - eps_us


@pytest.mark.parametrize("mode", list(PipelineMode))
def test_stats_count_every_batch_and_name_the_bounding_stage(mode: PipelineMode):
    pipe = run(mode, {"fast": 0.001, "slow": 0.008}, consumer_s=0.002)
    stats = json.loads(json.dumps(pipe.stats()))  # JSON-ready
    assert stats["mode"] == mode.value
    assert stats["steps"] == NUM_ITEMS
    assert list(stats["stages"]) == ["source", "fast", "slow", "compute"]
    for name, counters in stats["stages"].items():
        assert counters["items"] == NUM_ITEMS, name
    assert stats["bound_by"] == "slow"
    slow = stats["stages"]["slow"]
    assert slow["busy_s"] >= NUM_ITEMS * 0.008
    assert slow["busy_per_item_s"] == pytest.approx(slow["busy_s"] / NUM_ITEMS, abs=1e-5)
    compute = stats["stages"]["compute"]
    assert compute["busy_s"] >= NUM_ITEMS * 0.002
    assert stats["wall_s"] >= compute["busy_s"] + compute["stall_s"] - 1e-3
    if mode is PipelineMode.PIPELINED:
        # "fast" waits for "slow" to take its batches: blocked on its full output queue
        assert stats["stages"]["fast"]["blocked_s"] > 0.5 * NUM_ITEMS * 0.006
        # and "slow" is the bottleneck: it hardly waits for anything
        assert slow["blocked_s"] + slow["stall_s"] < slow["busy_s"]


@pytest.mark.parametrize("mode", list(PipelineMode))
def test_trace_is_valid_chrome_json_with_one_event_per_stage_per_batch(tmp_path: Path, mode: PipelineMode):
    pipe = run(mode, {"a": 0.003, "b": 0.003, "c": 0.003}, consumer_s=0.003)
    path = pipe.write_trace(tmp_path / "run" / "trace.json")
    trace = json.loads(path.read_text())
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    rows = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert list(rows.values()) == ["source", "a", "b", "c", "compute"]
    events = x_events(trace)
    for e in events:
        assert e["pid"] == 3 and e["dur"] >= 0 and e["ts"] >= 0
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(e)
    for tid, name in rows.items():
        batches = sorted(e["args"]["batch"] for e in events if e["tid"] == tid)
        assert batches == list(range(NUM_ITEMS)), name
    cross_batch = [
        (a, b) for a in events for b in events if a["args"]["batch"] != b["args"]["batch"] and overlaps(a, b)
    ]
    if mode is PipelineMode.PIPELINED:
        assert cross_batch, "consecutive batches should overlap across stage rows"
        assert all(a["tid"] != b["tid"] for a, b in cross_batch)  # one batch at a time per stage
    else:
        assert not [(a, b) for a in events for b in events if a is not b and overlaps(a, b)]


def test_trace_keeps_only_the_first_batches(tmp_path: Path):
    pipe = run(PipelineMode.PIPELINED, {"a": 0.0}, consumer_s=0.0, trace_batches=3)
    events = x_events(json.loads(pipe.write_trace(tmp_path / "t.json").read_text()))
    assert len(events) == 3 * 3  # source, a, compute
    assert pipe.stats()["stages"]["a"]["items"] == NUM_ITEMS  # counters still cover every batch


def test_one_default_trace_size_for_the_config_and_the_timeline():
    assert PipelineConfig().trace_batches == TRACE_BATCHES
    timeline = Timeline(["a"])
    for batch in range(TRACE_BATCHES + 5):
        timeline.add_work("a", batch, batch, batch + 1)
    assert [span[0] for span in timeline.counters["a"].spans] == list(range(TRACE_BATCHES))


def test_stall_warning_names_the_slow_stage_when_the_consumer_waits():
    pipe = run(PipelineMode.PIPELINED, {"prefetch": 0.012, "fill": 0.001}, consumer_s=0.001)
    message = pipe.stall_warning()
    assert message is not None and "'prefetch'" in message and "consumer waits" in message


def test_the_stall_warning_says_what_would_speed_the_bounding_stage_up():
    pipe = run(PipelineMode.PIPELINED, {"prefetch": 0.012, "fill": 0.001}, consumer_s=0.001)
    message = pipe.stall_warning({"prefetch": "raise the host rows", "fill": "raise the slots"})
    assert message is not None and message.endswith("ms per batch: raise the host rows")


def test_no_stall_warning_when_compute_bounds_the_step():
    pipe = run(PipelineMode.PIPELINED, {"prefetch": 0.001, "fill": 0.001}, consumer_s=0.012)
    assert pipe.stall_warning() is None
    assert pipe.stats()["bound_by"] == "compute"


def test_no_stall_warning_in_sequential_mode():
    pipe = run(PipelineMode.SEQUENTIAL, {"prefetch": 0.012}, consumer_s=0.001)
    assert pipe.stall_warning() is None
    assert stall_warning({"mode": "pipelined", "consumer_wait_fraction": 0.9, "stages": {}}) is not None
