"""TorchRec's npy layout (``<prefix>_{dense,sparse,labels}.npy``) as a row source: the arrays are
memory-mapped and checked (dtypes, shapes, non-finite values) as their rows are read."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from recsys.data.block import Block, Jagged, pack_origin
from recsys.data.issues import NOT_FINITE, Issues, MalformedInputError, OnError, log_issues
from recsys.data.row_sources import WHOLE, Span
from recsys.data.spec import DenseSpec, Transform
from recsys.errors import UserError

__all__ = ["NpySource"]


_NPY_KINDS = {"dense": "fiub", "sparse": "iub", "labels": "fiub"}  # numpy dtype kinds each array may have


def _load_npy_part(prefix: Path) -> list[np.ndarray]:
    """``<prefix>_{dense,sparse,labels}.npy`` memory-mapped, checked: (N, D) numbers, (N, F) integer ids,
    (N,) or (N, 1) labels. Anything else is a UserError naming the file (no pickled data is ever loaded)."""
    arrays = []
    for kind, kinds in _NPY_KINDS.items():
        path = Path(f"{prefix}_{kind}.npy")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise UserError(f"npy file not found: {path}") from None
        except (OSError, ValueError, EOFError) as err:
            raise UserError(f"{path}: not a readable .npy array ({' '.join(str(err).split())})") from None
        if not isinstance(array, np.ndarray) or array.dtype.kind not in kinds:
            raise UserError(
                f"{path}: {kind} must be {'integer ids' if kind == 'sparse' else 'numbers'}, got dtype {getattr(array, 'dtype', type(array).__name__)}"
            )
        want_2d = kind != "labels" or (array.ndim == 2 and array.shape[1] == 1)
        if (array.ndim != 2) if want_2d else (array.ndim != 1):
            shape = "(N,) or (N, 1)" if kind == "labels" else "(N, columns)"
            raise UserError(f"{path}: {kind} must have shape {shape}, got {array.shape}")
        arrays.append(array)
    rows = {a.shape[0] for a in arrays}
    if len(rows) != 1:
        raise UserError(
            f"{prefix}_{{dense,sparse,labels}}.npy have different row counts {[a.shape[0] for a in arrays]}"
        )
    return arrays


class NpySource:
    """TorchRec's npy layout: ``<prefix>_dense.npy`` (N, D) float32 (already transformed),
    ``<prefix>_sparse.npy`` (N, F) int ids, ``<prefix>_labels.npy`` (N,) or (N, 1); memory-mapped.

    NaN and ±inf in the dense array follow the same rule as in text: with ``dense`` (the spec's
    ``[[dense]]`` entries, one per column; only ``fill`` and ``invalid`` apply, the values are already
    transformed) a column with ``invalid = "missing"`` reads them as ``fill``; anything else is a bad
    value, as is a label other than 0 or 1. ``raise`` names the array and ``[row, column]`` of the first;
    ``skip`` drops those rows and counts them (row counts and resume positions then count kept rows).
    """

    def __init__(
        self,
        prefixes: list[Path],
        *,
        span: Span = WHOLE,
        chunk_rows: int = 65536,
        on_error: OnError = OnError.RAISE,
        dense: Sequence[DenseSpec] = (),
    ):
        self.prefixes = list(prefixes)
        self.first_file = span.first_file  # the file number of prefixes[0] in the blocks' origins
        self.parts = [tuple(_load_npy_part(p)) for p in prefixes]
        widths = {(a[0].shape[1], a[1].shape[1]) for a in self.parts}
        if len(widths) > 1:
            raise UserError(
                f"npy files {', '.join(map(str, prefixes))} differ in their dense/sparse widths {sorted(widths)}"
            )
        self.counts = [int(a[2].shape[0]) for a in self.parts]
        self.lo, self.hi = span.lo, (sum(self.counts) if span.hi is None else span.hi)
        self.chunk_rows = chunk_rows
        self.on_error = on_error
        self.issues = {str(p): Issues(str(p), on_error) for p in self.prefixes}
        self._lenient, self._fill = _npy_dense_rules(dense, self.num_dense, self.prefixes)
        self._rows: int | None = None

    @property
    def num_dense(self) -> int:
        return int(self.parts[0][0].shape[1])

    @property
    def num_sparse(self) -> int:
        return int(self.parts[0][1].shape[1])

    def num_rows(self) -> int:
        if self.on_error is OnError.RAISE:
            return self.hi - self.lo
        if self._rows is None:  # skipped rows are not rows: count by reading (as text does)
            self._rows = sum(b.num_rows for b in self.blocks())
        return self._rows

    def blocks(self, *, skip_rows: int = 0) -> Iterator[Block]:
        if self.on_error is OnError.RAISE:  # every row is a row: seek
            yield from self._blocks(self.lo + skip_rows)
            return
        for block in self._blocks(self.lo):
            if skip_rows >= block.num_rows:
                skip_rows -= block.num_rows
                continue
            yield block.slice(skip_rows, block.num_rows) if skip_rows else block
            skip_rows = 0

    def pairs(self, *, skip_rows: int = 0) -> Iterator[tuple[Block, None]]:
        """Blocks with no split keys (npy files have no named columns to sort or group by)."""
        for block in self.blocks(skip_rows=skip_rows):
            yield block, None

    def _blocks(self, lo: int) -> Iterator[Block]:
        base = 0
        for k, (prefix, (dense, sparse, labels), count) in enumerate(
            zip(self.prefixes, self.parts, self.counts, strict=True)
        ):
            issues = self.issues[str(prefix)]
            issues.counts.clear()  # counts describe the latest pass
            a, b = max(lo, base) - base, min(self.hi, base + count) - base
            for start in range(a, b, self.chunk_rows):
                stop = min(b, start + self.chunk_rows)
                ids = np.asarray(sparse[start:stop])
                if ids.dtype == np.int32:  # TorchRec's shuffled files: 32-bit hex ids ≥ 2**31 wrapped
                    ids = ids.view(np.uint32)
                ids = ids.astype(np.int64)
                with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, reported below
                    values = np.asarray(dense[start:stop], dtype=np.float32)
                block = Block(
                    values,
                    tuple(Jagged.single(ids[:, j]) for j in range(ids.shape[1])),
                    np.asarray(labels[start:stop], dtype=np.float32).reshape(-1),
                    pack_origin(self.first_file + k, np.arange(start + 1, stop + 1, dtype=np.int64)),
                )
                yield self._checked(block, prefix, start, issues)
            log_issues(issues)
            base += count

    def _checked(self, block: Block, prefix: Path, first: int, issues: Issues) -> Block:
        """``block`` (rows from ``first`` of ``prefix``) with NaN/inf filled or reported, labels checked."""
        dense = block.dense
        nonfinite = ~np.isfinite(dense)  # one vectorised pass: the common case ends here
        bad_label = (block.labels != 0) & (block.labels != 1)
        if not nonfinite.any() and not bad_label.any():
            return block
        if self._lenient.any() and nonfinite.any():
            fill = nonfinite & self._lenient
            dense = np.where(fill, self._fill, dense)
            nonfinite &= ~fill
        bad_dense = nonfinite.any(axis=1)
        bad = bad_dense | bad_label
        if not bad.any():
            return Block(dense, block.ids, block.labels, block.origin)
        if self.on_error is OnError.RAISE:
            row = int(np.flatnonzero(bad)[0])
            if bad_dense[row]:
                col = int(np.flatnonzero(nonfinite[row])[0])
                where = f"{prefix}_dense.npy[{first + row}, {col}]: {NOT_FINITE}"
                raise MalformedInputError(f"{where}: {dense[row, col].item()!r}")
            where = f"{prefix}_labels.npy[{first + row}]: label not 0 or 1"
            raise MalformedInputError(f"{where}: {block.labels[row].item()!r}")
        issues.report(np.flatnonzero(bad_dense), f"dense value {NOT_FINITE}")
        issues.report(np.flatnonzero(bad_label & ~bad_dense), "label not 0 or 1")
        return Block(dense, block.ids, block.labels, block.origin).take(np.flatnonzero(~bad))


def _npy_dense_rules(
    dense: Sequence[DenseSpec], width: int, prefixes: list[Path]
) -> tuple[np.ndarray, np.ndarray]:
    """(lenient (D,) bool, fill (D,) float32) of each dense column of npy files from the spec's entries."""
    if not dense:
        return np.zeros(width, dtype=bool), np.zeros(width, dtype=np.float32)
    if len(dense) != width:
        raise UserError(
            f"npy files {', '.join(map(str, prefixes))} have {width} dense columns, the spec names {len(dense)}"
        )
    for d in dense:
        if d.transform is not Transform.NONE or d.shift != 0.0 or d.scale != 1.0:
            raise UserError(
                f"dense feature {d.name!r}: npy dense values are already transformed; "
                "only fill and invalid apply (remove transform, shift and scale)"
            )
    lenient = np.array([d.invalid == "missing" for d in dense], dtype=bool)
    return lenient, np.array([d.fill for d in dense], dtype=np.float32)
