"""Per-split statistics (``split_stats``) against hand counts, and the constant-predictor logloss."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.data.array_dataset import ArrayDataset
from recsys.data.issues import OnError
from recsys.data.source import DataConfig, build_dataset
from recsys.data.stats import SplitStats, constant_logloss, split_stats_of, stats_of_batches
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.errors import UserError

# Ten rows: row i has time TIMES[i] and label LABELS[i].
LABELS = [1, 0, 1, 1, 0, 0, 0, 1, 1, 0]
TIMES = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0]

SPEC = """
name = "counted"
format = "csv"
[source]
files = ["rows.csv"]
[read]
delimiter = ","
[label]
column = "y"
[split]
eval_fraction = 0.3
order_by = "{order_by}"
shuffle = {shuffle}
[[sparse]]
name = "row"
kind = "int"
"""


def _dataset(folder: Path, *, order_by: str = "", shuffle: bool = False, on_error=OnError.RAISE, extra=""):
    lines = ["row,t,y"] + [f"{i},{t},{y}" for i, (t, y) in enumerate(zip(TIMES, LABELS, strict=True))]
    (folder / "rows.csv").write_text("\n".join(lines + [extra] if extra else lines) + "\n")
    (folder / "spec.toml").write_text(SPEC.format(order_by=order_by, shuffle=str(shuffle).lower()))
    config = DataConfig(source=str(folder / "spec.toml"), on_error=on_error)
    return build_dataset(config, synthetic=SyntheticConfig(), seed=0)


def test_streamed_split_counts_by_hand(tmp_path):
    # No order_by, no shuffle: streamed; rows 0-6 train (1 0 1 1 0 0 0: 3 positives), 7-9 held (1 1 0: 2).
    ds = _dataset(tmp_path)
    assert type(ds.train_source).__name__ == "TextSource"  # really the streamed path
    stats = ds.split_stats()
    assert stats == {"train": SplitStats(rows=7, positives=3), "eval": SplitStats(rows=3, positives=2)}
    assert stats["eval"].positive_rate == pytest.approx(2 / 3)
    assert ds.split_stats() is stats  # counted once, kept


def test_sorted_split_counts_by_hand(tmp_path):
    # By time: rows 9 1 2 3 4 5 6 train (labels 0 0 1 1 0 0 0: 2 positives), rows 7 8 0 held (1 1 1: 3).
    for shuffle in (False, True):
        stats = _dataset(tmp_path, order_by="t", shuffle=shuffle).split_stats()
        assert stats == {"train": SplitStats(rows=7, positives=2), "eval": SplitStats(rows=3, positives=3)}


def test_skipped_rows_are_not_counted(tmp_path):
    # An 11th line with a bad label: skip drops it, so the split has the 10 good rows (11 - round(3.3)).
    ds = _dataset(tmp_path, on_error=OnError.SKIP, extra="10,11,7")
    stats = ds.split_stats()
    assert stats["train"].rows + stats["eval"].rows == 10
    assert stats["train"].positives + stats["eval"].positives == sum(LABELS)


def test_synthetic_eval_is_exact_and_train_a_marked_sample():
    data = SyntheticCriteo(SyntheticConfig(num_sparse=2, id_space=50, eval_samples=300), seed=4)
    stats = data.split_stats()
    labels = torch.cat([b.labels for b in data.eval_batches(rank=0, world_size=1, batch_size=64)])
    assert stats["eval"] == SplitStats(rows=300, positives=int(labels.sum().item()))
    first = data.batch(step=0, rank=0, world_size=1, batch_size=300).labels  # the stream's first 300
    assert stats["train"] == SplitStats(rows=300, positives=int(first.sum().item()), sampled=True)
    assert 0.1 < stats["train"].positive_rate < 0.5


def test_array_dataset_counts_its_arrays():
    labels = np.array([1, 1, 0, 0, 0, 1, 0, 1, 0, 0])
    ds = ArrayDataset.from_arrays(
        dense=np.zeros((10, 1)),
        ids={"a": np.arange(10)},
        labels=labels,
        id_spaces={"a": 10},
        eval_fraction=0.4,
    )
    assert ds.split_stats() == {
        "train": SplitStats(rows=6, positives=3),
        "eval": SplitStats(rows=4, positives=1),
    }


class _Minimal:
    """A factory's dataset without split_stats."""

    feature_names = ["a"]
    id_spaces = [10]
    num_dense = 1

    def train_batches(self, *, rank, world_size, batch_size, start_step):
        return iter(())

    def eval_batches(self, *, rank, world_size, batch_size):
        return iter(())


def make_minimal(config, *, seed):
    return _Minimal()


def make_nothing(config, *, seed):
    return object()


def test_a_factory_dataset_without_split_stats_is_accepted_and_gives_none():
    ds = build_dataset(DataConfig(source=f"{__name__}:make_minimal"), synthetic=SyntheticConfig(), seed=0)
    assert split_stats_of(ds) is None
    with pytest.raises(
        UserError, match="returned object, not a Dataset \\(it lacks feature_names, id_spaces"
    ):
        build_dataset(DataConfig(source=f"{__name__}:make_nothing"), synthetic=SyntheticConfig(), seed=0)


def test_stats_of_batches_counts_what_it_reads(tmp_path):
    ds = _dataset(tmp_path)
    assert stats_of_batches(ds.eval_batches(rank=0, world_size=1, batch_size=2)) == ds.split_stats()["eval"]


def test_split_stats_as_json_values():
    assert SplitStats(rows=0, positives=0).as_dict() == {
        "rows": 0,
        "positives": 0,
        "positive_rate": None,
        "sampled": False,
    }
    assert math.isnan(SplitStats(rows=0, positives=0).positive_rate)
    with pytest.raises(ValueError, match="positives must be in"):
        SplitStats(rows=3, positives=4)


def test_constant_logloss_by_hand():
    # Base rate 0.25; held out: 1 positive, 3 negatives → -(ln 0.25 + 3 ln 0.75) / 4.
    want = -(math.log(0.25) + 3 * math.log(0.75)) / 4
    got = constant_logloss(SplitStats(rows=8, positives=2), SplitStats(rows=4, positives=1))
    assert got == pytest.approx(want, rel=1e-15)
    assert round(got, 6) == 0.562335


@pytest.mark.parametrize(
    ("train", "held"), [((8, 2), (4, 1)), ((5, 0), (4, 1)), ((5, 5), (3, 2)), ((5, 0), (2, 0))]
)
def test_constant_logloss_is_what_torch_bce_gives(train, held):
    t, h = SplitStats(rows=train[0], positives=train[1]), SplitStats(rows=held[0], positives=held[1])
    labels = torch.tensor([1.0] * h.positives + [0.0] * (h.rows - h.positives), dtype=torch.float64)
    predicted = torch.full_like(labels, t.positive_rate)
    bce = torch.nn.functional.binary_cross_entropy(predicted, labels).item()
    assert constant_logloss(t, h) == pytest.approx(bce, rel=1e-12)


def test_constant_logloss_without_rows_is_nan():
    assert math.isnan(constant_logloss(SplitStats(rows=0, positives=0), SplitStats(rows=2, positives=1)))
    assert math.isnan(constant_logloss(SplitStats(rows=2, positives=1), SplitStats(rows=0, positives=0)))


def test_shuffled_npy_split_loads_and_counts(tmp_path):
    # npy with shuffle = true used to fail (the npy reader had no pairs()); labels 0 1 0 1 ...: the last
    # 5 of 20 rows (15..19: 1 0 1 0 1) are held out.
    np.save(tmp_path / "day_0_dense.npy", np.zeros((20, 2), np.float32))
    np.save(tmp_path / "day_0_sparse.npy", np.arange(40).reshape(20, 2))
    np.save(tmp_path / "day_0_labels.npy", (np.arange(20) % 2).astype(np.float32))
    spec = 'name = "n"\nformat = "torchrec_npy"\n[source]\nfiles = ["day_0"]\n[split]\neval_fraction = 0.25\nshuffle = true\n'
    (tmp_path / "spec.toml").write_text(spec)
    ds = build_dataset(DataConfig(source=str(tmp_path / "spec.toml")), synthetic=SyntheticConfig(), seed=0)
    assert ds.split_stats() == {
        "train": SplitStats(rows=15, positives=7),
        "eval": SplitStats(rows=5, positives=3),
    }
