"""The nested pipeline that feeds the tiered tables (section ``[pipeline]``).

``recsys.tiered.tiered_feed`` builds a :class:`pipelines.StagedPipeline` from it: load, key routing,
tier prefetch and device fill of later batches on worker threads while the current batch computes (tables
in memory: the load stage alone, ``Trainer.feed``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from embedding_store.threads import lower_thread_priority
from pipelines.config import TRACE_BATCHES, PipelineConfig, PipelineMode, Stage

__all__ = ["PipelineSection"]


class ClusterKind(enum.Enum):
    """How a rank's training batch is cut into its frozen windows."""

    NONE = "none"  # in arrival order
    KEYS = "keys"  # samples that share ids in the same window (recsys/clustering.py)


@dataclass(kw_only=True, frozen=True, slots=True)
class PipelineSection:
    """The nested pipeline that feeds tiered tables (section ``[pipeline]``).

    Attributes:
        mode: ``pipelined`` runs load, key routing, tier prefetch and device fill of later batches on
            worker threads while the current batch computes; ``sequential`` runs them inline (reference).
        trace_batches: batches recorded in ``trace.json`` (Chrome trace; 0: none).
        worker_nice: how much lower than the training thread's the OS scheduling priority of the tier
            prefetch and device fill threads is (nice 0..19, per thread; Linux only). Where the stage
            threads and the training step share too few cores, the training step — the critical path — is
            then preempted less often. Load and key routing keep the training thread's priority: they run
            far ahead to feed the lookahead window. 0 gives every thread the same priority.
        frozen_windows: micro-batch windows per training batch (``recsys/windows.py``): the pooled
            embeddings are exchanged window by window, each window's dense compute overlapping the later
            windows' exchange, with one sparse update per batch. 1 (default) keeps the batch whole; more
            matches the unsplit run to rounding, not bitwise.
        cluster: ``none`` (default): windows take a rank's batch in arrival order; ``keys``: the batch is
            reordered first so that samples sharing ids share a window (``recsys/clustering.py``, a function
            of the batch alone; windows keep their sizes), which makes the ``rows`` exchange
            (``sparse.exchange``) send fewer rows. The model changes by rounding only (the dense
            gradients are summed in another order). Nothing to do with one window.
    """

    mode: PipelineMode = PipelineMode.PIPELINED
    trace_batches: int = TRACE_BATCHES
    worker_nice: int = 10
    frozen_windows: int = 1
    cluster: ClusterKind = ClusterKind.NONE

    def __post_init__(self) -> None:
        if self.trace_batches < 0:
            raise ValueError(f"trace_batches must be >= 0, got {self.trace_batches}")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be in 0..19, got {self.worker_nice}")
        if self.frozen_windows < 1:
            raise ValueError(f"frozen_windows must be >= 1, got {self.frozen_windows}")

    def staged_config(self) -> PipelineConfig:
        """The :class:`~pipelines.StagedPipeline` configuration of a run's feed: this mode and trace size,
        the source worker named as the load stage."""
        return PipelineConfig(mode=self.mode, source_name=Stage.LOAD, trace_batches=self.trace_batches)

    def lower_worker_priority(self) -> None:
        """Lower the calling thread's OS priority by ``worker_nice`` (the ``on_start`` of the tier prefetch
        and device fill stages)."""
        lower_thread_priority(self.worker_nice)
