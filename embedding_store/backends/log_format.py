"""The log layout's on-disk format: names, keys, blocks and where a sequence number lives
(docs/tiers.md, "Write-back by write time"; :mod:`~embedding_store.backends.log_tables` writes and reads it; a store records its geometry, :mod:`~embedding_store.backends.meta`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from embedding_store.config import TableSpec
from embedding_store.errors import StoreCorruptError

__all__ = [
    "BLOCK_BYTES",
    "CAPPED_MIN_SEGMENT_ROWS",
    "JOIN_BLOCKS",
    "RUN_IDS",
    "Geometry",
    "blocks_of",
    "encode_keys",
    "rows_of_blocks",
    "runs_name",
    "segment_name",
    "split_segments",
]

# Ids per runs record: 8 + 8 * 240 bytes stays below LMDB's largest in-page value (~2 KiB with 4 KiB
# pages), so no record needs an overflow page (a search of the free list for contiguous pages).
RUN_IDS = 240
# A block's bytes at most: the largest value LMDB keeps inside a 4 KiB leaf page (two blocks a page). A
# larger block would be an overflow page, which LMDB only points at: py-lmdb then takes its page fault
# while it copies the value, holding the interpreter lock, so cold reads would fault one at a time, and
# dropping a segment would read every one of its overflow pages.
BLOCK_BYTES = 2016
# Blocks joined into one buffer at once when rows are taken out of them (rows_of_blocks): ~2 MB.
JOIN_BLOCKS = 1024
# The smallest segment of a table with a row cap (Geometry.capped): bounds the segments of small tables.
CAPPED_MIN_SEGMENT_ROWS = 2048


def segment_name(table: str, segment: int) -> bytes:
    """LMDB name of ``table``'s segment; ``__`` names cannot be table names (TableSpec refuses them)."""
    return f"__log__/{table}/{segment:012d}".encode()


def runs_name(table: str) -> bytes:
    return f"__log__/{table}/runs".encode()


def encode_keys(numbers: np.ndarray) -> list[bytes]:
    """(N,) int64 numbers >= 0 -> N 8-byte big-endian keys (LMDB's byte order = ascending order)."""
    # Opaque 8-byte items become bytes objects in numpy's C loop: no Python loop over the numbers.
    return np.ascontiguousarray(numbers, dtype=">u8").view("V8").tolist()


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where a table's sequence number lives: block ``seq // block``, segment ``seq // segment``."""

    block: int  # rows per block
    segment: int  # sequence numbers per segment (a multiple of ``block``)

    @staticmethod
    def of(spec: TableSpec, segment_rows: int) -> Geometry:
        block = max(1, BLOCK_BYTES // spec.row_bytes)
        return Geometry(block=block, segment=block * max(1, segment_rows // block))

    @staticmethod
    def capped(spec: TableSpec, segment_rows: int, page_size: int, largest_block: int) -> Geometry:
        """A table of at most ``spec.expected_max_rows`` rows, packed for space: blocks of the row count
        that puts the most rows in a leaf page (5 rows of 260 bytes, three blocks a 4 KiB page: 15 rows
        where 7-row blocks fit 14), segments of about a 32nd of the rows (a dropped segment's pages
        come back to LMDB's free list two commits later: smaller segments, less file held by them), at
        least ``CAPPED_MIN_SEGMENT_ROWS`` and at most ``segment_rows``."""
        assert spec.expected_max_rows is not None
        rb = spec.row_bytes
        # a leaf page holds its 16-byte header and, per node, an index slot, a node header, a key and
        # the value: 2 + 8 + 8 + block bytes
        block = max(
            range(1, max(1, largest_block // rb) + 1),
            key=lambda r: (r * ((page_size - 16) // (r * rb + 18)), r),
        )
        rows = max(CAPPED_MIN_SEGMENT_ROWS, 1 << max(0, (spec.expected_max_rows // 32).bit_length() - 1))
        return Geometry(block=block, segment=block * max(1, min(segment_rows, rows) // block))

    def plan(self, ordered: np.ndarray) -> tuple[np.ndarray, list[bytes], np.ndarray, list[int]]:
        """For ascending sequence numbers: the index of each one's block among the distinct blocks, the
        blocks' keys, each block's segment, and where a new segment starts in the keys (with 0 and the end).
        """
        numbers = ordered // self.block
        first = np.ones(numbers.shape[0], dtype=bool)  # ascending: a linear pass, no sort
        np.not_equal(numbers[1:], numbers[:-1], out=first[1:])
        blocks, inverse = numbers[first], np.cumsum(first) - 1
        seg_of = blocks * self.block // self.segment
        return (
            inverse,
            encode_keys(blocks),
            seg_of,
            [0, *(np.flatnonzero(np.diff(seg_of)) + 1).tolist(), len(blocks)],
        )


def rows_of_blocks(
    values: Sequence[bytes | memoryview | None], inverse: np.ndarray, slots: np.ndarray, spec: TableSpec
) -> np.ndarray:
    """Rows ``slots`` of blocks ``inverse`` (ascending indexes into ``values``; None: a block that was not
    found) as an (N, R) float32 array.

    The blocks are joined ``JOIN_BLOCKS`` at a time: each join stays in reused heap memory, where one join
    of 10,000 blocks (18 MB) maps fresh pages and faults on every one of them (that fault cost more than
    the reads themselves, docs/performance.md, store primitives)."""
    try:
        lens = np.fromiter(map(len, values), dtype=np.int64, count=len(values))  # type: ignore[arg-type]
    except TypeError:  # len(None)
        raise StoreCorruptError(
            f"table {spec.name!r}: the log index points at blocks that are missing"
        ) from None
    rows_in = lens // spec.row_bytes
    if (lens % spec.row_bytes).any() or (slots >= rows_in[inverse]).any():
        raise StoreCorruptError(f"table {spec.name!r}: a log block of unexpected size")
    start = np.zeros(len(values), dtype=np.int64)
    np.cumsum(rows_in[:-1], out=start[1:])
    out = np.empty((inverse.shape[0], spec.row_floats), dtype=np.float32)
    blocks = cast("Sequence[bytes]", values)
    for a in range(0, len(values), JOIN_BLOCKS):
        i, j = np.searchsorted(inverse, [a, a + JOIN_BLOCKS])
        if i < j:
            flat = np.frombuffer(b"".join(blocks[a : a + JOIN_BLOCKS]), dtype=np.float32)
            out[i:j] = flat.reshape(-1, spec.row_floats)[start[inverse[i:j]] - start[a] + slots[i:j]]
    return out


def split_segments(seqs: np.ndarray, segment: int) -> list[tuple[int, int]]:
    """[a, b) ranges of ``seqs`` (consecutive numbers) that stay inside one segment."""
    out, a, n = [], 0, seqs.shape[0]
    while a < n:
        b = min(n, a + (int(seqs[a]) // segment + 1) * segment - int(seqs[a]))
        out.append((a, b))
        a = b
    return out


def blocks_of(rows: np.ndarray, first_seq: int, block: int) -> list[tuple[bytes, bytes]]:
    """(block key, packed rows) of ``rows`` numbered from the block-aligned ``first_seq``."""
    n, row_bytes = rows.shape[0], rows.shape[1] * 4
    full = n // block
    flat = rows.reshape(-1)
    values = flat[: full * block * rows.shape[1]].view(f"V{block * row_bytes}").tolist() if full else []
    if full * block < n:
        values.append(rows[full * block :].tobytes())
    return list(zip(encode_keys(first_seq // block + np.arange(len(values))), values, strict=True))
