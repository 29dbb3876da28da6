"""Malformed input: one line naming file, line and field by default; skip-and-count when asked."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from recsys.data.issues import MalformedInputError, OnError
from recsys.data.row_sources import TextSource
from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError
from tests.recsys.data.conftest import criteo_lines, criteo_oracle

SPEC = 'name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = 0.0\n'


def _with_bad_line(lineno: int, bad: str, n: int = 50) -> tuple[list[str], list[str]]:
    good = criteo_lines(n, seed=7)
    lines = list(good)
    lines.insert(lineno - 1, bad)
    return lines, good


def _break(field: int, value: str) -> str:
    parts = criteo_lines(1, seed=8)[0].split("\t")
    parts[field] = value
    return "\t".join(parts)


CASES = [
    (_break(3, "12a"), "field 'I3' (column 4): not an integer: '12a'"),
    (_break(5, "-"), "field 'I5' (column 6): not an integer: '-'"),
    (_break(14, "zz0a1b2c"), "field 'C1' (column 15): not a hexadecimal id: 'zz0a1b2c'"),
    (_break(39, "0a1b2c3g"), "field 'C26' (column 40): not a hexadecimal id: '0a1b2c3g'"),
    (_break(0, "2"), "field 'label' (column 1): not 0 or 1: '2'"),
    ("\t".join(criteo_lines(1, seed=9)[0].split("\t")[:39]), "expected 40 fields, got 39"),
    (criteo_lines(1, seed=9)[0] + "\textra", "expected 40 fields, got 41"),
    ("", "empty line"),
]


def _load(tmp_path, lines, on_error="raise"):
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    (tmp_path / "spec.toml").write_text(SPEC)
    ds = build_dataset(
        DataConfig(source=str(tmp_path / "spec.toml"), on_error=OnError(on_error)),
        synthetic=SyntheticConfig(),
        seed=0,
    )
    return ds


@pytest.fixture(params=["threads", "processes"])
def parse_in(request, monkeypatch):
    """Parse in threads, or in worker processes (as for big files)."""
    if request.param == "processes":
        monkeypatch.setattr(TextSource, "PROCESS_MIN_BYTES", 0)
    return request.param


@pytest.mark.parametrize(("bad", "message"), CASES)
def test_default_is_one_line_naming_file_line_and_field(tmp_path, bad, message, parse_in):
    lines, _ = _with_bad_line(17, bad)
    ds = _load(tmp_path, lines)
    with pytest.raises(MalformedInputError) as info:
        next(ds.train_batches(rank=0, world_size=1, batch_size=64, start_step=0))
    assert str(info.value) == f"{tmp_path / 'day_0'}:17: {message}"
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)  # the CLI prints it, exit 2


def test_skip_mode_drops_counts_and_reports_why(tmp_path, caplog, parse_in):
    good = criteo_lines(40, seed=7)
    lines = list(good)
    for k, (bad, _) in enumerate(CASES):
        lines.insert(3 + 5 * k, bad)
    ds = _load(tmp_path, lines, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="recsys"):
        (batch,) = list(ds.eval_batches(rank=0, world_size=1, batch_size=10**6)) or [None]
        b = next(ds.train_batches(rank=0, world_size=1, batch_size=40, start_step=0))
    assert batch is None  # eval_fraction = 0: nothing held out
    # Exactly the good lines, in order.
    for i, line in enumerate(good):
        dense, ids, y = criteo_oracle(line)
        assert b.dense[i].tolist() == dense and b.labels[i].item() == y
        assert [int(v) for v in b.sparse.values().view(26, 40)[:, i]] == ids
    source = ds.train_source
    assert source.use_processes() == (parse_in == "processes")
    assert source.num_rows() == 40 and source.skipped == len(CASES)
    counts = source.issues[str(tmp_path / "day_0")].counts
    assert counts["empty line"] == 1 and counts["expected 40 fields"] == 2
    assert counts["field 'label' (column 1): not 0 or 1"] == 1
    assert sum(counts.values()) == len(CASES)
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"skipped 8 malformed line(s) of {tmp_path / 'day_0'}: ") for m in logged), logged


def test_skip_mode_resume_counts_rows_not_lines(tmp_path):
    good = criteo_lines(60, seed=11)
    lines = list(good)
    lines.insert(10, "junk")
    lines.insert(30, "")
    ds = _load(tmp_path, lines, on_error="skip")
    full = ds.train_batches(rank=0, world_size=1, batch_size=7, start_step=0)
    ref = [next(full) for _ in range(12)]
    resumed = ds.train_batches(rank=0, world_size=1, batch_size=7, start_step=5)
    for r in ref[5:]:
        assert np.array_equal(next(resumed).dense.numpy(), r.dense.numpy())


def test_csv_bad_number_and_bad_id(tmp_path):
    (tmp_path / "a.csv").write_text("u,x,y\n1,0.5,1\n2,abc,0\n")
    (tmp_path / "s.toml").write_text(
        'name = "a"\nformat = "csv"\n[source]\nfiles = ["a.csv"]\n[read]\ndelimiter = ","\n[label]\ncolumn = "y"\n'
        '[split]\neval_fraction = 0.0\n[[dense]]\nname = "x"\n[[sparse]]\nname = "u"\nkind = "int"\nid_space = 2\n'
    )
    ds = build_dataset(DataConfig(source=str(tmp_path / "s.toml")), synthetic=SyntheticConfig(), seed=0)
    with pytest.raises(MalformedInputError, match=r"a\.csv:3: field 'x' \(column 2\): not a number: 'abc'"):
        next(ds.train_batches(rank=0, world_size=1, batch_size=1, start_step=0))
    (tmp_path / "a.csv").write_text("u,x,y\n1,0.5,1\n2,0.1,0\n")
    ds = build_dataset(DataConfig(source=str(tmp_path / "s.toml")), synthetic=SyntheticConfig(), seed=0)
    with pytest.raises(
        MalformedInputError, match=r"a\.csv:3: field 'u' \(column 1\): id outside the id space: '2'"
    ):
        next(ds.train_batches(rank=0, world_size=1, batch_size=2, start_step=0))


def test_dense_invalid_missing_turns_junk_into_the_fill_value(tmp_path):
    (tmp_path / "a.csv").write_text("u,x,y\n1,0.5,1\n2,unkonwn,0\n3,,1\n")
    (tmp_path / "s.toml").write_text(
        'name = "a"\nformat = "csv"\n[source]\nfiles = ["a.csv"]\n[read]\ndelimiter = ","\n[label]\ncolumn = "y"\n'
        '[split]\neval_fraction = 0.0\n[[dense]]\nname = "x"\ninvalid = "missing"\nfill = -1.0\n[[sparse]]\nname = "u"\n'
    )
    ds = build_dataset(DataConfig(source=str(tmp_path / "s.toml")), synthetic=SyntheticConfig(), seed=0)
    b = next(ds.train_batches(rank=0, world_size=1, batch_size=3, start_step=0))
    assert b.dense[:, 0].tolist() == [0.5, -1.0, -1.0] and b.labels.tolist() == [1.0, 0.0, 1.0]
