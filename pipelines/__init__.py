"""The nested training pipeline (docs/design.md): inter-batch stages on workers, bounded queues, traces.

Public API:
    StagedPipeline, StageSpec, PipelineConfig, PipelineMode, Stage, StageFailed: the inter-batch pipeline.
    DeviceContext: the stream/event abstraction (CUDA streams or CPU no-ops).
    Timeline, stall_warning: per-stage counters, Chrome trace, the stall warning.
"""

from pipelines.config import PipelineConfig, PipelineMode, Stage, StageSpec
from pipelines.device import DeviceContext, Event
from pipelines.staged import StagedPipeline, StageFailed
from pipelines.timeline import StageCounters, Timeline, stall_warning

__all__ = [
    "DeviceContext",
    "Event",
    "PipelineConfig",
    "PipelineMode",
    "Stage",
    "StageCounters",
    "StageFailed",
    "StageSpec",
    "StagedPipeline",
    "Timeline",
    "stall_warning",
]
