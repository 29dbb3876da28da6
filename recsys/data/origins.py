"""Columns of rows found by their origin: the values of named columns, as they appear in the files.

A block read from files carries each row's origin (:func:`recsys.data.block.pack_origin`: the file's
number and the row's 1-based line, or row of a Parquet file). :class:`OriginColumns` reads the values of
some columns of those rows back from the files — text exactly as the file has it, Parquet values as
text — so that a score can be written beside its input row's keys (``recsys predict --keep``).

Rows are found by reading forward: requests in file order (a streamed split) cost one pass over each
file; a request for an earlier line starts that file's pass again, so rows in another order (a sorted
split) are best asked for all at once (:meth:`OriginColumns.values` sorts the request).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from recsys.data.block import unpack_origin
from recsys.data.chunks import iter_chunks
from recsys.data.spec import DatasetSpec, Format
from recsys.errors import UserError

__all__ = ["OriginColumns"]

# A file's rows from some line on: (first line, the values of each wanted column of each row).
_Chunk = tuple[int, list[list[str]]]


class OriginColumns:
    """The values of ``names`` (columns of the data files, as :func:`data_columns` names them) of rows
    given by origin.

    Args:
        spec: the files' spec (format, delimiter).
        files: the files the origins number (``SpecDataset.origin_files``).
        columns: the files' column names.
        names: the columns to read.

    Raises:
        UserError: a name that is not one of ``columns``, or a format without named columns.
    """

    def __init__(
        self, spec: DatasetSpec, files: Sequence[Path], columns: Sequence[str], names: Sequence[str]
    ):
        if spec.format not in (Format.CSV, Format.RECBOLE, Format.PARQUET):
            raise UserError(f"--keep needs named columns; {spec.format.value} data has none")
        unknown = [n for n in names if n not in columns]
        if unknown:
            raise UserError(
                f"--keep {','.join(unknown)}: no such column in the data (columns: {', '.join(columns)})"
            )
        self.parquet = spec.format is Format.PARQUET
        self.delimiter = b"\t" if spec.format is Format.RECBOLE else spec.read.delimiter.encode()
        self.files = list(files)
        self.names = list(names)
        self._index = [list(columns).index(n) for n in names]
        self._passes: dict[int, tuple[Iterator[_Chunk], _Chunk]] = {}

    def values(self, origin: np.ndarray) -> list[np.ndarray]:
        """Per name, (N,) str (object) values of the rows ``origin`` (any order; repeats allowed)."""
        out = [np.empty(origin.shape[0], dtype=object) for _ in self.names]
        file, line = unpack_origin(np.asarray(origin, dtype=np.int64))
        order = np.lexsort((line, file))
        bounds = np.flatnonzero(np.diff(file[order])) + 1
        for part in np.split(order, bounds):
            if part.size:
                found = self._file_values(int(file[part[0]]), line[part])
                for j, column in enumerate(found):
                    out[j][part] = column
        return out

    def _file_values(self, k: int, lines: np.ndarray) -> list[list[str]]:
        """The wanted columns of ascending ``lines`` of file ``k``, read forward from where it stopped."""
        chunks, current = self._passes.get(k) or self._start(k)
        if lines[0] < current[0]:  # behind this pass: read the file again
            chunks, current = self._start(k)
        found: list[list[str]] = [[] for _ in self.names]
        for line in lines.tolist():
            first, rows = current
            while line >= first + len(rows[0]):
                nxt = next(chunks, None)
                if nxt is None:
                    raise UserError(f"{self.files[k]}: no line {line} (the file changed while it was read?)")
                current = nxt
                first, rows = current
            for j, column in enumerate(rows):
                found[j].append(column[line - first])
        self._passes[k] = (chunks, current)
        return found

    def _start(self, k: int) -> tuple[Iterator[_Chunk], _Chunk]:
        chunks = self._parquet(self.files[k]) if self.parquet else self._text(self.files[k])
        return chunks, (1, [[] for _ in self.names])

    def _text(self, path: Path) -> Iterator[_Chunk]:
        delimiter, index = self.delimiter, self._index
        for data, first, n in iter_chunks(path, chunk_bytes=1 << 20):
            columns: list[list[str]] = [[] for _ in index]
            for raw in bytes(data).split(b"\n", n - 1):
                fields = raw.rstrip(b"\r\n").split(delimiter)
                for j, i in enumerate(index):
                    columns[j].append(fields[i].decode("utf-8", "replace") if i < len(fields) else "")
            yield first, columns

    def _parquet(self, path: Path) -> Iterator[_Chunk]:
        import pyarrow.parquet as pq

        first = 1
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1 << 16, columns=self.names):
            columns = [["" if v is None else str(v) for v in batch.column(n).to_pylist()] for n in self.names]
            yield first, columns
            first += batch.num_rows
