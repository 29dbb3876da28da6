"""``recsys preprocess``: Criteo TSV (or any spec) → TorchRec's npy layout, streaming, with a progress bar.

For each input file ``X`` it writes ``<out>/X_dense.npy`` (N, 13) float32 (log-transformed),
``X_sparse.npy`` (N, 26) int64 and ``X_labels.npy`` (N, 1) int32 — the layout TorchRec's Criteo tools
use, read back by ``format = "torchrec_npy"``. Rows are appended chunk by chunk to preallocated files
(``np.lib.format.open_memmap``), so memory stays at a few chunks whatever the file size; the row count
comes from a first newline-counting pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from recsys.data.block import Block
from recsys.data.criteo import NUM_DENSE, NUM_SPARSE, CriteoParser
from recsys.data.issues import OnError
from recsys.data.row_sources import TextSource
from recsys.errors import UserError

__all__ = ["criteo_tsv_to_npy", "write_npy"]


def _criteo_source(path: Path, on_error: OnError, has_label: bool) -> TextSource:
    return TextSource([path], CriteoParser(has_label), on_error=on_error)


def write_npy(
    blocks: list[Block] | object,
    prefix: Path,
    *,
    num_rows: int,
    num_dense: int,
    num_sparse: int,
    progress: tqdm | None = None,
) -> int:
    """Write a stream of single-hot blocks as ``prefix_{dense,sparse,labels}.npy``; returns rows written.

    ``num_rows`` is an upper bound (rows skipped as malformed leave the files shorter: they are
    truncated to the rows written).
    """
    tmp = {k: Path(f"{prefix}_{k}.npy.partial") for k in ("dense", "sparse", "labels")}
    dense = np.lib.format.open_memmap(tmp["dense"], mode="w+", dtype=np.float32, shape=(num_rows, num_dense))
    sparse = np.lib.format.open_memmap(tmp["sparse"], mode="w+", dtype=np.int64, shape=(num_rows, num_sparse))
    labels = np.lib.format.open_memmap(tmp["labels"], mode="w+", dtype=np.int32, shape=(num_rows, 1))
    row = 0
    for block in blocks:  # type: ignore[attr-defined]
        n = block.num_rows
        if any(not j.is_single for j in block.ids):
            raise UserError("the npy layout holds one id per sparse feature; this data is multi-hot")
        # Readers report NaN/inf and bad labels; this guards the files (labels become int32 here).
        bad = ~np.isfinite(block.dense).all(axis=1) | ((block.labels != 0) & (block.labels != 1))
        if bad.any():
            at = row + int(np.flatnonzero(bad)[0])
            raise UserError(f"{prefix}: row {at} has a dense value that is not finite or a label not 0 or 1")
        dense[row : row + n] = block.dense
        sparse[row : row + n] = np.stack([j.values for j in block.ids], axis=1) if block.ids else 0
        labels[row : row + n, 0] = block.labels
        row += n
        if progress is not None:
            progress.update(n)
    for arr in (dense, sparse, labels):
        arr.flush()
    del dense, sparse, labels
    for kind, path in tmp.items():
        final = Path(f"{prefix}_{kind}.npy")
        if row < num_rows:  # rewrite shorter (only after skipped lines)
            full = np.load(path, mmap_mode="r")
            np.save(final, np.asarray(full[:row]))
            del full
            path.unlink()
        else:
            os.replace(path, final)
    return row


def criteo_tsv_to_npy(
    inputs: list[Path],
    out_dir: Path,
    *,
    on_error: OnError = OnError.RAISE,
    has_label: bool = True,
    progress: bool = True,
) -> list[Path]:
    """Convert Criteo TSV files (plain or .gz) to TorchRec npy files in ``out_dir``; returns the prefixes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prefixes = []
    for path in inputs:
        if not path.is_file():
            raise UserError(f"input file not found: {path}")
        source = _criteo_source(path, on_error, has_label)
        lines = source.total_lines()
        name = path.name.removesuffix(".gz").removesuffix(".tsv").removesuffix(".txt")
        prefix = out_dir / name
        # disable=None: the bar shows on terminals only, so logs and error output stay clean.
        with tqdm(
            total=lines, desc=path.name, unit="row", unit_scale=True, mininterval=0.5, disable=None
        ) as bar:
            rows = write_npy(
                source.blocks(),
                prefix,
                num_rows=lines,
                num_dense=NUM_DENSE,
                num_sparse=NUM_SPARSE,
                progress=bar,
            )
        if source.skipped:
            bar.write(f"{path}: {rows} rows written, {source.skipped} malformed lines skipped")
        prefixes.append(prefix)
    return prefixes
