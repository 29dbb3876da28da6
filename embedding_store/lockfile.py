"""An exclusive, crash-safe lock on a store directory.

LMDB's own lock file coordinates readers and writers but happily lets two processes write the same
environment. ``fcntl.flock`` on a separate file gives one owner at a time; the kernel drops the lock
when the owning process dies, so a stale lock file left by a killed process never blocks a reopen.
flock locks belong to an open file description, so a second open in the same process is refused too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from embedding_store.errors import StoreLockedError

__all__ = ["DirectoryLock"]

LOCK_NAME = "tierrec.lock"


class DirectoryLock:
    """Holds ``<path>/tierrec.lock`` exclusively for its lifetime (a context manager)."""

    def __init__(self, path: Path) -> None:
        self._file = path / LOCK_NAME
        self._fd: int | None = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            os.close(self._fd)
            self._fd = None
            raise StoreLockedError(f"store {path} is locked by another process or open handle") from err
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

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
