"""Tiered training is bitwise identical to untiered training (docs/design.md, invariant 4), end to end.

The device tier holds at most 10% and the host tier at most 30% of the rows the run touches, so rows
really move between all three tiers (LMDB is read and written); the model digests must still be equal.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks

BASE = [
    "synthetic.num_sparse=3",
    "synthetic.id_space=20000",
    "synthetic.eval_samples=64",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=32",
    "train.steps=160",
    "eval.batch_size=16",
    "store.lookahead=2",
]


def _train(rank: int, world_size: int, overrides: list[str]) -> dict:
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out = []
    for tiered in (False, True):
        cfg = config_from_dict(
            {}, [*BASE, *overrides, f"train.nproc={world_size}", f"store.tiered={str(tiered).lower()}"]
        )
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            summary = trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            digest = trainer.digest()
            tiers = {} if trainer.tier_metrics is None else trainer.tier_metrics.store_stats()
            touched = _touched(trainer)
            dtypes = {str(s.weight.dtype) for s in local_shards(trainer.dmp, trainer.tables)}
            trainer.close()
        (dtype,) = dtypes
        out.append(
            {
                "digest": digest,
                "auc": summary["auc"],
                "tiers": tiers,
                "touched": touched,
                "weight_dtype": dtype,
            }
        )
    return {"untiered": out[0], "tiered": out[1]}


def _touched(trainer) -> int:
    """Rows the run touched, summed over tables (0 for an untiered trainer)."""
    if trainer.tiered is None:
        return 0
    return sum(len(ids) for name in trainer.tiered.names for ids, _, _ in trainer.tiered.local_rows(name))


# Together the default cases cover world sizes 1 and 2, table-wise and row-wise, row-wise Adagrad, SGD and
# Adagrad; the slow ones fill in the remaining combinations.
CASES = [
    (2, "table_wise", "exact_rowwise_adagrad"),
    (2, "row_wise", "exact_sgd"),
    (1, "table_wise", "exact_adagrad"),
    pytest.param(1, "row_wise", "exact_rowwise_adagrad", marks=pytest.mark.slow),
    pytest.param(2, "row_wise", "exact_rowwise_adagrad", marks=pytest.mark.slow),
    pytest.param(2, "table_wise", "exact_sgd", marks=pytest.mark.slow),
    pytest.param(2, "row_wise", "exact_adagrad", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world_size", "sharding", "optimizer"), CASES)
def test_tiered_digest_equals_untiered(world_size, sharding, optimizer):
    # Row-wise: every rank holds device_rows slots of each table for its share of the ids.
    device_rows, host_rows = (80, 240) if sharding == "row_wise" and world_size > 1 else (120, 360)
    results = run_ranks(
        world_size=world_size,
        fn=_train,
        arg=[
            f"sparse.sharding={sharding}",
            f"sparse.optimizer={optimizer}",
            f"store.device_rows={device_rows}",
            f"store.host_rows={host_rows}",
        ],
    )
    for r in results:
        assert r["tiered"]["digest"] == r["untiered"]["digest"]
        assert r["tiered"]["auc"] == r["untiered"]["auc"] or (math.isnan(r["tiered"]["auc"]))
    tiers = results[0]["tiered"]["tiers"]
    touched = sum(r["tiered"]["touched"] for r in results)
    owners = world_size if sharding == "row_wise" else 1
    assert device_rows * 3 * owners <= 0.1 * touched  # the device tier holds <= 10% of touched rows
    assert host_rows * 3 * owners <= 0.3 * touched  # the host tier holds <= 30%
    for table in tiers.values():
        assert table["device"]["evictions"] > 0
        assert table["ssd"]["rows_out"] > 0 or table["host"]["evictions"] > 0  # written back towards LMDB
        assert table["ssd"]["misses"] > 0 and table["host"]["hits"] > 0


# The rows exchange (sparse.exchange = rows, recsys/exchange.py): the same tiered == untiered promise, with one
# window and with four windows of a key-clustered batch (pipeline.cluster = keys).
ROWS_CASES = [
    (1, "table_wise", "exact_rowwise_adagrad", 1, ""),
    (2, "row_wise", "exact_adagrad", 4, ""),
    (2, "table_wise", "exact_sgd", 1, ""),
    (2, "row_wise", "exact_rowwise_adagrad", 2, "cat_1"),  # cat_1's table pooled inside the rows exchange,
    # and the tiers' stages run inline (pipeline.mode = sequential, below)
    pytest.param(2, "table_wise", "exact_rowwise_adagrad", 4, "", marks=pytest.mark.slow),
    pytest.param(2, "row_wise", "exact_rowwise_adagrad", 1, "", marks=pytest.mark.slow),
    pytest.param(2, "table_wise", "exact_adagrad", 4, "cat_0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world_size", "sharding", "optimizer", "windows", "pooled"), ROWS_CASES)
def test_rows_exchange_tiered_digest_equals_untiered(world_size, sharding, optimizer, windows, pooled):
    device_rows, host_rows = (80, 240) if sharding == "row_wise" and world_size > 1 else (120, 360)
    overrides = [f"sparse.sharding={sharding}", f"sparse.optimizer={optimizer}", "sparse.exchange=rows"]
    if pooled:
        overrides += [f'sparse.exchange_tables={{{pooled} = "pooled"}}', "pipeline.mode=sequential"]
    tiers = [f"store.device_rows={device_rows}", f"store.host_rows={host_rows}"]
    windowed = [f"pipeline.frozen_windows={windows}", f"pipeline.cluster={'keys' if windows > 1 else 'none'}"]
    results = run_ranks(world_size=world_size, fn=_train, arg=[*overrides, *tiers, *windowed])
    for r in results:
        assert r["tiered"]["digest"] == r["untiered"]["digest"]
    for table in results[0]["tiered"]["tiers"].values():
        assert table["device"]["evictions"] > 0 and table["ssd"]["misses"] > 0


# Half-precision weights (sparse.weights_precision = fp16): float16 values on every tier, 132-byte rows in the
# store; stochastic rounding (the default) or FBGEMM rounding to nearest.
FP16_CASES = [
    (1, "table_wise", "exact_rowwise_adagrad", "pipelined", "stochastic"),
    (2, "row_wise", "exact_sgd", "sequential", "stochastic"),
    (1, "row_wise", "exact_adagrad", "sequential", "nearest"),
    pytest.param(2, "table_wise", "exact_adagrad", "pipelined", "stochastic", marks=pytest.mark.slow),
    pytest.param(2, "row_wise", "exact_rowwise_adagrad", "pipelined", "nearest", marks=pytest.mark.slow),
    pytest.param(1, "row_wise", "exact_rowwise_adagrad", "sequential", "stochastic", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world_size", "sharding", "optimizer", "mode", "rounding"), FP16_CASES)
def test_fp16_tiered_digest_equals_untiered(world_size, sharding, optimizer, mode, rounding):
    device_rows, host_rows = (80, 240) if sharding == "row_wise" and world_size > 1 else (120, 360)
    overrides = [f"sparse.sharding={sharding}", f"sparse.optimizer={optimizer}", f"pipeline.mode={mode}"]
    tiers = [f"store.device_rows={device_rows}", f"store.host_rows={host_rows}"]
    half = [*overrides, *tiers, "sparse.weights_precision=fp16", f"sparse.fp16_rounding={rounding}"]
    results = run_ranks(world_size=world_size, fn=_train, arg=half)
    # stochastic rounding: float32 slot tables holding float16 values; nearest: FBGEMM's float16 tables
    dtype = "torch.float32" if rounding == "stochastic" else "torch.float16"
    for r in results:
        assert r["tiered"]["digest"] == r["untiered"]["digest"]
        assert r["tiered"]["auc"] == r["untiered"]["auc"] or math.isnan(r["tiered"]["auc"])
        assert r["tiered"]["weight_dtype"] == r["untiered"]["weight_dtype"] == dtype
    for table in results[0]["tiered"]["tiers"].values():
        assert table["device"]["evictions"] > 0 and table["ssd"]["misses"] > 0
