"""Per-stage counters, the Chrome trace of every stage of every batch, and the stall warning.

Each stage (the source, every ``StageSpec``, and the consumer) has its own counters, written only by the
thread that runs the stage, so no lock is needed; readers see a consistent-enough snapshot under the GIL.

Words used in the report:
    busy_s: seconds inside the stage's function (on CUDA: host time to enqueue the work, not GPU time).
    stall_s: seconds waiting for the previous stage's output (for the consumer: for the next batch).
    blocked_s: seconds waiting for room in the output queue, i.e. for the next stage to take a batch.
    bound_by: the stage with the highest busy time per batch: the one that sets the step time when the
        pipeline overlaps perfectly.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.config import TRACE_BATCHES

__all__ = ["StageCounters", "Timeline", "stall_warning"]


@dataclass(slots=True)
class StageCounters:
    """Cumulative counters of one stage."""

    name: str
    items: int = 0
    busy_s: float = 0.0
    stall_s: float = 0.0
    blocked_s: float = 0.0
    # (batch, start_ns, end_ns) of each traced batch, relative to the timeline's origin
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "items": self.items,
            "busy_s": round(self.busy_s, 6),
            "stall_s": round(self.stall_s, 6),
            "blocked_s": round(self.blocked_s, 6),
            "busy_per_item_s": round(self.busy_s / self.items, 6) if self.items else 0.0,
        }


class Timeline:
    """Counters and trace spans of one pipeline run.

    Args:
        names: stage names in pipeline order (source first, consumer last); trace rows follow this order.
        rank: process rank, the trace's ``pid``.
        trace_batches: only batches with a smaller index are kept as trace spans.
    """

    def __init__(self, names: Sequence[str], *, rank: int = 0, trace_batches: int = TRACE_BATCHES) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {list(names)}")
        self.names = list(names)
        self.rank = rank
        self.trace_batches = trace_batches
        self.counters = {name: StageCounters(name) for name in names}
        self.start_ns = time.perf_counter_ns()
        self.end_ns: int | None = None

    def now_ns(self) -> int:
        return time.perf_counter_ns() - self.start_ns

    def add_work(self, name: str, batch: int, start_ns: int, end_ns: int) -> None:
        """Count one batch of work of ``name`` and keep its span for the trace."""
        counters = self.counters[name]
        counters.items += 1
        counters.busy_s += (end_ns - start_ns) * 1e-9
        if batch < self.trace_batches:
            counters.spans.append((batch, start_ns, end_ns))

    def finish(self) -> None:
        """Freeze the wall time (end of stream or close); later calls keep the first end."""
        if self.end_ns is None:
            self.end_ns = self.now_ns()

    def wall_s(self) -> float:
        end_ns = self.end_ns if self.end_ns is not None else self.now_ns()
        return end_ns * 1e-9

    def bound_by(self) -> str | None:
        """The stage with the highest busy time per batch, or None before any batch finished."""
        busy = {n: c.busy_s / c.items for n, c in self.counters.items() if c.items}
        return max(busy, key=lambda n: busy[n]) if busy else None

    def report(self, mode: str) -> dict[str, Any]:
        """JSON-ready summary for metrics.jsonl / summary.json (the ``pipeline`` key).

        ``steps`` counts the batches the consumer has finished; ``consumer_wait_fraction`` is the share
        of the wall time the consumer spent waiting for its next batch.
        """
        consumer = self.counters[self.names[-1]]
        wall_s = self.wall_s()
        steps = consumer.items
        return {
            "mode": mode,
            "steps": steps,
            "wall_s": round(wall_s, 6),
            "step_s": round(wall_s / steps, 6) if steps else None,
            "bound_by": self.bound_by(),
            "consumer_wait_fraction": round(consumer.stall_s / wall_s, 4) if wall_s > 0 else 0.0,
            "stages": {name: self.counters[name].as_dict() for name in self.names},
        }

    def trace_events(self) -> list[dict[str, Any]]:
        """Trace Event Format: one complete ("X") event per stage per traced batch, ts/dur in µs.

        One row (``tid``) per stage, named by metadata events and sorted in pipeline order, so
        Perfetto / chrome://tracing show consecutive batches overlapping across rows.
        """
        pid = self.rank
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}}
        ]
        for tid, name in enumerate(self.names, start=1):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        for tid, name in enumerate(self.names, start=1):
            for batch, start_ns, end_ns in list(self.counters[name].spans):
                events.append(
                    {
                        "name": f"{name} {batch}",
                        "cat": "pipeline",
                        "ph": "X",
                        "ts": start_ns / 1e3,
                        "dur": (end_ns - start_ns) / 1e3,
                        "pid": pid,
                        "tid": tid,
                        "args": {"batch": batch, "stage": name},
                    }
                )
        return events

    def write_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write the Chrome trace JSON to ``path`` (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path


def stall_warning(
    report: dict[str, Any], *, fraction: float = 0.5, advice: Mapping[str, str] | None = None
) -> str | None:
    """A warning when the consumer waits for input more than ``fraction`` of the wall time, else None.

    Only the consumer's wait costs step time: in a healthy, compute-bound pipeline every earlier stage is
    blocked on a full queue most of the time, and a stage behind the bottleneck stalls on input — both are
    expected. The message names the stage that bounds the step, its busy time per batch and, from
    ``advice`` (stage name -> what would speed it up), what to change.

    Example:
        >>> stall_warning({"mode": "pipelined", "consumer_wait_fraction": 0.1, "stages": {}}) is None
        True
    """
    if report.get("mode") != "pipelined":
        return None  # sequential mode waits for every stage by design
    wait = float(report.get("consumer_wait_fraction") or 0.0)
    if wait <= fraction:
        return None
    bound = report.get("bound_by")
    stages = report.get("stages", {})
    per_item_ms = 1e3 * float(stages.get(bound, {}).get("busy_per_item_s", 0.0)) if bound else 0.0
    hint = (advice or {}).get(bound or "")
    return (
        f"pipeline stall: the consumer waits {wait:.0%} of the step for its next batch; "
        f"stage {bound!r} bounds the step at {per_item_ms:.1f} ms per batch" + (f": {hint}" if hint else "")
    )
