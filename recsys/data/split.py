"""Splitting rows held in memory: ``order_by`` keys, ``group_by`` groups and where the held-out cut falls.

A spec's ``[split]`` either names held-out files or holds out ``eval_fraction`` of the rows. With
``order_by`` or ``group_by`` the parser returns per-row :class:`SplitKeys` next to each block, the split
is loaded into memory, and :func:`split_rows` picks the rows of each side:

* ``order_by`` sorts rows (stable: ties keep file order). A column whose values are all numbers sorts
  as numbers (float64); a column none of whose values is a number sorts by the bytes of its values
  (ISO dates ``2024-01-09 < 2024-01-10``); a column with both is refused. Empty values sort first.
  With ``order_format`` (strptime codes) the column's text is parsed as a time and sorts as one (a value
  that does not parse is a malformed row, per ``on_error``); text that looks like dates which do not sort
  as text (``1/9/2024``, ``2024-1-9``) is refused without it.
* ``group_by`` keeps every row of a group (equal bytes in that column) on one side. With ``order_by``
  groups are ordered by their smallest ``order_by`` value (ties: by the group's key hash, then by its
  first row) and the last whole groups nearest to ``eval_fraction`` of the rows are held out; without
  it, a group is held out when a hash of its key alone falls below ``eval_fraction``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from embedding_store.hashing import mix64
from recsys.data.fields import column_matrix
from recsys.data.issues import Problems
from recsys.data.numbers import parse_float
from recsys.data.spec import SplitSpec
from recsys.data.tabular import ArrowTable, SideTable, Table, TextTable
from recsys.errors import UserError

__all__ = [
    "SplitKeys",
    "order_times",
    "row_keys",
    "merge_keys",
    "split_rows",
    "check_split_columns",
    "held_out_groups",
]

# Salts the group hash so that a group's side does not follow its token id (the same 64-bit hash).
_GROUP_SALT = np.uint64(0x6A09E667F3BCC909)


@dataclass(frozen=True, slots=True)
class SplitKeys:
    """Per-row split keys of N rows.

    ``order``: (N,) float64 (NaN: empty) when the values are numbers, bytes ``S`` (``b""``: empty) when
    they are text, or None without ``order_by``. ``group``: (N,) int64 key hashes, or None.
    ``number_at`` / ``text_at``: where the first number / text value is (for the message that refuses a
    column holding both), empty when there is none.
    """

    order: np.ndarray | None
    group: np.ndarray | None
    number_at: str = ""
    text_at: str = ""

    @property
    def num_rows(self) -> int:
        arr = self.order if self.order is not None else self.group
        return 0 if arr is None else int(arr.shape[0])

    def __getitem__(self, index: Any) -> SplitKeys:
        """The keys of some rows (``index``: a slice or integer array)."""
        return SplitKeys(
            None if self.order is None else self.order[index],
            None if self.group is None else self.group[index],
            self.number_at,
            self.text_at,
        )


def _mixed(column: str, number_at: str, text_at: str) -> UserError:
    return UserError(
        f"[split] order_by = {column!r}: the column holds numbers ({number_at}) and text ({text_at}); "
        "it sorts as numbers when every value is one, by bytes when none is"
    )


# A value that reads as a date: day, month and year in some order, split by / . or -
_DATE_LIKE = re.compile(rb"\s*\d{1,4}([/.-])\d{1,2}\1\d{1,4}(?!\d)")
# ... that sorts as text: a zero-padded year, month and day, in that order
_ISO_DATE = re.compile(rb"\s*\d{4}([/.-])\d{2}\1\d{2}(?!\d)")
_DATE_SAMPLE = 1000  # values of a chunk looked at


def _refuse_unsortable_dates(texts: np.ndarray, column: str, where: Any) -> None:
    """Refuse text keys that are dates which do not sort as text (``where(i)``: where value ``i`` is)."""
    for i in np.flatnonzero(texts != b"")[:_DATE_SAMPLE]:
        value = bytes(texts[i])
        if _DATE_LIKE.match(value) and not _ISO_DATE.match(value):
            raise UserError(
                f"[split] order_by = {column!r}: its values are dates that do not sort as text "
                f"({value.decode('utf-8', 'replace')!r} at {where(int(i))}); set [split] order_format to "
                'their strptime codes (e.g. "%m/%d/%Y")'
            )


def _texts(table: Table, column: str) -> np.ndarray:
    """(N,) the column's values as bytes (``b""``: empty or null)."""
    if isinstance(table, TextTable):  # zero-padded: numpy compares bytes strings without trailing NULs
        mat, _ = column_matrix(table.fields, table.columns.index(column))
        return np.ascontiguousarray(mat).view(f"S{mat.shape[1]}").ravel()
    import pyarrow as pa

    arr = table.batch.column(table.columns.index(column))  # type: ignore[attr-defined]
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        raise UserError(
            f"[split] order_format applies to text, and order_by column {column!r} has type {arr.type}: "
            "remove order_format"
        )
    raw = [b"" if v is None else v.encode() for v in arr.to_pylist()]
    return np.array(raw, dtype=np.bytes_) if raw else np.zeros(0, "S1")


def order_times(table: Table, split: SplitSpec, problems: Problems) -> np.ndarray | None:
    """With ``split.order_format``: (N,) float64 seconds since 1970 of the ``order_by`` column's times
    (a time without a zone is read as UTC; NaN: an empty value); a value the format does not parse is
    reported to ``problems``. None without ``order_format``."""
    if not split.order_format:
        return None
    column = split.order_by
    if column not in table.columns:
        return None  # row_keys names the missing column
    texts = _texts(table, column)
    distinct, inverse = np.unique(texts, return_inverse=True)  # dates repeat: parse each once
    times = np.full(distinct.shape[0], np.nan)
    bad = np.zeros(distinct.shape[0], dtype=bool)
    for k, raw in enumerate(distinct.tolist()):
        if raw.strip() == b"":
            continue
        try:
            t = datetime.strptime(raw.decode("utf-8").strip(), split.order_format)
        except (UnicodeDecodeError, ValueError):
            bad[k] = True
            continue
        times[k] = (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()
    unparsed = bad[inverse]
    if unparsed.any():
        shown = np.array([v.decode("utf-8", "replace") for v in texts.tolist()], dtype=np.str_)
        reason = f"[split] order_by {column!r}: not a time of order_format {split.order_format!r}"
        problems.add_rows(table.lines, unparsed, reason, shown)
    return times[inverse]


def _text_order(table: TextTable, column: str, where: str) -> SplitKeys:
    f = table.fields
    col = table.columns.index(column)
    own = Problems(f.num_rows)  # a value that is not a number is text here, not an error
    values, missing = parse_float(f, col, name=column, problems=own)
    text = own.bad & ~missing
    number = ~own.bad & ~missing
    number_at = text_at = ""
    if number.any():
        row = int(np.flatnonzero(number)[0])
        number_at = f"{where}:{int(f.lines[row])} {f.text(row, col)!r}"
    if text.any():
        row = int(np.flatnonzero(text)[0])
        text_at = f"{where}:{int(f.lines[row])} {f.text(row, col)!r}"
        if number_at:
            raise _mixed(column, number_at, text_at)
        texts = _texts(table, column)
        _refuse_unsortable_dates(texts, column, lambda i: f"{where}:{int(f.lines[i])}")
        return SplitKeys(texts, None, "", text_at)
    return SplitKeys(np.where(missing, np.nan, values), None, number_at, "")


def _arrow_order(table: ArrowTable, column: str, where: str) -> SplitKeys:
    import pyarrow as pa

    arr = table.batch.column(table.columns.index(column))
    kind = arr.type
    null = np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if any(
        is_text(kind)
        for is_text in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_binary,
            pa.types.is_large_binary,
        )
    ):
        raw = [b"" if v is None else (v.encode() if isinstance(v, str) else v) for v in arr.to_pylist()]
        keys = np.array(raw, dtype=np.bytes_) if raw else np.zeros(0, "S1")
        first = np.flatnonzero(~null)
        at = f"{where} row {int(table.lines[first[0]])}" if first.size else ""
        _refuse_unsortable_dates(keys, column, lambda i: f"{where} row {int(table.lines[i])}")
        return SplitKeys(keys, None, "", at)
    if pa.types.is_temporal(kind):
        arr = arr.cast(pa.int32() if kind.bit_width == 32 else pa.int64())  # its count of time units
    elif not (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_decimal(kind)
    ):
        raise UserError(
            f"{where}: [split] order_by column {column!r} has type {kind}; it needs numbers, dates, "
            "timestamps or strings"
        )
    values = np.asarray(arr.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))
    bad = ~np.isfinite(values) & ~null
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise UserError(
            f"{where} row {int(table.lines[row])}: [split] order_by column {column!r}: "
            f"not a finite number: {values[row].item()!r}"
        )
    first = np.flatnonzero(~null)
    at = f"{where} row {int(table.lines[first[0]])}" if first.size else ""
    return SplitKeys(values, None, at, "")


def _group_keys(table: Table, column: str) -> np.ndarray:
    """(N,) int64 hashes of the column's bytes (as the column's text for Parquet numbers and dates)."""
    if isinstance(table, TextTable):
        return table.keys(column)
    import pyarrow as pa

    arr = table.batch.column(table.columns.index(column))
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.large_string())
    one = ArrowTable(pa.RecordBatch.from_arrays([arr], names=[column]), 0)
    return one.keys(column)


def row_keys(
    table: Table, *, order_by: str, group_by: str, where: str, times: np.ndarray | None = None
) -> SplitKeys | None:
    """The split keys of a table's rows, or None when the split needs none.

    Args:
        table: a chunk of the data (text or a Parquet record batch).
        order_by, group_by: the ``[split]`` columns ("" for none).
        where: the file, for messages.
        times: the ``order_by`` values as times (:func:`order_times`), with ``order_format``.

    Raises:
        UserError: a column the table lacks, an ``order_by`` column holding numbers and text, or (Parquet)
            a non-finite number or an unsortable type in it.
    """
    if not order_by and not group_by:
        return None
    for key, column in (("order_by", order_by), ("group_by", group_by)):
        if column and column not in table.columns:
            raise UserError(
                f"{where}: [split] {key} = {column!r}: no such column (columns: {', '.join(table.columns)})"
            )
    keys = SplitKeys(None, None)
    if order_by and times is not None:
        keys = SplitKeys(times, None, where, "")
    elif order_by and isinstance(table, TextTable):
        keys = _text_order(table, order_by, where)
    elif order_by:
        keys = _arrow_order(table, order_by, where)  # type: ignore[arg-type]
    if group_by:
        keys = SplitKeys(keys.order, _group_keys(table, group_by), keys.number_at, keys.text_at)
    return keys


def merge_keys(parts: Sequence[SplitKeys], order_by: str) -> SplitKeys:
    """The keys of a whole split from those of its chunks, in order; ``order`` becomes sortable as is.

    Number keys come back float64 with empty values as -inf (so they sort first), text keys as bytes.

    Raises:
        UserError: chunks whose ``order_by`` values are numbers in some and text in others.
    """
    group = np.concatenate([p.group for p in parts]) if parts and parts[0].group is not None else None
    if not order_by:
        return SplitKeys(None, group)
    number_at = next((p.number_at for p in parts if p.number_at), "")
    text_at = next((p.text_at for p in parts if p.text_at), "")
    texts = [p.order.dtype.kind == "S" for p in parts]  # type: ignore[union-attr]
    if any(texts):
        if number_at:
            raise _mixed(order_by, number_at, text_at)
        # A chunk of only empty values came back as NaN numbers: as text it is empty bytes.
        orders = [p.order if t else np.zeros(p.num_rows, "S1") for p, t in zip(parts, texts, strict=True)]
        return SplitKeys(np.concatenate(orders), group, "", text_at)
    order = np.concatenate([p.order for p in parts]) if parts else np.zeros(0)  # type: ignore[misc]
    return SplitKeys(np.where(np.isnan(order), -np.inf, order), group, number_at, "")


def held_out_groups(group_keys: np.ndarray, eval_fraction: float) -> np.ndarray:
    """(G,) bool: which groups a split without ``order_by`` holds out, from their int64 key hashes alone.

    The same key is on the same side in every run, whatever the seed or the other rows; raising
    ``eval_fraction`` only moves more groups to the held-out side.
    """
    h = mix64(group_keys.astype(np.uint64) ^ _GROUP_SALT)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < eval_fraction


def split_rows(keys: SplitKeys, num_rows: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) as int64 indices, each in the order the side is read.

    Without groups: rows sorted by ``order`` (stable), the last ``round(N * eval_fraction)`` held out.
    With groups and ``order``: rows sorted by ``order``; groups ordered by their first (smallest) key,
    ties by key hash then first row; the last k groups are held out, k the group boundary whose held-out
    row count is nearest to ``round(N * eval_fraction)`` (ties: the larger k), and at least one group
    when that target is > 0. With groups alone: :func:`held_out_groups`, rows in file order.
    """
    perm = np.arange(num_rows) if keys.order is None else np.argsort(keys.order, kind="stable")
    target = round(num_rows * eval_fraction)
    if keys.group is None:
        cut = num_rows - target
        return perm[:cut], perm[cut:]
    uniq, first, inv = np.unique(keys.group, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if keys.order is None:
        held_row = held_out_groups(uniq, eval_fraction)[inv]
    else:
        _, rank = np.unique(keys.order, return_inverse=True)  # equal values, equal rank
        # perm is sorted by order: a group's first appearance in it carries its smallest value.
        groups_in_perm, at = np.unique(inv[perm], return_index=True)
        smallest = np.empty(uniq.shape[0], dtype=np.int64)
        smallest[groups_in_perm] = rank.reshape(-1)[perm[at]]
        ranked = np.lexsort((first, uniq, smallest))  # last key first: smallest value, hash, first row
        sizes = np.bincount(inv, minlength=uniq.shape[0])[ranked]
        held = np.concatenate([[0], np.cumsum(sizes[::-1])])  # held[k]: rows of the last k groups
        gap = np.abs(held - target)
        k = int(np.flatnonzero(gap == gap.min())[-1])
        if target > 0:
            k = max(k, 1)
        held_group = np.zeros(uniq.shape[0], dtype=bool)
        held_group[ranked[uniq.shape[0] - k :]] = True
        held_row = held_group[inv]
    in_perm = held_row[perm]
    return perm[~in_perm], perm[in_perm]


def check_split_columns(
    split: SplitSpec, *, where: str, columns: Sequence[str], sides: Sequence[SideTable] = ()
) -> None:
    """Refuse an ``order_by`` / ``group_by`` column that the data files lack, before any row is read.

    Raises:
        UserError: naming the key and the column, and the side file when only a joined file has it.
    """
    for key, column in (("order_by", split.order_by), ("group_by", split.group_by)):
        if not column or column in columns:
            continue
        side = next((s for s in sides if column in s.columns), None)
        if side is not None:
            raise UserError(
                f"{where} [split] {key} = {column!r}: a column of the joined file {side.path}, not of the "
                "data files; the split reads the data files' own columns"
            )
        raise UserError(
            f"{where} [split] {key} = {column!r}: no such column in the data (columns: {', '.join(columns)})"
        )
