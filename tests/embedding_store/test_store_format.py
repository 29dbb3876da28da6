"""The store describes itself (format 2): a store is read with the geometry it recorded, never with this
code's constants; what this code cannot read is refused naming the field; a format-1 store (the previous
format) reads exactly and has its metadata upgraded; too many log segments is a typed error."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import pytest

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreFullError,
    StoreIncompatibleError,
    StoreSegmentsError,
    TableSpec,
    scan_snapshot,
)
from embedding_store.backends import log_format, log_tables, open_backend, open_snapshot
from embedding_store.backends.meta import LEGACY_BLOCK_BYTES, table_meta

SEED = 3
NARROW = TableSpec(name="n", dim=4, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, num_embeddings=10_000)
WIDE = TableSpec(name="w", dim=60, optimizer=OptimizerKind.EXACT_SGD)
TABLES = [NARROW, WIDE]


def _options(layout: str = "log", **kw: object) -> LmdbOptions:
    kw.setdefault("log_segment_rows", 128)
    return LmdbOptions(layout=layout, initial_map_size_bytes=1 << 20, **kw)  # type: ignore[arg-type]


def _fill(path: Path, layout: str = "log") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A store of both tables with rows over many blocks and segments (some rewritten); its rows."""
    rng = np.random.default_rng(0)
    backend = open_backend(path, options=_options(layout), seed=SEED, tables=TABLES)
    want: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in TABLES}
    for _ in range(12):
        for spec in TABLES:
            ids = np.unique(rng.integers(0, 2_000, size=90))
            rows = rng.standard_normal((ids.shape[0], spec.row_floats)).astype(np.float32)
            backend.put_rows([(spec.name, ids, rows)])
            want[spec.name].update(zip(ids.tolist(), rows, strict=True))
    backend.close()
    return {
        name: (np.array(sorted(rows), dtype=np.int64), np.stack([rows[i] for i in sorted(rows)]))
        for name, rows in want.items()
    }


def _check(path: Path, want: dict[str, tuple[np.ndarray, np.ndarray]], layout: str = "log") -> None:
    for spec in TABLES:  # read-only first (writes nothing), then opened for writing
        ids, rows = want[spec.name]
        chunks = list(scan_snapshot(path, spec, seed=SEED, chunk_rows=100))
        assert np.array_equal(np.concatenate([c[0] for c in chunks]), ids)
        assert np.array_equal(np.concatenate([c[1] for c in chunks]), rows)
    backend = open_backend(path, options=_options(layout), seed=SEED, tables=TABLES)
    for spec in TABLES:
        ids, rows = want[spec.name]
        found, got = backend.get_rows(spec.name, np.arange(2_000))
        assert np.array_equal(np.flatnonzero(found), ids) and np.array_equal(got, rows)
        assert backend.num_rows(spec.name) == ids.shape[0]
    backend.close()


def _meta(path: Path) -> dict:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        raw = txn.get(b"format", db=env.open_db(b"__meta__", txn=txn, create=False))
    env.close()
    return json.loads(bytes(raw))


def _write_meta(path: Path, meta: dict) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format", json.dumps(meta, sort_keys=True).encode(), db=env.open_db(b"__meta__", txn=txn))
    env.close()


def test_the_metadata_records_format_page_size_and_each_tables_geometry(tmp_path: Path) -> None:
    _fill(tmp_path / "s")
    meta = _meta(tmp_path / "s")
    assert (
        meta["format"] == 2 and meta["layout"] == "log" and meta["seed"] == SEED and meta["page_size"] == 4096
    )
    narrow, wide = meta["tables"]["n"], meta["tables"]["w"]
    assert narrow == {**table_meta(NARROW), "row_bytes": 20, "block_rows": 100, "segment_rows": 100}
    assert wide == {**table_meta(WIDE), "row_bytes": 240, "block_rows": 8, "segment_rows": 128}


def test_a_changed_block_constant_reads_the_recorded_geometry(tmp_path: Path, monkeypatch) -> None:
    want = _fill(tmp_path / "s")
    monkeypatch.setattr(log_format, "BLOCK_BYTES", 1000)  # this code's blocks would hold 50 / 4 rows
    _check(tmp_path / "s", want)
    backend = open_backend(tmp_path / "s", options=_options(), seed=SEED, tables=TABLES)
    rows = np.full((3, NARROW.row_floats), 7.0, np.float32)
    backend.put_rows([("n", np.array([5, 6, 7]), rows)])  # appended with the recorded geometry
    assert np.array_equal(backend.get_rows("n", np.array([5, 6, 7]))[1], rows)
    backend.close()
    assert _meta(tmp_path / "s")["tables"]["n"]["block_rows"] == 100


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m["tables"]["n"].update(row_bytes=24), "row_bytes"),
        (lambda m: m["tables"]["w"].update(block_rows=4), "block_rows"),  # smaller than written
        (lambda m: m["tables"]["w"].update(block_rows=16, segment_rows=128), "block_rows"),  # past a page
        (lambda m: m["tables"]["n"].update(block_rows=50), "block_rows"),  # fits a page, contradicts data
        (lambda m: m["tables"]["w"].update(segment_rows=100), "segment_rows"),
        (lambda m: m.update(page_size=8192), "page_size"),
        (lambda m: m.update(format=3), "format"),
        (lambda m: m.update(format="2"), "format"),
        (lambda m: m.update(layout="hash"), "layout"),
    ],
)
def test_metadata_this_code_cannot_read_is_refused_naming_the_field(tmp_path: Path, edit, field: str) -> None:
    _fill(tmp_path / "s")
    meta = _meta(tmp_path / "s")
    edit(meta)
    _write_meta(tmp_path / "s", meta)
    with pytest.raises(StoreIncompatibleError, match=field):
        open_backend(tmp_path / "s", options=_options(), seed=SEED, tables=TABLES).close()
    if field not in ("layout",):
        with pytest.raises(StoreIncompatibleError, match=field):
            for spec in TABLES:
                list(scan_snapshot(tmp_path / "s", spec, seed=SEED))


def _format_1(meta: dict) -> dict:
    """The metadata of the previous commit's code (git show 0ed2fd7:embedding_store/lmdb_backend.py)."""
    old = {
        "format": 1,
        "seed": meta["seed"],
        "tables": {name: {k: t[k] for k in table_meta(NARROW)} for name, t in meta["tables"].items()},
        "layout": meta["layout"],
    }
    if meta["layout"] == "log":
        old["segment_rows"] = 128
    return old


@pytest.mark.parametrize("layout", ["log", "btree"])
def test_a_format_1_store_reads_exactly_and_is_upgraded_when_opened_for_writing(
    tmp_path: Path, layout: str
) -> None:
    want = _fill(tmp_path / "s", layout)
    assert log_format.BLOCK_BYTES == LEGACY_BLOCK_BYTES  # the geometry format 1 wrote
    _write_meta(tmp_path / "s", _format_1(_meta(tmp_path / "s")))
    for spec in TABLES:  # read-only: read with format 1's geometry, and left as it is
        chunks = list(scan_snapshot(tmp_path / "s", spec, seed=SEED))
        assert np.array_equal(np.concatenate([c[1] for c in chunks]), want[spec.name][1])
    assert _meta(tmp_path / "s")["format"] == 1
    _check(tmp_path / "s", want, layout)
    meta = _meta(tmp_path / "s")
    assert meta["format"] == 2 and meta["page_size"] == 4096
    if layout == "log":
        assert meta["tables"]["w"]["block_rows"] == LEGACY_BLOCK_BYTES // WIDE.row_bytes
    _check(tmp_path / "s", want, layout)


def test_a_format_1_store_keeps_format_1_geometry_when_the_constant_changes(
    tmp_path: Path, monkeypatch
) -> None:
    want = _fill(tmp_path / "s")
    _write_meta(tmp_path / "s", _format_1(_meta(tmp_path / "s")))
    monkeypatch.setattr(log_format, "BLOCK_BYTES", 1000)
    _check(tmp_path / "s", want)


def test_too_many_segments_is_a_typed_error_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(log_tables, "LOG_MAX_SEGMENTS", 6)
    options = _options(log_segment_rows=8, log_compact_at=0.95)  # rows 8 to a segment, little compaction
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[WIDE])
    rows = np.ones((16, WIDE.row_floats), np.float32)
    for k in range(3):
        backend.put_rows([("w", np.arange(16 * k, 16 * k + 16), rows)])  # segments 0..5
    with pytest.raises(StoreSegmentsError, match="store.lmdb.log_segment_rows") as raised:
        backend.put_rows([("w", np.arange(100, 104), rows[:4])])
    assert isinstance(raised.value, StoreFullError)
    assert "cap of 6" in str(raised.value) and "8 rows a segment" in str(raised.value)
    assert backend.num_rows("w") == 48 and not backend.get_rows("w", np.arange(100, 104))[0].any()
    backend.close()
    backend = open_backend(tmp_path / "s", options=options, seed=SEED, tables=[WIDE])
    assert backend.num_rows("w") == 48
    backend.close()
    reader = open_snapshot(tmp_path / "s", seed=SEED)
    assert sum(c[0].shape[0] for c in reader.chunks(WIDE)) == 48
    reader.close()
