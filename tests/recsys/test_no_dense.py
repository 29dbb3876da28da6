"""A model over sparse features alone (a dataset with no dense column) trains: DLRM's bottom MLP and the
logistic model's linear layer see no inputs (their weights are empty), and the step's health check skips
what it cannot measure instead of failing on it."""

from __future__ import annotations

import json
import math

import pytest

from tests.recsys.tiny import run_train, tiny_config


@pytest.mark.parametrize("model", ["dlrm", "dcn", "logistic"])
def test_a_model_without_dense_features_trains(tmp_path, cli_env, model) -> None:
    config = tmp_path / "no_dense.toml"
    config.write_text(
        tiny_config(
            synthetic={"num_dense": 0},
            model={"name": model},
            store={"tiered": False},
            train={"steps": 150, "nproc": 1},
            eval={"every": 0},
        )
    )
    run_train(config, tmp_path / "run", env=cli_env)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert math.isfinite(summary["logloss"])
    assert summary["auc"] > 0.53  # it learns from the sparse features (0.54-0.56 at 150 steps)
