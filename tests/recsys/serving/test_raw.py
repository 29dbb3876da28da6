"""Raw records score as their lines of the training file would: the bundle carries the spec's transforms.

The oracle is the training reader itself: the records are the held-out lines of the CSV file (as
``csv.DictReader`` gives them, text), and :meth:`Scorer.encode` must give bit for bit the dense values
and ids that the dataset's own held-out batches hold; the scores then equal the trained model's.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.data.criteo import DENSE_NAMES, SPARSE_NAMES
from recsys.data.source import DataConfig, build_dataset
from recsys.data.spec import load_spec
from recsys.metrics import auc_logloss
from recsys.serving import load_bundle
from recsys.serving.raw import RawFields
from tests.conftest import subprocess_env
from tests.recsys.serving.conftest import held_out_batches, summary
from tests.recsys.tiny import run_train

# Features whose names do not sort in the model's order (z, a, m); every kind of field and transform.
SPEC = """name = "shop"
format = "csv"
[source]
files = ["clicks.csv"]
[read]
delimiter = ","
[label]
column = "click"
[split]
eval_fraction = 0.25
[[dense]]
name = "age"
transform = "log1p"
fill = 3.5
[[dense]]
name = "price"
shift = 10.0
scale = 0.5
invalid = "missing"
[[sparse]]
name = "z"
column = "tags"
separator = "|"
max_length = 3
[[sparse]]
name = "a"
column = "user"
kind = "int"
id_space = 500
[[sparse]]
name = "m"
column = "zip"
prefix = 3
"""

CONFIG = """[data]
source = "{spec}"
[model]
embedding_dim = 8
dense_arch = [16, 8]
over_arch = [16]
[train]
steps = 30
batch_size = 64
threads_per_rank = 1
[store]
tiered = true
tables = ["z", "m"]
device_rows = 300
host_rows = 100
[eval]
batch_size = 128
"""


def _lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["request,user,tags,zip,age,price,click"]
    for i in range(n):
        tags = "|".join(f"t{rng.randint(0, 40)}" for _ in range(rng.randint(0, 4)))
        age = "" if rng.random() < 0.1 else str(rng.randint(-3, 90))
        price = rng.choice(["", "n/a", f"{rng.random() * 40:.2f}"])
        user = rng.randint(0, 499)
        click = int(rng.random() < 0.2 + 0.5 * (user % 3 == 0))
        out.append(f"r{i},{user},{tags},{rng.randint(10000, 99999)},{age},{price},{click}")
    return out


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A trained and exported run on the CSV data: (root, run, bundle)."""
    from recsys.serving.export import export_bundle

    root = tmp_path_factory.mktemp("shop")
    (root / "clicks.csv").write_text("\n".join(_lines(1200)) + "\n")
    (root / "spec.toml").write_text(SPEC)
    (root / "c.toml").write_text(CONFIG.format(spec=root / "spec.toml"))
    run_train(root / "c.toml", root / "run", env=subprocess_env())
    export_bundle(root / "run", root / "bundle")
    return root, root / "run", root / "bundle"


def _held_out_records(root: Path) -> list[dict[str, str]]:
    with open(root / "clicks.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows[len(rows) - round(len(rows) * 0.25) :]


def test_raw_records_encode_as_the_training_reader_reads_them(shop):
    root, run, bundle = shop
    scorer = load_bundle(bundle)
    assert scorer.features == ["z", "a", "m"] != sorted(scorer.features)  # the model's order
    assert scorer.dense_names == ["age", "price"]
    records = _held_out_records(root)
    batches = held_out_batches(run, 0, 1)
    dense, sparse = scorer.encode(records)
    assert np.array_equal(dense, torch.cat([b.dense for b in batches]).numpy())
    for name in scorer.features:
        values = torch.cat([b.sparse[name].values() for b in batches]).numpy()
        lengths = torch.cat([b.sparse[name].lengths() for b in batches]).numpy()
        assert np.array_equal(sparse[name][0], values) and np.array_equal(sparse[name][1], lengths), name
    # Scored in the evaluation's batches, the probabilities are the trained model's, bit for bit.
    logits = torch.cat([scorer.logits(b.dense, b.sparse) for b in batches])
    raw = torch.cat([scorer.score(records[i : i + 128]) for i in range(0, len(records), 128)])
    assert torch.equal(raw, torch.sigmoid(logits))
    labels = torch.tensor([float(r["click"]) for r in records])
    auc, _ = auc_logloss(logits, labels)
    assert auc == pytest.approx(summary(run)["auc"], abs=1e-6)


def test_raw_values_as_numbers_and_none_score_as_their_text(shop):
    root, _, bundle = shop
    scorer = load_bundle(bundle)
    records = _held_out_records(root)[:20]
    typed = [
        {
            **r,
            "user": int(r["user"]),
            "age": None if r["age"] == "" else int(r["age"]),
            "price": float(r["price"]) if r["price"] not in ("", "n/a") else r["price"],
        }
        for r in records
    ]
    assert torch.equal(scorer.score(typed), scorer.score(records))
    # Two raw records, as an online service would receive them (extra keys are ignored).
    two = [
        {"request": "q1", "user": 7, "tags": "t1|t5", "zip": "94110", "age": 31, "price": 12.5},
        {"request": "q2", "user": "42", "tags": "", "zip": "", "age": None, "price": "n/a"},
    ]
    probs = scorer.score(two)
    assert probs.shape == (2,) and ((probs > 0) & (probs < 1)).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("zip"), "record 1: no column 'zip'"),
        (lambda r: r.update(user="x7"), "record 1: field 'user'"),
        (lambda r: r.update(user=900), "id outside the id space"),
        (lambda r: r.update(age=float("nan")), "record 1: field 'age': not a finite number"),
        (lambda r: r.update(age=True), "record 1: field 'age' must be text or a number"),
        (lambda r: r.update(tags="t1\nt2"), "record 1: field 'tags' holds a line break"),
    ],
)
def test_bad_raw_records_are_refused_naming_the_record(shop, change, message):
    root, _, bundle = shop
    scorer = load_bundle(bundle)
    records = [dict(r) for r in _held_out_records(root)[:3]]
    change(records[1])
    with pytest.raises(ValueError, match=message) as err:
        scorer.score(records)
    assert "\n" not in str(err.value)


def test_the_bundle_records_the_spec_without_the_training_machines_paths(shop):
    _, _, bundle = shop
    model = json.loads((bundle / "model.json").read_text())
    assert model["interaction_order"] == ["z", "a", "m"]
    assert "source" not in model["spec"] and "path" not in model["spec"]
    assert [s["name"] for s in model["spec"]["sparse"]] == ["z", "a", "m"]


def test_a_bundle_of_synthetic_data_has_no_raw_form(exported):
    scorer = load_bundle(exported("table_wise_2"))
    assert scorer.dense_names is None
    with pytest.raises(ValueError, match="without a dataset spec"):
        scorer.score([{"cat_0": 1}])


def test_criteo_records_encode_as_the_tsv_reader_reads_them(tmp_path):
    from tests.recsys.data.conftest import criteo_lines

    lines = criteo_lines(300, seed=3)
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    (tmp_path / "s.toml").write_text(
        'name = "c"\nformat = "criteo_tsv"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = 0.5\n'
    )
    data = build_dataset(DataConfig(source=str(tmp_path / "s.toml")), synthetic=None, seed=0)  # type: ignore[arg-type]
    (batch,) = list(data.eval_batches(rank=0, world_size=1, batch_size=1000))
    fields = RawFields(load_spec(tmp_path / "s.toml"), data.feature_names)
    records = [
        dict(zip(DENSE_NAMES + SPARSE_NAMES, line.split("\t")[1:], strict=True)) for line in lines[150:]
    ]
    dense, sparse = fields.encode(records)
    assert np.array_equal(dense, batch.dense.numpy())
    for name in data.feature_names:
        assert np.array_equal(sparse[name][0], batch.sparse[name].values().numpy())


def test_parquet_records_encode_as_the_parquet_reader_reads_them(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(0)
    n = 200
    table = pa.table(
        {
            "user": pa.array(rng.integers(0, 100, n), pa.int64()),
            "city": pa.array([f"c{i % 13}" if i % 7 else None for i in range(n)]),
            "age": pa.array([float(x) if x % 5 else None for x in rng.integers(0, 80, n)]),
            "click": pa.array(rng.integers(0, 2, n), pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    (tmp_path / "s.toml").write_text(
        'name = "p"\nformat = "parquet"\n[source]\nfiles = ["d.parquet"]\n[label]\ncolumn = "click"\n'
        '[split]\neval_fraction = 0.5\n[[dense]]\nname = "age"\ntransform = "log1p"\n'
        '[[sparse]]\nname = "user"\n[[sparse]]\nname = "city"\n'
    )
    data = build_dataset(DataConfig(source=str(tmp_path / "s.toml")), synthetic=None, seed=0)  # type: ignore[arg-type]
    (batch,) = list(data.eval_batches(rank=0, world_size=1, batch_size=1000))
    fields = RawFields(load_spec(tmp_path / "s.toml"), ["city", "user"])
    dense, sparse = fields.encode(table.to_pylist()[100:])
    assert np.array_equal(dense, batch.dense.numpy())
    for name in ("user", "city"):
        assert np.array_equal(sparse[name][0], batch.sparse[name].values().numpy())
        assert np.array_equal(sparse[name][1], batch.sparse[name].lengths().numpy())
