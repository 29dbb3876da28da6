"""User-facing errors: the CLI prints their one-line message and exits with code 2."""

from __future__ import annotations

import errno

__all__ = ["UserError", "no_space_left"]


class UserError(ValueError):
    """Bad input from the user (config, flags, files); the message names the culprit in one line."""


def no_space_left(err: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error behind ``err`` (itself, or one it was raised from or during), or None.

    torch.save reports a failed write as a RuntimeError raised while handling the OSError of the file.
    """
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None
