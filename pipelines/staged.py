"""The inter-batch pipeline: named stages on worker threads, bounded queues, the consumer in order.

Threading contract (PIPELINED):

- The *source* iterator is pulled by its own worker thread, then each ``StageSpec.fn`` runs on its own
  worker thread (and, on CUDA, its own stream), for batch 0, 1, 2, ... in order. A stage never runs two
  batches at once, so a stage function may keep state between calls.
- Between two stages sits a bounded hand-off counted in *started* batches: a stage starts batch ``j`` only
  once the next stage (or the consumer) has taken batch ``j - capacity``. The source therefore runs at most
  ``source_capacity + sum(capacities)`` batches ahead of the consumer.
- The consumer — the thread that iterates the pipeline, normally the main thread doing forward/backward/
  optimizer — receives the items in batch order. **Asking for batch i+1 is the signal that batch i is
  finished**: the pipeline takes batch i+1 out of the last queue only then, so with ``capacity=1`` the last
  stage starts batch i+2 only after the loop body of batch i has returned. Release batch i's pins (or
  anything else the later stages must not touch before batch i is done) at the end of the loop body; no
  hook is needed. On CUDA, a stage with ``sync_with_consumer=True`` additionally makes its stream wait for
  the consumer's stream up to that point, so the release is also ordered on the device.
- A failure in the source or in any stage stops every worker at its next hand-off and is raised in the
  consumer as ``StageFailed`` (stage name, batch index, original exception chained as ``__cause__``) as
  soon as the consumer next waits for a batch. Batches already finished by later stages are dropped.
- ``close()`` (or leaving the ``with`` block) stops and joins every worker, also mid-stream; a worker still
  inside a stage function finishes that call first.

SEQUENTIAL runs the source and every stage inline in the consumer's ``__next__``, one batch at a time, on
the current stream: the reference the pipelined mode must match item for item.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipelines.config import PipelineConfig, PipelineMode, StageSpec
from pipelines.device import DeviceContext, Event
from pipelines.timeline import Timeline, stall_warning

__all__ = ["StageFailed", "StagedPipeline"]

log = logging.getLogger(__name__)

_END = object()  # end-of-stream marker; passes through every hand-off


class StageFailed(RuntimeError):
    """A pipeline stage raised; ``stage`` and ``batch`` say where, ``__cause__`` holds the original error."""

    def __init__(self, stage: str, batch: int, cause: BaseException) -> None:
        super().__init__(f"pipeline stage {stage!r} failed on batch {batch}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.batch = batch
        self.cause = cause


class _Stopped(Exception):
    """Raised inside the pipeline when it was stopped (error or close) while a thread waited."""


class _Edge:
    """Bounded hand-off between two threads; room is counted in batches started, not yet taken."""

    def __init__(self, capacity: int) -> None:
        self._cond = threading.Condition()
        self._entries: deque[Any] = deque()
        self._capacity = capacity
        self._in_flight = 0  # reserved by the producer and not yet taken by the consumer
        self._aborted = False

    def reserve(self) -> None:
        """Block until the producer may start one more batch."""
        with self._cond:
            while self._in_flight >= self._capacity and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise _Stopped
            self._in_flight += 1

    def put(self, entry: Any) -> None:
        with self._cond:
            self._entries.append(entry)
            self._cond.notify_all()

    def get(self) -> Any:
        """Block until an entry is there; taking a batch frees the producer's slot."""
        with self._cond:
            while not self._entries and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise _Stopped
            entry = self._entries.popleft()
            if entry is not _END:
                self._in_flight -= 1
                self._cond.notify_all()
            return entry

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class StagedPipeline:
    """Runs ``source`` through ``stages`` and yields the finished items in order.

    Args:
        source: iterable of raw items (batch 0, 1, ...); pulled by its own worker in PIPELINED mode.
        stages: the stages in order; names unique and distinct from the config's source/consumer names.
        config: mode, source capacity, names, trace size.
        device: streams/events/copies; None: ``DeviceContext()`` (CUDA when available, else CPU).
        rank: process rank (the trace's ``pid``).

    Example:
        >>> stages = [StageSpec(name="double", fn=lambda x: 2 * x), StageSpec(name="inc", fn=lambda x: x + 1)]
        >>> with StagedPipeline(range(4), stages, device=DeviceContext("cpu")) as pipe:
        ...     out = [item for item in pipe]  # forward/backward of each batch goes in this loop
        >>> out
        [1, 3, 5, 7]
        >>> pipe.stats()["stages"]["double"]["items"]
        4
    """

    def __init__(
        self,
        source: Iterable[Any],
        stages: Sequence[StageSpec],
        *,
        config: PipelineConfig | None = None,
        device: DeviceContext | None = None,
        rank: int = 0,
    ) -> None:
        self.config = config if config is not None else PipelineConfig()
        self.stages = list(stages)
        for spec in self.stages:
            if not isinstance(spec, StageSpec):
                raise TypeError(f"stages must be StageSpec objects, got {spec!r}")
        names = [self.config.source_name, *(s.name for s in self.stages), self.config.consumer_name]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names (with source and consumer) must be unique, got {names}")
        self.device = device if device is not None else DeviceContext()
        self._source = source
        self._iterator: Iterator[Any] | None = None
        self.timeline = Timeline(names, rank=rank, trace_batches=self.config.trace_batches)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._error: StageFailed | None = None
        self._threads: list[threading.Thread] = []
        # edge k feeds stage k (edge 0: source -> first stage; edge -1: last stage -> consumer)
        capacities = [self.config.source_capacity, *(s.capacity for s in self.stages)]
        self._edges = [_Edge(c) for c in capacities]
        self._consumer_event: Event | None = None  # consumer's stream after its last finished batch
        self._next_batch = 0  # SEQUENTIAL: index of the next batch
        # StageSpec.lead: batches each stage has finished, the stream's length once the source has ended
        self._leads = [self._lead_of(k, spec) for k, spec in enumerate(self.stages)]
        self._led = {lead[0] for lead in self._leads if lead is not None}  # stages some later stage waits on
        self._progress = threading.Condition()
        self._finished = [0] * len(self.stages)
        self._total: int | None = None
        self._halted = False
        self._current: tuple[int, int] | None = None  # (batch, ns handed out) of the consumer's batch

    def _lead_of(self, k: int, spec: StageSpec) -> tuple[int, int] | None:
        """``spec.lead`` as (index of the earlier stage, batches ahead); checked against the capacities."""
        if spec.lead is None:
            return None
        name, n = spec.lead
        earlier = [s.name for s in self.stages[:k]]
        if name not in earlier:
            raise ValueError(f"stage {spec.name!r}: lead names {name!r}, which is not a stage before it")
        j = earlier.index(name)
        room = sum(s.capacity for s in self.stages[j:k])
        if room < n:
            raise ValueError(
                f"stage {spec.name!r}: {name!r} cannot run {n} batches ahead of it "
                f"(the capacities between them add up to {room})"
            )
        return j, n

    @property
    def mode(self) -> PipelineMode:
        return self.config.mode

    # -- consumer side -------------------------------------------------------------------------------

    def __iter__(self) -> StagedPipeline:
        with self._lock:
            if not self._started and not self._closed:
                self._started = True
                self._iterator = iter(self._source)
                if self.mode is PipelineMode.PIPELINED:
                    self._start_workers()
        return self

    def __next__(self) -> Any:
        if not self._started:
            iter(self)
        if self._closed:
            self._raise_error()
            raise StopIteration
        self._end_consumer_step()
        if self.mode is PipelineMode.SEQUENTIAL:
            return self._next_sequential()
        # Everything the consumer enqueued so far belongs to batches it has finished (see module doc).
        self._consumer_event = self.device.record()
        wait_start = self.timeline.now_ns()
        try:
            entry = self._edges[-1].get()
        except _Stopped:
            self.close()
            self._raise_error()
            raise StopIteration from None
        now = self.timeline.now_ns()
        self.timeline.counters[self.config.consumer_name].stall_s += (now - wait_start) * 1e-9
        if entry is _END:
            self.close()
            raise StopIteration
        batch, item, event = entry
        self.device.wait(event)
        self.device.record_stream(item)
        self._current = (batch, now)
        return item

    def _next_sequential(self) -> Any:
        assert self._iterator is not None
        tl, batch = self.timeline, self._next_batch
        wait_start = start = tl.now_ns()
        try:
            item = next(self._iterator)
        except StopIteration:
            self.close()
            raise
        except Exception as exc:
            self._fail_inline(self.config.source_name, batch, exc)
        end = tl.now_ns()
        tl.add_work(self.config.source_name, batch, start, end)
        for spec in self.stages:
            start = end
            try:
                item = spec.fn(item)
            except Exception as exc:
                self._fail_inline(spec.name, batch, exc)
            end = tl.now_ns()
            tl.add_work(spec.name, batch, start, end)
        tl.counters[self.config.consumer_name].stall_s += (end - wait_start) * 1e-9
        self._next_batch += 1
        self._current = (batch, end)
        return item

    def _fail_inline(self, stage: str, batch: int, exc: Exception) -> NoReturn:
        self._fail(stage, batch, exc)
        self.close()
        self._raise_error()
        raise AssertionError("unreachable: _fail set the error")

    def _end_consumer_step(self) -> None:
        if self._current is not None:
            batch, start = self._current
            self._current = None
            self.timeline.add_work(self.config.consumer_name, batch, start, self.timeline.now_ns())

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error from self._error.cause

    # -- lifetime --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop and join every worker (also mid-stream); idempotent. Call from the consumer's thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._halt()
        self._end_consumer_step()
        if self.mode is PipelineMode.SEQUENTIAL:
            _close_iterator(self._iterator)  # PIPELINED: the source worker does it in its own thread
        for thread in self._threads:
            thread.join(self.config.join_timeout_s)
            if thread.is_alive():
                log.warning(
                    "pipeline worker %s still inside its stage function after %.1f s; left behind",
                    thread.name,
                    self.config.join_timeout_s,
                )
        self.timeline.finish()

    def __enter__(self) -> StagedPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- observability --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """JSON-ready per-stage busy/stall/blocked seconds, item counts, ``bound_by`` (see timeline)."""
        return self.timeline.report(self.mode.value)

    def stall_warning(self, advice: Mapping[str, str] | None = None) -> str | None:
        """A one-line warning when the consumer waits for input most of the step (see ``stall_warning``);
        ``advice``: per stage, what would speed it up."""
        return stall_warning(self.stats(), fraction=self.config.stall_fraction, advice=advice)

    def write_trace(self, path: str | Path) -> Path:
        """Write the Chrome trace (Trace Event Format JSON) of every stage of every traced batch."""
        return self.timeline.write_trace(path)

    # -- workers ---------------------------------------------------------------------------------------

    def _start_workers(self) -> None:
        targets: list[tuple[str, Any]] = [(self.config.source_name, self._run_source)]
        targets += [(spec.name, self._stage_runner(k, spec)) for k, spec in enumerate(self.stages)]
        for name, target in targets:
            # daemon: a stage function that never returns must not keep the interpreter alive
            thread = threading.Thread(target=target, name=f"tierrec-pipeline-{name}", daemon=True)
            self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def _fail(self, stage: str, batch: int, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = StageFailed(stage, batch, exc)
        self._halt()

    def _halt(self) -> None:
        """Wake every worker waiting at a hand-off or for a lead; each stops there."""
        for edge in self._edges:
            edge.abort()
        with self._progress:
            self._halted = True
            self._progress.notify_all()

    def _wait_for_lead(self, lead: tuple[int, int], batch: int) -> None:
        """Block until stage ``lead[0]`` has finished batch ``batch + lead[1]`` or the stream's last batch."""
        j, n = lead
        with self._progress:
            while not self._halted:
                done = self._finished[j]
                if done > batch + n or (self._total is not None and done >= self._total):
                    return
                self._progress.wait()
            raise _Stopped

    def _run_source(self) -> None:
        assert self._iterator is not None
        name, out, tl = self.config.source_name, self._edges[0], self.timeline
        counters = tl.counters[name]
        batch, exhausted = 0, False
        try:
            self.device.bind_thread()
            stream = self.device.new_stream()
            while True:
                wait_start = tl.now_ns()
                out.reserve()
                start = tl.now_ns()
                counters.blocked_s += (start - wait_start) * 1e-9
                with self.device.stream(stream):
                    try:
                        item = next(self._iterator)
                    except StopIteration:
                        exhausted = True
                        with self._progress:
                            self._total = batch
                            self._progress.notify_all()
                        out.put(_END)
                        return
                    event = self.device.record()
                tl.add_work(name, batch, start, tl.now_ns())
                out.put((batch, item, event))
                batch += 1
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - any escape would leave the consumer waiting forever
            self._fail(name, batch, exc)
        finally:
            if not exhausted:
                _close_iterator(self._iterator)  # a generator runs its cleanup in the thread that drove it

    def _stage_runner(self, k: int, spec: StageSpec) -> Any:
        def run() -> None:
            inp, out, tl = self._edges[k], self._edges[k + 1], self.timeline
            counters = tl.counters[spec.name]
            batch = -1
            try:
                self.device.bind_thread()
                if spec.on_start is not None:
                    spec.on_start()
                stream = self.device.new_stream()
                while True:
                    # room downstream first: holding an input we cannot pass on would let the
                    # previous stage run one batch further ahead than its capacity says
                    wait_start = tl.now_ns()
                    out.reserve()
                    got_room = tl.now_ns()
                    entry = inp.get()
                    start = tl.now_ns()
                    counters.blocked_s += (got_room - wait_start) * 1e-9
                    counters.stall_s += (start - got_room) * 1e-9
                    if entry is _END:
                        out.put(_END)
                        return
                    batch, item, event = entry
                    lead = self._leads[k]
                    if lead is not None:
                        self._wait_for_lead(lead, batch)  # waiting for the earlier stage is a stall too
                        waited = tl.now_ns()
                        counters.stall_s += (waited - start) * 1e-9
                        start = waited
                    with self.device.stream(stream):
                        self.device.wait(event)
                        if spec.sync_with_consumer:
                            self.device.wait(self._consumer_event)
                        self.device.record_stream(item)
                        item = spec.fn(item)
                        event = self.device.record()
                    tl.add_work(spec.name, batch, start, tl.now_ns())
                    out.put((batch, item, event))
                    if k in self._led:
                        with self._progress:
                            self._finished[k] += 1
                            self._progress.notify_all()
            except _Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - see _run_source
                self._fail(spec.name, batch, exc)

        return run


def _close_iterator(iterator: Iterator[Any] | None) -> None:
    """Let a source stopped mid-stream release what it holds (a generator's ``finally``, open files)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing the pipeline source failed")
