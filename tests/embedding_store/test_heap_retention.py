"""``bound_heap_retention``: once it is set, large blocks come from mappings of their own, so freeing them
gives the memory back instead of leaving it in the heap (glibc's default raises the threshold to the
size of every large block freed)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from embedding_store.memory import bound_heap_retention

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)


def _heap_rss() -> int:
    """Bytes of the process's brk heap in memory (``[heap]`` in /proc/self/smaps)."""
    total, name = 0, ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                name = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Rss:" and name == "[heap]":
                total += int(fields[1]) * 1024
    return total


def test_blocks_above_the_threshold_do_not_grow_the_heap() -> None:
    np.ones(1 << 20).sum()  # a freed 8 MiB block: glibc's default would now serve 2 MiB from the heap
    assert bound_heap_retention(1 << 20)
    before = _heap_rss()
    arrays = [np.ones(1 << 18) for _ in range(64)]  # 64 blocks of 2 MiB, every page touched
    grown = _heap_rss() - before
    assert sum(a.nbytes for a in arrays) == 128 << 20
    assert grown < 16 << 20, f"the heap grew by {grown >> 20} MiB"
