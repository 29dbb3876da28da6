"""``recsys train --seeds``: one run per seed and the spread of their held-out metrics."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from recsys.errors import UserError
from recsys.seeds import parse_seeds, seed_summary
from tests.recsys.tiny import ROOT, tiny_config


@pytest.mark.parametrize(
    ("text", "seeds"), [("0,1,2", [0, 1, 2]), ("3", [3]), ("0-3", [0, 1, 2, 3]), ("5, 1", [5, 1])]
)
def test_seed_lists_and_ranges(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "1,1", "-1", "0-x", "2-1"])
def test_bad_seed_lists_are_refused(text):
    with pytest.raises(UserError, match="--seeds: expected"):
        parse_seeds(text)


def test_the_spread_is_taken_over_the_seeds():
    runs = {
        s: {"auc": a, "logloss": 0.5 + a / 10, "constant_logloss": 0.69, "best": None}
        for s, a in [(0, 0.7), (1, 0.72), (2, 0.77)]
    }
    out = seed_summary(runs)
    assert out["final"]["auc"] == {
        "median": 0.72,
        "mean": statistics.fmean([0.7, 0.72, 0.77]),
        "std": statistics.stdev([0.7, 0.72, 0.77]),
        "min": 0.7,
        "max": 0.77,
    }
    assert out["best"]["auc"]["median"] is None  # no run kept a best checkpoint


def test_train_with_seeds_writes_one_run_per_seed_and_their_spread(tmp_path, cli_env):
    config = tmp_path / "c.toml"
    config.write_text(tiny_config(train={"steps": 20, "nproc": 1, "log_every": 10}))
    cmd = [
        sys.executable,
        "-m",
        "recsys",
        "train",
        "--config",
        str(config),
        "--out",
        str(tmp_path / "runs"),
        "--seeds",
        "0,1",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads((tmp_path / "runs" / f"seed_{s}" / "summary.json").read_text()) for s in (0, 1)]
    assert [s["config"]["train"]["seed"] for s in summaries] == [0, 1]
    assert summaries[0]["model_digest"] != summaries[1]["model_digest"]
    spread = json.loads((tmp_path / "runs" / "seeds.json").read_text())
    assert spread["seeds"] == [0, 1]
    assert spread["final"]["auc"]["median"] == pytest.approx(statistics.median(s["auc"] for s in summaries))
    assert "auc: median" in proc.stdout
    again = subprocess.run(
        [*cmd, "--resume"], cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training into" not in again.stdout  # both seeds had finished: nothing is trained again
    assert json.loads((tmp_path / "runs" / "seeds.json").read_text()) == spread
