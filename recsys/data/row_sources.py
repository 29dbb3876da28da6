"""Row sources: one pass over a split's rows as a stream of :class:`Block`, with bounded memory.

A source knows how many rows it has and can start a pass after any number of rows (the data position
of a resumed run). Text is read in chunks of whole lines and parsed ahead by a small pool of worker
processes (big files) or threads, results kept in file order; npy files are memory-mapped; Parquet is
read by row group; small data sets live in memory.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from recsys.data.block import Block
from recsys.data.chunks import after_lines, count_lines, iter_chunks
from recsys.data.issues import Issues, OnError, log_issues
from recsys.data.parallel import ProcessParsePool, picklable, process_pool_available

__all__ = [
    "RowSource",
    "Span",
    "WHOLE",
    "TextReading",
    "TextSource",
    "MemorySource",
    "ParquetSource",
    "ChunkParser",
    "rebatch",
]

# (data, first line, issues) -> (block, order key or None); the block's origin, when it has one, holds the
# lines of its rows (file number 0: the text source sets the file's number).
ChunkParser = Callable[[bytes, int, Issues], tuple[Block, np.ndarray | None]]


class RowSource(Protocol):
    def num_rows(self) -> int: ...

    def blocks(self, *, skip_rows: int = 0) -> Iterator[Block]:
        """One pass over the rows, starting after the first ``skip_rows``."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TextReading:
    """How a :class:`TextSource` reads its files.

    Attributes:
        header: each file starts with a header line, which is not data.
        chunk_bytes: bytes of whole lines parsed at a time (None: 1 MiB with processes, 512 KiB with threads).
        workers: parsers running ahead of the reader.
        processes: parse in processes (True), threads (False), or ``"auto"``: processes for passes over
            at least :data:`TextSource.PROCESS_MIN_BYTES` when the parser can be pickled.
    """

    header: bool = False
    chunk_bytes: int | None = None
    workers: int = 2
    processes: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.processes not in (True, False, "auto"):
            raise ValueError(f"processes must be True, False or 'auto', got {self.processes!r}")


@dataclass(frozen=True, slots=True)
class Span:
    """Which rows of a file sequence a source reads, and how its files are numbered in origins.

    Attributes:
        lo, hi: rows (data lines of text) ``[lo, hi)`` of the files read as one sequence; ``hi`` None: to
            the end.
        first_file: the file number of the first file in the blocks' origins (held-out files are
            numbered after the training files).
    """

    lo: int = 0
    hi: int | None = None
    first_file: int = 0


WHOLE = Span()  # every row, the files numbered from 0


class TextSource:
    """Data lines ``[lo, hi)`` of text files read as one sequence (a header line per file is not data).

    Blocks carry their rows' origins (file number ``first_file + k`` for ``files[k]``, the line in it)
    when the parser gives lines.

    In the default ``raise`` mode every data line is a row, so skipping rows is counting newlines; with
    ``skip`` malformed lines are dropped and counted, and rows are counted by parsing.

    ``workers`` parse ahead of the reader, in processes (:mod:`recsys.data.parallel`) or threads:
    ``processes = "auto"`` uses processes for passes over at least :data:`PROCESS_MIN_BYTES` of text
    when the parser can be pickled (a module-level function or object), threads otherwise.
    """

    PROCESS_MIN_BYTES = 64 << 20  # smaller passes are not worth starting processes for

    def __init__(
        self,
        files: list[Path],
        parse: ChunkParser,
        *,
        on_error: OnError,
        span: Span = WHOLE,
        reading: TextReading | None = None,
    ) -> None:
        reading = reading or TextReading()
        self.files = files
        self.first_file = span.first_file  # the file number of files[0] in the blocks' origins
        self.parse = parse
        self.header = reading.header
        self.on_error = on_error
        self.lo, self.hi = span.lo, span.hi
        self._chunk_bytes = reading.chunk_bytes
        self.workers = reading.workers
        self.processes = reading.processes
        self.issues = {str(p): Issues(str(p), on_error) for p in files}
        self._line_counts: list[int] | None = None
        self._rows: int | None = None

    def line_counts(self) -> list[int]:
        """Data lines of each file (counted once)."""
        if self._line_counts is None:
            self._line_counts = [max(0, count_lines(p) - self.header) for p in self.files]
        return self._line_counts

    def total_lines(self) -> int:
        hi = sum(self.line_counts()) if self.hi is None else self.hi
        return hi - self.lo

    def num_rows(self) -> int:
        if self._rows is None:
            if self.on_error is OnError.RAISE:
                self._rows = self.total_lines()
            else:
                self._rows = sum(b.num_rows for b in self.blocks())
        return self._rows

    def _chunks(self, lo: int, hi: int | None, chunk_bytes: int) -> Iterator[tuple[Path, bytes, int]]:
        """Data lines [lo, hi) of the file sequence, as (file, chunk of whole lines, first line number)."""
        base = 0
        for k, path in enumerate(self.files):
            if hi is not None and base >= hi:
                return
            count = self.line_counts()[k] if (lo > base or hi is not None) else None
            if count is not None and lo >= base + count:
                base += count
                continue
            skip = max(0, lo - base)
            left = None if hi is None else min(hi, base + count) - base - skip  # type: ignore[operator]
            for data, first, n in iter_chunks(path, chunk_bytes=chunk_bytes, skip_lines=skip + self.header):
                if left is not None:
                    if n >= left:
                        if left:
                            yield path, data[: after_lines(data, left)], first
                        left = 0
                        break
                    left -= n
                yield path, data, first
            if count is not None:  # None: reading every file whole, positions are not needed
                base += count

    def use_processes(self) -> bool:
        """Whether a pass parses in processes (see the class docstring)."""
        if self.processes == "auto":
            big = sum(p.stat().st_size for p in self.files if p.is_file()) >= self.PROCESS_MIN_BYTES
            return big and process_pool_available() and picklable(self.parse)
        return bool(self.processes)

    @contextlib.contextmanager
    def _pool(self, processes: bool, chunk_bytes: int) -> Iterator[Callable[[bytes, int, Issues], Future]]:
        """``submit(data, first_line, issues) -> Future`` of the parser's result, while the workers live."""
        if processes:
            slots = 2 * self.workers + 1  # the reader keeps 2 per worker pending
            with ProcessParsePool(
                self.parse, workers=self.workers, chunk_bytes=chunk_bytes, slots=slots
            ) as procs:
                yield procs.submit
        else:
            with ThreadPoolExecutor(max_workers=self.workers) as threads:
                yield lambda data, first, issues: threads.submit(self.parse, data, first, issues)

    def _parsed(self, lo: int) -> Iterator[tuple[Block, np.ndarray | None]]:
        """Parsed chunks in file order; ``workers`` parse ahead (bounded: 2 chunks per worker)."""
        current: str | None = None
        for issues in self.issues.values():  # counts describe the latest pass
            issues.counts.clear()
        processes = self.use_processes()
        # Bytes per chunk: 1 MiB for processes (fewer hand-overs), 512 KiB for threads.
        chunk_bytes = self._chunk_bytes or (1 << 20 if processes else 512 << 10)
        number = {str(p): self.first_file + k for k, p in enumerate(self.files)}
        with self._pool(processes, chunk_bytes) as submit:
            pending: deque[tuple[str, Future]] = deque()
            chunks = self._chunks(lo, self.hi, chunk_bytes)
            exhausted = False
            while True:
                while not exhausted and len(pending) < 2 * self.workers:
                    item = next(chunks, None)
                    if item is None:
                        exhausted = True
                        break
                    path, data, first = item
                    pending.append((str(path), submit(data, first, self.issues[str(path)])))
                if not pending:
                    break
                path_s, fut = pending.popleft()
                if current is not None and path_s != current:
                    log_issues(self.issues[current])
                current = path_s
                try:
                    block, keys = fut.result()
                    yield block.with_file(number[path_s]), keys
                except BaseException:
                    for _, other in pending:
                        other.cancel()
                    raise
        if current is not None:
            log_issues(self.issues[current])

    def blocks(self, *, skip_rows: int = 0) -> Iterator[Block]:
        for block, _ in self.pairs(skip_rows=skip_rows):
            yield block

    def pairs(self, *, skip_rows: int = 0) -> Iterator[tuple[Block, np.ndarray | None]]:
        """Blocks with their split keys (the parser's second result: ``order_by`` / ``group_by`` keys)."""
        if self.on_error is OnError.RAISE:
            yield from self._parsed(self.lo + skip_rows)
            return
        for block, order in self._parsed(self.lo):
            if skip_rows >= block.num_rows:
                skip_rows -= block.num_rows
                continue
            if skip_rows:
                block = block.slice(skip_rows, block.num_rows)
                order = None if order is None else order[skip_rows:]
                skip_rows = 0
            yield block, order

    @property
    def skipped(self) -> int:
        """Malformed lines skipped in the latest pass (``skip`` mode)."""
        return sum(i.skipped for i in self.issues.values())


class MemorySource:
    """Rows held in memory (small data sets, and any split that is sorted or shuffled)."""

    def __init__(self, block: Block, *, chunk_rows: int = 65536) -> None:
        self.block = block
        self.chunk_rows = chunk_rows

    def num_rows(self) -> int:
        return self.block.num_rows

    def blocks(self, *, skip_rows: int = 0) -> Iterator[Block]:
        for start in range(skip_rows, self.block.num_rows, self.chunk_rows):
            yield self.block.slice(start, min(self.block.num_rows, start + self.chunk_rows))


class ParquetSource:
    """Rows ``[lo, hi)`` of Parquet files, read a record batch at a time (needs pyarrow).

    ``convert(batch, first_row, path)`` turns a record batch (rows from ``first_row`` of file ``path``)
    into a block and its split keys; the block's origin, when it has one, holds 1-based row numbers
    (the source sets the file number, ``first_file + k`` for ``files[k]``).
    """

    def __init__(
        self,
        files: list[Path],
        convert: Callable[[Any, int, Path], tuple[Block, Any]],
        *,
        span: Span = WHOLE,
        batch_rows: int = 65536,
    ) -> None:
        import pyarrow.parquet as pq

        self.first_file = span.first_file  # the file number of files[0] in the blocks' origins
        self.paths = list(files)
        self.files = [pq.ParquetFile(p) for p in files]
        self.counts = [f.metadata.num_rows for f in self.files]
        self.convert = convert
        self.lo, self.hi = span.lo, (sum(self.counts) if span.hi is None else span.hi)
        self.batch_rows = batch_rows

    def num_rows(self) -> int:
        return self.hi - self.lo

    def pairs(self, *, skip_rows: int = 0) -> Iterator[tuple[Block, Any]]:
        """Blocks with their split keys."""
        lo = self.lo + skip_rows
        base = 0
        for k, (path, pf, count) in enumerate(zip(self.paths, self.files, self.counts, strict=True)):
            row = base
            if base + count > lo and base < self.hi:
                for batch in pf.iter_batches(batch_size=self.batch_rows):
                    a, b = max(lo, row), min(self.hi, row + batch.num_rows)
                    if a < b:
                        block, keys = self.convert(batch.slice(a - row, b - a), a - base, path)
                        yield block.with_file(self.first_file + k), keys
                    row += batch.num_rows
            base += count

    def blocks(self, *, skip_rows: int = 0) -> Iterator[Block]:
        for block, _ in self.pairs(skip_rows=skip_rows):
            yield block


def rebatch(blocks: Iterator[Block], rows: int) -> Iterator[Block]:
    """Blocks of exactly ``rows`` rows from a stream of blocks of any size (the last may be shorter)."""
    held: list[Block] = []
    count = 0
    for block in blocks:
        while block.num_rows:
            take = min(rows - count, block.num_rows)
            held.append(block.slice(0, take) if take < block.num_rows else block)
            block = block.slice(take, block.num_rows) if take < block.num_rows else block.slice(0, 0)
            count += take
            if count == rows:
                yield Block.concat(held)
                held, count = [], 0
    if count:
        yield Block.concat(held)
