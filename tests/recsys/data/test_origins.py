"""Every reader gives each row its origin (file number, 1-based line or row), through skips, sorts and
held-out files; :class:`OriginColumns` reads columns back by origin. The oracle is the file itself: each
row's ``row`` id (a sparse feature) is the value written on its line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recsys.data.block import Block, Jagged, pack_origin, unpack_origin
from recsys.data.issues import OnError
from recsys.data.npy_source import NpySource
from recsys.data.origins import OriginColumns
from recsys.data.row_sources import MemorySource, Span
from recsys.data.source import DataConfig, build_dataset
from recsys.data.spec_dataset import SpecDataset, data_columns, input_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.errors import UserError

SPEC = """
name = "rows"
format = "{fmt}"
[source]
files = [{files}]
[read]
delimiter = ","
[label]
column = "y"
[split]
{split}
[[dense]]
name = "v"
[[sparse]]
name = "row"
kind = "int"
"""


def _dataset(folder: Path, *, fmt="csv", files=("a.csv",), split="eval_fraction = 0.5", skip=False):
    names = ", ".join(f'"{f}"' for f in files)
    (folder / "spec.toml").write_text(SPEC.format(fmt=fmt, files=names, split=split))
    on_error = OnError.SKIP if skip else OnError.RAISE
    config = DataConfig(source=str(folder / "spec.toml"), on_error=on_error)
    return build_dataset(config, synthetic=SyntheticConfig(), seed=0)


def _rows(source) -> tuple[list[int], list[int], list[int]]:
    """(row ids, file numbers, lines) of every row a source gives, in its order."""
    blocks = [source.block] if isinstance(source, MemorySource) else list(source.blocks())
    block = Block.concat(blocks)
    file, line = unpack_origin(block.origin)
    return block.ids[0].values.tolist(), file.tolist(), line.tolist()


def _write(path: Path, rows: list[str]) -> None:
    path.write_text("\n".join(["row,t,v,y", *rows]) + "\n")


def test_text_rows_keep_their_lines_through_skipped_rows_and_held_out_files(tmp_path):
    _write(tmp_path / "a.csv", ["0,5,1,0", "1,4,x,1", "2,3,2,0", "3,2", "4,1,3,1"])  # lines 3, 5 are bad
    _write(tmp_path / "b.csv", ["10,9,1,0", "11,8,nan,1", "12,7,2,1"])
    ds = _dataset(tmp_path, files=("a.csv",), split='eval_files = ["b.csv"]', skip=True)
    assert ds.origin_files == [tmp_path / "a.csv", tmp_path / "b.csv"]
    assert _rows(ds.train_source) == ([0, 2, 4], [0, 0, 0], [2, 4, 6])
    assert _rows(ds.eval_source) == ([10, 12], [1, 1], [2, 4])


def test_sorted_and_grouped_splits_map_back_to_their_lines(tmp_path):
    rows = [f"{i},{(i * 7) % 10},{i},{i % 2}" for i in range(10)]
    _write(tmp_path / "a.csv", rows)
    _write(tmp_path / "b.csv", rows[:3])
    for split in ('order_by = "t"', 'group_by = "y"'):
        ds = _dataset(tmp_path, files=("a.csv", "b.csv"), split=f"eval_fraction = 0.3\n{split}")
        for source in (ds.train_source, ds.eval_source):
            ids, files, lines = _rows(source)
            for row, file, line in zip(ids, files, lines, strict=True):
                text = ds.origin_files[file].read_text().splitlines()[line - 1]
                assert int(text.split(",")[0]) == row


def test_parquet_rows_are_numbered_per_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for name, ids in (("a.parquet", [0, 1, 2, 3]), ("b.parquet", [10, 11])):
        values = [float("nan") if i == 1 else float(i) for i in ids]
        table = pa.table({"row": ids, "t": [9 - i for i in ids], "v": values, "y": [i % 2 for i in ids]})
        pq.write_table(table, tmp_path / name, row_group_size=2)
    ds = _dataset(
        tmp_path, fmt="parquet", files=("a.parquet", "b.parquet"), split="eval_fraction = 0.5", skip=True
    )
    ids, files, lines = _rows(ds.train_source)
    ids2, files2, lines2 = _rows(ds.eval_source)
    assert (ids + ids2, files + files2, lines + lines2) == (
        [0, 2, 3, 10, 11],
        [0, 0, 0, 1, 1],
        [1, 3, 4, 1, 2],
    )
    keys = OriginColumns(ds.spec, ds.origin_files, data_columns(ds.spec, ds.origin_files[0]), ["t", "row"])
    origin = pack_origin(1, np.array([2])).tolist() + pack_origin(0, np.array([3, 1])).tolist()
    t, row = keys.values(np.array(origin))
    assert t.tolist() == ["-2", "7", "9"] and row.tolist() == ["11", "2", "0"]


def test_npy_and_criteo_rows(tmp_path):
    for k, prefix in enumerate(("p0", "p1")):
        dense = np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * k
        dense[1, 0] = np.nan if k == 0 else dense[1, 0]
        np.save(tmp_path / f"{prefix}_dense.npy", dense)
        np.save(tmp_path / f"{prefix}_sparse.npy", np.arange(3).reshape(3, 1) + 10 * k)
        np.save(tmp_path / f"{prefix}_labels.npy", np.zeros(3, np.int64))
    source = NpySource([tmp_path / "p0", tmp_path / "p1"], on_error=OnError.SKIP, span=Span(first_file=3))
    assert _rows(source) == ([0, 2, 10, 11, 12], [3, 3, 4, 4, 4], [1, 3, 1, 2, 3])
    line = "\t".join(["1", *["1"] * 13, *["0a"] * 26])
    (tmp_path / "day_0").write_text(f"{line}\nbad\n{line}\n")
    (tmp_path / "c.toml").write_text('name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n')
    config = DataConfig(source=str(tmp_path / "c.toml"), on_error=OnError.SKIP)
    ds = build_dataset(config, synthetic=SyntheticConfig(), seed=0)
    block = Block.concat([*ds.train_source.blocks(), *ds.eval_source.blocks()])
    assert unpack_origin(block.origin)[1].tolist() == [1, 3]


def test_input_files_read_without_their_label_column(tmp_path):
    _write(tmp_path / "a.csv", ["0,5,1,0"])
    _dataset(tmp_path)  # the spec
    from recsys.data.spec import load_spec

    spec = load_spec(tmp_path / "spec.toml")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "n.csv").write_text("v,t,row\n1.5,3,7\n2.5,4,8\n")
    ds = input_dataset(spec, [tmp_path / "new" / "n.csv"])
    assert isinstance(ds, SpecDataset) and not ds.spec.read.has_label
    assert _rows(ds.train_source) == ([7, 8], [0, 0], [2, 3])
    assert ds.eval_source.num_rows() == 0 and ds.columns() == ["v", "t", "row"]
    keys = OriginColumns(ds.spec, ds.origin_files, ds.columns(), ["row"])
    assert keys.values(pack_origin(0, np.array([3, 2, 3])))[0].tolist() == ["8", "7", "8"]  # back and forth
    with pytest.raises(UserError, match=r"--keep nope: no such column in the data \(columns: v, t, row\)"):
        OriginColumns(ds.spec, ds.origin_files, ds.columns(), ["nope"])


def test_blocks_carry_origins_only_when_every_part_has_them():
    ids = (Jagged.single(np.arange(4)),)
    read = Block(np.zeros((4, 1), np.float32), ids, np.zeros(4, np.float32), pack_origin(2, np.arange(1, 5)))
    made = Block(np.zeros((4, 1), np.float32), ids, np.zeros(4, np.float32))
    assert Block.concat([read, read]).origin.tolist() == read.origin.tolist() * 2
    assert Block.concat([read, made]).origin is None
    assert unpack_origin(read.take(np.array([3, 0])).origin)[1].tolist() == [4, 1]
    assert unpack_origin(read.slice(1, 3).with_file(5).origin)[0].tolist() == [5, 5]
