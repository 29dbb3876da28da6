"""The run directory's lock: one training run at a time writes a run directory.

A second ``recsys train`` with the same ``--out`` would replace the first run's metrics and checkpoints
while it trains (a fresh run clears them). The process that owns the run's lifetime — the local launcher,
or rank 0 under torchrun — holds ``flock`` on ``<out>/.tierrec-run.lock`` for the whole run; the kernel
drops it when that process dies, so a killed run never blocks the next one.
"""

from __future__ import annotations

from pathlib import Path

from embedding_store import StoreLockedError
from embedding_store.lockfile import DirectoryLock
from recsys.errors import UserError

__all__ = ["RUN_LOCK", "lock_run_dir"]

RUN_LOCK = ".tierrec-run.lock"


def lock_run_dir(out: Path) -> DirectoryLock:
    """Create ``out`` if needed and lock it for this process (a context manager).

    Raises:
        UserError: another process holds it, or the directory cannot be created.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        return DirectoryLock(out, name=RUN_LOCK)
    except StoreLockedError as err:
        raise UserError(
            f"run directory {out} is in use by process {err.holder} (another training run?); "
            "wait for it to finish or choose another --out"
        ) from None
    except OSError as err:
        raise UserError(f"cannot lock run directory {out}: {err.strerror or err}") from None
