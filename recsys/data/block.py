"""Columnar blocks of samples: what every reader produces before rows become a :class:`Batch`.

A :class:`Block` holds N samples: dense features ``(N, D)`` float32, one :class:`Jagged` of int64 ids
per sparse feature, and labels ``(N,)`` float32. Blocks are cheap to slice, gather (``take``) and
concatenate, so a dataset can assemble any global batch from the blocks its reader streams, and give
each rank its slice.

A block read from files also says where each row came from (``origin``: the file's index in the reader's
file list and the row's 1-based line, packed by :func:`pack_origin`), so that a score can be traced back
to its input line however the rows were dropped, sorted or grouped on the way; generated data has none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["Jagged", "Block", "ORIGIN_LINE_BITS", "pack_origin", "unpack_origin"]

# An origin is ``file << ORIGIN_LINE_BITS | line``: lines (or rows) below 2**40, files below 2**23.
ORIGIN_LINE_BITS = 40
_LINE_MASK = (1 << ORIGIN_LINE_BITS) - 1


def pack_origin(file: int, lines: np.ndarray) -> np.ndarray:
    """(N,) int64 origins of 1-based ``lines`` (or rows) of file number ``file``."""
    return np.asarray(lines, dtype=np.int64) | np.int64(file << ORIGIN_LINE_BITS)


def unpack_origin(origin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(file numbers, lines)`` of (N,) origins, both (N,) int64."""
    return origin >> ORIGIN_LINE_BITS, origin & _LINE_MASK


@dataclass(frozen=True)
class Jagged:
    """Variable-length id lists of N samples: ``values`` (nnz,) int64, ``lengths`` (N,) int64."""

    values: np.ndarray
    lengths: np.ndarray

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """(N + 1,) start of each row in ``values`` (computed once: gathers from big blocks reuse it)."""
        out = np.zeros(self.lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    @functools.cached_property
    def is_single(self) -> bool:
        """Exactly one id per row (values are then indexed like the rows)."""
        return self.values.shape[0] == self.lengths.shape[0] and bool((self.lengths == 1).all())

    @staticmethod
    def single(ids: np.ndarray) -> Jagged:
        """One id per sample."""
        out = Jagged(np.ascontiguousarray(ids, dtype=np.int64), np.ones(ids.shape[0], dtype=np.int64))
        out.__dict__["is_single"] = True  # known: spare the check (cached_property's own slot)
        return out

    def __reduce__(self) -> tuple[object, tuple[np.ndarray, ...]]:
        """Pickles (to parser processes and back) leave out the all-ones lengths of single-id rows."""
        if self.__dict__.get("is_single"):
            return Jagged.single, (self.values,)
        return Jagged, (self.values, self.lengths)

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    def take(self, index: np.ndarray) -> Jagged:
        """The rows ``index`` (int64, any order, repeats allowed)."""
        if self.is_single:
            return Jagged(self.values[index], np.ones(index.shape[0], dtype=np.int64))
        lengths = self.lengths[index]
        starts = self.offsets[index]
        total = int(lengths.sum())
        # Position p of the output belongs to output row r: source index starts[r] + (p - out_offset[r]).
        out_offsets = np.cumsum(lengths) - lengths
        gather = np.arange(total, dtype=np.int64) + np.repeat(starts - out_offsets, lengths)
        return Jagged(self.values[gather], lengths)

    def slice(self, lo: int, hi: int) -> Jagged:
        if self.is_single:
            return Jagged(self.values[lo:hi], self.lengths[lo:hi])
        first = int(self.offsets[lo])
        lengths = self.lengths[lo:hi]
        return Jagged(self.values[first : first + int(lengths.sum())], lengths)

    @staticmethod
    def concat(parts: list[Jagged]) -> Jagged:
        return Jagged(np.concatenate([p.values for p in parts]), np.concatenate([p.lengths for p in parts]))


@dataclass(frozen=True, slots=True)
class Block:
    """N samples in columns. Shapes: dense (N, D) float32, ids[f] Jagged over N, labels (N,) float32,
    ``origin`` (N,) int64 (:func:`pack_origin`) or None (rows that were not read from files)."""

    dense: np.ndarray
    ids: tuple[Jagged, ...]
    labels: np.ndarray
    origin: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index: np.ndarray) -> Block:
        origin = None if self.origin is None else self.origin[index]
        return Block(self.dense[index], tuple(j.take(index) for j in self.ids), self.labels[index], origin)

    def slice(self, lo: int, hi: int) -> Block:
        origin = None if self.origin is None else self.origin[lo:hi]
        return Block(self.dense[lo:hi], tuple(j.slice(lo, hi) for j in self.ids), self.labels[lo:hi], origin)

    def with_file(self, file: int) -> Block:
        """This block with its origins' file number set to ``file`` (their lines kept; None stays None)."""
        if self.origin is None:
            return self
        return Block(self.dense, self.ids, self.labels, pack_origin(file, self.origin & _LINE_MASK))

    @staticmethod
    def concat(parts: list[Block]) -> Block:
        if len(parts) == 1:
            return parts[0]
        num_sparse = len(parts[0].ids)
        # Origins only when every part has them: a mix of read and generated rows has none.
        origins = [p.origin for p in parts if p.origin is not None]
        return Block(
            np.concatenate([p.dense for p in parts]),
            tuple(Jagged.concat([p.ids[f] for p in parts]) for f in range(num_sparse)),
            np.concatenate([p.labels for p in parts]),
            np.concatenate(origins) if len(origins) == len(parts) else None,
        )
