"""Column-mapped data (CSV/TSV, RecBole atomic files, Parquet) → :class:`Block`, with side-file joins.

A spec maps columns to features: each ``[[dense]]`` and ``[[sparse]]`` entry names a column, of the
main file or of a joined side file (RecBole's ``.user`` / ``.item``). A chunk of the main file is a
*table* (:class:`TextTable` over parsed text, :class:`ArrowTable` over a Parquet record batch); side files
are loaded whole as :class:`SideTable` and looked up by a hashed key, vectorised (sorted keys and
``searchsorted``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from recsys.data import portable_math
from recsys.data.block import Block, Jagged
from recsys.data.fields import Fields
from recsys.data.issues import NOT_FINITE, Problems
from recsys.data.numbers import parse_float, parse_hex, parse_int
from recsys.data.spec import DatasetSpec, DenseSpec, SparseKind, SparseSpec, Transform
from recsys.data.tokens import hash_tokens
from recsys.errors import UserError

__all__ = ["Table", "TextTable", "ArrowTable", "SideTable", "to_block", "needed_columns"]


class Table(Protocol):
    """Named columns of N rows."""

    columns: list[str]
    lines: np.ndarray  # (N,) file line numbers, for messages

    @property
    def num_rows(self) -> int: ...

    def numeric(
        self, column: str, problems: Problems, *, lenient: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(values (N,) float64, missing (N,) bool); ``lenient``: non-numbers are missing, not errors.

        Non-numbers include NaN and ±inf; a value that is reported (not lenient) is 0 in ``values``.
        """

    def sparse(self, column: str, feature: SparseSpec, problems: Problems) -> Jagged: ...

    def keys(self, column: str) -> np.ndarray:
        """(N,) int64 hashed join keys."""


@dataclass
class TextTable:
    """A chunk of delimited text: ``fields`` with one column per name in ``columns``."""

    fields: Fields
    columns: list[str]

    @property
    def lines(self) -> np.ndarray:
        return self.fields.lines

    @property
    def num_rows(self) -> int:
        return self.fields.num_rows

    def _col(self, column: str) -> int:
        return self.columns.index(column)

    def numeric(
        self, column: str, problems: Problems, *, lenient: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        if not lenient:
            return parse_float(self.fields, self._col(column), name=column, problems=problems)
        own = Problems(self.num_rows)  # values that are not numbers become missing
        values, missing = parse_float(self.fields, self._col(column), name=column, problems=own)
        return np.where(own.bad, 0.0, values), missing | own.bad

    def sparse(self, column: str, feature: SparseSpec, problems: Problems) -> Jagged:
        col = self._col(column)
        if feature.kind is SparseKind.TOKEN:
            values, lengths = hash_tokens(
                self.fields,
                col,
                separator=feature.separator.encode(),
                prefix=feature.prefix,
                max_length=feature.max_length,
            )
            return Jagged(values, lengths)
        if feature.separator:
            raise UserError(f"sparse feature {feature.name!r}: a separator needs kind = 'token'")
        parse = parse_int if feature.kind is SparseKind.INT else parse_hex
        ids, missing = parse(self.fields, col, name=column, problems=problems)
        if feature.id_space:
            out = ((ids < 0) | (ids >= feature.id_space)) & ~missing
            problems.add(
                self.fields, col, out, f"field {column!r} (column {col + 1}): id outside the id space"
            )
        keep = ~missing
        return Jagged(ids[keep], keep.astype(np.int64))

    def keys(self, column: str) -> np.ndarray:
        values, lengths = hash_tokens(self.fields, self._col(column))
        out = np.full(self.num_rows, -1, dtype=np.int64)  # an empty key matches nothing
        out[lengths.astype(bool)] = values
        return out


def sparse_ids(table: Table, column: str, feature: SparseSpec, problems: Problems) -> Jagged:
    """A sparse feature's ids from one column, inside the feature's declared id space.

    Hashed tokens are folded into a declared ``id_space`` (modulo, so distinct tokens may share an id);
    the model's tables are sized by it in tiered and untiered runs alike. Integer and hexadecimal ids
    outside it are errors (reported per ``on_error``) by the table's own parser.
    """
    ids = table.sparse(column, feature, problems)
    if feature.kind is SparseKind.TOKEN and feature.id_space:
        return Jagged(ids.values % feature.id_space, ids.lengths)
    return ids


class ArrowTable:
    """A Parquet record batch (pyarrow): numeric columns as they are, string columns hashed."""

    def __init__(self, batch: Any, first_row: int) -> None:
        self.batch = batch
        self.columns = list(batch.schema.names)
        self.lines = np.arange(first_row + 1, first_row + 1 + batch.num_rows, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.batch.num_rows)

    def _array(self, column: str) -> Any:
        import pyarrow as pa

        arr = self.batch.column(self.columns.index(column))
        return arr.cast(pa.large_string()) if pa.types.is_string(arr.type) else arr

    def numeric(
        self, column: str, problems: Problems, *, lenient: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        import pyarrow as pa

        arr = self._array(column)
        if not (
            pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type)
        ):
            raise UserError(f"parquet column {column!r} has type {arr.type}, not a number")
        missing = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        values = np.asarray(
            arr.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64
        )
        # NaN and ±inf are bad values, as in text (parse_float): missing when lenient, else reported.
        nonfinite = ~np.isfinite(values)
        if nonfinite.any():
            if lenient:
                missing = missing | nonfinite
            else:
                problems.add_rows(self.lines, nonfinite, f"field {column!r}: {NOT_FINITE}", values)
            values = np.where(nonfinite, 0.0, values)
        return values, missing

    def _fields(self, arr: Any) -> Fields:
        """A large_string array as Fields over its data buffer (no copy of the characters)."""
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        buf = np.concatenate([data, np.zeros(8, np.uint8)])
        null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        starts = offsets[:-1].copy()
        ends = np.where(null, starts, offsets[1:])
        return Fields(buf, starts[:, None], ends[:, None], self.lines)

    def sparse(self, column: str, feature: SparseSpec, problems: Problems) -> Jagged:
        import pyarrow as pa

        arr = self._array(column)
        if pa.types.is_large_string(arr.type):
            values, lengths = hash_tokens(
                self._fields(arr),
                0,
                separator=feature.separator.encode(),
                prefix=feature.prefix,
                max_length=feature.max_length,
            )
            return Jagged(values, lengths)
        if pa.types.is_integer(arr.type):
            missing = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            ids = np.asarray(arr.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
            keep = ~missing
            return Jagged(ids[keep], keep.astype(np.int64))
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = np.asarray(
                arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64
            )
            flat = arr.flatten()
            if pa.types.is_integer(flat.type):
                values = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.int64)
            else:
                flat_fields = self._fields(flat.cast(pa.large_string()))
                flat_fields = Fields(
                    flat_fields.buf, flat_fields.starts, flat_fields.ends, np.zeros(len(flat), np.int64)
                )
                values, _ = hash_tokens(flat_fields, 0)
            return Jagged(values, lengths)
        raise UserError(
            f"parquet column {column!r} has type {arr.type}; sparse features need strings, ints or lists"
        )

    def keys(self, column: str) -> np.ndarray:
        arr = self._array(column)
        import pyarrow as pa

        if pa.types.is_integer(arr.type):
            arr = arr.cast(pa.large_string())
        values, lengths = hash_tokens(self._fields(arr), 0)
        out = np.full(self.num_rows, -1, dtype=np.int64)
        out[lengths.astype(bool)] = values
        return out


class SideTable:
    """A whole side file, indexed by the hashed ``on`` column, with its needed features precomputed."""

    def __init__(self, table: Table, *, on: str, path: str, spec: DatasetSpec, problems: Problems) -> None:
        self.on = on
        self.path = path
        self.columns = set(table.columns)
        keys = table.keys(on)
        self.order = np.argsort(keys, kind="stable")
        self.sorted_keys = keys[self.order]
        n = table.num_rows
        self.numeric: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.sparse: dict[str, Jagged] = {}
        for d in spec.dense:
            column = d.column or d.name
            if column in self.columns and column != on and column not in self.numeric:
                values, missing = table.numeric(column, problems, lenient=d.invalid == "missing")
                self.numeric[column] = (np.append(values, 0.0), np.append(missing, True))
        if spec.label.column in self.columns and spec.label.column != on:
            values, missing = table.numeric(spec.label.column, problems)
            self.numeric[spec.label.column] = (np.append(values, 0.0), np.append(missing, True))
        for s in spec.sparse:
            column = s.column or s.name
            if column in self.columns and column != on:
                j = sparse_ids(table, column, s, problems)
                # One extra empty row at index n: what a row without a match gets.
                self.sparse[s.name] = Jagged(j.values, np.append(j.lengths, 0))
        self.missing_row = n

    def rows_for(self, keys: np.ndarray) -> np.ndarray:
        """Side row of each key (``missing_row`` where the side file has none)."""
        if self.sorted_keys.shape[0] == 0:
            return np.full(keys.shape[0], self.missing_row, dtype=np.int64)
        at = np.minimum(np.searchsorted(self.sorted_keys, keys), self.sorted_keys.shape[0] - 1)
        found = self.sorted_keys[at] == keys
        return np.where(found, self.order[at], self.missing_row)


def _transform(d: DenseSpec, values: np.ndarray, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(feature (N,) float32, overflow (N,) bool): rows whose finite value left float32's range."""
    if d.transform is Transform.LOG1P:
        values = portable_math.log1p(np.maximum(values, 0.0))  # the same bits on every CPU
    with np.errstate(over="ignore", invalid="ignore"):  # found below, row by row
        out = np.where(missing, d.fill, (values - d.shift) * d.scale).astype(np.float32)
    return out, ~np.isfinite(out) & ~missing


def needed_columns(spec: DatasetSpec) -> set[str]:
    cols = {d.column or d.name for d in spec.dense} | {s.column or s.name for s in spec.sparse}
    if spec.read.has_label:
        cols.add(spec.label.column)
    if spec.split.order_by:
        cols.add(spec.split.order_by)
    return cols


def to_block(
    table: Table, spec: DatasetSpec, sides: list[SideTable], problems: Problems
) -> tuple[Block, np.ndarray | None]:
    """The spec's features of a table's rows, and the ``order_by`` column when the split sorts rows.

    The block's ``origin`` is the table's ``lines`` (file number 0: the reader sets the file's).
    """
    side_rows: dict[int, np.ndarray] = {}

    def side_of(column: str) -> tuple[SideTable, np.ndarray] | None:
        for i, side in enumerate(sides):
            if column in side.columns:
                if i not in side_rows:
                    side_rows[i] = side.rows_for(table.keys(side.on))
                return side, side_rows[i]
        return None

    def numeric(column: str, lenient: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if column in table.columns:
            return table.numeric(column, problems, lenient=lenient)
        found = side_of(column)
        if found is None:
            raise UserError(
                f"{spec.path}: no column {column!r} in the data (columns: {', '.join(table.columns)})"
            )
        side, rows = found
        values, missing = side.numeric[column]
        return values[rows], missing[rows]

    n = table.num_rows
    dense = np.zeros((n, len(spec.dense)), dtype=np.float32)
    for j, d in enumerate(spec.dense):
        column, lenient = d.column or d.name, d.invalid == "missing"
        values, missing = numeric(column, lenient)
        dense[:, j], overflow = _transform(d, values, missing)
        if overflow.any():  # e.g. 1e300: finite in the file, inf as the model's float32
            if lenient:
                dense[overflow, j] = d.fill
            else:
                reason = f"field {column!r}: {NOT_FINITE} as float32 after the transform"
                problems.add_rows(table.lines, overflow, reason, values)
    ids = []
    for s in spec.sparse:
        column = s.column or s.name
        if column in table.columns:
            ids.append(sparse_ids(table, column, s, problems))
            continue
        found = side_of(column)
        if found is None:
            raise UserError(
                f"{spec.path}: no column {column!r} in the data (columns: {', '.join(table.columns)})"
            )
        side, rows = found
        ids.append(side.sparse[s.name].take(rows))
    if spec.read.has_label:
        values, missing = numeric(spec.label.column)
        if spec.label.threshold is not None:
            labels = (values >= spec.label.threshold).astype(np.float32)
        else:
            labels = values.astype(np.float32)
            problems.add_rows(
                table.lines, (labels != 0) & (labels != 1), f"label {spec.label.column!r}: not 0 or 1"
            )
        problems.add_rows(table.lines, missing, f"label {spec.label.column!r}: missing")
    else:  # data to score, without labels (read as 0, as criteo_tsv's has_label = false does)
        labels = np.zeros(n, dtype=np.float32)
    order = numeric(spec.split.order_by)[0] if spec.split.order_by else None
    return Block(dense, tuple(ids), labels, table.lines), order
