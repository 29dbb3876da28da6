"""NaN and ±inf in numeric input: one rule in every reader (docs/datasets.md, "NaN and infinity").

A non-finite dense value is a bad value like ``abc``: ``invalid = "missing"`` reads it as the feature's
``fill``; otherwise (the default ``invalid = "error"``) ``on_error = "raise"`` stops at the first with one
line naming file, line, column and the value, and ``skip`` drops its row and counts it. A label that is
not finite (or, without ``threshold``, not 0/1) is always an error or a skipped row. Oracles: arrays
written out by hand from the input rows.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from recsys.data.block import Block, Jagged
from recsys.data.issues import MalformedInputError, OnError
from recsys.data.npy_source import NpySource
from recsys.data.row_sources import TextSource
from recsys.data.source import DataConfig, build_dataset
from recsys.data.spec import DenseSpec
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError
from tests.recsys.data.conftest import criteo_lines

# Every spelling numpy's and Python's float parsers turn into NaN or ±inf (1e999 overflows).
SPELLINGS = [
    "nan",
    "NaN",
    "-nan",
    "NAN",
    "inf",
    "+inf",
    "-inf",
    "Infinity",
    "-Infinity",
    "INF",
    "1e999",
    "-1e999",
]


def _dataset(tmp_path, spec: str, on_error: str = "raise"):
    (tmp_path / "spec.toml").write_text(spec)
    return build_dataset(
        DataConfig(source=str(tmp_path / "spec.toml"), on_error=OnError(on_error)),
        synthetic=SyntheticConfig(),
        seed=0,
    )


def _all_train_rows(ds, rows: int):
    """Every training row in one batch (no shuffle, no held-out rows in these specs)."""
    b = next(ds.train_batches(rank=0, world_size=1, batch_size=rows, start_step=0))
    return b.dense.numpy(), b.labels.numpy()


def _csv_spec(dense: str = "", label: str = "") -> str:
    return (
        'name = "a"\nformat = "csv"\n[source]\nfiles = ["a.csv"]\n[read]\ndelimiter = ","\n'
        f'[label]\ncolumn = "y"\n{label}\n[split]\neval_fraction = 0.0\n'
        f'[[dense]]\nname = "x"\n{dense}\n[[dense]]\nname = "z"\n[[sparse]]\nname = "u"\n'
    )


def _csv(tmp_path, xs: list[str], ys: list[str] | None = None) -> None:
    ys = ys or [str(i % 2) for i in range(len(xs))]
    body = "".join(f"{i},{x},{i + 0.5},{y}\n" for i, (x, y) in enumerate(zip(xs, ys, strict=True)))
    (tmp_path / "a.csv").write_text("u,x,z,y\n" + body)


# -- csv (and the side files of joins) --------------------------------------------------------------


@pytest.fixture(params=["threads", "processes"])
def parse_in(request, monkeypatch):
    """Parse in threads, or in worker processes (as for big files)."""
    if request.param == "processes":
        monkeypatch.setattr(TextSource, "PROCESS_MIN_BYTES", 0)
    return request.param


def test_csv_invalid_missing_reads_every_spelling_as_fill(tmp_path, parse_in):
    xs = ["1.5", *SPELLINGS, "", "-2"]
    _csv(tmp_path, xs)
    ds = _dataset(tmp_path, _csv_spec('invalid = "missing"\nfill = -7.0'))
    dense, labels = _all_train_rows(ds, len(xs))
    expected_x = [1.5] + [-7.0] * len(SPELLINGS) + [-7.0, -2.0]  # the empty field is missing too
    assert dense[:, 0].tolist() == expected_x
    assert dense[:, 1].tolist() == [i + 0.5 for i in range(len(xs))]  # the other column untouched
    assert labels.tolist() == [float(i % 2) for i in range(len(xs))]


def test_csv_fill_is_not_transformed(tmp_path):
    _csv(tmp_path, ["3", "nan", "-inf"])
    ds = _dataset(
        tmp_path, _csv_spec('invalid = "missing"\nfill = 0.25\ntransform = "log1p"\nshift = 1.0\nscale = 2.0')
    )
    dense, _ = _all_train_rows(ds, 3)
    expected = np.array([(np.log1p(3.0) - 1.0) * 2.0, 0.25, 0.25], dtype=np.float32)
    assert dense[:, 0].tolist() == expected.tolist()


def test_csv_finite_values_beyond_float32_are_nonfinite_features(tmp_path):
    # 1e300 is a float64 but inf as the model's float32; scale can push a value there too.
    _csv(tmp_path, ["1", "1e300", "-3.5e38", "2e38"])
    dense, _ = _all_train_rows(
        _dataset(tmp_path, _csv_spec('invalid = "missing"\nfill = 5.0\nscale = 2.0')), 4
    )
    assert dense[:, 0].tolist() == [2.0, 5.0, 5.0, 5.0]
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(_dataset(tmp_path, _csv_spec()), 4)
    assert str(info.value) == (
        f"{tmp_path / 'a.csv'}:3: field 'x': not a finite number as float32 after the transform: 1e+300"
    )


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_csv_default_raises_naming_file_line_column_and_value(tmp_path, spelling):
    _csv(tmp_path, ["1", "2", spelling, "nan"])
    ds = _dataset(tmp_path, _csv_spec())
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(ds, 4)
    # Line 4: the header is line 1, the rows start at line 2.
    assert (
        str(info.value) == f"{tmp_path / 'a.csv'}:4: field 'x' (column 2): not a finite number: {spelling!r}"
    )


def test_csv_skip_drops_and_counts_nonfinite_rows(tmp_path, caplog, parse_in):
    xs = ["1", "nan", "2", "inf", "3", "-Infinity", "4"]
    _csv(tmp_path, xs)
    ds = _dataset(tmp_path, _csv_spec(), on_error="skip")
    assert ds.train_source.num_rows() == 4
    with caplog.at_level(logging.WARNING, logger="recsys"):
        dense, labels = _all_train_rows(ds, 4)
    assert dense[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert dense[:, 1].tolist() == [0.5, 2.5, 4.5, 6.5]  # the kept rows' other column: rows 0, 2, 4, 6
    assert labels.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert "3 × field 'x' (column 2): not a finite number" in caplog.text


def test_join_side_file_nonfinite_follows_the_same_rule(tmp_path):
    (tmp_path / "a.csv").write_text("u,y\n1,1\n2,0\n3,1\n")
    (tmp_path / "users.csv").write_text("u,age\n1,30\n2,NaN\n3,inf\n")
    spec = (
        'name = "a"\nformat = "csv"\n[source]\nfiles = ["a.csv"]\n[read]\ndelimiter = ","\n'
        '[[join]]\nfile = "users.csv"\non = "u"\n[label]\ncolumn = "y"\n[split]\neval_fraction = 0.0\n'
        '[[dense]]\nname = "age"\n{}\n[[sparse]]\nname = "u"\n'
    )
    ds = _dataset(tmp_path, spec.format('invalid = "missing"\nfill = -1.0'))
    dense, _ = _all_train_rows(ds, 3)
    assert dense[:, 0].tolist() == [30.0, -1.0, -1.0]
    with pytest.raises(
        MalformedInputError, match=r"users\.csv:3: field 'age' \(column 2\): not a finite number: 'NaN'$"
    ):
        _dataset(tmp_path, spec.format(""))


# -- labels -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["", "threshold = 0.5"])
@pytest.mark.parametrize("spelling", ["nan", "inf", "-Infinity", "1e999"])
def test_nonfinite_label_is_an_error_with_or_without_threshold(tmp_path, label, spelling):
    # With a threshold, inf >= 0.5 would silently be a positive and NaN >= 0.5 a negative.
    _csv(tmp_path, ["1", "2", "3"], ["1", spelling, "0"])
    ds = _dataset(tmp_path, _csv_spec(label=label))
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(ds, 3)
    assert (
        str(info.value) == f"{tmp_path / 'a.csv'}:3: field 'y' (column 4): not a finite number: {spelling!r}"
    )


def test_nonfinite_label_is_skipped_even_when_dense_is_lenient(tmp_path):
    _csv(tmp_path, ["1", "nan", "3", "4"], ["1", "0", "nan", "0.5"])
    ds = _dataset(tmp_path, _csv_spec('invalid = "missing"\nfill = 9.0'), on_error="skip")
    dense, labels = _all_train_rows(ds, 2)  # rows 2 (label NaN) and 3 (label 0.5, not 0/1) dropped
    assert dense[:, 0].tolist() == [1.0, 9.0] and labels.tolist() == [1.0, 0.0]
    assert ds.train_source.num_rows() == 2


# -- recbole ----------------------------------------------------------------------------------------


def test_recbole_float_columns(tmp_path):
    (tmp_path / "d.inter").write_text(
        "user_id:token\titem_id:token\tprice:float\trating:float\n"
        "u1\ti1\t2.5\t5\nu2\ti2\tnan\t2\nu1\ti2\t-inf\t4\nu2\ti1\t7\t1\n"
    )
    (tmp_path / "d.item").write_text("item_id:token\tweight:float\ni1\tInfinity\ni2\t0.5\n")
    spec = (
        'name = "d"\nformat = "recbole"\n[source]\nfiles = ["d.inter"]\n[label]\ncolumn = "rating"\n'
        'threshold = 4\n[split]\neval_fraction = 0.0\n[[dense]]\nname = "price"\ninvalid = "missing"\n'
        'fill = -3.0\n[[dense]]\nname = "weight"\ninvalid = "missing"\nfill = 8.0\n[[sparse]]\nname = "user_id"\n'
    )
    dense, labels = _all_train_rows(_dataset(tmp_path, spec), 4)
    assert dense.tolist() == [[2.5, 8.0], [-3.0, 0.5], [-3.0, 0.5], [7.0, 8.0]]
    assert labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    strict = spec.replace('invalid = "missing"\nfill = 8.0', "")
    with pytest.raises(
        MalformedInputError, match=r"d\.item:2: field 'weight' \(column 2\): not a finite number: 'Infinity'$"
    ):
        _dataset(tmp_path, strict)


# -- criteo ---------------------------------------------------------------------------------------


CRITEO_SPEC = 'name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = 0.0\n'


def _criteo_with(field: int, value: str) -> list[str]:
    lines = criteo_lines(6, seed=3)
    parts = lines[4].split("\t")
    parts[field] = value
    lines[4] = "\t".join(parts)
    return lines


@pytest.mark.parametrize("spelling", ["nan", "inf", "-Infinity", "1e999"])
@pytest.mark.parametrize(("field", "name"), [(0, "label"), (3, "I3")])
def test_criteo_counts_and_label_are_integers_so_nonfinite_is_malformed(tmp_path, spelling, field, name):
    (tmp_path / "day_0").write_text("\n".join(_criteo_with(field, spelling)) + "\n")
    ds = _dataset(tmp_path, CRITEO_SPEC)
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(ds, 6)
    assert str(info.value) == (
        f"{tmp_path / 'day_0'}:5: field {name!r} (column {field + 1}): not an integer: {spelling!r}"
    )


def test_criteo_skip_drops_the_row(tmp_path):
    lines = _criteo_with(3, "NaN")
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    ds = _dataset(tmp_path, CRITEO_SPEC, on_error="skip")
    _, labels = _all_train_rows(ds, 5)
    assert labels.tolist() == [float(line.split("\t")[0]) for k, line in enumerate(lines) if k != 4]


# -- parquet --------------------------------------------------------------------------------------


def _parquet(tmp_path, x: list[float | None], y: list[float | None]) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = len(x)
    table = pa.table(
        {"u": [str(i) for i in range(n)], "x": pa.array(x, pa.float64()), "y": pa.array(y, pa.float64())}
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=4)


def _parquet_spec(dense: str = "", label: str = "") -> str:
    return (
        'name = "p"\nformat = "parquet"\n[source]\nfiles = ["a.parquet"]\n'
        f'[label]\ncolumn = "y"\n{label}\n[split]\neval_fraction = 0.0\n'
        f'[[dense]]\nname = "x"\n{dense}\n[[sparse]]\nname = "u"\n'
    )


NAN, INF = float("nan"), float("inf")


def test_parquet_nonfinite_and_null_become_fill(tmp_path):
    _parquet(tmp_path, [1.0, NAN, None, INF, -INF, 2.5], [1, 0, 1, 0, 1, 0])
    dense, labels = _all_train_rows(_dataset(tmp_path, _parquet_spec('invalid = "missing"\nfill = 4.0')), 6)
    assert dense[:, 0].tolist() == [1.0, 4.0, 4.0, 4.0, 4.0, 2.5]
    assert labels.tolist() == [1, 0, 1, 0, 1, 0]


def test_parquet_default_raises_and_skip_counts(tmp_path):
    _parquet(tmp_path, [1.0, 2.0, 3.0, 4.0, -INF, 6.0], [1, 0, 1, 0, 1, 0])
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(_dataset(tmp_path, _parquet_spec()), 6)
    assert str(info.value) == f"{tmp_path / 'a.parquet'}:5: field 'x': not a finite number: -inf"
    dense, labels = _all_train_rows(_dataset(tmp_path, _parquet_spec(), on_error="skip"), 5)
    assert dense[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 6.0] and labels.tolist() == [1, 0, 1, 0, 0]


@pytest.mark.parametrize("label", ["", "threshold = 0.5"])
def test_parquet_nonfinite_label(tmp_path, label):
    _parquet(tmp_path, [1.0, 2.0, 3.0], [1, NAN, 0])
    with pytest.raises(MalformedInputError, match=r"a\.parquet:2: field 'y': not a finite number: nan$"):
        _all_train_rows(_dataset(tmp_path, _parquet_spec(label=label)), 3)
    _parquet(tmp_path, [1.0, 2.0, 3.0], [1, INF, 0])
    dense, labels = _all_train_rows(_dataset(tmp_path, _parquet_spec(label=label), on_error="skip"), 2)
    assert dense[:, 0].tolist() == [1.0, 3.0] and labels.tolist() == [1.0, 0.0]


# -- torchrec npy ---------------------------------------------------------------------------------


def _npy(tmp_path, dense: np.ndarray, labels: np.ndarray) -> None:
    n = dense.shape[0]
    np.save(tmp_path / "d_dense.npy", dense.astype(np.float32))
    np.save(tmp_path / "d_sparse.npy", (np.arange(2 * n) % 5).reshape(n, 2).astype(np.int64))
    np.save(tmp_path / "d_labels.npy", labels.reshape(n, 1))


NPY_DENSE = np.array([[0.5, 1.0, 2.0], [NAN, 1.5, 2.5], [0.0, INF, 3.0], [1.0, 2.0, -INF], [4.0, 5.0, 6.0]])


def _npy_spec(dense: str = "") -> str:
    return (
        f'name = "n"\nformat = "torchrec_npy"\n[source]\nfiles = ["d"]\n[split]\neval_fraction = 0.0\n{dense}'
    )


def test_npy_default_raises_naming_array_row_column_and_value(tmp_path):
    _npy(tmp_path, NPY_DENSE, np.array([1, 0, 1, 0, 1], np.int32))
    with pytest.raises(MalformedInputError) as info:
        _all_train_rows(_dataset(tmp_path, _npy_spec()), 5)
    assert str(info.value) == f"{tmp_path / 'd'}_dense.npy[1, 0]: not a finite number: nan"


def test_npy_dense_entries_give_fill_per_column(tmp_path):
    _npy(tmp_path, NPY_DENSE, np.array([1, 0, 1, 0, 1], np.int32))
    entries = "".join(
        f'[[dense]]\nname = "d{j}"\ninvalid = "missing"\nfill = {fill}\n'
        for j, fill in enumerate([-1, -2, -3])
    )
    dense, labels = _all_train_rows(_dataset(tmp_path, _npy_spec(entries)), 5)
    expected = [[0.5, 1.0, 2.0], [-1.0, 1.5, 2.5], [0.0, -2.0, 3.0], [1.0, 2.0, -3.0], [4.0, 5.0, 6.0]]
    assert dense.tolist() == expected and labels.tolist() == [1, 0, 1, 0, 1]
    # Only column 1 lenient: row 1's NaN (column 0) is still an error.
    mixed = '[[dense]]\nname = "a"\n[[dense]]\nname = "b"\ninvalid = "missing"\n[[dense]]\nname = "c"\n'
    with pytest.raises(MalformedInputError, match=r"d_dense\.npy\[1, 0\]: not a finite number: nan$"):
        _all_train_rows(_dataset(tmp_path, _npy_spec(mixed)), 5)


def test_npy_dense_entries_must_match_and_not_transform(tmp_path):
    _npy(tmp_path, NPY_DENSE, np.array([1, 0, 1, 0, 1], np.int32))
    with pytest.raises(UserError, match="have 3 dense columns, the spec names 1"):
        _dataset(tmp_path, _npy_spec('[[dense]]\nname = "a"\n'))
    three = '[[dense]]\nname = "a"\ntransform = "log1p"\n[[dense]]\nname = "b"\n[[dense]]\nname = "c"\n'
    with pytest.raises(UserError, match="'a': npy dense values are already transformed"):
        _dataset(tmp_path, _npy_spec(three))


def test_npy_skip_drops_rows_counts_and_resumes_by_kept_rows(tmp_path, caplog):
    _npy(tmp_path, NPY_DENSE, np.array([1, 0, 1, 0, 1], np.int32))
    source = NpySource([tmp_path / "d"], on_error=OnError.SKIP, chunk_rows=2)
    assert source.num_rows() == 2
    with caplog.at_level(logging.WARNING, logger="recsys"):
        block = Block.concat(list(source.blocks()))  # chunks of 2 rows: rows 0-1, 2-3, 4
    assert block.dense.tolist() == [[0.5, 1.0, 2.0], [4.0, 5.0, 6.0]] and block.labels.tolist() == [1, 1]
    assert "3 × dense value not a finite number" in caplog.text
    later = [b for b in source.blocks(skip_rows=1) if b.num_rows]
    assert [b.dense.tolist() for b in later] == [[[4.0, 5.0, 6.0]]]


@pytest.mark.parametrize(("label", "shown"), [(NAN, "nan"), (0.5, "0.5"), (2.0, "2.0")])
def test_npy_labels_must_be_0_or_1(tmp_path, label, shown):
    labels = np.array([1, 0, 1, label, 0], np.float32)
    _npy(tmp_path, np.ones((5, 3)), labels)
    with pytest.raises(MalformedInputError) as info:
        list(NpySource([tmp_path / "d"]).blocks())
    assert str(info.value) == f"{tmp_path / 'd'}_labels.npy[3]: label not 0 or 1: {shown}"
    (block,) = list(NpySource([tmp_path / "d"], on_error=OnError.SKIP).blocks())
    assert block.labels.tolist() == [1, 0, 1, 0]


def test_npy_lenient_columns_keep_valid_rows_fast(tmp_path):
    # The common case: nothing to fix, the block is the memory-mapped rows as they are.
    _npy(tmp_path, np.arange(15.0).reshape(5, 3), np.array([1, 0, 1, 0, 1], np.int32))
    lenient = [DenseSpec(name=f"d{j}", invalid="missing", fill=-1.0) for j in range(3)]
    (block,) = list(NpySource([tmp_path / "d"], dense=lenient).blocks())
    assert block.dense.tolist() == np.arange(15.0).reshape(5, 3).tolist()


def test_preprocess_write_npy_refuses_nonfinite_values(tmp_path):
    from recsys.data.preprocess import write_npy

    block = Block(
        np.array([[1.0], [NAN]], np.float32), (Jagged.single(np.array([1, 2])),), np.array([0, 1], np.float32)
    )
    with pytest.raises(UserError, match="row 1 has a dense value that is not finite"):
        write_npy([block], tmp_path / "x", num_rows=2, num_dense=1, num_sparse=1)


@pytest.mark.parametrize("key", ["fill", "shift", "scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e39, True])
def test_a_spec_whose_dense_constants_are_not_finite_is_refused(key, value):
    from recsys.data.spec import spec_from_dict

    tree = {"name": "x", "format": "csv", "sparse": [{"name": "a"}], "dense": [{"name": "d", key: value}]}
    with pytest.raises(
        UserError, match=rf"dense feature 'd': {key} must be a finite number, got {re.escape(repr(value))}"
    ):
        spec_from_dict(tree)
