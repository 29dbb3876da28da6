"""``recsys evaluate`` reproduces the training run's own held-out figures from its checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from recsys.metrics import auc_logloss
from tests.recsys.serving.conftest import EVERY_RUN, STEPS, cli, summary


def test_evaluate_cli_reproduces_the_final_metrics_exactly(trained, tmp_path):
    run = trained("table_wise_2")
    out = tmp_path / "eval.json"
    proc = cli("evaluate", "--run", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    saved = summary(run)
    assert result["step"] == STEPS and result["world_size"] == 2
    assert result["auc"] == saved["auc"] and result["logloss"] == saved["logloss"]
    assert f"step {STEPS}: auc {saved['auc']:.6f}" in proc.stdout


@pytest.mark.parametrize("name", EVERY_RUN)
def test_evaluate_reproduces_the_final_metrics_and_logits(name, trained, training_logits):
    results = training_logits(name)
    saved = summary(trained(name))
    assert [r["world_size"] for r in results] == [saved["world_size"]] * saved["world_size"]
    assert results[0]["auc"] == saved["auc"] and results[0]["logloss"] == saved["logloss"]
    # The logits kept for the scorer tests are the ones those figures come from.
    logits = torch.cat([r["logits"] for r in results])
    labels = torch.cat([r["labels"] for r in results])
    assert auc_logloss(logits, labels) == (saved["auc"], saved["logloss"])


def test_evaluate_an_earlier_checkpoint_reproduces_its_evaluation(trained, tmp_path):
    run = trained("table_wise_2")
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at_10 = next(r for r in logged if r["kind"] == "eval" and r["step"] == 10)
    out = tmp_path / "eval.json"
    proc = cli("evaluate", "--run", str(run), "--checkpoint", "10", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["step"], result["auc"], result["logloss"]) == (10, at_10["auc"], at_10["logloss"])


@pytest.mark.slow
def test_evaluate_on_another_number_of_ranks_repartitions(trained, tmp_path):
    """One rank evaluates a 2-rank checkpoint: the same model, batches of other sizes (rounding only)."""
    run = trained("row_wise_2")
    out = tmp_path / "eval.json"
    proc = cli("evaluate", "--run", str(run), "--nproc", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result, saved = json.loads(out.read_text()), summary(run)
    assert result["world_size"] == 1
    assert result["auc"] == pytest.approx(saved["auc"], abs=1e-6)
    assert result["logloss"] == pytest.approx(saved["logloss"], rel=1e-6)


def test_evaluate_refuses_a_missing_or_damaged_checkpoint(trained, tmp_path):
    run = trained("table_wise_2")
    proc = cli("evaluate", "--run", str(run), "--checkpoint", "15")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().count("\n") == 0
        and "no complete checkpoint" in proc.stderr
        and "10, 20" in proc.stderr
    )

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("store"))
    rank_file = copy / "checkpoints" / f"step_{STEPS:08d}" / "rank_1.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    proc = cli("evaluate", "--run", str(copy))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "is damaged" in proc.stderr and "rank_1.pt" in proc.stderr


def test_evaluate_refuses_a_config_that_does_not_fit_the_checkpoint(trained):
    proc = cli("evaluate", "--run", str(trained("table_wise_2")), "--set", "model.over_arch=[16]")
    assert proc.returncode == 2
    assert "model.over_arch: checkpoint [32], config [16]" in proc.stderr
