"""Thread scheduling: background threads that yield the CPU to the training step."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["lower_thread_priority"]


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's nice value (capped at 19).

    Linux keeps a nice value per thread (``setpriority`` on the thread id); elsewhere, or where the system
    refuses, nothing changes. Raising one's own nice value needs no privilege.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
