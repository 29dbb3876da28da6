"""Columns of split fields converted to numbers, all rows at once; bad fields go to ``Problems``.

Decimal integers of up to 8 digits and Criteo's 8-digit hexadecimal ids are read by SWAR digit
arithmetic (8 digits per 64-bit word operation on the chunk's nibble buffer), longer ones one byte
column at a time; floats by numpy's C parser, with NaN and ±inf reported as bad values.
"""

from __future__ import annotations

import numpy as np

from recsys.data.fields import NIBBLE_TABLE, Fields, column_matrix
from recsys.data.issues import NOT_FINITE, Problems

__all__ = ["parse_float", "parse_hex", "parse_int"]

_HEX = np.frombuffer(NIBBLE_TABLE, dtype=np.uint8)  # byte -> hexadecimal digit value, 0xFF otherwise


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
    mat, lens = column_matrix(f, col)
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
    mat, lens = column_matrix(f, col)
    nib = _HEX[mat]
    in_field = np.arange(mat.shape[1])[None, :] < lens[:, None]
    bad = ((nib == 255) & in_field).any(axis=1) | (lens > 15)
    problems.add(f, col, bad, f"field {name!r} (column {col + 1}): not a hexadecimal id")
    value = np.zeros(mat.shape[0], dtype=np.int64)
    for k in range(min(mat.shape[1], 15)):
        value = np.where(in_field[:, k], (value << 4) | (nib[:, k] & 15).astype(np.int64), value)
    return value, lens == 0


def parse_float(f: Fields, col: int, *, name: str, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """Decimal numbers → (values (N,) float64, missing (N,) bool); empty fields are missing.

    NaN and ±inf in any spelling the C parser accepts (``nan``, ``-Infinity``, ``1e999``) are bad values
    like ``abc``, reported to ``problems`` (a caller with ``invalid = "missing"`` turns them into missing):
    a NaN that reached training would make every later loss NaN. Bad values are 0 in ``values``.
    """
    mat, lens = column_matrix(f, col)
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
