"""Results a user can judge: the split report, the constant baseline, the best checkpoint, early stopping.

The fixture is a CSV whose labels are noise: the model can only overfit, so its held-out log loss falls
for a few evaluations and then rises — the run whose best evaluation is not its last.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from recsys.checkpoint import checkpoint_meta, verify_checkpoint
from recsys.selection import BestTracker, Evaluation
from tests.recsys.tiny import run_train

SPEC = """name = "noise"
format = "csv"
[source]
files = ["d.csv"]
[read]
delimiter = ","
[label]
column = "click"
[split]
eval_fraction = 0.5
[[dense]]
name = "x"
[[sparse]]
name = "user"
id_space = 64
[[sparse]]
name = "item"
id_space = 64
"""

CONFIG = """[data]
source = "{spec}"
[model]
embedding_dim = 8
dense_arch = [16, 8]
over_arch = [32]
[sparse]
learning_rate = 0.02
[train]
steps = {steps}
batch_size = 64
log_every = 50
dense_learning_rate = 0.02
checkpoint_every = 10
[eval]
every = 10
batch_size = 512
patience = {patience}
[store]
device_rows = 64
host_rows = 16
"""


def _data(folder: Path) -> list[int]:
    """Write the CSV and spec; returns the labels in file order."""
    rng = random.Random(1)
    labels = [int(rng.random() < 0.4) for _ in range(800)]
    rng = random.Random(2)
    rows = [f"u{rng.randint(0, 60)},i{rng.randint(0, 60)},{rng.random():.3f},{y}" for y in labels]
    (folder / "d.csv").write_text("user,item,x,click\n" + "\n".join(rows) + "\n")
    (folder / "spec.toml").write_text(SPEC)
    return labels


def _config(folder: Path, *, steps: int, patience: int) -> Path:
    path = folder / f"c_{steps}_{patience}.toml"
    path.write_text(CONFIG.format(spec=folder / "spec.toml", steps=steps, patience=patience))
    return path


def _evals(run: Path) -> list[dict]:
    return [
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"
    ]


def test_best_tracker_selects_by_the_chosen_metric_and_counts_patience():
    t = BestTracker(select="logloss", patience=2)
    assert t.update(Evaluation(step=10, auc=0.6, logloss=0.7))
    assert not t.update(Evaluation(step=20, auc=0.9, logloss=0.7))  # equal is not better
    assert not t.exhausted
    assert not t.update(Evaluation(step=30, auc=0.9, logloss=0.8))
    assert t.exhausted and t.best is not None and t.best.step == 10
    restored = BestTracker(select="logloss", patience=2)
    restored.load(json.loads(json.dumps(t.state())))
    assert restored.best == t.best and restored.bad == 2
    by_auc = BestTracker(select="auc", patience=0)
    for step, auc in [(10, 0.6), (20, None), (30, 0.7), (40, 0.65)]:
        by_auc.update(Evaluation(step=step, auc=auc, logloss=1.0))
    assert by_auc.best is not None and by_auc.best.step == 30 and not by_auc.exhausted


@pytest.fixture(scope="module")
def overfit(tmp_path_factory) -> tuple[Path, list[int], Path]:
    from tests.conftest import subprocess_env

    folder = tmp_path_factory.mktemp("noise")
    labels = _data(folder)
    run = folder / "run"
    run_train(_config(folder, steps=300, patience=3), run, env=subprocess_env())
    return folder, labels, run


def test_the_split_report_and_baseline_match_a_hand_count(overfit):
    _, labels, run = overfit
    summary = json.loads((run / "summary.json").read_text())
    train, held = labels[:400], labels[400:]  # a positional split: the last half is held out
    for name, part in (("train", train), ("eval", held)):
        assert summary["splits"][name] == {
            "rows": 400,
            "positives": sum(part),
            "positive_rate": sum(part) / 400,
            "sampled": False,
        }
    p, q = sum(train) / 400, sum(held) / 400
    expected = -(q * math.log(p) + (1 - q) * math.log(1 - p))  # by hand
    assert summary["constant_logloss"] == pytest.approx(expected, rel=1e-12)
    assert all(r["constant_logloss"] == pytest.approx(expected, rel=1e-12) for r in _evals(run))
    # Noise labels: the last model is worse than the constant, and the run says so.
    assert summary["logloss"] > expected
    assert any(w.startswith("THE MODEL IS NO BETTER THAN A CONSTANT") for w in summary["warnings"])


def test_a_rising_held_out_loss_keeps_the_best_checkpoint_and_stops_after_patience(overfit):
    _, _, run = overfit
    summary = json.loads((run / "summary.json").read_text())
    evals = _evals(run)
    best = min(evals, key=lambda r: r["logloss"])
    assert summary["stopped_early"] is True
    assert summary["best"]["step"] == best["step"] and summary["best"]["logloss"] == best["logloss"]
    assert summary["steps"] == best["step"] + 3 * 10 < 300  # three evaluations without improvement
    assert (
        summary["last"]["step"] == summary["steps"]
        and summary["last"]["logloss"] > summary["best"]["logloss"]
    )
    assert summary["best"]["digest"] != summary["model_digest"]
    (kept,) = sorted((run / "best").glob("step_*"))
    assert kept.name == f"step_{best['step']:08d}" and verify_checkpoint(kept) == []
    assert checkpoint_meta(kept)["step"] == best["step"]
    assert [r["best"] for r in evals] == [
        r["logloss"] < min(e["logloss"] for e in evals[:i]) if i else True for i, r in enumerate(evals)
    ]


def test_resume_across_a_best_checkpoint_update_gives_the_same_digest_and_best(overfit, cli_env):
    folder, _, whole_run = overfit
    whole = json.loads((whole_run / "summary.json").read_text())
    assert whole["best"]["step"] >= 20
    first = whole["best"]["step"] - 10  # the first part ends before the best evaluation
    part = folder / "part"
    run_train(_config(folder, steps=first, patience=3), part, env=cli_env)
    run_train(_config(folder, steps=300, patience=3), part, "--resume", env=cli_env)
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["best"]["step"] > first  # the best was updated after the resume
    assert resumed["model_digest"] == whole["model_digest"]
    assert {k: v for k, v in resumed["best"].items() if k != "checkpoint"} == {
        k: v for k, v in whole["best"].items() if k != "checkpoint"
    }
    assert resumed["steps"] == whole["steps"] and resumed["stopped_early"]
