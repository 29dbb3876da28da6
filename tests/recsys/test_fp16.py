"""Half-precision weights (``sparse.weights_precision = fp16``) across a resume onto another number of
ranks: the tiered run and the in-memory run, each stopped at step 20 on 2 ranks and resumed on 1, end
with the same digest; resuming with the other precision is refused in one line.

(Tiered == in memory without a resume, on 1 and 2 ranks, is tests/recsys/test_tiered.py's fp16 cases;
serving an fp16 bundle, tests/recsys/serving's ``fp16_2`` run.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.recsys.tiny import run_train, tiny_config

CONFIG = tiny_config(
    train={"steps": 20, "checkpoint_every": 0},
    sparse={"weights_precision": "fp16", "sharding": "row_wise"},
    store={"tables": ["cat_0", "cat_2"]},
)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


ROWS = (
    "--set",
    "sparse.exchange=rows",
    "--set",
    "pipeline.frozen_windows=2",
    "--set",
    "pipeline.cluster=keys",
)


@pytest.mark.parametrize("exchange", [(), ROWS], ids=["pooled", "rows"])
def test_fp16_resumed_on_another_world_size_equals_in_memory(tmp_path, cli_env, exchange):
    """Also with the rows exchange (recsys/exchange.py) and two key-clustered windows."""
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    digests = {}
    for tiered in ("true", "false"):
        out = tmp_path / f"tiered_{tiered}"
        mode = ("--set", f"store.tiered={tiered}", *exchange)
        run_train(config, out, "--nproc", "2", *mode, env=cli_env)
        resumed = run_train(
            config, out, "--resume", "--nproc", "1", "--set", "train.steps=40", *mode, env=cli_env
        )
        assert "re-partitioned a checkpoint of 2 ranks onto 1" in resumed.stderr
        summary = _summary(out)
        assert summary["steps"] == 40 and summary["world_size"] == 1
        digests[tiered] = summary["model_digest"]
    assert digests["true"] == digests["false"]

    if exchange:
        return
    # the same run resumed as fp32 would train another model: refused in one line, nothing changed
    out = tmp_path / "tiered_true"
    before = (out / "summary.json").read_bytes()
    proc = run_train(
        config, out, "--resume", "--set", "train.steps=60", "--set", "sparse.weights_precision=fp32",
        env=cli_env, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "sparse.weights_precision" in errors[0], proc.stderr[-2000:]
    assert (out / "summary.json").read_bytes() == before


def test_row_bytes_follow_the_precision():
    """The tuner and capacities given as sizes count rows of these bytes (recsys.tiered.row_bytes)."""
    from embedding_store import OptimizerKind, WeightsPrecision
    from recsys.sparse import SparseConfig
    from recsys.tiered import row_bytes

    half, full = (SparseConfig(weights_precision=p) for p in (WeightsPrecision.FP16, WeightsPrecision.FP32))
    assert (row_bytes(half, 64), row_bytes(full, 64)) == (
        132,
        260,
    )  # 64 weights + row-wise Adagrad's one float
    sgd = SparseConfig(optimizer=OptimizerKind.EXACT_SGD, weights_precision=WeightsPrecision.FP16)
    assert row_bytes(sgd, 7) == 16  # 7 halves round up to 4 words


def test_device_slots_follow_the_rounding():
    """Stochastic rounding trains float32 slot tables (260-byte slots, 132-byte rows below them); FBGEMM's
    float16 tables (rounding to nearest) have 132-byte slots. A device size counts slots of those bytes."""
    from embedding_store import WeightsPrecision
    from recsys.capacities import Capacities
    from recsys.config import config_from_dict
    from recsys.sparse import Fp16Rounding, SparseConfig
    from recsys.tiered import row_bytes, slot_row_bytes

    fp16 = WeightsPrecision.FP16
    stochastic = SparseConfig(weights_precision=fp16)
    nearest = SparseConfig(weights_precision=fp16, fp16_rounding=Fp16Rounding.NEAREST)
    assert (slot_row_bytes(stochastic, 64), row_bytes(stochastic, 64)) == (260, 132)
    assert (slot_row_bytes(nearest, 64), row_bytes(nearest, 64)) == (132, 132)
    assert slot_row_bytes(SparseConfig(), 64) == 260
    capacity = {"cat_0": {"device": "26000B", "host": "26400B"}}
    cfg = config_from_dict({"store": {"tiered": True, "capacity": capacity}}, [])
    caps = Capacities.resolve(cfg.store, ["cat_0"], row_bytes=132, slot_row_bytes=260)
    assert (caps.device_rows["cat_0"], caps.host_rows["cat_0"]) == (100, 200)
