"""The nested training pipeline (docs/design.md): inter-batch stages on workers, bounded queues, traces.

Public API:
    StagedPipeline, StageSpec, PipelineConfig, PipelineMode, Stage, StageFailed: the inter-batch pipeline.
    DeviceContext: the stream/event abstraction (CUDA streams or CPU no-ops).
    Timeline, stall_warning: per-stage counters, Chrome trace, the stall warning.

The names are loaded on first use, so that ``pipelines.config`` (read by a run's config) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.config import PipelineConfig, PipelineMode, Stage, StageSpec
    from pipelines.device import DeviceContext, Event
    from pipelines.staged import StagedPipeline, StageFailed
    from pipelines.timeline import StageCounters, Timeline, stall_warning

_WHERE = {
    **dict.fromkeys(("PipelineConfig", "PipelineMode", "Stage", "StageSpec"), "pipelines.config"),
    **dict.fromkeys(("DeviceContext", "Event"), "pipelines.device"),
    **dict.fromkeys(("StagedPipeline", "StageFailed"), "pipelines.staged"),
    **dict.fromkeys(("StageCounters", "Timeline", "stall_warning"), "pipelines.timeline"),
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
