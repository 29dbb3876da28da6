"""Spec datasets: rank shares, resume positions, splits, joins, multi-hot tokens, Parquet, factories."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.data.source import DataConfig, Dataset, build_dataset
from recsys.data.synthetic import SyntheticConfig
from recsys.data.tokens import hash_strings
from recsys.errors import UserError

N = 1003  # rows of the CSV fixture (odd, so batches and shares do not divide it)

CSV_SPEC = """
name = "rows"
format = "csv"
[source]
files = ["rows.csv"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = 0.2
order_by = "{order_by}"
shuffle = {shuffle}
[[dense]]
name = "x"
[[sparse]]
name = "row"
kind = "int"
id_space = 100000
[[sparse]]
name = "tags"
separator = "|"
max_length = 2
[[sparse]]
name = "zip3"
column = "zip"
prefix = 3
"""


def _write_rows(folder: Path) -> list[dict]:
    rng = np.random.default_rng(5)
    rows = []
    for i in range(N):
        tags = "|".join(rng.choice(["a", "bb", "ccc", "dddd"], size=int(rng.integers(0, 4))))
        rows.append(
            {
                "row": i,
                "x": float(rng.normal()),
                "y": int(rng.integers(0, 2)),
                "tags": tags,
                "zip": str(int(rng.integers(10000, 99999))),
                "t": int(rng.integers(0, 10**6)),
            }
        )
    lines = ["row,x,y,tags,zip,t"] + [
        f"{r['row']},{r['x']!r},{r['y']},{r['tags']},{r['zip']},{r['t']}" for r in rows
    ]
    (folder / "rows.csv").write_text("\n".join(lines) + "\n")
    return rows


def _dataset(
    folder: Path, *, order_by: str = "", shuffle: bool = False, fmt: str = "csv", seed: int = 0
) -> Dataset:
    spec = CSV_SPEC.format(order_by=order_by, shuffle=str(shuffle).lower())
    if fmt == "parquet":
        spec = spec.replace('format = "csv"', 'format = "parquet"').replace("rows.csv", "rows.parquet")
    (folder / "spec.toml").write_text(spec)
    return build_dataset(DataConfig(source=str(folder / "spec.toml")), synthetic=SyntheticConfig(), seed=seed)


def _row_ids(batch) -> list[int]:
    return batch.sparse.to_dict()["row"].values().tolist()


@pytest.fixture
def rows(tmp_path) -> list[dict]:
    return _write_rows(tmp_path)


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_read_disjoint_rows_whose_union_is_the_split(tmp_path, rows, shuffle):
    ds = _dataset(tmp_path, shuffle=shuffle)
    train_rows = N - round(N * 0.2)
    batch = 64
    steps = -(-train_rows // batch)  # one epoch, the last batch wraps into the next
    first_epoch = {0: [], 1: []}  # rows each rank read at global positions < train_rows
    for rank in (0, 1):
        it = ds.train_batches(rank=rank, world_size=2, batch_size=batch, start_step=0)
        for step in range(steps):
            b = next(it)
            assert b.batch_size == batch // 2
            positions = step * batch + rank * (batch // 2) + np.arange(batch // 2)
            first_epoch[rank] += [r for p, r in zip(positions, _row_ids(b), strict=True) if p < train_rows]
    assert not set(first_epoch[0]) & set(first_epoch[1])
    assert sorted(first_epoch[0] + first_epoch[1]) == list(range(train_rows))  # the whole split, once
    seen = first_epoch
    if shuffle:
        assert seen[0][:32] != list(range(32))
    ev = {
        r: [i for b in ds.eval_batches(rank=r, world_size=2, batch_size=50) for i in _row_ids(b)]
        for r in (0, 1)
    }
    assert not set(ev[0]) & set(ev[1])
    assert sorted(ev[0] + ev[1]) == list(range(train_rows, N))


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_yields_what_an_uninterrupted_run_yields(tmp_path, rows, shuffle):
    ds = _dataset(tmp_path, shuffle=shuffle)
    full = ds.train_batches(rank=1, world_size=2, batch_size=96, start_step=0)
    reference = [next(full) for _ in range(30)]  # 30 × 96 rows: three epochs of 802
    for k in (1, 8, 9, 17, 29):
        resumed = ds.train_batches(rank=1, world_size=2, batch_size=96, start_step=k)
        for ref in reference[k : k + 3]:
            got = next(resumed)
            assert torch.equal(got.dense, ref.dense) and torch.equal(got.labels, ref.labels)
            assert torch.equal(got.sparse.values(), ref.sparse.values())
    if shuffle:  # epochs are different permutations
        e0 = [i for b in reference[:8] for i in _row_ids(b)]
        e1 = [i for b in reference[9:17] for i in _row_ids(b)]
        assert e0 != e1


def test_features_match_the_rows(tmp_path, rows):
    ds = _dataset(tmp_path)
    b = next(ds.train_batches(rank=0, world_size=1, batch_size=200, start_step=0))
    kjt = b.sparse.to_dict()
    tags = kjt["tags"]
    zips = kjt["zip3"].values().tolist()
    offsets = [0, *np.cumsum(tags.lengths().tolist())]
    for i, r in enumerate(rows[:200]):
        assert b.dense[i, 0].item() == np.float32(r["x"]) and b.labels[i].item() == r["y"]
        expected = r["tags"].split("|")[:2] if r["tags"] else []
        got = tags.values()[offsets[i] : offsets[i + 1]].tolist()
        assert got == (hash_strings(expected).tolist() if expected else [])
        assert zips[i] == hash_strings([r["zip"][:3]])[0]
    assert ds.id_spaces == [100000, 2**63, 2**63]


def test_chronological_split_holds_out_the_latest_rows(tmp_path, rows):
    ds = _dataset(tmp_path, order_by="t")
    by_time = [r["row"] for r in sorted(rows, key=lambda r: r["t"])]
    cut = N - round(N * 0.2)
    ev = [i for b in ds.eval_batches(rank=0, world_size=1, batch_size=1000) for i in _row_ids(b)]
    assert ev == by_time[cut:]
    tr = [
        i
        for b in [next(ds.train_batches(rank=0, world_size=1, batch_size=cut, start_step=0))]
        for i in _row_ids(b)
    ]
    assert tr == by_time[:cut]


def test_parquet_reads_what_csv_reads(tmp_path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({k: [r[k] for r in rows] for k in ("row", "x", "y", "tags", "zip", "t")})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=300)
    a = _dataset(tmp_path)
    b = _dataset(tmp_path, fmt="parquet")
    for x, y in zip(
        a.eval_batches(rank=1, world_size=2, batch_size=40),
        b.eval_batches(rank=1, world_size=2, batch_size=40),
        strict=True,
    ):
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.sparse.values(), y.sparse.values()) and torch.equal(
            x.sparse.lengths(), y.sparse.lengths()
        )


RECBOLE_INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
RECBOLE_USER = "user_id:token\tage:token\tgender:token\n"
RECBOLE_ITEM = "item_id:token\tgenre:token_seq\n"


def test_recbole_atomic_files_join_users_and_items(tmp_path):
    inter = [("u1", "i1", 5, 30), ("u2", "i2", 2, 10), ("u1", "i3", 4, 20), ("u9", "i1", 3, 40)]
    (tmp_path / "d.inter").write_text(
        RECBOLE_INTER + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in inter)
    )
    (tmp_path / "d.user").write_text(RECBOLE_USER + "u1\t25\tF\nu2\t40\tM\n")
    (tmp_path / "d.item").write_text(RECBOLE_ITEM + "i1\tComedy Drama\ni2\tAction\ni3\t\n")
    (tmp_path / "spec.toml").write_text(
        """
name = "d"
format = "recbole"
[source]
files = ["d.inter"]
[label]
column = "rating"
threshold = 4
[split]
order_by = "timestamp"
eval_fraction = 0.25
[[sparse]]
name = "user"
column = "user_id"
[[sparse]]
name = "gender"
column = "gender"
[[sparse]]
name = "genre"
column = "genre"
separator = " "
"""
    )
    ds = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    b = next(ds.train_batches(rank=0, world_size=1, batch_size=3, start_step=0))
    kjt = b.sparse.to_dict()
    # Chronological: timestamps 10, 20, 30 train; 40 (user u9, unknown to the .user file) is held out.
    assert b.labels.tolist() == [0.0, 1.0, 1.0]
    assert kjt["user"].values().tolist() == hash_strings(["u2", "u1", "u1"]).tolist()
    assert kjt["gender"].values().tolist() == hash_strings(["M", "F", "F"]).tolist()
    assert kjt["genre"].lengths().tolist() == [1, 0, 2]
    assert kjt["genre"].values().tolist() == hash_strings(["Action", "Comedy", "Drama"]).tolist()
    (held,) = list(ds.eval_batches(rank=0, world_size=1, batch_size=8))
    assert held.sparse.to_dict()["gender"].lengths().tolist() == [0]  # no side row: an empty bag


def test_factory_source_and_unknown_sources(tmp_path):
    ds = build_dataset(
        DataConfig(source="examples.custom_dataset:make_dataset"), synthetic=SyntheticConfig(), seed=3
    )
    assert isinstance(ds, Dataset)
    b = next(ds.train_batches(rank=0, world_size=1, batch_size=16, start_step=0))
    assert b.dense.shape[0] == 16
    with pytest.raises(UserError, match="unknown data source 'nope'"):
        build_dataset(DataConfig(source="nope"), synthetic=SyntheticConfig(), seed=0)
    with pytest.raises(UserError, match="cannot import"):
        build_dataset(DataConfig(source="no_such_module:f"), synthetic=SyntheticConfig(), seed=0)
    (tmp_path / "bad.toml").write_text('name = "b"\nformat = "csv"\n[label]\ncolum = "y"\n')
    with pytest.raises(UserError, match=r"\[label\]: unknown key 'colum'; valid keys: column, threshold"):
        build_dataset(DataConfig(source=str(tmp_path / "bad.toml")), synthetic=SyntheticConfig(), seed=0)


def test_shipped_specs_parse():
    from recsys.data.spec import DATASETS_DIR, load_spec

    names = sorted(p.stem for p in DATASETS_DIR.glob("*.toml"))
    assert names == [
        "criteo-1tb",
        "criteo-kaggle",
        "movielens-100k",
        "movielens-1m",
        "open-bandit",
        "synthetic",
    ]
    for name in names:
        spec = load_spec(DATASETS_DIR / f"{name}.toml")
        assert spec.licence and spec.name == name
    ds = build_dataset(DataConfig(source="datasets/synthetic.toml"), synthetic=SyntheticConfig(), seed=0)
    assert ds.num_dense == 13 and len(ds.feature_names) == 26
