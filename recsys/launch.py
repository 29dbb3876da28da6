"""``recsys train`` without torchrun: the launcher that spawns ``train.nproc`` local workers.

The launcher holds the run directory's lock for the whole run, starts the workers (spawn), and waits for
them. It owns their lifetime:

- one worker fails: the others are killed after a short grace period and the root cause is printed (the
  earliest failure any rank reported, received through a pipe, so that it arrives even when the run
  directory is on a full disk): one line for a user error, its traceback and one line for any other. The
  workers print no tracebacks themselves: the other ranks' errors are echoes of the first (a peer closed
  the connection) and stay in their records, ``<run>/.failed_rank_<r>.json``;
- the launcher gets SIGTERM or SIGINT: it forwards SIGTERM, the workers finish their step, write a
  checkpoint and exit; whoever is still running after ``STOP_GRACE_S`` is killed. A second signal kills
  them at once;
- the launcher is killed (SIGKILL): the workers notice within a second and die too
  (:func:`recsys.lifetime.die_with_parent`), which releases the store lock.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from recsys.errors import UserError
from recsys.failures import Failure, clear_failures, first_failure, record_failure, set_failure_channel
from recsys.runlock import lock_run_dir

__all__ = ["launch", "EXIT_USAGE"]

log = logging.getLogger("recsys")

EXIT_USAGE = 2
# After the first worker failed: how long the others get to record their own failure before SIGKILL.
FAIL_GRACE_S = 3.0
# After a stop signal: how long the workers get to write their checkpoint before SIGKILL.
STOP_GRACE_S = 60.0


def _worker(
    local_rank: int, nproc: int, port: int, config: Any, out: Path, resume: dict[str, bool], channel: Any
) -> None:
    """Entry point of a spawned worker process."""
    import threading
    import traceback

    from tqdm import tqdm

    from recsys.cli import quiet_libraries
    from recsys.lifetime import RunStopped, die_with_parent
    from recsys.local_env import set_local_rank_env

    die_with_parent()
    set_local_rank_env(local_rank, nproc, port)
    set_failure_channel(channel)
    quiet_libraries()
    # A thread lock for tqdm: its default also makes a multiprocessing lock (a named semaphore), which the
    # os._exit below would leave for the resource tracker to report as leaked.
    tqdm.set_lock(threading.RLock())
    from recsys.train import run

    code = 0
    try:
        run(config, out, lock_run=False, **resume)
    except UserError:
        code = EXIT_USAGE  # reported through the channel; the launcher prints the first rank's message
    except RunStopped as stop:
        code = stop.exit_code
    except KeyboardInterrupt:  # a second SIGINT: stopped at once, without a checkpoint
        code = 1
    except Exception as err:  # the launcher prints the root cause only
        code = 1
        if not record_failure(out, local_rank, err):
            traceback.print_exc()  # the record reached no one: this is the only report
    # Leave without the interpreter's teardown, in which gloo's threads, still holding work objects,
    # now and then abort a finished worker ("terminate called without an active exception", SIGABRT).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Signals:
    """SIGTERM/SIGINT handlers of the launcher: remember the first, count them all."""

    def __init__(self) -> None:
        self.first = 0
        self.count = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.first = self.first or signum
        self.count += 1


def _kill(processes: list[multiprocessing.process.BaseProcess], signum: int) -> None:
    for p in processes:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)


def _drain(receive: Any) -> list[Failure]:
    """The failure records a worker sent through its pipe."""
    found = []
    try:
        while receive.poll():
            found.append(Failure(*receive.recv()))
    except (EOFError, OSError, TypeError):
        pass
    receive.close()
    return found


def _print_error(message: str) -> None:
    print(f"recsys: error: {message}", file=sys.stderr)


def launch(config: Any, out: Path, *, resume: dict[str, bool], port: int) -> int:
    """Train with ``config.train.nproc`` local workers; returns the process exit code.

    ``resume``: keyword arguments of :func:`recsys.train.run` (``resume``, ``allow_config_change``).
    """
    nproc = config.train.nproc
    with lock_run_dir(out):
        clear_failures(out)
        log.info("spawning %d local worker(s); run directory %s", nproc, out)
        ctx = multiprocessing.get_context("spawn")
        # One pipe per worker for its failure record (no semaphore: nothing leaks if we are killed).
        pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
        with _Signals() as signals:
            workers = [
                ctx.Process(
                    target=_worker,
                    args=(rank, nproc, port, config, out, resume, pipes[rank][1]),
                    name=f"tierrec-rank-{rank}",
                )
                for rank in range(nproc)
            ]
            for w in workers:
                w.start()
            for _, send in pipes:
                send.close()  # the workers hold their own copies
            failed = _supervise(workers, signals)
        failures = [f for receive, _ in pipes for f in _drain(receive)]
    return _outcome(workers, failed, signals, failures, out)


def _supervise(workers: list[multiprocessing.process.BaseProcess], signals: _Signals) -> int | None:
    """Wait for every worker; the index of the first that failed, or None."""
    failed: int | None = None
    deadline = None
    forwarded = 0
    while any(w.is_alive() for w in workers):
        if signals.count > forwarded:  # forward the first signal; on a second, kill at once
            _kill(workers, signal.SIGTERM if forwarded == 0 else signal.SIGKILL)
            forwarded = signals.count
            deadline = deadline or time.monotonic() + STOP_GRACE_S
        sentinels = [w.sentinel for w in workers if w.is_alive()]
        multiprocessing.connection.wait(sentinels, timeout=0.2)
        for i, w in enumerate(workers):
            if failed is None and w.exitcode not in (None, 0) and not signals.first:
                failed = i
                deadline = time.monotonic() + FAIL_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _kill(workers, signal.SIGKILL)
    for w in workers:
        w.join()
    if failed is None and not signals.first:
        failed = next((i for i, w in enumerate(workers) if w.exitcode != 0), None)
    return failed


def _outcome(
    workers: list[multiprocessing.process.BaseProcess],
    failed: int | None,
    signals: _Signals,
    failures: list[Failure],
    out: Path,
) -> int:
    codes = [w.exitcode for w in workers]
    stopped = {128 + signal.SIGTERM, 128 + signal.SIGINT}  # RunStopped: after writing a checkpoint
    if signals.first or (failed is not None and all(c in stopped for c in codes)):
        signum = signals.first or codes[0] - 128  # type: ignore[operator]
        name = signal.Signals(signum).name
        if all(c in stopped for c in codes):
            print(
                f"recsys: stopped by {name}; a checkpoint was written, continue with --resume",
                file=sys.stderr,
            )
        else:
            print(
                f"recsys: stopped by {name} before a checkpoint (worker exit codes {codes})", file=sys.stderr
            )
        return 128 + signum
    if failed is None:
        return 0
    code = codes[failed]
    assert code is not None
    if code < 0 and not any(f.rank == failed for f in failures):
        # Killed by a signal (OOM killer, kill -9): the other ranks' errors are only its echo.
        name = signal.Signals(-code).name if -code in signal.valid_signals() else ""
        _print_error(f"worker {failed} was killed by signal {-code} {name}".rstrip())
        return 1
    first = min(failures, key=lambda f: (f.time_s, f.rank)) if failures else first_failure(out)
    if first is not None:
        if first.user:
            _print_error(first.message)
            return EXIT_USAGE
        if first.detail:
            print(first.detail.rstrip(), file=sys.stderr)
        _print_error(f"worker {first.rank} failed: {first.message}")
        return 1
    _print_error(f"worker {failed} exited with code {code}")
    return EXIT_USAGE if code == EXIT_USAGE else 1
