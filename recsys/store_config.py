"""Tiered tables (section ``[store]``): which tables live on device slots ← host DRAM ← LMDB, and how big."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipelines import PipelineMode

__all__ = ["EvictionPolicy", "PipelineSection", "StoreSection"]


class EvictionPolicy(enum.Enum):
    LOOKAHEAD = "lookahead"  # unannounced rows first (LRU among them), then the furthest next use
    LRU = "lru"
    LFU = "lfu"


@dataclass(kw_only=True, frozen=True, slots=True)
class StoreSection:
    """Tiered embedding tables (section ``[store]``).

    Attributes:
        tiered: put the tables on the three tiers; ``false`` keeps every table fully in memory (the
            reference: same model, same digest).
        tables: sparse features whose tables are tiered (empty: all of them).
        device_rows: slots per tiered table on each rank that owns (a part of) it; they must hold the
            distinct ids of the batches in flight (three with TorchRec's pipeline) plus evaluation.
        host_rows: host-DRAM rows per tiered table per owning rank (0: no host tier).
        policy: eviction policy of both caches.
        lookahead: batches whose ids are announced ahead of use (LOOKAHEAD protects their rows and the
            prefetcher reads them from LMDB early).
        path: store directory (default: ``<run directory>/store``); one LMDB environment per rank.
    """

    tiered: bool = False
    tables: tuple[str, ...] = ()
    device_rows: int = 16_384
    host_rows: int = 65_536
    policy: EvictionPolicy = EvictionPolicy.LOOKAHEAD
    lookahead: int = 4
    path: str = ""

    def __post_init__(self) -> None:
        if self.device_rows < 1:
            raise ValueError(f"device_rows must be >= 1, got {self.device_rows}")
        if self.host_rows < 0:
            raise ValueError(f"host_rows must be >= 0, got {self.host_rows}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if len(set(self.tables)) != len(self.tables):
            raise ValueError(f"tables must be distinct, got {list(self.tables)}")


@dataclass(kw_only=True, frozen=True, slots=True)
class PipelineSection:
    """The nested pipeline that feeds tiered tables (section ``[pipeline]``).

    Attributes:
        mode: ``pipelined`` runs load, key routing, tier prefetch and device fill of later batches on
            worker threads while the current batch computes; ``sequential`` runs them inline (reference).
        trace_batches: batches recorded in ``trace.json`` (Chrome trace; 0: none).
    """

    mode: PipelineMode = PipelineMode.PIPELINED
    trace_batches: int = 200

    def __post_init__(self) -> None:
        if self.trace_batches < 0:
            raise ValueError(f"trace_batches must be >= 0, got {self.trace_batches}")
