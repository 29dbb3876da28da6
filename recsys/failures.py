"""Which rank failed first, and why: per-rank failure records in the run directory.

When one rank of a job fails, the others fail soon after with secondary errors (a gloo peer closed the
connection, a collective timed out) or are terminated by the launcher; the launcher may notice any of
them first. Each rank therefore records its failure — time, kind and one-line message — the moment it
stops, before it tears down its process group; the CLI reports the earliest record, which is the root
cause. Records go to the local launcher through a pipe (:func:`set_failure_channel`), which works when the
run directory's disk is full, and to ``<run>/.failed_rank_<r>.json`` for anyone else (torchrun users).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from recsys.errors import UserError

__all__ = ["Failure", "clear_failures", "first_failure", "record_failure", "set_failure_channel"]

_PATTERN = ".failed_rank_*.json"
# Where this process also sends its failure record: a multiprocessing Connection to the launcher, or None.
_channel: Any = None


class Failure(NamedTuple):
    """A rank's recorded failure: ``user`` is True for a UserError (exit code 2)."""

    rank: int
    time_s: float
    user: bool
    message: str


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if isinstance(err, UserError) else f"{type(err).__name__}: {text}"


def set_failure_channel(channel: Any) -> None:
    """Send this process's failure records to ``channel`` (a ``multiprocessing`` Connection) as well."""
    global _channel
    _channel = channel


def record_failure(out_dir: Path, rank: int, err: BaseException) -> None:
    """Record this rank's failure (best effort: a failure to record is ignored)."""
    record = {
        "rank": rank,
        "time_s": time.time(),
        "user": isinstance(err, UserError),
        "message": _one_line(err),
    }
    if _channel is not None:
        with contextlib.suppress(OSError, ValueError):
            _channel.send((rank, record["time_s"], record["user"], record["message"]))
    try:
        tmp = out_dir / f".failed_rank_{rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, out_dir / f".failed_rank_{rank}.json")
    except OSError:
        pass


def first_failure(out_dir: Path) -> Failure | None:
    """The earliest recorded failure of the run in ``out_dir``, or None."""
    found = []
    for path in out_dir.glob(_PATTERN):
        try:
            r = json.loads(path.read_text())
            found.append(Failure(int(r["rank"]), float(r["time_s"]), bool(r["user"]), str(r["message"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return min(found, key=lambda f: (f.time_s, f.rank)) if found else None


def clear_failures(out_dir: Path) -> None:
    """Remove the records of an earlier attempt."""
    for path in out_dir.glob(_PATTERN):
        path.unlink(missing_ok=True)
