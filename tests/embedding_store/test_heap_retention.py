"""``release_free_heap``: memory freed into glibc malloc's heap (blocks below its raised mmap threshold)
goes back to the system."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from embedding_store.memory import release_free_heap

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim"
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


def test_freed_heap_blocks_go_back_to_the_system() -> None:
    np.ones(1 << 20).sum()  # a freed 8 MiB block: glibc now serves blocks of 2 MiB from the heap
    arrays = [np.ones(1 << 18) for _ in range(64)]  # 64 blocks of 2 MiB, every page touched
    keep = np.ones(1 << 17)  # 1 MiB allocated after them: the top of the heap stays in use
    before = _heap_rss()
    del arrays
    assert release_free_heap()
    released = before - _heap_rss()
    assert keep.sum() == 1 << 17
    assert released > 96 << 20, f"the heap gave back {released >> 20} MiB of 128"
