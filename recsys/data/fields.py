"""Splitting chunks of delimited text (Criteo TSV, CSV/TSV, RecBole atomic files) into fields.

No per-row Python on the hot path: a chunk of whole lines is split into fields with a handful of numpy
passes over its bytes (separator positions → an (N, C) matrix of field starts and ends). Each column is
then converted at once: numbers by :mod:`recsys.data.numbers`, string tokens by
:mod:`recsys.data.tokens`. Lines with another number of fields, and empty lines, are reported to
:class:`~recsys.data.issues.Issues`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from recsys.data.chunks import NEWLINE
from recsys.data.issues import Issues

__all__ = ["NIBBLE_TABLE", "Fields", "column_matrix", "split_fields"]

CR = 13
PAD = 8  # zero bytes on both sides of a chunk's buffer
_ZEROS = bytes(PAD)


@dataclass(frozen=True, slots=True)
class Fields:
    """Well-formed lines of a chunk: field j of row i is ``buf[starts[i, j]:ends[i, j]]``.

    Shapes: starts, ends (N, C) int64; lines (N,) int64 file line numbers (1-based). ``shared`` holds
    what is computed once per chunk (the nibble buffer) for every Fields made from the same ``buf``.
    """

    buf: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    lines: np.ndarray
    shared: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.lines.shape[0])

    def keep(self, mask: np.ndarray) -> Fields:
        return Fields(self.buf, self.starts[mask], self.ends[mask], self.lines[mask], self.shared)

    def columns(self, starts: np.ndarray, ends: np.ndarray, lines: np.ndarray) -> Fields:
        """Other fields of the same chunk (e.g. columns stacked into one)."""
        return Fields(self.buf, starts, ends, lines, self.shared)

    def text(self, row: int, col: int) -> str:
        raw = self.buf[self.starts[row, col] : self.ends[row, col]].tobytes()
        return raw.decode("utf-8", "replace")

    def nibbles(self) -> np.ndarray:
        """``buf`` with every byte replaced by its hexadecimal digit value (0..15), other bytes by 0xFF."""
        nib = self.shared.get("nibbles")
        if nib is None:
            raw = self.buf.base if isinstance(self.buf.base, bytes) else self.buf.tobytes()
            nib = np.frombuffer(raw.translate(NIBBLE_TABLE), dtype=np.uint8)
            self.shared["nibbles"] = nib
        return nib


# Byte -> hexadecimal digit value (0..15), 0xFF for any other byte: bytes.translate's table of
# Fields.nibbles, and a numpy lookup table for the per-byte slow paths (recsys.data.numbers).
NIBBLE_TABLE = bytes(
    c - 48 if 48 <= c <= 57 else c - 87 if 97 <= c <= 102 else c - 55 if 65 <= c <= 70 else 0xFF
    for c in range(256)
)


def _separators(buf: np.ndarray, delimiter: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of delimiter and newline bytes in ``buf`` (outside the zero padding), and which are newlines."""
    core = buf[PAD : buf.shape[0] - PAD]
    if delimiter == 9:  # tab and newline are the only bytes <= 10 in text: one comparison, not three passes
        sep = np.flatnonzero(core <= NEWLINE)
        found = core[sep]
        if (found >= 9).all():  # all tabs and newlines (no other control bytes)
            return sep + PAD, found == NEWLINE
    sep = np.flatnonzero((core == NEWLINE) | (core == delimiter))
    return sep + PAD, core[sep] == NEWLINE


def split_fields(
    data: bytes, *, delimiter: bytes, num_fields: int, first_line: int, issues: Issues
) -> Fields:
    """Split a chunk of whole lines (ending with a newline) into fields.

    Lines with another number of fields, and empty lines, are reported to ``issues`` (so that in the
    default ``raise`` mode every line is a row, and a reader can skip rows by counting newlines).
    ``first_line`` is the file line number of the chunk's first line.
    """
    if len(delimiter) != 1:  # multi-byte delimiters (MovieLens ``::``) become a byte that text lacks
        data = data.replace(delimiter, b"\x1f")
        delimiter = b"\x1f"
    # PAD zero bytes on both sides let the SWAR parsers read 8 bytes around any field.
    buf = np.frombuffer(_ZEROS + data + _ZEROS, dtype=np.uint8)
    sep, nl_flag = _separators(buf, delimiter[0])  # (S,) positions of delimiters and newlines
    if num_fields > 1 and sep.shape[0] % num_fields == 0:
        # The common case, checked cheaply: every line has num_fields fields (so none is blank).
        grid = nl_flag.reshape(-1, num_fields)
        if grid[:, -1].all() and not grid[:, :-1].any():
            ends = sep.reshape(-1, num_fields)
            line_start = np.empty(ends.shape[0], dtype=np.int64)
            line_start[:1] = PAD
            line_start[1:] = ends[:-1, -1] + 1
            line_numbers = first_line + np.arange(ends.shape[0], dtype=np.int64)
            return _fields(buf, ends, line_start, line_numbers)
    nl_pos = sep[nl_flag]  # (L,) one per line
    num_lines = nl_pos.shape[0]
    line_start = np.empty(num_lines, dtype=np.int64)
    line_start[:1] = PAD
    line_start[1:] = nl_pos[:-1] + 1
    counts = np.diff(np.flatnonzero(nl_flag), prepend=-1)  # separators per line, newline included
    line_numbers = first_line + np.arange(num_lines, dtype=np.int64)
    blank = nl_pos - line_start - (buf[np.maximum(nl_pos - 1, 0)] == CR) <= 0
    good = (counts == num_fields) & ~blank
    bad = ~good & ~blank
    if blank.any() and (not bad.any() or np.flatnonzero(blank)[0] < np.flatnonzero(bad)[0]):
        issues.report(line_numbers[blank], "empty line")
        blank = np.zeros_like(blank)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        issues.report(line_numbers[bad], f"expected {num_fields} fields", f", got {int(counts[first])}")
    issues.report(line_numbers[blank], "empty line")
    if good.all():
        ends = sep.reshape(num_lines, num_fields)
    else:
        line_of_sep = np.repeat(np.arange(num_lines), counts)
        ends = sep[good[line_of_sep]].reshape(-1, num_fields)
        line_start = line_start[good]
        line_numbers = line_numbers[good]
    return _fields(buf, ends, line_start, line_numbers)


def _fields(buf: np.ndarray, ends: np.ndarray, line_start: np.ndarray, line_numbers: np.ndarray) -> Fields:
    """Fields of well-formed lines from their separator positions (``ends``, (N, C)) and line starts."""
    starts = np.empty_like(ends)
    starts[:, 0] = line_start
    starts[:, 1:] = ends[:, :-1] + 1
    if ends.shape[0] and (buf[ends[:, -1] - 1] == CR).any():  # Windows line ends
        last = ends[:, -1].copy()
        last -= (buf[last - 1] == CR) & (last > starts[:, -1])
        ends = ends.copy()
        ends[:, -1] = last
    return Fields(buf, starts, ends, line_numbers)


def column_matrix(f: Fields, col: int, *, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Column ``col`` as a zero-padded (N, W) uint8 matrix and its lengths (N,)."""
    starts = f.starts[:, col]
    lens = f.ends[:, col] - starts
    w = int(lens.max(initial=0)) if width is None else width
    w = max(w, 1)
    pos = np.arange(w, dtype=np.int64)
    mask = pos[None, :] < lens[:, None]
    idx = np.minimum(starts[:, None] + pos[None, :], f.buf.shape[0] - 1)
    mat = np.where(mask, f.buf[idx], np.uint8(0))
    return mat, lens
