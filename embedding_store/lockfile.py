"""An exclusive, crash-safe lock on a store directory.

LMDB's own lock file coordinates readers and writers but happily lets two processes write the same
environment. ``fcntl.flock`` on a separate file gives one owner at a time; the kernel drops the lock
when the owning process dies, so a stale lock file left by a killed process never blocks a reopen (the
next owner takes the lock and overwrites the pid recorded in it). flock locks belong to an open file
description, so a second open in the same process is refused too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from embedding_store.errors import StoreLockedError

__all__ = ["DirectoryLock", "LOCK_NAME"]

LOCK_NAME = "tierrec.lock"


def _holder(fd: int) -> str:
    """The pid recorded by the lock's owner, as text ('unknown' if it wrote none yet)."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


class DirectoryLock:
    """Holds ``<path>/<name>`` exclusively for its lifetime (a context manager).

    Args:
        path: the directory (must exist).
        name: the lock file's name inside it.
        guards: what the lock guards, named in the refusal (default: ``path`` for the store's own
            ``tierrec.lock``, else the lock file).

    Raises:
        StoreLockedError: another process or open handle holds it; the message names the holder's pid.
    """

    def __init__(self, path: Path, *, name: str = LOCK_NAME, guards: Path | None = None) -> None:
        self._file = path / name
        self._fd: int | None = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            holder = _holder(self._fd)
            os.close(self._fd)
            self._fd = None
            target = guards or (path if name == LOCK_NAME else self._file)
            locked = StoreLockedError(f"store {target} is in use by process {holder}")
            locked.holder = holder
            raise locked from err
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        """Whether this handle still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
