"""Config validation: every bad field is a ValueError that names the field and the value."""

from __future__ import annotations

import dataclasses

import pytest

from embedding_store import LmdbOptions, OptimizerKind, PolicyKind, StoreConfig, TableSpec


@pytest.mark.parametrize(
    ("factory", "field", "value"),
    [
        (TableSpec, "name", ""),
        (TableSpec, "name", "__meta__"),
        (TableSpec, "dim", 0),
        (TableSpec, "optimizer", "exact_sgd"),
        (TableSpec, "num_embeddings", 0),
        (TableSpec, "init_scale", float("nan")),
        (TableSpec, "host_capacity_rows", -1),
        (StoreConfig, "seed", -1),
        (StoreConfig, "device_capacity_rows", 0),
        (StoreConfig, "host_capacity_rows", -5),
        (StoreConfig, "policy", "lru"),
        (StoreConfig, "lookahead_batches", -1),
        (LmdbOptions, "initial_map_size_bytes", 10),
        (LmdbOptions, "max_map_size_bytes", 1 << 16),
        (LmdbOptions, "writer_batch_rows", 0),
    ],
)
def test_bad_field_names_field_and_value(factory, field, value) -> None:
    base = {
        TableSpec: {"name": "t", "dim": 4},
        StoreConfig: {"seed": 0, "device_capacity_rows": 8, "host_capacity_rows": 8},
        LmdbOptions: {},
    }[factory]
    with pytest.raises(ValueError, match=field) as info:
        factory(**{**base, field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_configs_are_frozen_keyword_only_and_row_layout_follows_the_optimizer() -> None:
    spec = TableSpec(name="t", dim=8, optimizer=OptimizerKind.EXACT_ADAGRAD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dim = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        TableSpec("t", 8)  # type: ignore[misc]
    assert spec.row_floats == 16
    assert TableSpec(name="t", dim=8, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD).row_bytes == 36
    assert TableSpec(name="t", dim=8, optimizer=OptimizerKind.EXACT_SGD).row_floats == 8
    config = StoreConfig(seed=1, device_capacity_rows=8, host_capacity_rows=2, policy=PolicyKind.LFU)
    assert config.device_rows(TableSpec(name="t", dim=2, device_capacity_rows=3)) == 3
    assert config.host_rows(TableSpec(name="t", dim=2)) == 2
