"""A log-layout table with a row cap (``TableSpec.expected_max_rows``): under the churn of a capped
table (new ids put, the oldest deleted to stay at the cap, live rows rewritten), the LMDB file stays
within 1.5x the cap's row bytes, where the layout for unbounded tables needs more than that; and what
it holds is exactly what a dict holds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from embedding_store import LmdbOptions, OptimizerKind, TableSpec
from embedding_store.backends import open_backend
from embedding_store.backends.log_format import Geometry

CAP = 1 << 16
ROUND = 2048  # rows written per commit, half of them rewrites of live rows


def _churn(path: Path, spec: TableSpec, rounds: int) -> tuple[float, dict[int, np.ndarray]]:
    """Run the churn; returns the file's largest size over the cap's row bytes, and the oracle."""
    backend = open_backend(path, options=LmdbOptions(), seed=0, tables=[spec])
    rng = np.random.default_rng(0)
    oracle: dict[int, np.ndarray] = {}
    order: list[int] = []  # ids by first put: the oldest is deleted first
    first, largest = 0, 0
    for _ in range(rounds):
        live = np.array(order, dtype=np.int64)
        old = rng.choice(live, size=min(ROUND // 2, live.shape[0]), replace=False) if order else live
        new = np.arange(first, first + ROUND - old.shape[0], dtype=np.int64)
        first += new.shape[0]
        over = len(order) + new.shape[0] - CAP
        if over > 0:
            keep = set(old.tolist())
            gone = [i for i in order if i not in keep][:over]
            backend.delete_rows(spec.name, np.array(sorted(gone), dtype=np.int64))
            dropped = set(gone)
            order = [i for i in order if i not in dropped]
            for i in gone:
                del oracle[i]
        ids = np.unique(np.concatenate([old, new]))
        rows = rng.standard_normal((ids.shape[0], spec.row_floats)).astype(np.float32)
        backend.put_rows([(spec.name, ids, rows)])
        order += new.tolist()
        oracle.update(zip(ids.tolist(), rows, strict=True))
        assert backend.num_rows(spec.name) == len(oracle) <= CAP
        largest = max(largest, os.path.getsize(path / "data.mdb"))
    backend.close()
    return largest / (CAP * spec.row_bytes), oracle


@pytest.mark.slow
def test_a_capped_log_stays_within_one_and_a_half_times_its_rows(tmp_path: Path) -> None:
    spec = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
    capped = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, expected_max_rows=CAP)
    plain, _ = _churn(tmp_path / "plain", spec, 200)
    ratio, oracle = _churn(tmp_path / "capped", capped, 200)
    assert ratio <= 1.5 < plain, (ratio, plain)
    backend = open_backend(tmp_path / "capped", options=LmdbOptions(), seed=0, tables=[capped])
    ids = np.array(sorted(oracle), dtype=np.int64)
    found, rows = backend.get_rows("t", ids)
    assert found.all() and np.array_equal(rows, np.stack([oracle[i] for i in ids.tolist()]))
    assert backend.num_rows("t") == len(oracle)
    backend.close()


def test_a_capped_table_is_packed_for_space() -> None:
    """Blocks of the row count that fills a 4 KiB leaf page best, segments of a 32nd of the cap."""
    spec = TableSpec(name="t", dim=64, expected_max_rows=1 << 18)  # 260-byte rows
    geo = Geometry.capped(spec, 1 << 20, 4096, 2016)
    assert geo.block == 5 and geo.segment == 5 * (8192 // 5)  # 15 rows a page (7-row blocks: 14)
    small = Geometry.capped(TableSpec(name="t", dim=64, expected_max_rows=1000), 1 << 20, 4096, 2016)
    assert small.segment == 5 * (2048 // 5)  # never below CAPPED_MIN_SEGMENT_ROWS
    with pytest.raises(ValueError, match="expected_max_rows"):
        TableSpec(name="t", dim=4, expected_max_rows=0)
