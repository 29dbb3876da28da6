"""Which rank failed first, and why: per-rank failure records in the run directory.

When one rank of a job fails, the others fail soon after with secondary errors (a gloo peer closed the
connection, a collective timed out) or are terminated by the launcher; the launcher may notice any of
them first. Each rank therefore records its failure — time, kind and one-line message — the moment it
stops, before it tears down its process group; the CLI reports the earliest record, which is the root
cause, with its traceback when it is not a user error (a secondary error's traceback stays in its record).
Records go to the local launcher through a pipe (:func:`set_failure_channel`), which works when the
run directory's disk is full, and to ``<run>/.failed_rank_<r>.json`` for anyone else (torchrun users).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from recsys.errors import UserError

__all__ = ["Failure", "clear_failures", "first_failure", "record_failure", "set_failure_channel"]

_PATTERN = ".failed_rank_*.json"
# Where this process also sends its failure record: a multiprocessing Connection to the launcher, or None.
_channel: Any = None
# The attribute that marks an exception as recorded.
_RECORDED = "_tierrec_failure_recorded"


class Failure(NamedTuple):
    """A rank's recorded failure: ``user`` is True for a UserError (exit code 2); ``detail`` is the
    traceback of any other error."""

    rank: int
    time_s: float
    user: bool
    message: str
    detail: str = ""


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if isinstance(err, UserError) else f"{type(err).__name__}: {text}"


def set_failure_channel(channel: Any) -> None:
    """Send this process's failure records to ``channel`` (a ``multiprocessing`` Connection) as well."""
    global _channel
    _channel = channel


def record_failure(out_dir: Path, rank: int, err: BaseException) -> bool:
    """Record this rank's failure (best effort); whether the record reached the launcher or the disk.

    An error already recorded (the same exception object, re-raised further up) is not recorded again.
    """
    if getattr(err, _RECORDED, False):
        return True
    with contextlib.suppress(AttributeError):
        setattr(err, _RECORDED, True)
    user = isinstance(err, UserError)
    detail = "" if user else "".join(traceback.format_exception(err))
    failure = Failure(rank, time.time(), user, _one_line(err), detail)
    delivered = False
    if _channel is not None:
        with contextlib.suppress(OSError, ValueError):
            _channel.send(tuple(failure))
            delivered = True
    try:
        tmp = out_dir / f".failed_rank_{rank}.json.tmp"
        tmp.write_text(json.dumps(failure._asdict()))
        os.replace(tmp, out_dir / f".failed_rank_{rank}.json")
        delivered = True
    except OSError:
        pass
    return delivered


def first_failure(out_dir: Path) -> Failure | None:
    """The earliest recorded failure of the run in ``out_dir``, or None."""
    found = []
    for path in out_dir.glob(_PATTERN):
        try:
            r = json.loads(path.read_text())
            found.append(
                Failure(
                    int(r["rank"]),
                    float(r["time_s"]),
                    bool(r["user"]),
                    str(r["message"]),
                    str(r.get("detail", "")),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return min(found, key=lambda f: (f.time_s, f.rank)) if found else None


def clear_failures(out_dir: Path) -> None:
    """Remove the records of an earlier attempt."""
    for path in out_dir.glob(_PATTERN):
        path.unlink(missing_ok=True)
