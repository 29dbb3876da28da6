"""Reading text files (plain or gzip) in chunks of whole lines, and counting their lines."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["NEWLINE", "after_lines", "count_lines", "count_newlines", "iter_chunks", "open_binary"]

NEWLINE = 10


def open_binary(path: Path):  # noqa: ANN202 - a binary file object
    """``path`` opened for reading bytes, gunzipped on the fly when it ends in ``.gz``."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115


def count_newlines(data: bytes | memoryview) -> int:
    """Newline bytes in ``data``: a numpy comparison per MiB, several times faster than ``bytes.count``."""
    arr = np.frombuffer(data, dtype=np.uint8)
    step = 1 << 20
    return sum(int(np.count_nonzero(arr[i : i + step] == NEWLINE)) for i in range(0, arr.shape[0], step))


def after_lines(data: bytes, k: int) -> int:
    """Offset in ``data`` just past its ``k``-th newline (k >= 1; ``data`` holds at least k lines)."""
    return int(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == NEWLINE)[k - 1]) + 1


def iter_chunks(
    path: Path, *, chunk_bytes: int = 8 << 20, skip_lines: int = 0
) -> Iterator[tuple[bytes, int, int]]:
    """Whole lines of ``path`` in chunks of about ``chunk_bytes``, after the first ``skip_lines`` lines.

    Yields ``(data, first_line, lines)``: ``data`` ends with a newline; ``first_line`` is the 1-based line
    number of its first line and ``lines`` how many lines it holds. Memory stays at a few chunks whatever
    the file size.
    """
    line = 1
    tail = b""
    with open_binary(path) as fh:
        while True:
            block = fh.read(chunk_bytes)
            if not block:
                break
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                tail += block
                continue
            # One copy at most: the previous partial line joined to this block's whole lines.
            data = tail + memoryview(block)[:cut] if tail or cut < len(block) else block
            tail = block[cut:]
            n = count_newlines(data)
            if skip_lines:
                if n <= skip_lines:
                    skip_lines -= n
                    line += n
                    continue
                data = data[after_lines(data, skip_lines) :]
                line += skip_lines
                n -= skip_lines
                skip_lines = 0
            yield data, line, n
            line += n
    if tail and not skip_lines:
        yield tail + b"\n", line, 1


def count_lines(path: Path) -> int:
    """Lines of a file (a last line without a newline counts), by counting newline bytes."""
    n = 0
    last = b"\n"
    with open_binary(path) as fh:
        while block := fh.read(16 << 20):
            n += count_newlines(block)
            last = block[-1:]
    return n + (last != b"\n")
