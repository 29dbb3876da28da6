"""Config mapping: TOML + --set overrides onto the components' dataclasses, and its one-line errors."""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest

from recsys.config import ConfigError, config_from_dict, config_to_dict, load_config, parse_override
from recsys.models import ModelName
from recsys.sparse import ShardingKind


def test_quickstart_loads_and_overrides_apply(repo_root):
    cfg = load_config(
        repo_root / "configs/quickstart.toml", ["train.steps=7", "train.seed=3", "model.name=dcn"]
    )
    assert cfg.train.steps == 7 and cfg.train.seed == 3 and cfg.model.name is ModelName.DCN
    assert cfg.synthetic.num_dense == 13 and cfg.synthetic.num_sparse == 26


def test_override_values_are_typed():
    cfg = config_from_dict(
        {}, ["sparse.sharding=row_wise", "model.dense_arch=[32, 16]", "sparse.learning_rate=1"]
    )
    assert cfg.sparse.sharding is ShardingKind.ROW_WISE
    assert cfg.model.dense_arch == (32, 16)
    assert cfg.sparse.learning_rate == 1.0 and isinstance(cfg.sparse.learning_rate, float)


def test_config_round_trips_through_dict():
    cfg = config_from_dict({}, ["train.steps=5", "model.name=logistic"])
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=1"], "unknown config key 'train.stepz'; valid keys of [train]: steps, batch_size"),
        (["train.steps=abc"], "train.steps must be an integer, got 'abc'"),
        (["train.steps=2.5"], "train.steps must be an integer, got 2.5"),
        (["model.name=bert"], "model.name must be one of ['dlrm', 'dcn', 'logistic'], got 'bert'"),
        (["train.steps=0"], "steps must be >= 1, got 0"),
        (["nosuch.key=1"], "unknown config section 'nosuch'"),
        (["steps=10"], "--set expects section.key=value, got 'steps=10'"),
        (["train.steps"], "--set expects section.key=value, got 'train.steps'"),
        (["synthetic.id_space=9223372036854775809"], "id_space"),
        (["train.nproc=3"], "train.batch_size (1024) must be divisible by train.nproc (3)"),
    ],
)
def test_bad_overrides_name_the_culprit(overrides, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown config section \[trian\]; valid sections: data, synthetic, model"
    ):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_parse_override_reads_toml_values():
    assert parse_override("a.b=true") == ("a", "b", True)
    assert parse_override("a.b = [1, 2]") == ("a", "b", [1, 2])
    assert parse_override("a.b=row_wise") == ("a", "b", "row_wise")


def test_unknown_data_source_is_a_user_error():
    from recsys.data.source import build_dataset
    from recsys.errors import UserError

    cfg = config_from_dict({"data": {"source": "nowhere"}})
    with pytest.raises(UserError, match="unknown data source 'nowhere'; valid: synthetic"):
        build_dataset(cfg.data, synthetic=cfg.synthetic, seed=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_pipeline_section_lowers_the_calling_threads_priority_by_worker_nice():
    """The ``on_start`` of the tier prefetch and device fill stages (``recsys.tiered.tiered_feed``)."""
    section = config_from_dict({}, ["pipeline.worker_nice=4"]).pipeline
    seen: list[tuple[int, int]] = []

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        section.lower_worker_priority()
        seen.append((before, os.getpriority(os.PRIO_PROCESS, tid)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    ((before, after),) = seen
    assert after == min(19, before + 4)


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"admit_after": 2.5}, "store.bounds.admit_after must be an integer, got 2.5"),
        ({"max_rows": "many"}, "store.bounds.max_rows must be an integer, got 'many'"),
        ({"cat_0": {"admit_after": True}}, "store.bounds.cat_0.admit_after must be an integer, got True"),
        ({"cat_0": 3}, "bounds.cat_0 = 3: unknown key"),
    ],
)
def test_a_bounds_value_of_the_wrong_type_names_the_expected_type(bounds, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"store": {"bounds": bounds}})


def test_bounds_for_a_feature_outside_store_tables_is_refused_with_the_fix():
    """A sub-table for a feature that store.tables leaves out would bound nothing: it is refused, not
    dropped (issue 50, defect c); within store.tables it applies."""
    store = {"tables": ["cat_0"], "bounds": {"cat_1": {"max_rows": 100}}}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"store": store})
    assert str(err.value) == (
        "[store] bounds.cat_1 bounds a table that store.tables does not list (cat_0): add 'cat_1' to "
        "store.tables, or remove [store.bounds.cat_1]"
    )
    applied = config_from_dict({"store": {"tables": ["cat_0", "cat_1"], "bounds": store["bounds"]}})
    assert applied.store.bounds_rules(["cat_0", "cat_1", "cat_2"])["cat_1"].max_rows == 100
    everywhere = config_from_dict({"store": {"bounds": store["bounds"]}})  # no store.tables: every feature
    assert set(everywhere.store.bounds_rules(["cat_0", "cat_1"])) == {"cat_1"}
