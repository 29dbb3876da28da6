"""``[split] order_by`` semantics: numbers as numbers, text by its bytes, empty first, mixed refused.

Each case writes one column ``t`` and reads back the row order of the training split followed by the
held-out split (the sorted order: the held-out rows are its last ``eval_fraction``).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from recsys.data.issues import OnError
from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError

SPEC = """
name = "ordered"
format = "{fmt}"
[source]
files = ["rows.{ext}"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = 0.5
order_by = "t"
[[sparse]]
name = "row"
kind = "int"
"""


def _dataset(folder: Path, fmt: str = "csv", on_error: OnError = OnError.RAISE):
    spec = SPEC.format(fmt=fmt, ext="csv" if fmt == "csv" else "parquet")
    (folder / "spec.toml").write_text(spec)
    config = DataConfig(source=str(folder / "spec.toml"), on_error=on_error)
    return build_dataset(config, synthetic=SyntheticConfig(), seed=0)


def _sorted_rows(folder: Path, values: list[str], **kwargs) -> list[int]:
    lines = ["row,t,y"] + [f"{i},{v},{i % 2}" for i, v in enumerate(values)]
    (folder / "rows.csv").write_text("\n".join(lines) + "\n")
    ds = _dataset(folder, **kwargs)
    return ds.train_source.block.ids[0].values.tolist() + ds.eval_source.block.ids[0].values.tolist()


def test_numbers_sort_as_numbers(tmp_path):
    # As text, "10" < "100" < "9" and "-1" < "2.5"; as numbers -1 < 2.5 < 9 < 10 < 100 < 1e3.
    values = ["10", "9", "100", "-1", "2.5", "1e3"]
    assert _sorted_rows(tmp_path, values) == [3, 4, 1, 0, 2, 5]


def test_equal_values_keep_file_order(tmp_path):
    assert _sorted_rows(tmp_path, ["2", "1", "2", "1", "2.0"]) == [1, 3, 0, 2, 4]


def test_text_sorts_by_its_bytes(tmp_path):
    dates = ["2024-01-10", "2024-01-09", "2023-12-31", "2024-01-09T08:00", "2024-01-09"]
    assert _sorted_rows(tmp_path, dates) == [2, 1, 4, 3, 0]
    # Bytes, not numbers inside text nor locale order: "B" < "a" < "v10" < "v9".
    assert _sorted_rows(tmp_path, ["v9", "v10", "a", "B"]) == [3, 2, 1, 0]


def test_text_order_is_kept_in_skip_mode(tmp_path):
    # Text used to be "not a number": in skip mode every row was dropped as malformed.
    rows = _sorted_rows(tmp_path, ["2024-02-01", "2024-01-01"], on_error=OnError.SKIP)
    assert rows == [1, 0]


def test_empty_values_sort_first(tmp_path):
    assert _sorted_rows(tmp_path, ["5", "", "-7", ""]) == [1, 3, 2, 0]
    assert _sorted_rows(tmp_path, ["b", "", "a"]) == [1, 2, 0]


@pytest.mark.parametrize("values", [["9", "abc", "10"], ["1", "nan", "2"], ["2024-01-01", "20240102"]])
def test_numbers_and_text_in_one_column_are_refused(tmp_path, values):
    with pytest.raises(UserError) as err:
        _sorted_rows(tmp_path, values)
    message = str(err.value)
    assert "[split] order_by = 't': the column holds numbers (" in message and ") and text (" in message
    assert "\n" not in message


def test_numbers_and_text_in_different_files_are_refused(tmp_path):
    # Chunks are parsed apart (files never share one): the whole split is checked after parsing.
    (tmp_path / "a.csv").write_text("row,t,y\n0,5,0\n1,7,1\n")
    (tmp_path / "b.csv").write_text("row,t,y\n2,,0\n3,late,1\n")
    spec = SPEC.format(fmt="csv", ext="csv").replace('files = ["rows.csv"]', 'files = ["a.csv", "b.csv"]')
    (tmp_path / "spec.toml").write_text(spec)
    with pytest.raises(UserError, match=r"holds numbers \(.*a.csv:2 '5'\) and text \(.*b.csv:3 'late'\)"):
        build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)


def test_a_file_of_empty_values_sorts_first_before_text(tmp_path):
    (tmp_path / "a.csv").write_text("row,t,y\n0,b,0\n")
    (tmp_path / "b.csv").write_text("row,t,y\n1,,0\n2,,1\n")
    (tmp_path / "c.csv").write_text("row,t,y\n3,a,1\n")
    spec = SPEC.format(fmt="csv", ext="csv").replace(
        'files = ["rows.csv"]', 'files = ["a.csv", "b.csv", "c.csv"]'
    )
    (tmp_path / "spec.toml").write_text(spec)
    ds = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    rows = ds.train_source.block.ids[0].values.tolist() + ds.eval_source.block.ids[0].values.tolist()
    assert rows == [1, 2, 3, 0]


def test_a_missing_order_by_column_is_refused(tmp_path):
    (tmp_path / "rows.csv").write_text("row,time,y\n0,1,0\n")
    with pytest.raises(
        UserError, match=r"\[split\] order_by = 't': no such column in the data \(columns: row, time, y\)"
    ):
        _dataset(tmp_path)


def test_parquet_columns_sort_by_their_type(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def order(column: object) -> list[int]:
        n = len(column)  # type: ignore[arg-type]
        pq.write_table(
            pa.table({"row": list(range(n)), "t": column, "y": [0] * n}), tmp_path / "rows.parquet"
        )
        ds = _dataset(tmp_path, fmt="parquet")
        return ds.train_source.block.ids[0].values.tolist() + ds.eval_source.block.ids[0].values.tolist()

    assert order([10, 9, None, 100]) == [2, 1, 0, 3]  # numbers, null first
    assert order(["2024-01-10", "2024-01-09", None, "é", "z"]) == [2, 1, 0, 4, 3]  # UTF-8 bytes: z < é
    day = datetime.datetime(2024, 1, 9)
    assert order([day + datetime.timedelta(hours=h) for h in (5, -3, 0)]) == [1, 2, 0]  # timestamps
    with pytest.raises(UserError, match=r"order_by column 't': not a finite number: nan"):
        order([1.0, float("nan")])
    with pytest.raises(UserError, match=r"order_by column 't' has type list<"):
        order([[1], [2]])


def test_parquet_files_of_numbers_and_text_are_refused_naming_each_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"row": [0, 1], "t": [5, 6], "y": [0, 1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"row": [2], "t": ["x"], "y": [1]}), tmp_path / "b.parquet")
    spec = SPEC.format(fmt="parquet", ext="parquet").replace(
        'files = ["rows.parquet"]', 'files = ["a.parquet", "b.parquet"]'
    )
    (tmp_path / "spec.toml").write_text(spec)
    with pytest.raises(
        UserError, match=r"holds numbers \(.*a.parquet row 1\) and text \(.*b.parquet row 1\)"
    ):
        build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)


def _with_format(folder: Path, fmt: str) -> None:
    spec = SPEC.format(fmt="csv", ext="csv").replace(
        'order_by = "t"', f'order_by = "t"\norder_format = "{fmt}"'
    )
    (folder / "spec.toml").write_text(spec)


def _format_rows(folder: Path, values: list[str], fmt: str, on_error: OnError = OnError.RAISE) -> list[int]:
    lines = ["row,t,y"] + [f"{i},{v},{i % 2}" for i, v in enumerate(values)]
    (folder / "rows.csv").write_text("\n".join(lines) + "\n")
    _with_format(folder, fmt)
    ds = build_dataset(
        DataConfig(source=str(folder / "spec.toml"), on_error=on_error), synthetic=SyntheticConfig(), seed=0
    )
    return ds.train_source.block.ids[0].values.tolist() + ds.eval_source.block.ids[0].values.tolist()


def test_order_format_orders_dates_as_times(tmp_path):
    # As text: "1/10/2024" < "1/9/2024" < "12/31/2023"; as dates 12/31/2023 < 1/9 < 1/10.
    values = ["1/10/2024", "12/31/2023", "1/9/2024", "", "2/1/2024"]
    assert _format_rows(tmp_path, values, "%m/%d/%Y") == [3, 1, 2, 0, 4]


def test_order_format_gives_the_split_of_the_same_dates_in_iso(tmp_path):
    us = ["3/2/2024", "1/15/2024", "12/1/2023", "1/15/2024", "2/29/2024", "1/2/2024"]
    iso = [datetime.datetime.strptime(v, "%m/%d/%Y").strftime("%Y-%m-%d") for v in us]
    ordered_us = _format_rows(tmp_path, us, "%m/%d/%Y")
    assert ordered_us == _sorted_rows(tmp_path, iso) == [2, 5, 1, 3, 4, 0]


def test_dates_that_do_not_sort_as_text_are_refused_without_order_format(tmp_path):
    for values in (["1/10/2024", "12/31/2023"], ["2024-1-9", "2024-1-10"], ["09.01.2024", "10.01.2024"]):
        with pytest.raises(UserError) as err:
            _sorted_rows(tmp_path, values)
        message = str(err.value)
        assert message.startswith("[split] order_by = 't': its values are dates that do not sort as text (")
        assert "rows.csv:2)" in message and "set [split] order_format" in message and "\n" not in message
    assert _sorted_rows(tmp_path, ["2024/01/10", "2024/01/09"]) == [1, 0]  # zero-padded, year first: fine


def test_a_value_order_format_cannot_parse_follows_on_error(tmp_path):
    values = ["1/10/2024", "13/45/2024", "1/9/2024", "1/8/2024"]
    with pytest.raises(
        UserError,
        match=r"rows.csv:3: \[split\] order_by 't': not a time of order_format "
        r"'%m/%d/%Y': '13/45/2024'",
    ):
        _format_rows(tmp_path, values, "%m/%d/%Y")
    assert _format_rows(tmp_path, values, "%m/%d/%Y", on_error=OnError.SKIP) == [3, 2, 0]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ('order_format = "%Y"', "order_format = '%Y' needs order_by"),
        ('order_by = "t"\norder_format = "Y-m-d"', "no strptime code in it"),
        ('order_by = "t"\norder_format = 3', "order_format must be strptime codes (a string), got 3"),
    ],
)
def test_a_bad_order_format_is_refused_in_one_line(tmp_path, split, message):
    spec = SPEC.format(fmt="csv", ext="csv").replace('order_by = "t"', split)
    (tmp_path / "spec.toml").write_text(spec)
    (tmp_path / "rows.csv").write_text("row,t,y\n0,1,0\n")
    with pytest.raises(UserError, match=re.escape(message)):
        build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)


def test_parquet_text_dates_take_order_format_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    t = ["1/10/2024", "12/31/2023", None, "1/9/2024"]
    pq.write_table(pa.table({"row": [0, 1, 2, 3], "t": t, "y": [0, 1, 0, 1]}), tmp_path / "rows.parquet")
    spec = SPEC.format(fmt="parquet", ext="parquet")
    (tmp_path / "spec.toml").write_text(spec)
    with pytest.raises(
        UserError, match=r"its values are dates that do not sort as text \('1/10/2024' at .*row 1\)"
    ):
        build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    (tmp_path / "spec.toml").write_text(
        spec.replace('order_by = "t"', 'order_by = "t"\norder_format = "%m/%d/%Y"')
    )
    ds = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    assert ds.train_source.block.ids[0].values.tolist() + ds.eval_source.block.ids[0].values.tolist() == [
        2,
        1,
        3,
        0,
    ]
