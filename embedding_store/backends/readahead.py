"""Read-ahead of a log segment's pages before compaction reads them (docs/tiers.md, "Write-back by write
time"), and dropping the pages LMDB's map holds.

LMDB maps the data file for random reads (no OS read-ahead), so a compaction that reads a cold segment
back takes one 4 KiB page fault per page. A segment is written in a few long runs of consecutive pages
(each append transaction takes its pages from the free list or the end of the file in ascending order),
so the writer notes where every ``PROBE_EVERY``-th block of each append landed and compaction asks the
kernel for those runs ahead of its reads (``POSIX_FADV_WILLNEED``): a few sequential reads instead of
one random read per page. The notes are hints: a wrong or missing one costs speed, never a wrong row.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "PAGE",
    "PROBE_EVERY",
    "MappedFile",
    "drop_mapped_pages",
    "page_runs",
    "probed_pages",
]

PAGE = 4096
# Blocks between two probes: a probe costs ~6 µs (a lookup of a page the append just wrote), ~1 % of an
# append at 1e6 rows/s; a run break then costs up to this many pages read needlessly at each side.
PROBE_EVERY = 64
# Bytes per WILLNEED call: the kernel reads at most its read-ahead window per call (128 KiB by default).
_ADVISE_BYTES = 128 << 10


def _mappings(path: str) -> Iterator[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of ``path`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == path:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                yield low, high, int(fields[2], 16)


def _dontneed(address: int, length: int) -> None:
    """MADV_DONTNEED on ``[address, address + length)``: for LMDB's read-only shared map (no writemap) this
    only drops page-table entries; the next read re-faults from the page cache."""
    ctypes.CDLL(None, use_errno=True).madvise(
        ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_DONTNEED
    )


def drop_mapped_pages(data_file: str) -> None:
    """Drop the pages of every mapping of ``data_file`` in this process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    for low, high, _ in _mappings(data_file):
        _dontneed(low, high - low)


def page_runs(blocks: np.ndarray, pages: np.ndarray, pad: int) -> list[tuple[int, int]]:
    """Runs of pages ``[first, end)`` that hold the probed ``blocks`` (ascending) and the blocks between.

    Neighbouring probes whose pages are no further apart than their blocks (a block takes at most a page)
    are in one run; each run is widened by ``pad`` pages at both ends for the blocks beyond its end
    probes, and runs that then overlap are merged.
    """
    breaks = np.flatnonzero(np.abs(np.diff(pages)) > np.diff(blocks)) + 1
    runs = []
    for part in np.split(np.arange(blocks.shape[0]), breaks) if blocks.shape[0] else []:
        lo, hi = int(pages[part].min()), int(pages[part].max())
        runs.append((max(0, lo - pad), hi + pad + 1))
    return _merged(runs)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Page runs ``[first, end)`` sorted, with overlapping or touching runs merged."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def probed_pages(cursor: Any, keys: list[bytes], base: int) -> np.ndarray | None:
    """The data-file page of each key's value, found by ``cursor`` of a ``buffers=True`` transaction in a
    map that starts at ``base`` (None when a key is missing)."""
    got = cursor.getmulti(keys)
    if len(got) != len(keys):
        return None
    where = np.fromiter((np.frombuffer(v, np.uint8).ctypes.data for _, v in got), np.int64, len(got))
    return (where - base) // PAGE


def joined(noted: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray] | None:
    """One segment's probes of all its appends as (blocks, pages), or None where it has none."""
    if not noted:
        return None
    return np.concatenate([b for b, _ in noted]), np.concatenate([p for _, p in noted])


def _advise(fd: int, runs: list[tuple[int, int]]) -> None:
    """``POSIX_FADV_WILLNEED`` over page runs in ``_ADVISE_BYTES`` calls (each returns once its reads are
    queued, so a long request takes about as long as the disk needs to read it)."""
    try:
        for lo, hi in runs:
            for start in range(lo * PAGE, hi * PAGE, _ADVISE_BYTES):
                os.posix_fadvise(fd, start, min(_ADVISE_BYTES, hi * PAGE - start), os.POSIX_FADV_WILLNEED)
    except OSError:  # a hint: a failed one costs speed only
        return


class MappedFile:
    """This process's map of LMDB's data file: where it starts, and read-ahead of its pages.

    Args:
        path: the data file's real path (as ``/proc/self/maps`` names it).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = None
        self._base: int | None = None
        self._ahead: threading.Thread | None = None
        self.enabled = sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")

    def base(self) -> int | None:
        """Address of the file's first byte in the map (None where it cannot be told)."""
        if self._base is None and self.enabled:
            self._base = next((low for low, _, offset in _mappings(self._path) if offset == 0), None)
        return self._base

    def moved(self) -> None:
        """The map was made again (a resize): find its start anew."""
        self._base = None

    def drop(self, map_bytes: int) -> bool:
        """Drop the map's page-table entries (``MADV_DONTNEED`` over its ``map_bytes``; the page cache
        stays). The caller holds the map lock, so the map cannot move meanwhile. Returns False where the
        map's start cannot be told (nothing was done)."""
        base = self.base()
        if base is None:
            return False
        _dontneed(base, map_bytes)
        return True

    def willneed(self, runs: list[tuple[int, int]]) -> int:
        """Ask the kernel to read page runs ``[first, end)`` into the page cache, from a background thread
        (queuing reads blocks while the disk's queue is full; the caller goes on meanwhile) once the
        previous request is queued; returns the bytes asked for."""
        if not self.enabled or not runs:
            return 0
        self.wait()
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._ahead = threading.Thread(target=_advise, args=(self._fd, runs), name="readahead", daemon=True)
        self._ahead.start()
        return sum(hi - lo for lo, hi in runs) * PAGE

    def wait(self) -> None:
        """Until the last request is queued."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None

    def close(self) -> None:
        self.wait()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
