"""Half-precision weights in packed rows (``TableSpec.weights_precision``): two weights to a 4-byte word,
rounded to nearest even once, carried bit for bit; a store records its tables' precision and refuses
another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreConfig,
    StoreIncompatibleError,
    TableSpec,
    TieredStore,
    WeightsPrecision,
)
from embedding_store.rows import pack_weights, row_chunk, weights_of

FP16 = WeightsPrecision.FP16


@pytest.mark.parametrize("dim", [1, 4, 7, 64])
@pytest.mark.parametrize("optimizer", list(OptimizerKind), ids=lambda o: o.name)
def test_packed_fp16_rows_hold_the_nearest_halves_and_the_state_in_float32(dim, optimizer) -> None:
    spec = TableSpec(name="t", dim=dim, optimizer=optimizer, weights_precision=FP16)
    assert spec.weight_words == (dim + 1) // 2 and spec.row_bytes == 4 * ((dim + 1) // 2 + spec.state_floats)
    rng = np.random.default_rng(dim)
    weights = rng.standard_normal((50, dim)).astype(np.float32)
    weights[0, 0] = np.float32(1 + 2**-11)  # a tie between two halves: nearest even is 1.0
    rows = np.full((50, spec.row_floats), np.nan, dtype=np.float32)
    state = rng.random((50, spec.state_floats)).astype(np.float32)
    rows[:, spec.weight_words :] = state
    pack_weights(spec, weights, rows[:, : spec.weight_words])
    got = weights_of(spec, rows)
    assert got.dtype == np.float16 and got.shape == (50, dim)
    assert np.array_equal(got.view(np.uint16), weights.astype(np.float16).view(np.uint16))
    assert got[0, 0] == 1.0
    if dim % 2:  # the odd dimension's last half-word is zero, not the NaN that was there
        assert (rows[:, : spec.weight_words].view(np.uint16)[:, dim] == 0).all()
    assert np.array_equal(rows[:, spec.weight_words :], state)  # untouched
    chunk = row_chunk(spec, np.arange(50), rows)
    assert np.array_equal(chunk.weights.numpy(), got)
    if spec.state_floats:
        assert np.array_equal(chunk.state.numpy().reshape(50, -1), state)


def test_a_dim_64_rowwise_adagrad_row_is_132_bytes_not_260() -> None:
    fp32 = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
    fp16 = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, weights_precision=FP16)
    assert (fp32.row_bytes, fp16.row_bytes) == (260, 132)
    with pytest.raises(ValueError, match="weights_precision"):
        TableSpec(name="t", dim=4, weights_precision="fp16")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["log", "btree", "memory"])
def test_a_store_refuses_a_table_of_another_precision(tmp_path: Path, layout: str) -> None:
    options = LmdbOptions(layout=layout, initial_map_size_bytes=1 << 20)
    config = StoreConfig(seed=1, device_capacity_rows=8, host_capacity_rows=8, lmdb=options)
    fp32 = TableSpec(name="t", dim=4)
    with TieredStore(tmp_path / "s", config=config, tables=[fp32]) as store:
        store.read_rows("t", np.arange(3))
    with pytest.raises(StoreIncompatibleError, match="float16|float32"):
        TieredStore(
            tmp_path / "s", config=config, tables=[TableSpec(name="t", dim=4, weights_precision=FP16)]
        )
