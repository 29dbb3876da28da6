"""The only place that knows about CUDA: pinned host buffers and device copies; and giving freed host
memory back to the system (``release_free_heap``).

Without CUDA every helper degrades to plain CPU tensors and synchronous copies, so the rest of the
store is written once for both cases.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["empty_host", "release_free_heap", "to_device", "to_host"]


def release_free_heap() -> bool:
    """Give the free memory inside glibc malloc's heaps back to the system (``malloc_trim(0)``).

    glibc serves blocks up to its mmap threshold from its heaps and raises that threshold to the size of
    every large block freed (up to 32 MiB), so a training step's transient arrays of a few MiB come from
    the heap, and freed, stay in the process between steps. The training loop calls this on a logging
    step at most every 10 s (``recsys.loop.TRIM_EVERY_S``): in a run of ``benchmarks/bench_scale.py``
    over 8 M ids (a call every 20 steps), peak anonymous RSS 1.02 GiB instead of 1.23 at ~20 ms a call.
    (Fixing the threshold lower instead halved that benchmark's speed: its steps then mapped and faulted
    in fresh memory for every large array.)

    Returns:
        whether it ran (False where the C library has no ``malloc_trim``, e.g. not glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


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
