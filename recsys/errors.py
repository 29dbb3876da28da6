"""User-facing errors: the CLI prints their one-line message and exits with code 2."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input from the user (config, flags, files); the message names the culprit in one line."""
