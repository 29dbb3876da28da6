"""The only place that knows about CUDA: pinned host buffers and device copies.

Without CUDA every helper degrades to plain CPU tensors and synchronous copies, so the rest of the
store is written once for both cases.
"""

from __future__ import annotations

import torch

__all__ = ["empty_host", "to_device", "to_host"]


def _cuda() -> bool:
    return torch.cuda.is_available()


def empty_host(rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) float32 host buffer, page-locked when CUDA is available (async H2D/D2H copies)."""
    return torch.empty((rows, cols), dtype=torch.float32, pin_memory=_cuda())


def to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy host rows to ``device``; non-blocking when the source is pinned and the target is CUDA."""
    if rows.device == device:
        return rows
    return rows.to(device, non_blocking=rows.is_pinned())


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """Copy rows to the CPU (synchronous: the caller packs them right away)."""
    return rows if rows.device.type == "cpu" else rows.to("cpu")
