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
parent re-raises. Each has its own pipe: the parent sends a task straight to the least busy worker, and
one collector thread receives every worker's results (no executor, feeder or wake-up threads between).

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
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from recsys.data.issues import Issues, OnError

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


def _init_worker(path: str, size: int) -> memoryview:
    """Set up a fresh worker; returns its mapping of the shared slot buffer."""
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
        return memoryview(mmap.mmap(fd, size))
    finally:
        os.close(fd)


def _parse_task(
    parse: Any,
    buf: memoryview,
    slot: tuple[int, int, int],
    task: tuple[bytes | None, int, int, str, OnError],
) -> tuple[bytes, list[tuple[int, int]] | None, dict[str, int]]:
    """Parse one chunk; returns (pickle, spans of its out-of-band buffers in the slot or None, counts).

    ``slot`` is (start, end of its input half, end) in ``buf``; ``task`` is (the chunk, or None when it
    is in the slot, its length, its first line number, file path, on_error).
    """
    base, out, end = slot
    data, nbytes, first, path, on_error = task
    if data is None:
        data = bytes(buf[base : base + nbytes])
    issues = Issues(path, on_error)
    result = parse(data, first, issues)
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    if out + sum(v.nbytes for v in views) > end:
        return pickle.dumps(result, protocol=5), None, dict(issues.counts)
    spans = []
    for v in views:
        buf[out : out + v.nbytes] = v
        spans.append((out, v.nbytes))
        out += v.nbytes
    return head, spans, dict(issues.counts)


def _worker_main(conn: Connection, parse: Any, path: str, size: int, slot_bytes: int, in_bytes: int) -> None:
    """A worker's life: tasks from its pipe, one at a time, until the parent closes it (or stops it)."""
    buf = _init_worker(path, size)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        slot, task = message
        base = slot * slot_bytes
        try:
            reply: tuple[bool, Any] = (
                True,
                _parse_task(parse, buf, (base, base + in_bytes, base + slot_bytes), task),
            )
        except BaseException as err:  # noqa: BLE001 - the reader re-raises it
            reply = (False, err)
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that cannot be pickled
            conn.send((False, RuntimeError(f"text parser failed: {reply[1]!r}")))
        except (BrokenPipeError, OSError):
            return


# -- in the parent ------------------------------------------------------------------------------------


@dataclass
class _Proc:
    """One worker process, the parent's end of its pipe and its tasks in flight (oldest first)."""

    process: Any
    conn: Connection
    in_flight: deque[tuple[int, Future, Issues]] = field(default_factory=deque)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    alive: bool = True


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
        self._lock = threading.Lock()  # guards every _Proc's in_flight and alive, and _closing
        self._closing = False
        path = f"/proc/{os.getpid()}/fd/{self._fd}"
        ctx = multiprocessing.get_context("fork")
        self._procs: list[_Proc] = []
        try:
            for _ in range(workers):
                here, there = ctx.Pipe()
                process = ctx.Process(
                    target=_worker_main,
                    args=(there, parse, path, size, self.slot_bytes, self.in_bytes),
                    name="tierrec-parser",
                    daemon=True,
                )
                process.start()
                there.close()
                self._procs.append(_Proc(process, here))
        except BaseException:
            self._stop_workers()
            self._release()
            raise
        # started after the forks, so that no worker inherits a copy of it
        self._collector = threading.Thread(
            target=self._collect_loop, name="tierrec-parse-collect", daemon=True
        )
        self._collector.start()

    def submit(self, data: bytes, first: int, issues: Issues) -> Future:
        if self._closing:
            raise RuntimeError("the text parser pool is closed")
        with self._slot_freed:  # a slot comes free as soon as a worker's result is copied out
            self._slot_freed.wait_for(lambda: bool(self._free))
            slot = self._free.popleft()
        inline: bytes | None = data
        if len(data) <= self.in_bytes:
            base = slot * self.slot_bytes
            self._buf[base : base + len(data)] = data
            inline = None
        outer: Future = Future()
        with self._lock:
            live = [p for p in self._procs if p.alive]
            proc = min(live, key=lambda p: len(p.in_flight)) if live and not self._closing else None
            if proc is not None:
                proc.in_flight.append((slot, outer, issues))
        if proc is None:
            self._free_slot(slot)
            outer.set_exception(RuntimeError("the text parser processes have stopped"))
            return outer
        try:
            with proc.send_lock:
                proc.conn.send((slot, (inline, len(data), first, issues.path, issues.on_error)))
        except OSError:
            pass  # the worker is gone: the collector fails its tasks, this one included
        return outer

    def _collect_loop(self) -> None:
        """Receive every worker's results in turn; a worker whose pipe closes has died (or was stopped)."""
        by_conn = {p.conn: p for p in self._procs}
        while by_conn:
            for conn in wait(list(by_conn)):
                proc = by_conn[conn]  # type: ignore[index]
                try:
                    ok, payload = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    del by_conn[conn]  # type: ignore[arg-type]
                    self._gone(proc)
                    continue
                with self._lock:
                    slot, outer, issues = proc.in_flight.popleft()
                self._finish(ok, payload, slot, outer, issues)

    def _gone(self, proc: _Proc) -> None:
        """A worker's pipe closed: fail the tasks it still had (cancelled, if the pool is closing)."""
        proc.process.join(timeout=5)
        with self._lock:
            proc.alive = False
            lost = list(proc.in_flight)
            proc.in_flight.clear()
            closing = self._closing
        for slot, outer, _ in lost:
            self._free_slot(slot)
            if closing:
                outer.cancel()
            else:
                self._settle(
                    outer,
                    error=RuntimeError(f"a text parser process died (exit code {proc.process.exitcode})"),
                )

    def _finish(self, ok: bool, payload: Any, slot: int, outer: Future, issues: Issues) -> None:
        """Copy the result out of its slot (the result owns its memory), free the slot, merge the counts."""
        result: Any = None
        error: BaseException | None = None
        try:
            if not ok:
                error = payload
            else:
                head, spans, counts = payload
                buffers = None if spans is None else self._copy_out(spans)
                result = pickle.loads(head, buffers=buffers)
                issues.merge(counts)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the result
            error = err
        self._free_slot(slot)
        self._settle(outer, result=result, error=error)

    @staticmethod
    def _settle(outer: Future, *, result: Any = None, error: BaseException | None = None) -> None:
        try:
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(result)
        except InvalidStateError:  # the reader cancelled it
            pass

    def _free_slot(self, slot: int) -> None:
        with self._slot_freed:
            self._free.append(slot)
            self._slot_freed.notify()

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
        """Stop the workers (tasks still in flight are cancelled) and release the shared buffer."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop_workers()
        self._collector.join(timeout=10)
        self._release()

    def _stop_workers(self) -> None:
        for proc in self._procs:
            if proc.process.is_alive():
                proc.process.terminate()  # a worker holds nothing the parent needs
        for proc in self._procs:
            proc.process.join(timeout=10)
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join()

    def _release(self) -> None:
        for proc in self._procs:
            proc.conn.close()
        self._buf.release()
        self._map.close()
        os.close(self._fd)
