"""Criteo click logs in their TSV layout (Kaggle display-advertising challenge and the 1TB logs).

One line per impression: ``label \\t I1 … I13 \\t C1 … C26``; integer counts (possibly negative, possibly
empty), categoricals as 8 hexadecimal digits (possibly empty). Kaggle's ``test.txt`` has no label column.
The 1TB logs are ``day_0`` … ``day_23`` (gzip or plain) in the same layout.

Conventions (shared with TorchRec's preprocessing): an empty count is 0, an empty categorical is id 0.
Counts are log-transformed as DLRM does, ``log(1 + max(x, 0))``; categoricals are parsed into int64 (a
value ≥ 2**31 would overflow int32), so the id space of each is 2**32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recsys.data import portable_math
from recsys.data.block import Block, Jagged
from recsys.data.fields import Fields, split_fields
from recsys.data.issues import Issues, Problems
from recsys.data.numbers import parse_hex, parse_int

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "DENSE_NAMES",
    "SPARSE_NAMES",
    "CriteoParser",
    "parse_criteo",
    "log_counts",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]


def log_counts(counts: np.ndarray) -> np.ndarray:
    """The dense transform: ``log(1 + max(x, 0))``, computed in float64 (the same bits on every CPU:
    :mod:`recsys.data.portable_math`) and rounded to float32."""
    return portable_math.log1p(np.maximum(counts, 0).astype(np.float64)).astype(np.float32)


def _parse_columns(f: Fields, first: int, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """Counts (N, 13) int64 and ids (N, 26) int64 from the columns starting at ``first``.

    All 13 count columns are converted in one pass (the fields flattened row by row), as are the 26 ids.
    """
    n = f.num_rows

    def flat(lo: int, hi: int) -> Fields:
        starts = f.starts[:, lo:hi].reshape(-1, 1)
        ends = f.ends[:, lo:hi].reshape(-1, 1)
        # Messages name rows of ``f`` (see _Flat): the flattened fields need no line numbers of their own.
        return f.columns(starts, ends, np.broadcast_to(np.int64(0), (starts.shape[0],)))

    dense, sparse = (first, first + NUM_DENSE), (first + NUM_DENSE, first + NUM_DENSE + NUM_SPARSE)
    counts, _ = parse_int(flat(*dense), 0, name="I", problems=_Flat(problems, f, dense, DENSE_NAMES))
    ids, _ = parse_hex(flat(*sparse), 0, name="C", problems=_Flat(problems, f, sparse, SPARSE_NAMES))
    return counts.reshape(n, NUM_DENSE), ids.reshape(n, NUM_SPARSE)


class _Flat:
    """Maps problems found in flattened columns ``[lo, hi)`` back to (row, named column) for the message."""

    def __init__(self, problems: Problems, f: Fields, cols: tuple[int, int], names: list[str]) -> None:
        self.problems, self.f, self.cols, self.names = problems, f, cols, names

    def add(self, _flat: Fields, _col: int, bad: np.ndarray, reason: str) -> None:
        lo, hi = self.cols
        per_col = bad.reshape(self.f.num_rows, hi - lo)
        what = reason.split(": ", 1)[1]
        for k in np.flatnonzero(per_col.any(axis=0)):
            col = lo + int(k)
            self.problems.add(
                self.f, col, per_col[:, k], f"field {self.names[k]!r} (column {col + 1}): {what}"
            )


def parse_criteo(
    data: bytes, *, first_line: int, has_label: bool, issues: Issues, id_spaces: tuple[int, ...] = ()
) -> Block:
    """One chunk of whole Criteo TSV lines → a Block (dense log-transformed, one id per categorical).

    ``id_spaces`` (one per categorical, or empty): the hexadecimal ids, hashes already, are folded
    into a declared id space (modulo), as hashed tokens are.
    """
    num_fields = NUM_DENSE + NUM_SPARSE + (1 if has_label else 0)
    f = split_fields(data, delimiter=b"\t", num_fields=num_fields, first_line=first_line, issues=issues)
    problems = Problems(f.num_rows)
    if has_label:
        label, _ = parse_int(f, 0, name="label", problems=problems)
        problems.add(f, 0, (label != 0) & (label != 1), "field 'label' (column 1): not 0 or 1")
    else:
        label = np.zeros(f.num_rows, dtype=np.int64)
    counts, ids = _parse_columns(f, 1 if has_label else 0, problems)
    by_feature = np.ascontiguousarray(ids.T)  # one transposing copy; each feature's ids are then a row
    for j, space in enumerate(id_spaces):
        if space < 1 << 32:
            by_feature[j] %= space
    block = Block(
        log_counts(counts),
        tuple(Jagged.single(by_feature[j]) for j in range(NUM_SPARSE)),
        label.astype(np.float32),
        f.lines,  # the origin: lines of file 0 (the text source sets the file)
    )
    keep = problems.resolve(f.lines, issues)
    return block if keep is None else block.take(np.flatnonzero(keep))


@dataclass(frozen=True)
class CriteoParser:
    """:func:`parse_criteo` as a text source's chunk parser (picklable, so it can parse in processes)."""

    has_label: bool = True
    id_spaces: tuple[int, ...] = ()

    def __call__(self, data: bytes, first: int, issues: Issues) -> tuple[Block, None]:
        block = parse_criteo(
            data, first_line=first, has_label=self.has_label, issues=issues, id_spaces=self.id_spaces
        )
        return block, None
