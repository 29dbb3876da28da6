"""A full disk while the run directory is written: one line naming the file (exit 2 at the CLI)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from recsys.errors import UserError, no_space_left

__all__ = ["disk_full", "writing"]


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into one line naming it."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if no_space_left(err) is None:
            raise
        raise disk_full(path) from err


def disk_full(path: Path | str) -> UserError:
    return UserError(f"no space left on device writing {path}; free disk space, then continue with --resume")
