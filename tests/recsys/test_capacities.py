"""Where a tiered table's capacities come from when the store is not tiered, or names untiered features."""

from __future__ import annotations

import json
import shlex

import pytest

from recsys.capacities import Capacities
from recsys.config import load_config
from recsys.errors import UserError
from tests.recsys.tiny import run_train, tiny_config

SECTION = '\n[store.capacity]\ncat_0 = { device = 1500, host = "2KiB" }\ncat_3 = { host = 0 }\n'


def test_an_untiered_run_does_not_use_store_capacity(tmp_path, cli_env):
    config = tmp_path / "run.toml"
    config.write_text(tiny_config(train={"steps": 5}) + SECTION)
    proc = run_train(config, tmp_path / "run", "--set", "store.tiered=false", env=cli_env)
    assert proc.stderr.count("[store.capacity] (cat_0, cat_3) not used") == 1, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and not summary["tiered"]
    assert summary["capacities"] == {} and summary["capacities_differ_from_tune"] is None


def _error(config, *overrides: str) -> str:
    cfg = load_config(config, list(overrides))
    features = [f"cat_{i}" for i in range(4)]
    chosen = [f for f in features if f in cfg.store.tables] if cfg.store.tables else features
    with pytest.raises(UserError) as err:
        Capacities.resolve(cfg.store, chosen, row_bytes=36)
    return str(err.value)


def test_an_entry_for_an_untiered_feature_says_how_to_fix_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(tiny_config() + SECTION)
    message = _error(config, 'store.tables=["cat_0", "cat_1"]')
    assert "not tiered: ['cat_3']" in message and "Add them to store.tables" in message
    # The --set it suggests keeps the tiered tables' entries and is accepted.
    fix = shlex.split(message.split("drop their entries: ", 1)[1])
    assert fix[0] == "--set"
    cfg = load_config(config, ['store.tables=["cat_0", "cat_1"]', fix[1]])
    caps = Capacities.resolve(cfg.store, ["cat_0", "cat_1"], row_bytes=36)
    assert caps.of("cat_0") == (1500, 2048 // 36) and caps.of("cat_1") == (1400, 400)
    # With every feature tiered, an unknown name is not a feature at all.
    message = _error(config, "store.capacity={cat_9={device=5}}")
    assert "features the data does not have: ['cat_9']" in message and "store.capacity={}" in message
