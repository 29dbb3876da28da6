"""A run whose loss, dense gradients or embedding rows become non-finite stops with one line naming them."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks
from tests.recsys.tiny import run_train, tiny_config

SMALL = [
    "synthetic.num_sparse=2",
    "synthetic.id_spaces=[50, 40]",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
]


def test_a_diverging_run_stops_with_one_line_naming_the_step_and_the_loss(tmp_path, cli_env):
    config = tmp_path / "c.toml"
    config.write_text(
        tiny_config(train={"steps": 60, "nproc": 2, "log_every": 10, "dense_learning_rate": 1e30})
    )
    proc = run_train(config, tmp_path / "run", env=cli_env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"recsys: error: training diverged at step \d+: the loss \((nan|inf|-inf)\) on rank [01] is not finite; "
        r"lower train\.dense_learning_rate \(1e\+30\) or sparse\.learning_rate \(0\.05\), or check the input data",
        last,
    ), last
    assert not (tmp_path / "run" / "summary.json").exists()
    metrics = tmp_path / "run" / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        json.loads(line, parse_constant=lambda token: pytest.fail(f"non-JSON token {token}"))


def _found(rank: int, world_size: int, tiered: bool) -> dict[str, str]:
    """What ``_nonfinite`` names after each kind of poisoning, on a freshly built model."""
    from recsys.distributed import init_distributed
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    cfg = config_from_dict({}, [*SMALL, f"train.nproc={world_size}", f"store.tiered={str(tiered).lower()}"])
    trainer = Trainer(cfg, init_distributed(threads_per_rank=1), out_dir=Path(tempfile.mkdtemp()))
    found = {
        "clean": trainer.health.nonfinite(0.5, rows=True),
        "loss": trainer.health.nonfinite(math.nan, rows=True),
    }
    with torch.no_grad():
        shard = next(s for s in local_shards(trainer.dmp, trainer.tables) if s.table == "t_cat_1")
        shard.weight[7, 3] = math.inf
        found["row, not scanned"] = trainer.health.nonfinite(0.5, rows=False)
        found["row"] = trainer.health.nonfinite(0.5, rows=True)
        # 3 rows of each shard per scan, in turn: rows 0-2, then 3-5 pass; 6-8 holds row 7
        found["row, in turn"] = [trainer.health.nonfinite(0.5, rows=True, budget=3) for _ in range(3)]
        shard.weight[7, 3] = 0.0
        name, param = trainer.health.dense_params()[2]
        param.grad = torch.zeros_like(param)
        param.grad.view(-1)[0] = math.nan
        found["gradient"] = trainer.health.nonfinite(0.5, rows=False)
        found["gradient name"] = name
    return found


@pytest.mark.parametrize("tiered", [False, True])
def test_the_first_non_finite_quantity_is_named(tiered):
    (found,) = run_ranks(world_size=1, fn=_found, arg=tiered)
    assert found["clean"] == ""
    assert found["loss"] == "the loss (nan)"
    assert found["row, not scanned"] == ""
    assert found["row"] == f"{'slot' if tiered else 'row'} 7 of embedding table t_cat_1"
    assert found["row, in turn"] == ["", "", found["row"]]
    assert found["gradient"] == f"the gradient of dense parameter {found['gradient name']}"


def _agreed(rank: int, world_size: int, _arg: None) -> str:
    """Only rank 1 sees a non-finite loss; every rank must stop with the same message."""
    from recsys.distributed import init_distributed
    from recsys.errors import UserError
    from recsys.trainer import Trainer

    cfg = config_from_dict({}, [*SMALL, f"train.nproc={world_size}"])
    trainer = Trainer(cfg, init_distributed(threads_per_rank=1), out_dir=None)  # type: ignore[arg-type]
    step = 12
    trainer.health.check(0.5, step=step)  # nobody sees a problem: no error
    try:
        trainer.health.check(math.inf if rank == 1 else 0.5, step=step)
    except UserError as err:
        return str(err)
    return ""


def test_all_ranks_stop_together_when_one_rank_sees_a_non_finite_loss():
    messages = run_ranks(world_size=2, fn=_agreed)
    assert messages[0] == messages[1]
    assert messages[0].startswith("training diverged at step 12: the loss (inf) on rank 1 is not finite")


def test_the_row_scan_finds_the_first_non_finite_row_as_a_full_mask_does():
    """Row sums flag the suspects; rows whose finite values overflow their sum are not reported."""
    from recsys.health import _first_nonfinite_row

    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        weight = torch.randn(int(torch.randint(1, 400, (1,), generator=gen)), 5, generator=gen)
        for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):  # finite rows whose sum overflows
            r = int(torch.randint(0, weight.shape[0], (1,), generator=gen))
            weight[r, :2] = 3e38
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            r, c = (int(torch.randint(0, n, (1,), generator=gen)) for n in weight.shape)
            weight[r, c] = [math.nan, math.inf, -math.inf][trial % 3]
        mask = (~torch.isfinite(weight)).any(dim=1).nonzero()
        want = int(mask[0, 0]) if mask.numel() else None
        assert _first_nonfinite_row(weight) == want, trial
