"""Resume in process: every dense optimizer's state (Adam's is created lazily) comes back exactly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks

BASE = [
    "synthetic.num_sparse=3",
    "synthetic.id_space=500",
    "synthetic.eval_samples=64",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=32",
    "train.checkpoint_every=10",
]


def _digests(rank: int, world_size: int, optimizer: str) -> tuple[str, str]:
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)

    def train(out: Path, steps: int, resume: bool) -> str:
        cfg = config_from_dict({}, [*BASE, f"train.dense_optimizer={optimizer}", f"train.steps={steps}"])
        trainer = Trainer(cfg, env, out_dir=out)
        trainer.start(resume=resume)
        trainer.fit(MetricsLog(out / "metrics.jsonl", enabled=False))
        digest = trainer.digest()
        trainer.close()
        return digest

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        whole = train(Path(a), 30, resume=False)
        train(Path(b), 10, resume=False)  # ends with a checkpoint at step 10
        resumed = train(Path(b), 30, resume=True)
    return whole, resumed


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd"])
def test_resume_restores_dense_optimizer_state(optimizer):
    ((whole, resumed),) = run_ranks(world_size=1, fn=_digests, arg=optimizer)
    assert whole == resumed
