"""Restore onto another world size (2 -> 1, 1 -> 2): rows re-partitioned by the new ownership, same model.

A run checkpoints after ``STEPS`` steps on W ranks; ``--resume --nproc W'`` with ``train.steps = STEPS``
restores it on W' ranks (no further step) and reports the digest of what it restored, which must equal
the W-rank run's. Tiered rows are streamed from every old rank's snapshot into the store of their new
owner; plain tables (sharded by TorchRec) are reassembled from the old shards by their global offsets.
Two tables are tiered and two are plain, so both paths are exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recsys.tiny import run_train, tiny_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40

CONFIG = tiny_config(train={"steps": 40, "checkpoint_every": 20}, store={"tables": ["cat_0", "cat_2"]})


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    ("sharding", "before", "after"),
    [
        ("row_wise", 2, 1),
        pytest.param("row_wise", 1, 2, marks=pytest.mark.slow),
        pytest.param("table_wise", 2, 1, marks=pytest.mark.slow),
        pytest.param("table_wise", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_restore_onto_another_world_size_keeps_the_model(sharding, before, after, tmp_path, cli_env):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    shard = ("--set", f"sparse.sharding={sharding}")
    run_train(config, out, "--nproc", str(before), *shard, env=cli_env)
    saved = _summary(out)
    assert saved["world_size"] == before and saved["steps"] == STEPS
    resumed = run_train(config, out, "--resume", "--nproc", str(after), *shard, env=cli_env)
    assert f"re-partitioned a checkpoint of {before} ranks onto {after}" in resumed.stderr
    restored = _summary(out)
    assert restored["world_size"] == after
    assert restored["model_digest"] == saved["model_digest"]
