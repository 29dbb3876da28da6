"""The only place that knows about CUDA: pinned host buffers and device copies; and how much freed host
memory the process keeps (``bound_heap_retention``).

Without CUDA every helper degrades to plain CPU tensors and synchronous copies, so the rest of the
store is written once for both cases.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["HEAP_MMAP_THRESHOLD", "bound_heap_retention", "empty_host", "to_device", "to_host"]

# Blocks of at least this many bytes get mappings of their own, returned to the system when freed.
HEAP_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def bound_heap_retention(threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Fix glibc malloc's mmap threshold at ``threshold`` bytes for the whole process (idempotent).

    glibc serves a large block with a mapping of its own and unmaps it when it is freed, but by default
    it raises that threshold to the size of every such block freed, up to 32 MiB. The tier stages' and
    the writer's transient arrays of a few MiB then come from the heap, where freed memory stays in the
    process: in a 100 M-row run (``benchmarks/bench_scale.py``) the heap held 0.67 GiB, and in its 2 M-row
    run (``--quick``) this setting cut peak RSS from 1.11 to 1.00 GiB (4 MiB: 1.09). A fixed threshold
    also ends the raising.

    Returns:
        whether it was set (False where the C library has no ``mallopt``, e.g. not glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


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
