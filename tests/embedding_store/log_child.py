"""Child process of the log-layout kill tests: ``python log_child.py STORE_DIR SEED FIRST_BATCH BATCHES``.

Writes ``BATCHES`` batches (numbered from ``FIRST_BATCH``) of random ids into a log-layout backend whose
segments are small, so compaction runs every few batches. Each batch is one ``put_rows`` (one
transaction, then any compactions); a row is ``[id, batch, ...]``. ``expected(seed, upto)`` is the
oracle: the newest row of every id after batches ``0..upto``. Prints ``DONE`` when it ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends import RowBackend
from embedding_store.backends import open_backend as _open_backend

SPEC = TableSpec(name="t", dim=3, optimizer=OptimizerKind.EXACT_SGD)
OPTIONS = LmdbOptions(initial_map_size_bytes=1 << 20, log_segment_rows=64, log_compact_at=0.5)
IDS = 400  # id space of the batches
BATCH = 40


def batch(seed: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``b``: sorted unique ids and their rows ``[id, b, b * id]``."""
    rng = np.random.default_rng([seed, b])
    ids = np.unique(rng.integers(0, IDS, size=BATCH) * 7919 % (1 << 40))
    rows = np.stack([ids, np.full(ids.shape, b), b * ids], axis=1).astype(np.float32)
    return ids.astype(np.int64), rows


def expected(seed: int, upto: int) -> dict[int, tuple[float, ...]]:
    """The newest row of each id after batches 0..upto."""
    out: dict[int, tuple[float, ...]] = {}
    for b in range(upto + 1):
        ids, rows = batch(seed, b)
        out.update(zip(ids.tolist(), map(tuple, rows.tolist()), strict=True))
    return out


def open_backend(path: str | Path) -> RowBackend:
    return _open_backend(Path(path), options=OPTIONS, seed=0, tables=[SPEC])


def main() -> None:
    path, seed, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    backend = open_backend(path)
    for b in range(first, first + count):
        ids, rows = batch(seed, b)
        backend.put_rows([("t", ids, rows)])
    backend.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
