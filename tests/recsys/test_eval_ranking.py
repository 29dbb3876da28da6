"""``[eval] group_by``: a run reports gauc, ndcg_at_10 and recall_at_10 of its held-out split, as
recsys/ranking.py computes them from the split's logits, labels and the group feature's ids."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np

from recsys import plot
from recsys.config import load_config
from recsys.data.source import build_dataset
from recsys.ranking import ranking_metrics
from recsys.serving.evaluate import evaluate_checkpoint
from tests.recsys.tiny import run_train, tiny_config

RANKED = ("gauc", "ndcg_at_10", "recall_at_10")


def test_a_run_reports_ranking_metrics_over_its_groups(tmp_path, cli_env) -> None:
    config = tmp_path / "ranked.toml"
    config.write_text(
        tiny_config(
            # requests of 16 samples sharing cat_0 (the "user"), 4 requests interleaved
            synthetic={"request_size": 16, "user_features": 1, "interleave": 4},
            store={"tiered": False},
            train={"steps": 60, "nproc": 1},
            eval={"every": 30, "group_by": "cat_0"},
        )
    )
    run = tmp_path / "run"
    proc = run_train(config, run, env=cli_env)
    summary = json.loads((run / "summary.json").read_text())
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [30, 60]
    for name in RANKED:
        assert 0.0 <= summary[name] <= 1.0 and summary[name] == evals[-1][name]
    assert "gauc " in proc.stdout + proc.stderr  # on the evaluation's line
    curves = plot.curves(plot.read_records(run / "metrics.jsonl")[0])
    assert curves.gauc == [r["gauc"] for r in evals]  # drawn beside the AUC
    if importlib.util.find_spec("matplotlib") is not None:
        png, _, _ = plot.plot_run(run, tmp_path / "curves.png")
        assert png.stat().st_size > 10_000

    # the oracle: the held-out logits and labels, and each sample's first cat_0 id, in evaluation order
    (result,) = evaluate_checkpoint(run, keep_logits=True)
    cfg = load_config(config, [])
    data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
    groups = np.concatenate(
        [
            b.sparse["cat_0"].values().numpy()
            for b in data.eval_batches(rank=0, world_size=1, batch_size=cfg.eval.batch_size)
        ]
    )
    expected = ranking_metrics(result["logits"], result["labels"], groups)
    assert expected["groups"] > 10 and expected["gauc_groups"] > 5
    for name in RANKED:
        assert summary[name] == expected[name] == result[name]
        assert math.isfinite(expected[name])


def test_group_by_must_name_a_sparse_feature(tmp_path, cli_env) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        tiny_config(store={"tiered": False}, train={"steps": 1, "nproc": 1}, eval={"group_by": "user"})
    )
    proc = run_train(config, tmp_path / "run", env=cli_env, check=False)
    assert proc.returncode == 2
    assert (
        "eval.group_by = 'user': not a sparse feature of the data (cat_0, cat_1, cat_2, cat_3)" in proc.stderr
    )
