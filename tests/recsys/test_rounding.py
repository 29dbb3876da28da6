"""``sparse.fp16_rounding = stochastic`` (recsys.rounding): after every training step, exactly the rows the
step updated are rounded to float16 values, each as embedding_store.rounding rounds it with the key of
(seed, table, step) and the row's id — checked against that oracle on 2 ranks row-wise (ids = the shard's
row offset + its row). Tiered == in memory with it is tests/recsys/test_tiered.py's fp16 cases."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks

OVERRIDES = [
    "synthetic.num_sparse=2",
    "synthetic.id_space=3000",
    "synthetic.eval_samples=64",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
    "train.steps=12",
    "train.seed=7",
    "eval.batch_size=64",
    "sparse.sharding=row_wise",
    "sparse.optimizer=exact_sgd",
    "sparse.learning_rate=0.3",
    "sparse.max_rows_per_table=3000",
    "sparse.weights_precision=fp16",
    "store.tiered=false",
]


def _exact(w: torch.Tensor) -> torch.Tensor:
    """(S,) True where a row's values are all float16 numbers."""
    return (w.half().float().view(torch.int32) == w.view(torch.int32)).all(dim=1)


def _check(rank: int, world_size: int, _: object) -> dict:
    from embedding_store.rounding import round_values, step_key
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    cfg = config_from_dict({}, [*OVERRIDES, f"train.nproc={world_size}"])
    out = {"steps": 0, "rounded_rows": 0, "mismatched_rows": 0, "inexact_after": 0, "offsets": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, env, out_dir=Path(tmp))
        trainer.start(resume=False)
        shards = list(local_shards(trainer.dmp, trainer.tables))
        out["offsets"] = sorted({s.row_offset for s in shards})
        out["dtypes"] = sorted({str(s.weight.dtype) for s in shards})
        out["initial_exact"] = all(bool(_exact(s.weight).all()) for s in shards)
        rounding = trainer.rounding
        assert rounding is not None
        original = rounding.after_step

        def checked(step: int) -> None:
            before = [s.weight.detach().clone() for s in shards]
            original(step)
            out["steps"] += 1
            for shard, b in zip(shards, before, strict=True):
                updated = (~_exact(b)).nonzero().squeeze(1)  # rows the step's update moved off float16
                expected = b.clone()
                ids = updated + shard.row_offset
                key = step_key(7, shard.table, step)
                expected[updated] = round_values(b[updated], ids, key=key)
                after = shard.weight.detach()
                out["rounded_rows"] += int(updated.numel())
                out["mismatched_rows"] += int(
                    (after.view(torch.int32) != expected.view(torch.int32)).any(1).sum()
                )
                out["inexact_after"] += int((~_exact(after)).sum())

        rounding.after_step = checked  # type: ignore[method-assign]
        trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
        trainer.close()
    return out


def test_each_step_rounds_the_rows_it_updated_as_the_oracle_does():
    results = run_ranks(world_size=2, fn=_check, arg=None)
    assert [r["offsets"] for r in results] == [[0], [1500]]  # row-wise: rank 1's ids start at 1500
    for r in results:
        assert r["dtypes"] == ["torch.float32"] and r["initial_exact"]
        assert r["steps"] == 12
        assert r["rounded_rows"] > 12 * 10  # every step updated rows off float16 values
        assert r["mismatched_rows"] == 0 and r["inexact_after"] == 0
