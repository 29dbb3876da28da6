"""What ``recsys export`` and ``recsys predict`` write: temporary names, their leftovers, a full disk.

Both write into ``.NAME.tmp-PID`` beside the destination and rename it into place at the end; on an
error or a signal Python can handle (SIGINT, SIGTERM) the temporary is removed. A process killed
outright (SIGKILL, the OOM killer, a power cut) cannot remove it: the next export or predict to the same
destination removes the temporaries of processes that no longer exist (:func:`remove_stale`).

Light on purpose (the standard library at import): predict refuses a damaged bundle before numpy loads.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from recsys.errors import UserError, no_space_left

__all__ = ["remove_stale", "temporary", "write_failure"]


def temporary(dest: Path) -> Path:
    """The temporary name of ``dest`` for this process: ``.NAME.tmp-PID`` beside it."""
    return dest.with_name(f".{dest.name}.tmp-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(dest: Path) -> list[Path]:
    """Remove the temporaries of ``dest`` (files or folders) left by processes that are gone; returns them.

    A temporary of a live process (another export or predict writing the same destination, or a
    process that reuses a dead one's id) is left alone; so is this process's own.
    """
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.tmp-(\d+)")
    removed = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:  # no such folder yet: nothing to clean
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid() or _alive(int(match[1])):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def write_failure(err: BaseException, dest: Path, retry: str) -> UserError | None:
    """The one-line error of a failed write of ``dest``: a full disk (ENOSPC, EDQUOT, or LMDB's EIO on a
    nearly full filesystem) or another LMDB error of the file being written; None for anything else.
    ``retry``: what to do once there is room (``export again``)."""
    if no_space_left(err) is not None:
        return UserError(f"no space left on device writing {dest}; free disk space, then {retry}")
    from embedding_store import StoreFullError
    from embedding_store.backends import storage_error

    mapped = storage_error(err, str(dest), dest.parent)
    if isinstance(mapped, StoreFullError):
        return UserError(f"no space left on device writing {dest}; free disk space, then {retry}")
    if mapped is not None:
        return UserError(f"writing {dest} failed: {err}")
    return None
