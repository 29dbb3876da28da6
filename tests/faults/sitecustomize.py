"""Test-only fault injection for subprocess runs; never on a production path.

Tests put this folder first on PYTHONPATH, so every Python process they start (the CLI and its spawned
workers) imports it at startup. With ``TIERREC_FAULT=site:action:n[:rank]`` it wraps one function when its
module is first imported; the n-th call (1-based, counted per process) on the given rank (default: any)
either raises ``RuntimeError("injected fault at <site>")`` (action ``raise``) or SIGKILLs its own process
(action ``kill``). Before acting it appends ``<site> <action> <rank> <unix time>`` to ``TIERREC_FAULT_LOG``
when that is set, so a test knows when the fault landed.

Sites (the thread each runs on in a pipelined tiered run):

- ``writer``: ``LogBackend.put_rows`` (the default layout), a write-back transaction (the background writer thread; kill:
  0-3 ms after the transaction starts, so inside it or just after its commit);
- ``prefetch``: ``TieredTables.prefetch``, SSD -> host reads (the prefetch stage worker);
- ``route``: ``TieredTables.route``, key routing (the route stage worker);
- ``compact``: ``LogTables.compact``, one compaction of a log segment (the background writer thread; kill:
  0-3 ms after it starts, so while it reads, copies, drops the segment, or just after);
- ``snapshot``: ``LmdbRows.snapshot`` (both LMDB layouts), the store snapshot inside a checkpoint (kill: after the copy,
  before the checkpoint is marked complete);
- ``step``: ``TrainModel.forward``, mid training step (the main thread).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import random
import signal
import sys
import threading
import time

_SITES = {
    "writer": ("embedding_store.backends.log", "LogBackend", "put_rows"),
    "prefetch": ("recsys.tiered", "TieredTables", "prefetch"),
    "route": ("recsys.tiered", "TieredTables", "route"),
    "compact": ("embedding_store.backends.log_tables", "LogTables", "compact"),
    "snapshot": ("embedding_store.backends.lmdb_env", "LmdbRows", "snapshot"),
    "step": ("recsys.models", "TrainModel", "forward"),
}


def _parse(spec: str) -> tuple[str, str, int, int | None]:
    parts = spec.split(":")
    site, action, n = parts[0], parts[1], int(parts[2])
    rank = int(parts[3]) if len(parts) > 3 and parts[3] != "" else None
    if site not in _SITES or action not in ("raise", "kill"):
        raise ValueError(f"TIERREC_FAULT: bad spec {spec!r}")
    return site, action, n, rank


def _wrap(site: str, action: str, n: int, rank: int | None, fn):  # type: ignore[no-untyped-def]
    lock = threading.Lock()
    calls = [0]

    @functools.wraps(fn)  # torch.fx reads the signature when it traces the model's forward
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        me = int(os.environ.get("RANK", "0"))
        if rank is None or rank == me:
            with lock:
                calls[0] += 1
                fire = calls[0] == n
            if fire:
                log = os.environ.get("TIERREC_FAULT_LOG")
                if log:
                    with open(log, "a") as f:
                        f.write(f"{site} {action} {me} {time.time()}\n")
                if action == "kill":
                    if site == "snapshot":
                        fn(*args, **kwargs)  # the copy is written, the checkpoint not yet complete
                    elif site in ("writer", "compact"):  # inside its LMDB transactions, or just after
                        threading.Timer(
                            random.uniform(0, 0.003), os.kill, (os.getpid(), signal.SIGKILL)
                        ).start()
                        fn(*args, **kwargs)
                        time.sleep(1)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at {site}")
        return fn(*args, **kwargs)

    return wrapper


class _Patcher(importlib.abc.MetaPathFinder):
    """Wraps the target function right after its module is executed."""

    def __init__(self, spec: str) -> None:
        self.site, self.action, self.n, self.rank = _parse(spec)
        self.module, self.cls, self.attr = _SITES[self.site]

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, patcher = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):  # type: ignore[no-untyped-def]
                return loader.create_module(spec)

            def exec_module(self, module):  # type: ignore[no-untyped-def]
                loader.exec_module(module)
                cls = getattr(module, patcher.cls)
                original = getattr(cls, patcher.attr)
                setattr(
                    cls, patcher.attr, _wrap(patcher.site, patcher.action, patcher.n, patcher.rank, original)
                )

        spec.loader = _Loader()
        return spec


if os.environ.get("TIERREC_FAULT"):
    sys.meta_path.insert(0, _Patcher(os.environ["TIERREC_FAULT"]))
