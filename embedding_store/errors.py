"""The typed error family of the store.

Every storage fault surfaces as a subclass of :class:`StoreError`; LMDB exceptions are mapped at the
backend boundary with the original exception chained as ``__cause__``. Bad arguments (wrong shapes,
unknown table names) stay ``ValueError``/``TypeError``.
"""

from __future__ import annotations

__all__ = [
    "IdOutOfRangeError",
    "StoreCapacityError",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "StoreIncompatibleError",
    "StoreLockedError",
    "StoreSegmentsError",
]


class StoreError(Exception):
    """Base class of every storage fault raised by ``embedding_store``."""


class StoreFullError(StoreError):
    """The LMDB map reached its hard cap, or the disk is full. No transaction was half-applied."""


class StoreLockedError(StoreError):
    """Another process (or another open handle in this process) holds the store's lock file.

    ``holder`` is the pid the owner recorded in the lock file (text; ``"unknown"`` if none).
    """

    holder: str = "unknown"


class StoreCorruptError(StoreError):
    """The on-disk store is unreadable: bad metadata, truncated rows, an LMDB corruption report."""


class StoreIncompatibleError(StoreError):
    """The on-disk store was written for different tables (dim, dtype, optimizer, id space) or seed."""


class IdOutOfRangeError(StoreError, ValueError):
    """An id is negative, or not below ``num_embeddings`` of a bounded table."""


class StoreCapacityError(StoreError):
    """A batch needs more device slots than are free or evictable (slots pinned by in-flight batches)."""


class StoreClosedError(StoreError):
    """The store was used after ``close()``."""


class StoreSegmentsError(StoreFullError):
    """A log-layout store would need more segments than its cap (``LOG_MAX_SEGMENTS``); nothing was
    written. The message names ``store.lmdb.log_segment_rows``, the value the store records and the cap."""
