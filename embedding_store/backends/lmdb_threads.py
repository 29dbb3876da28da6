"""How the LMDB backend's threads share its environment: a shared/exclusive lock that keeps every
transaction out of a map resize, and a pool of reader threads that splits a large read into runs.

A read of rows that are not in the page cache costs one page fault per row, and one transaction's
reads (``get``, ``getmulti``) take them one at a time. LMDB serves any number of concurrent read
transactions (py-lmdb opens every environment with ``MDB_NOTLS``, so a read transaction belongs to no
thread; each run begins its own) and py-lmdb releases the GIL while LMDB walks the tree, so runs on
several threads keep that many faults in flight and the disk serves them in parallel (docs/tiers.md,
"Parallel cold reads").

Where the pages are cached the split only costs: hand-offs between threads and a transaction per run.
So by default a read is split only while reads take major page faults (pages read from the disk, counted
per thread with ``getrusage(RUSAGE_THREAD)``): a read of cached pages runs its runs one after another in
the calling thread, and hands the rest to the pool as soon as one of them faulted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import resource
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from embedding_store.config import READ_SPLITS
from embedding_store.errors import StoreClosedError

__all__ = ["MIN_RUN_KEYS", "ReaderPool", "SharedExclusiveLock", "thread_major_faults"]

T = TypeVar("T")

# Fewest keys one run reads: a read of fewer than twice this many stays in the calling thread.
MIN_RUN_KEYS = 64


def thread_major_faults() -> int:
    """Major page faults (pages read from the disk) the calling thread has taken so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


# Where threads' faults cannot be counted (not Linux), "auto" splits as "always" does.
_COUNTS_THREAD_FAULTS = hasattr(resource, "RUSAGE_THREAD")


def _faulting(faults: int, keys: int) -> bool:
    """Whether reading ``keys`` keys with ``faults`` major faults was bound by the disk: at least 2 faults and
    1 per 32 keys (a fault waits ~80 us for the disk, a cached key costs ~0.1 us)."""
    return faults >= 2 and faults * 32 >= keys


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

    With ``split="auto"`` the pool runs in one of two modes, chosen by the last read: *cached* reads every
    run in the calling thread and moves to *faulting* (the rest of that read on the pool) once the runs
    read so far took major faults (``_faulting``); *faulting* splits every read and returns to *cached*
    after a read whose runs together took few. ``split="always"`` splits every read that has several runs.

    Args:
        threads: most runs of one read in flight; 1 reads everything in the calling thread.
        min_run: fewest keys of one run.
        split: ``"auto"`` or ``"always"`` (``embedding_store.config.READ_SPLITS``).
        major_faults: the calling thread's major fault count so far (``thread_major_faults``).
    """

    def __init__(
        self,
        threads: int,
        *,
        min_run: int = MIN_RUN_KEYS,
        split: str = "auto",
        major_faults: Callable[[], int] = thread_major_faults,
    ) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"ReaderPool threads must be an int >= 1, got {threads!r}")
        if split not in READ_SPLITS:
            raise ValueError(f"ReaderPool split must be one of {READ_SPLITS}, got {split!r}")
        self._threads = threads
        self._min_run = max(1, min_run)
        self._auto = split == "auto" and _COUNTS_THREAD_FAULTS
        self._major_faults = major_faults
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.faulting = not self._auto  # the mode of the next read (benign races: any mode reads right)

    def runs(self, n: int) -> list[slice]:
        """Contiguous slices covering ``range(n)`` in order, at most ``threads``, each >= ``min_run`` keys."""
        parts = min(self._threads, n // self._min_run)
        if parts <= 1:
            return [slice(0, n)]
        bounds = [i * n // parts for i in range(parts + 1)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    def map(self, read: Callable[[slice], T], runs: list[slice]) -> list[T]:
        """``[read(run) for run in runs]``, the runs at the same time where that pays. Returns once every
        run ended; an error of one run is raised after the others ended (none outlives the call)."""
        if len(runs) == 1 or self._threads == 1:
            return [read(run) for run in runs]
        if self.faulting:
            got = self._split(read, runs)
            if self._auto and not _faulting(sum(f for _, f in got), sum(r.stop - r.start for r in runs)):
                self.faulting = False
            return [value for value, _ in got]
        out: list[T] = []
        faults = keys = 0
        for i, run in enumerate(runs):
            value, run_faults = self._counted(read, run)
            out.append(value)
            faults += run_faults
            keys += run.stop - run.start
            if _faulting(faults, keys):
                self.faulting = True
                if rest := runs[i + 1 :]:
                    out.extend(value for value, _ in self._split(read, rest))
                return out
        return out

    def _counted(self, read: Callable[[slice], T], run: slice) -> tuple[T, int]:
        """``read(run)`` and the major faults the calling thread took in it."""
        before = self._major_faults()
        value = read(run)
        return value, self._major_faults() - before

    def _split(self, read: Callable[[slice], T], runs: list[slice]) -> list[tuple[T, int]]:
        """Each run's value and major faults, the first run read in the calling thread."""
        if len(runs) == 1:
            return [self._counted(read, runs[0])]
        pool = self._executor()
        futures = [pool.submit(self._counted, read, run) for run in runs[1:]]
        try:
            first = self._counted(read, runs[0])
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
