"""``recsys predict`` writes one score per held-out row; their AUC is the checkpoint's AUC."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from recsys.errors import UserError
from recsys.metrics import auc_logloss
from recsys.serving.predict import predict
from tests.recsys.serving.conftest import cli, summary


def _read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return rows


def test_predict_cli_scores_every_held_out_row(trained, exported, tmp_path):
    run = trained("table_wise_2")
    out = tmp_path / "scores.csv"
    args = ["predict", "--bundle", str(exported("table_wise_2")), "--out", str(out), "--batch-size", "100"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scored 512 rows; cache hit rates: cat_0" in proc.stdout
    rows = _read_csv(out)
    assert [int(r["row"]) for r in rows] == list(range(512))
    logits = torch.tensor([float(r["logit"]) for r in rows], dtype=torch.float32)
    labels = torch.tensor([float(r["label"]) for r in rows])
    scores = torch.tensor([float(r["score"]) for r in rows], dtype=torch.float32)
    # sigmoid's vectorised and scalar paths may differ in the last bit: batches of 100 here, 512 there.
    torch.testing.assert_close(scores, torch.sigmoid(logits), rtol=3e-7, atol=0)
    # Other batches than the 2 ranks x 256 of training: AUC equal (no two scores swap order here),
    # log loss equal to float32 rounding of the logits (~1e-7 relative).
    auc, logloss = auc_logloss(logits, labels)
    saved = summary(run)
    assert auc == pytest.approx(saved["auc"], abs=1e-9)
    assert logloss == pytest.approx(saved["logloss"], rel=1e-6)


def test_predict_parquet_all_splits_with_a_row_limit(exported, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "scores.parquet"
    report = predict(exported("row_wise_2"), out, split="all", options={"rows": 700, "batch_size": 256})
    table = pq.read_table(out).to_pydict()
    assert report["rows"] == 700 and len(table["row"]) == 700
    splits = np.array(table["split"])
    assert (splits[:700] == "train").all()  # the training split first; synthetic training data is endless
    assert table["row"] == list(range(700))
    assert set(table) == {"row", "split", "label", "logit", "score"}


def test_predict_on_other_data_with_the_same_schema(exported, tmp_path):
    """``--set`` reshapes the data (here: a held-out split of another size) but not the model."""
    out = tmp_path / "s.csv"
    report = predict(exported("dcn_1"), out, options={"overrides": ["synthetic.eval_samples=100"]})
    assert report["rows"] == 100 and len(_read_csv(out)) == 100
    with pytest.raises(UserError, match="the model was trained on"):
        predict(exported("dcn_1"), tmp_path / "t.csv", options={"overrides": ["synthetic.num_sparse=3"]})
    with pytest.raises(UserError, match="no end"):
        predict(exported("dcn_1"), tmp_path / "t.csv", split="train")
    with pytest.raises(UserError, match="suffix"):
        predict(exported("dcn_1"), tmp_path / "t.txt")
    assert not (tmp_path / "t.csv").exists()
