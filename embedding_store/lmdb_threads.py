"""How the LMDB backend's threads share its environment: a shared/exclusive lock that keeps every
transaction out of a map resize, and a pool of reader threads that splits a large read into runs.

A read of rows that are not in the page cache costs one page fault per row, and one transaction's
``getmulti`` takes them one at a time. LMDB serves any number of concurrent read transactions (py-lmdb
opens every environment with ``MDB_NOTLS``, so a read transaction belongs to no thread; each run begins
its own) and py-lmdb releases the GIL while LMDB walks the tree, so runs on several threads keep that many
faults in flight and the disk serves them in parallel (docs/tiers.md, "Parallel cold reads").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from embedding_store.errors import StoreClosedError

__all__ = ["MIN_RUN_KEYS", "ReaderPool", "SharedExclusiveLock"]

T = TypeVar("T")

# Fewest keys one run reads: a read of fewer than twice this many stays in the calling thread.
MIN_RUN_KEYS = 64


class SharedExclusiveLock:
    """Many shared holders or one exclusive holder."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class ReaderPool:
    """Splits a read of N keys into up to ``threads`` contiguous runs and reads them at the same time.

    The calling thread reads the first run itself, ``threads - 1`` pool threads the others; the pool
    starts on the first read that splits and stops in :meth:`close`. Several callers share the pool.

    Args:
        threads: most runs of one read in flight; 1 reads everything in the calling thread.
        min_run: fewest keys of one run.
    """

    def __init__(self, threads: int, *, min_run: int = MIN_RUN_KEYS) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"ReaderPool threads must be an int >= 1, got {threads!r}")
        self._threads = threads
        self._min_run = max(1, min_run)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def runs(self, n: int) -> list[slice]:
        """Contiguous slices covering ``range(n)`` in order, at most ``threads``, each >= ``min_run`` keys."""
        parts = min(self._threads, n // self._min_run)
        if parts <= 1:
            return [slice(0, n)]
        bounds = [i * n // parts for i in range(parts + 1)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    def map(self, read: Callable[[slice], T], runs: list[slice]) -> list[T]:
        """``[read(run) for run in runs]``, the runs at the same time. Returns once every run ended; an
        error of one run is raised after the others ended (none outlives the call)."""
        if len(runs) == 1 or self._threads == 1:
            return [read(run) for run in runs]
        pool = self._executor()
        futures = [pool.submit(read, run) for run in runs[1:]]
        try:
            first = read(runs[0])
        finally:
            concurrent.futures.wait(futures)
        return [first, *(f.result() for f in futures)]

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise StoreClosedError("read of an LMDB environment after close()")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._threads - 1, thread_name_prefix="tierrec-lmdb-read"
                )
            return self._pool

    def close(self) -> None:
        """Wait for running reads and stop the threads (idempotent); later splitting reads raise."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
