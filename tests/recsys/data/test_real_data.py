"""Real data fetched at run time (network, minutes): MovieLens-1M/100k and the Open Bandit click log.

Marked slow: `make test-slow` (or `pytest -m slow tests/recsys/data/test_real_data.py`). The data goes to
the user's cache (`$TIERREC_CACHE` or ~/.cache/tierrec), never into the repository.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from recsys.data.source import DataConfig, build_dataset
from recsys.data.synthetic import SyntheticConfig

pytestmark = pytest.mark.slow


def _load(name: str):
    return build_dataset(DataConfig(source=name), synthetic=SyntheticConfig(), seed=0)


def test_movielens_1m_rows_label_and_chronological_split():
    ds = _load("movielens-1m")
    train, held = ds.train_source.block, ds.eval_source.block
    assert train.num_rows + held.num_rows == 1_000_209 and held.num_rows == 100_021
    positive = (train.labels.sum() + held.labels.sum()) / 1_000_209
    assert abs(positive - 0.575) < 0.001  # rating >= 4
    assert ds.feature_names == ["user", "item", "gender", "age", "occupation", "zip3", "genres", "decade"]
    genres = train.ids[6]
    assert genres.lengths.max() == 6 and genres.lengths.min() >= 1  # multi-hot, every movie has a genre
    assert len(np.unique(train.ids[2].values)) == 2  # gender joined from ml-1m.user


def test_movielens_100k_loads():
    ds = _load("movielens-100k")
    assert ds.train_source.num_rows() == 90_000 and ds.eval_source.num_rows() == 10_000


def _train(repo_root, cli_env, python, config, out, *sets):
    args = [python, "-m", "recsys", "train", "--config", config, "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, cwd=repo_root, env=cli_env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_open_bandit_trains_end_to_end(repo_root, cli_env, python, tmp_path):
    summary = _train(repo_root, cli_env, python, "configs/open-bandit.toml", tmp_path)
    assert summary["steps"] == 100 and summary["world_size"] == 2
    assert 0.0 <= summary["auc"] <= 1.0 and np.isfinite(summary["logloss"])


@pytest.mark.skipif(os.environ.get("TIERREC_SKIP_ML1M_TRAIN") == "1", reason="asked to skip")
def test_movielens_1m_dlrm_dcn_beats_logistic_regression(repo_root, cli_env, python, tmp_path):
    dlrm = _train(repo_root, cli_env, python, "configs/movielens-1m.toml", tmp_path / "dcn")
    assert dlrm["model"] == "dcn"
    lr = _train(
        repo_root, cli_env, python, "configs/movielens-1m.toml", tmp_path / "lr", "model.name=logistic"
    )
    assert dlrm["auc"] >= 0.775
    assert dlrm["auc"] - lr["auc"] >= 0.01
