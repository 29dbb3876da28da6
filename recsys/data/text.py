"""Vectorised parsing of delimited text (Criteo TSV, CSV/TSV, RecBole atomic files).

No per-row Python on the hot path: a chunk of whole lines is split into fields with a handful of numpy
passes over its bytes (separator positions → an (N, C) matrix of field starts and ends), and each column
is converted at once (decimal and hexadecimal integers by digit arithmetic, floats by numpy's C parser,
string tokens by a 64-bit hash of their bytes).

Malformed lines are reported by :class:`Issues` with file, line and field; the caller either raises the
first one or drops those lines and counts them (``on_error = "skip"``).
"""

from __future__ import annotations

import collections
import enum
import gzip
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedding_store.hashing import mix64 as _mix
from recsys.errors import UserError

__all__ = [
    "OnError",
    "MalformedInputError",
    "Issues",
    "Fields",
    "split_fields",
    "iter_chunks",
    "count_lines",
    "count_newlines",
    "after_lines",
    "Problems",
    "parse_int",
    "parse_hex",
    "parse_float",
    "NOT_FINITE",
    "hash_tokens",
    "hash_strings",
]

log = logging.getLogger("recsys")

NEWLINE = 10
CR = 13
PAD = 8
_ZEROS = bytes(PAD)


class OnError(enum.Enum):
    """What a reader does with a malformed line."""

    RAISE = "raise"  # stop with one line naming file, line and field
    SKIP = "skip"  # drop the line, count it by reason, and log the counts


class MalformedInputError(UserError):
    """A malformed line in an input file (the message names file, line and field)."""


@dataclass
class Issues:
    """Malformed lines found in one file: raise on the first, or count them by reason."""

    path: str
    on_error: OnError
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # parser threads share it

    def report(self, lines: np.ndarray, reason: str, detail: str = "") -> None:
        """``lines`` (file line numbers, 1-based) are malformed because of ``reason``."""
        if lines.size == 0:
            return
        if self.on_error is OnError.RAISE:
            raise MalformedInputError(f"{self.path}:{int(lines.min())}: {reason}{detail}")
        with self._lock:
            self.counts[reason] += int(lines.size)

    def merge(self, counts: dict[str, int]) -> None:
        """Add counts found elsewhere (by a parser process) for this file."""
        if counts:
            with self._lock:
                self.counts.update(counts)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        reasons = "; ".join(f"{n} × {why}" for why, n in self.counts.most_common())
        return f"skipped {self.skipped} malformed line(s) of {self.path}: {reasons}"


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
            nib = np.frombuffer(raw.translate(_NIBBLE_TABLE), dtype=np.uint8)
            self.shared["nibbles"] = nib
        return nib


# Byte -> hexadecimal digit value (0..15), 0xFF for any other byte: as bytes.translate's table, and as
# a numpy lookup table for the per-byte slow paths.
_NIBBLE_TABLE = bytes(
    c - 48 if 48 <= c <= 57 else c - 87 if 97 <= c <= 102 else c - 55 if 65 <= c <= 70 else 0xFF
    for c in range(256)
)
_HEX = np.frombuffer(_NIBBLE_TABLE, dtype=np.uint8)


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


def _matrix(f: Fields, col: int, *, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
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


class Problems:
    """Bad fields found while converting the rows of one chunk; :meth:`resolve` raises or drops them."""

    def __init__(self, num_rows: int) -> None:
        self.bad = np.zeros(num_rows, dtype=bool)
        self._found: list[tuple[np.ndarray, str, int, str]] = []  # (mask, reason, first line, detail)

    def add(self, f: Fields, col: int, bad: np.ndarray, reason: str) -> None:
        if not bad.any():
            return
        row = int(np.flatnonzero(bad)[0])
        self._found.append((bad, reason, int(f.lines[row]), f": {f.text(row, col)!r}"))
        self.bad |= bad

    def add_rows(
        self, lines: np.ndarray, bad: np.ndarray, reason: str, values: np.ndarray | None = None
    ) -> None:
        """Bad rows that have no text field (Parquet, npy); ``values`` (N,) names the first one's value."""
        if not bad.any():
            return
        row = int(np.flatnonzero(bad)[0])
        detail = "" if values is None else f": {values[row].item()!r}"
        self._found.append((bad, reason, int(lines[row]), detail))
        self.bad |= bad

    def resolve(self, lines: np.ndarray, issues: Issues) -> np.ndarray | None:
        """Raise for the earliest bad line (``raise``), or count bad rows once each; the rows to keep."""
        if not self._found:
            return None
        if issues.on_error is OnError.RAISE:
            _, reason, line, detail = min(self._found, key=lambda item: item[2])
            raise MalformedInputError(f"{issues.path}:{line}: {reason}{detail}")
        seen = np.zeros_like(self.bad)
        for mask, reason, _, _ in self._found:
            new = mask & ~seen
            issues.report(lines[new], reason)
            seen |= mask
        return ~self.bad


def parse_int(f: Fields, col: int, *, name: str, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers (optional sign) → (values (N,) int64, missing (N,) bool); bad rows → ``problems``."""
    starts = f.starts[:, col]
    lens = f.ends[:, col] - starts
    first = f.buf[starts]
    neg = (first == 45) & (lens > 0)
    sign = neg | ((first == 43) & (lens > 0))
    digits = lens - sign
    short = digits <= 8
    if short.all():
        value, bad = _swar_decimal(f.nibbles(), f.ends[:, col], digits)
        bad |= sign & (digits == 0)
        problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not an integer")
        return np.where(neg, -value, value), lens == 0
    value = np.zeros(lens.shape[0], dtype=np.int64)
    missing = lens == 0
    rows = np.flatnonzero(short)
    sub = f.keep(rows)
    value[rows] = parse_int(sub, col, name=name, problems=_Rows(problems, f, rows))[0]
    rows = np.flatnonzero(~short)
    value[rows] = _parse_int_slow(f.keep(rows), col, name=name, problems=_Rows(problems, f, rows))
    return value, missing


class _Rows:
    """Problems of a subset of rows, mapped back to the whole chunk."""

    def __init__(self, problems: Problems, f: Fields, rows: np.ndarray) -> None:
        self.problems, self.f, self.rows = problems, f, rows

    def add(self, _sub: Fields, col: int, bad: np.ndarray, reason: str) -> None:
        full = np.zeros(self.f.num_rows, dtype=bool)
        full[self.rows[bad]] = True
        self.problems.add(self.f, col, full, reason)


_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_SIXES = np.uint64(0x0606060606060606)


def _words_ending_at(buf: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The 8 bytes before each position in ``ends``, as little-endian uint64 (byte 7 = last byte)."""
    # Gathered as 8-byte opaque items (copied without the unaligned-integer path), then read as integers.
    view = np.ndarray(shape=(buf.shape[0] - 7,), dtype="V8", buffer=buf, strides=(1,))
    return view[ends - 8].view("<u8")


# Masks keeping the top n (0..8) bytes of a uint64, by n.
_KEEP_HIGH = np.array([((1 << 64) - 1) ^ ((1 << (64 - 8 * n)) - 1) for n in range(9)], dtype=np.uint64)


def _swar_decimal(nib: np.ndarray, ends: np.ndarray, digits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Up to 8 decimal digits ending at each of ``ends`` → (values int64, bad bool), 8 digits per word op.

    ``nib`` is the chunk's nibble buffer (:meth:`Fields.nibbles`): the field's digit values are
    right-aligned in a word and padded on the left with zeros; the classic multiply-and-shift reduction
    then folds 8 digits into a number in 3 steps. A byte is a decimal digit iff its nibble is < 10.
    """
    w = _words_ending_at(nib, ends) & _KEEP_HIGH[digits]
    # Bytes are 0..15 or 0xFF: a high nibble in w (0xFF) or in w + 6 (10..15) marks a non-digit.
    bad = ((w | (w + _SIXES)) & _HIGH_NIBBLES) != 0
    with np.errstate(over="ignore"):
        w = (w * np.uint64(10)) + (w >> np.uint64(8))
        w = (
            ((w & np.uint64(0x000000FF000000FF)) * np.uint64(100 + (1000000 << 32)))
            + (((w >> np.uint64(16)) & np.uint64(0x000000FF000000FF)) * np.uint64(1 + (10000 << 32)))
        ) >> np.uint64(32)
    return w.astype(np.int64), bad


def _swar_hex8(nib: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exactly 8 hexadecimal digits at each of ``starts`` → (values int64 in [0, 2**32), bad bool).

    ``nib`` is the chunk's nibble buffer: byte k of the word is digit k's value, or 0xFF for a non-digit.
    """
    w = _words_ending_at(nib, starts + 8)
    bad = (w & _HIGH_NIBBLES) != 0
    # Fold nibble bytes into the number; digit 0 (lowest byte) is the most significant.
    t = ((w & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(4)) | (
        (w >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)
    )
    u = ((t & np.uint64(0x000000FF000000FF)) << np.uint64(8)) | (
        (t >> np.uint64(16)) & np.uint64(0x000000FF000000FF)
    )
    v = ((u & np.uint64(0xFFFF)) << np.uint64(16)) | ((u >> np.uint64(32)) & np.uint64(0xFFFF))
    return v.astype(np.int64), bad


def _parse_int_slow(f: Fields, col: int, *, name: str, problems: Problems | _Rows) -> np.ndarray:
    """Integers of any length up to 18 digits, one byte column at a time."""
    mat, lens = _matrix(f, col)
    too_long = lens > 18
    if too_long.any():
        problems.add(f, col, too_long, f"field {name!r} (column {col + 1}): integer too long")
        mat = mat[:, :18]
    digits = mat - np.uint8(48)
    is_digit = digits <= 9
    in_field = np.arange(mat.shape[1])[None, :] < lens[:, None]
    signed = (mat[:, 0] == 45) | (mat[:, 0] == 43)  # '-' or '+'
    ok_char = is_digit | ~in_field
    ok_char[:, 0] |= signed
    bad = ~ok_char.all(axis=1) | (signed & (lens == 1))
    problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not an integer")
    value = np.zeros(mat.shape[0], dtype=np.int64)
    for k in range(mat.shape[1]):
        take = in_field[:, k] & is_digit[:, k]
        value = np.where(take, value * 10 + digits[:, k], value)
    return np.where(mat[:, 0] == 45, -value, value)


def parse_hex(f: Fields, col: int, *, name: str, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal ids of up to 15 digits (Criteo: 8) → (values (N,) int64 ≥ 0, missing (N,) bool)."""
    starts = f.starts[:, col]
    lens = f.ends[:, col] - starts
    if ((lens == 8) | (lens == 0)).all():  # Criteo: 8 digits or empty
        value, bad = _swar_hex8(f.nibbles(), starts)
        bad &= lens == 8
        problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not a hexadecimal id")
        return np.where(lens == 0, 0, value), lens == 0
    mat, lens = _matrix(f, col)
    nib = _HEX[mat]
    in_field = np.arange(mat.shape[1])[None, :] < lens[:, None]
    bad = ((nib == 255) & in_field).any(axis=1) | (lens > 15)
    problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not a hexadecimal id")
    value = np.zeros(mat.shape[0], dtype=np.int64)
    for k in range(min(mat.shape[1], 15)):
        value = np.where(in_field[:, k], (value << 4) | (nib[:, k] & 15).astype(np.int64), value)
    return value, lens == 0


NOT_FINITE = "not a finite number"  # the reason every reader gives for NaN and ±inf


def parse_float(f: Fields, col: int, *, name: str, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """Decimal numbers → (values (N,) float64, missing (N,) bool); empty fields are missing.

    NaN and ±inf in any spelling the C parser accepts (``nan``, ``-Infinity``, ``1e999``) are bad values
    like ``abc``, reported to ``problems`` (a caller with ``invalid = "missing"`` turns them into missing):
    a NaN that reached training would make every later loss NaN. Bad values are 0 in ``values``.
    """
    mat, lens = _matrix(f, col)
    missing = lens == 0
    strings = mat.view(f"S{mat.shape[1]}").ravel()
    strings = np.where(missing, b"0", strings)
    try:
        value = strings.astype(np.float64)
    except ValueError:
        # Slow path, only for chunks that hold a malformed number: find which ones.
        value = np.zeros(strings.shape[0], dtype=np.float64)
        bad = np.zeros(strings.shape[0], dtype=bool)
        for i, s in enumerate(strings):
            try:
                value[i] = float(s)
            except ValueError:
                bad[i] = True
        problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not a number")
    # One vectorised pass: the fast path stays a C parse plus this check.
    nonfinite = ~np.isfinite(value)
    if nonfinite.any():
        problems.add(f, col, nonfinite, f"field {name!r} (column {col + 1}): {NOT_FINITE}")
        value[nonfinite] = 0.0
    return value, missing


_SALT = np.uint64(0x7F4A7C159E3779B9)


def _hash_matrix(mat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """64-bit hash of each row's first ``lens`` bytes → int64 ids in [0, 2**63).

    Depends only on the bytes and the length, never on the matrix width: words past a row's end are not
    mixed in.
    """
    n, w = mat.shape
    words = -(-w // 8)
    padded = np.zeros((n, words * 8), dtype=np.uint8)
    padded[:, :w] = mat
    as_words = padded.view("<u8")  # (N, words)
    with np.errstate(over="ignore"):
        h = _mix(lens.astype(np.uint64) ^ _SALT)
        for k in range(words):
            h = np.where(lens > 8 * k, _mix(h ^ as_words[:, k]), h)
    return (h >> np.uint64(1)).astype(np.int64)


def hash_strings(tokens: list[str] | list[bytes]) -> np.ndarray:
    """The ids :func:`hash_tokens` gives these tokens (for tests and lookups)."""
    raw = [t.encode() if isinstance(t, str) else t for t in tokens]
    width = max((len(t) for t in raw), default=1) or 1
    mat = np.zeros((len(raw), width), dtype=np.uint8)
    for i, t in enumerate(raw):
        mat[i, : len(t)] = np.frombuffer(t, dtype=np.uint8)
    return _hash_matrix(mat, np.array([len(t) for t in raw], dtype=np.int64))


def hash_tokens(
    f: Fields, col: int, *, separator: bytes = b"", prefix: int = 0, max_length: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """String tokens → hashed ids as (values (nnz,) int64, lengths (N,) int64).

    Without ``separator`` every non-empty field is one token (an empty field has no id). With it, a field
    is a list of tokens (multi-hot), at most ``max_length`` kept (0: all). ``prefix`` keeps only the first
    ``prefix`` bytes of each token (e.g. a zip code's region).
    """
    starts = f.starts[:, col]
    ends = f.ends[:, col]
    if separator:
        # Every byte position of the column's fields, flattened; split at separator bytes.
        lens = ends - starts
        total = int(lens.sum())
        row_of = np.repeat(np.arange(starts.shape[0]), lens)
        pos = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        is_sep = f.buf[pos] == separator[0]
        # A token starts at a field start or after a separator, and ends before a separator or field end.
        begin = np.ones(total, dtype=bool)
        begin[1:] = (row_of[1:] != row_of[:-1]) | is_sep[:-1]
        begin &= ~is_sep
        end = np.ones(total, dtype=bool)
        end[:-1] = (row_of[1:] != row_of[:-1]) | is_sep[1:]
        end &= ~is_sep
        tok_start = pos[begin]
        tok_end = pos[end] + 1
        tok_row = row_of[begin]
        lengths = np.bincount(tok_row, minlength=starts.shape[0]).astype(np.int64)
        if max_length:
            rank = np.arange(tok_row.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            keep = rank < max_length
            tok_start, tok_end = tok_start[keep], tok_end[keep]
            lengths = np.minimum(lengths, max_length)
    else:
        tok_start, tok_end = starts, ends
        lengths = (ends > starts).astype(np.int64)
        keep = lengths.astype(bool)
        tok_start, tok_end = tok_start[keep], tok_end[keep]
    if prefix:
        tok_end = np.minimum(tok_end, tok_start + prefix)
    token_fields = f.columns(tok_start[:, None], tok_end[:, None], np.zeros(tok_start.shape[0], np.int64))
    mat, tlens = _matrix(token_fields, 0)
    return _hash_matrix(mat, tlens), lengths


# -- reading files in chunks of whole lines ---------------------------------------------------------


def _open(path: Path):  # noqa: ANN202 - a binary file object
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
    with _open(path) as fh:
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
    with _open(path) as fh:
        while block := fh.read(16 << 20):
            n += count_newlines(block)
            last = block[-1:]
    return n + (last != b"\n")


def log_issues(issues: Issues) -> None:
    if issues.skipped:
        log.warning("%s", issues.summary())
