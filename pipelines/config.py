"""Configuration of the inter-batch pipeline: mode, stages, queue capacities, trace size."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TRACE_BATCHES", "PipelineConfig", "PipelineMode", "Stage", "StageSpec"]

# The one default of how many batches a run's Chrome trace keeps: PipelineConfig's, Timeline's and the
# recsys ``[pipeline]`` section's (docs/configuration.md). Small enough that a long run's trace stays a
# few MB; 200 batches show the steady state well past warm-up.
TRACE_BATCHES = 200


class PipelineMode(enum.Enum):
    """How the stages of consecutive batches are scheduled."""

    SEQUENTIAL = (
        "sequential"  # every stage inline in the consumer's thread, one batch at a time: the reference
    )
    PIPELINED = "pipelined"  # one worker thread (and device stream) per stage, bounded queues between them


class Stage(enum.StrEnum):
    """Names of the stages of the training pipeline (docs/design.md, the nested pipeline), in order.

    The pipeline core accepts any stage name; these are the ones the TorchRec binding uses, so metrics,
    traces and warnings speak one vocabulary.
    """

    LOAD = "load"  # read and parse a batch of raw ids, dense features and labels (host)
    ROUTE = "route"  # key routing: unique ids of tiered tables to their owner rank (all-to-all)
    PREFETCH = "prefetch"  # tier prefetch SSD -> DRAM, announced L batches ahead (lookahead)
    FILL = "fill"  # device fill + remap: rows into slots, ids -> slot ids, pins taken
    COMPUTE = "compute"  # forward / backward / optimizer, on the consumer's (main) thread


@dataclass(kw_only=True, frozen=True, slots=True)
class StageSpec:
    """One stage: a named function applied to every batch, in batch order, on the stage's own worker.

    Attributes:
        name: stage name (a ``Stage`` or any non-empty string); unique within a pipeline.
        fn: ``item -> item``. Called for batch 0, 1, 2, ... in order, always from the same thread, so it
            may keep state between calls.
        capacity: how many batches this stage may run ahead of the stage after it (or of the consumer):
            the stage starts batch ``j`` only once its successor has taken batch ``j - capacity``. So
            ``capacity=1`` on the device-fill stage fills batch i+1 while batch i computes and never
            touches batch i+2 before the consumer has finished batch i.
        sync_with_consumer: on CUDA, the stage's stream waits, before each batch, for all the work the
            consumer enqueued on its stream up to the batch it last finished (the stage writes device
            state that the consumer's kernels read, e.g. slots freed by released pins). Free on CPU.
        on_start: called once on the stage's worker thread before its first batch, e.g. to lower that
            thread's OS scheduling priority (the TorchRec binding lowers the tier prefetch and device fill
            threads by ``pipeline.worker_nice``, so that where the workers and the consumer share too few
            cores the training step, the critical path, is preempted less often). Not called in SEQUENTIAL
            mode, where every stage runs on the consumer's thread. An exception fails the stage like one
            raised by ``fn``.
        lead: ``(stage, n)``: start batch ``i`` only once the earlier stage ``stage`` has finished batch
            ``i + n`` (or its last batch, where the stream ends sooner). A stage whose work reads what the
            earlier stage has done for later batches — the store's eviction reads the batches announced
            after the one it fills — then sees the same ``n`` of them on every run, whatever the threads'
            timing. The capacities from ``stage`` up to the one before this must add up to at least ``n``
            (else ``stage`` could never run that far ahead); the pipeline checks it when it is built.
            SEQUENTIAL mode runs each batch through every stage before the next and ignores it.
    """

    name: str
    fn: Callable[[Any], Any]
    capacity: int = 1
    sync_with_consumer: bool = False
    on_start: Callable[[], None] | None = None
    lead: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StageSpec.name must be a non-empty str, got {self.name!r}")
        # a Stage member becomes its plain value, so metrics keys, trace rows and messages read "fill"
        object.__setattr__(self, "name", str(self.name))
        if not callable(self.fn):
            raise ValueError(f"StageSpec.fn must be callable, got {self.fn!r}")
        if not isinstance(self.capacity, int) or isinstance(self.capacity, bool) or self.capacity < 1:
            raise ValueError(f"StageSpec.capacity must be an int >= 1, got {self.capacity!r}")
        if self.on_start is not None and not callable(self.on_start):
            raise ValueError(f"StageSpec.on_start must be None or callable, got {self.on_start!r}")
        if self.lead is not None:
            ok = isinstance(self.lead, tuple) and len(self.lead) == 2 and isinstance(self.lead[1], int)
            if not ok or isinstance(self.lead[1], bool) or self.lead[1] < 0:
                raise ValueError(f"StageSpec.lead must be None or (stage name, int >= 0), got {self.lead!r}")
            object.__setattr__(self, "lead", (str(self.lead[0]), self.lead[1]))


@dataclass(kw_only=True, frozen=True, slots=True)
class PipelineConfig:
    """How a ``StagedPipeline`` runs.

    Attributes:
        mode: SEQUENTIAL (reference, no overlap) or PIPELINED.
        source_name: stage name under which pulling the next item from the source iterator is measured
            and traced (use ``Stage.LOAD`` when the loader reads the batch inside ``__next__``).
        source_capacity: how many items the source worker may run ahead of the first stage; the source
            runs at most ``source_capacity + sum(stage capacities)`` batches ahead of the consumer.
        consumer_name: name of the consumer (the loop body on the main thread) in metrics and the trace.
        trace_batches: batches with index below this are recorded in the Chrome trace (0: no trace);
            bounds the trace's memory on long runs.
        stall_fraction: ``stall_warning`` speaks when the consumer waits for input more than this
            fraction of the wall time.
        join_timeout_s: how long ``close()`` waits for each worker; a worker still inside a stage
            function after that is left behind (it is a daemon thread) and logged.
    """

    mode: PipelineMode = PipelineMode.PIPELINED
    source_name: str = "source"
    source_capacity: int = 1
    consumer_name: str = Stage.COMPUTE.value
    trace_batches: int = TRACE_BATCHES
    stall_fraction: float = 0.5
    join_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, PipelineMode):
            raise ValueError(f"PipelineConfig.mode must be a PipelineMode, got {self.mode!r}")
        for field in ("source_name", "consumer_name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"PipelineConfig.{field} must be a non-empty str, got {value!r}")
            object.__setattr__(self, field, str(value))
        if self.source_name == self.consumer_name:
            raise ValueError(
                f"PipelineConfig.source_name and consumer_name must differ, both are {self.source_name!r}"
            )
        if not isinstance(self.source_capacity, int) or self.source_capacity < 1:
            raise ValueError(
                f"PipelineConfig.source_capacity must be an int >= 1, got {self.source_capacity!r}"
            )
        if not isinstance(self.trace_batches, int) or self.trace_batches < 0:
            raise ValueError(f"PipelineConfig.trace_batches must be an int >= 0, got {self.trace_batches!r}")
        if not 0.0 < self.stall_fraction <= 1.0:
            raise ValueError(f"PipelineConfig.stall_fraction must be in (0, 1], got {self.stall_fraction!r}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"PipelineConfig.join_timeout_s must be > 0, got {self.join_timeout_s!r}")
