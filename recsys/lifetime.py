"""Process lifetime: workers that die with their launcher, and a clean stop on SIGTERM or SIGINT.

A training worker must not outlive the process that started it (``recsys train`` or torchrun's agent):
an orphan keeps training and holds the store lock, so ``--resume`` is refused until it ends. Each worker
therefore asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``, Linux) and also
watches its parent id from a thread, which covers the parent dying before the request took effect and
systems without prctl.

SIGTERM (what a scheduler sends before it kills a job) and SIGINT only set a flag: the training loop
checks it after every step, all ranks agree on it in the same collective, write a checkpoint and raise
:class:`RunStopped`. A second SIGINT stops at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

__all__ = ["RunStopped", "StopSignal", "die_with_parent", "stop_signal"]

log = logging.getLogger("recsys")

_PR_SET_PDEATHSIG = 1
# How often the watchdog thread compares the parent id with the one it started with.
_PARENT_POLL_S = 0.5


class RunStopped(Exception):
    """Training stopped on a signal after writing a checkpoint at ``step``."""

    def __init__(self, signum: int, step: int) -> None:
        self.signum = signum
        self.step = step
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} at step {step}; a checkpoint was written, continue with --resume"
        )

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return 128 + self.signum


def die_with_parent() -> None:
    """End this process (SIGKILL) as soon as its parent process is gone."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog alone
            pass
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tierrec-parent-watch", daemon=True).start()


class StopSignal:
    """The signal that asked this process to stop (0 while none did)."""

    def __init__(self) -> None:
        self.signum = 0

    @contextlib.contextmanager
    def catching(self) -> Iterator[StopSignal]:
        """Catch SIGTERM and SIGINT meanwhile (in the main thread; elsewhere signals stay as they are)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.signum = 0
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        if not self.signum:
            log.warning(
                "received %s: stopping after this step and writing a checkpoint", signal.Signals(signum).name
            )
        self.signum = self.signum or signum


stop_signal = StopSignal()
