"""The one multi-process test harness: run a function on N local ranks over gloo.

Example:
    results = run_ranks(world_size=2, fn=my_check, arg=123)  # my_check(rank, world_size, arg) -> picklable
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from recsys.distributed import free_port, set_local_rank_env


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], arg: Any, queue: Any) -> None:
    set_local_rank_env(rank, world_size, port)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, arg)))
    except BaseException:  # report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave as recsys.launch's workers do, without the interpreter's teardown: in it gloo's threads, still
    # holding work objects, now and then abort a finished rank ("terminate called without an active
    # exception", SIGABRT) after its result was sent. The queue's feeder thread is drained first.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    *, world_size: int, fn: Callable[..., Any], arg: Any = None, timeout_s: float = 300
) -> list[Any]:
    """Run ``fn(rank, world_size, arg)`` in ``world_size`` spawned processes; returns results by rank.

    ``fn`` must be importable (a module-level function of a test module).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, arg, queue),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, status, value = queue.get(timeout=timeout_s)
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    if errors:
        for p in procs.processes:
            p.kill()
        raise AssertionError("\n".join(errors))
    procs.join(timeout_s)
    return [results[r] for r in range(world_size)]
