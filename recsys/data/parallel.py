"""Parsing text chunks in worker processes, with results passed through shared memory.

Threads share one interpreter lock, and the parsers make many small numpy calls per chunk, so two parser
threads give little more than one. Processes scale, but pipes are slow for megabytes of arrays, so every
task has a *slot* of one shared buffer (a ``memfd``): the parent copies the chunk's bytes into the
slot's input half, the worker parses them and writes the arrays of its result (pickled out of band,
protocol 5) into the slot's output half, and only a small pickle crosses the pipe. A result too big for
its slot travels through the pipe instead, so any chunk works.

Workers are forked, as PyTorch's DataLoader workers are: they start at once, need no importable
``__main__`` and run nothing but numpy code on the chunk (no torch, no locks of the parent's threads).
They tune their own ``malloc`` so that a chunk's temporaries reuse memory instead of faulting in fresh
pages, and report malformed lines as counts (``skip``) or as the error itself (``raise``), which the
parent re-raises.

Linux only (``os.memfd_create``); :func:`process_pool_available` says whether this platform has it.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import pickle
import signal
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from recsys.data.text import Issues, OnError

__all__ = ["ProcessParsePool", "process_pool_available", "picklable"]


def process_pool_available() -> bool:
    return hasattr(os, "memfd_create") and "fork" in multiprocessing.get_all_start_methods()


def picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure means "use threads"
        return False
    return True


# -- in the worker ------------------------------------------------------------------------------------

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


class _Worker:
    parse: Any = None
    buf: memoryview | None = None
    slot_bytes = 0
    in_bytes = 0


def _init_worker(parse: Any, path: str, size: int, slot_bytes: int, in_bytes: int) -> None:
    # Ctrl-C reaches the whole process group: the reader stops its workers itself, without their tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # glibc: keep large temporaries on the heap and the heap's top mapped, so that each chunk's arrays
    # reuse memory instead of faulting in fresh pages (a worker's heap stays at a few chunks' size).
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        mallopt(_M_TRIM_THRESHOLD, 512 << 20)
    except (OSError, AttributeError):  # not glibc
        pass
    fd = os.open(path, os.O_RDWR)
    try:
        _Worker.buf = memoryview(mmap.mmap(fd, size))
    finally:
        os.close(fd)
    _Worker.parse, _Worker.slot_bytes, _Worker.in_bytes = parse, slot_bytes, in_bytes


def _parse_task(
    slot: int, data: bytes | None, nbytes: int, first: int, path: str, on_error: OnError
) -> tuple[bytes, list[tuple[int, int]] | None, dict[str, int]]:
    """Parse one chunk; returns (pickle, spans of its out-of-band buffers in the slot or None, counts)."""
    buf = _Worker.buf
    assert buf is not None
    base = slot * _Worker.slot_bytes
    if data is None:
        data = bytes(buf[base : base + nbytes])
    issues = Issues(path, on_error)
    result = _Worker.parse(data, first, issues)
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    out, end = base + _Worker.in_bytes, base + _Worker.slot_bytes
    if out + sum(v.nbytes for v in views) > end:
        return pickle.dumps(result, protocol=5), None, dict(issues.counts)
    spans = []
    for v in views:
        buf[out : out + v.nbytes] = v
        spans.append((out, v.nbytes))
        out += v.nbytes
    return head, spans, dict(issues.counts)


# -- in the parent ------------------------------------------------------------------------------------


class ProcessParsePool:
    """``workers`` parser processes; ``submit`` returns a Future of the parser's result, in any order.

    At most ``slots`` tasks are in flight: a further ``submit`` waits until a worker's result has been
    copied out of its slot. Use as a context manager; leaving it stops the workers.
    """

    def __init__(self, parse: Any, *, workers: int, chunk_bytes: int, slots: int) -> None:
        self.in_bytes = chunk_bytes * 2  # a chunk is chunk_bytes plus the previous chunk's partial line
        self.slot_bytes = self.in_bytes + chunk_bytes * 6
        self._fd = os.memfd_create("tierrec-parse")
        size = self.slot_bytes * slots
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._buf = memoryview(self._map)
        self._free: deque[int] = deque(range(slots))
        self._slot_freed = threading.Condition()
        path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init_worker,
            initargs=(parse, path, size, self.slot_bytes, self.in_bytes),
        )

    def submit(self, data: bytes, first: int, issues: Issues) -> Future:
        with self._slot_freed:  # a slot comes free as soon as a worker's result is copied out
            self._slot_freed.wait_for(lambda: bool(self._free))
            slot = self._free.popleft()
        inline: bytes | None = data
        if len(data) <= self.in_bytes:
            base = slot * self.slot_bytes
            self._buf[base : base + len(data)] = data
            inline = None
        inner = self._pool.submit(_parse_task, slot, inline, len(data), first, issues.path, issues.on_error)
        outer: Future = Future()
        inner.add_done_callback(lambda f: self._collect(f, outer, slot, issues))
        return outer

    def _collect(self, inner: Future, outer: Future, slot: int, issues: Issues) -> None:
        """Copy the result out of its slot (the result owns its memory), free the slot, merge the counts."""
        result: Any = None
        error: BaseException | None = None
        try:
            if inner.cancelled():
                error = RuntimeError("text parsing was cancelled")
            elif (exc := inner.exception()) is not None:
                error = (
                    RuntimeError(f"a text parser process died ({exc})")
                    if isinstance(exc, BrokenProcessPool)
                    else exc
                )
            else:
                head, spans, counts = inner.result()
                buffers = None if spans is None else self._copy_out(spans)
                result = pickle.loads(head, buffers=buffers)
                issues.merge(counts)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the result
            error = err
        with self._slot_freed:
            self._free.append(slot)
            self._slot_freed.notify()
        try:
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(result)
        except InvalidStateError:  # the reader cancelled it
            pass

    def _copy_out(self, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The result's buffers, copied from the slot into one new writable allocation (they are adjacent)."""
        if not spans:
            return []
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        block = memoryview(bytearray(self._buf[lo:hi]))
        return [block[o - lo : o - lo + n] for o, n in spans]

    def __enter__(self) -> ProcessParsePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._buf.release()
        self._map.close()
        os.close(self._fd)
