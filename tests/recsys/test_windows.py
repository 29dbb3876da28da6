"""Frozen windows (recsys/windows.py): the same training, the pooled-embedding exchange split by sample.

Oracle: the unsplit run of the same config. Windows change only the floating-point reduction order of the
dense gradients (summed window by window) and the row count of each matrix product, so after 20 steps
every dense parameter, embedding row and optimizer state agrees with the unsplit run to 1e-3 of that
tensor's largest magnitude, and the held-out log loss to a relative 1e-5. Observed: dense parameters
~3e-7, rows up to ~1e-4 (element-wise Adagrad amplifies rounding while a row's accumulated state is still
near zero), log loss ~2e-9. A run with another seed differs by more than 0.5, so the tolerance separates
"the same training" from "a different one".
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks

BASE = [
    "synthetic.num_sparse=3",
    "synthetic.id_space=5000",
    "synthetic.eval_samples=256",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
    "train.steps=20",
    "eval.batch_size=64",
    "eval.every=0",
]


def _state(trainer) -> dict[str, np.ndarray]:
    """Every dense parameter and this rank's embedding shards with their optimizer state (as numpy: the
    result crosses a process boundary)."""
    from recsys.sharding import local_shards

    out = {
        f"dense/{k}": v.detach().numpy().copy()
        for k, v in trainer.dmp.named_parameters()
        if "embedding" not in k
    }
    for shard in local_shards(trainer.dmp, trainer.tables):
        out[f"rows/{shard.table}"] = shard.weight.detach().numpy().copy()
        if shard.state is not None:
            out[f"state/{shard.table}"] = shard.state.detach().numpy().copy()
    return out


def _train(rank: int, world_size: int, overrides: list[str]) -> dict:
    import recsys.models
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    calls = [0]
    rest = recsys.models.windowed_rest

    def counting(*args):  # noqa: ANN002, ANN202 - one call per windowed training batch
        calls[0] += 1
        return rest(*args)

    recsys.models.windowed_rest = counting
    env = init_distributed(threads_per_rank=1)
    out = {}
    for name, extra in (
        ("whole", []),
        ("windows", ["pipeline.frozen_windows=4"]),
        ("seed", ["train.seed=7"]),
    ):
        cfg = config_from_dict({}, [*BASE, *overrides, *extra, f"train.nproc={world_size}"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            before = calls[0]
            summary = trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            out[name] = {"logloss": summary["logloss"], "state": _state(trainer), "split": calls[0] - before}
            trainer.close()
    return out


def _max_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest absolute difference of any tensor, relative to that tensor's largest magnitude."""
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


@pytest.mark.parametrize(
    ("world_size", "sharding", "optimizer"),
    [
        (1, "table_wise", "exact_rowwise_adagrad"),
        (2, "row_wise", "exact_sgd"),
        (2, "table_wise", "exact_adagrad"),
    ],
)
def test_frozen_windows_match_the_unsplit_batch(world_size, sharding, optimizer) -> None:
    results = run_ranks(
        world_size=world_size,
        fn=_train,
        arg=[f"sparse.sharding={sharding}", f"sparse.optimizer={optimizer}", "sparse.learning_rate=0.1"],
    )
    for r in results:
        assert r["whole"]["split"] == 0
        assert r["windows"]["split"] == 20  # every training batch went through the windows
        assert _max_rel(r["windows"]["state"], r["whole"]["state"]) < 1e-3
        assert _max_rel(r["seed"]["state"], r["whole"]["state"]) > 0.5  # the tolerance is discriminating
        assert r["windows"]["logloss"] == pytest.approx(r["whole"]["logloss"], rel=1e-5)


def test_more_windows_than_samples_is_a_config_error() -> None:
    results = run_ranks(world_size=1, fn=_expect_error, arg=[*BASE, "pipeline.frozen_windows=65"])
    assert results == ["pipeline.frozen_windows=65 is more than the 64 samples of a rank's batch"]


def _expect_error(rank: int, world_size: int, overrides: list[str]) -> str:
    from recsys.distributed import init_distributed
    from recsys.errors import UserError
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            Trainer(config_from_dict({}, overrides), env, out_dir=Path(tmp))
        except UserError as err:
            return str(err)
    return "no error"
