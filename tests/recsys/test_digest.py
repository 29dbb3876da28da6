"""The model digest hashes rows in id order: the same state gives the same digest under any sharding."""

from __future__ import annotations

import torch

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks

SMALL = [
    "synthetic.num_sparse=3",
    "synthetic.id_spaces=[50, 37, 64]",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
]


def _digest_after_edit(rank: int, world_size: int, arg: tuple[list[str], bool]) -> str:
    """Build the sharded model, give rows with id % 3 == 0 a known new value and state, and digest."""
    from recsys.distributed import init_distributed
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    overrides, nudge = arg
    cfg = config_from_dict({}, [*overrides, f"train.nproc={world_size}"])
    trainer = Trainer(cfg, init_distributed(threads_per_rank=1), out_dir=None)  # type: ignore[arg-type]
    with torch.no_grad():
        for shard in local_shards(trainer.dmp, trainer.tables):
            ids = torch.arange(shard.row_offset, shard.row_offset + shard.weight.shape[0])
            rows = (ids % 3 == 0).nonzero().squeeze(1)
            shard.weight[rows] = (ids[rows, None] * 0.25 + torch.arange(shard.weight.shape[1])).float()
            if shard.state is not None:
                shard.state[rows] = 1.5
            if nudge and shard.table == "t_cat_1" and len(rows):
                shard.weight[rows[-1], 0] = torch.nextafter(shard.weight[rows[-1], 0], torch.tensor(1e9))
    return trainer.digest()


OPTIMIZERS = ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"]


def _digests(rank: int, world_size: int, arg: tuple[list[str], bool]) -> list[str]:
    base, nudge = arg
    return [
        _digest_after_edit(rank, world_size, ([*base, f"sparse.optimizer={o}"], nudge)) for o in OPTIMIZERS
    ]


def test_digest_is_independent_of_sharding_and_world_size():
    """Per optimizer: world size 1, table-wise on 2 ranks and row-wise on 2 ranks hash the same state alike."""
    (one,) = run_ranks(world_size=1, fn=_digests, arg=(SMALL, False))
    assert len(set(one)) == 3  # the optimizer state is part of the digest
    table_wise = run_ranks(world_size=2, fn=_digests, arg=(SMALL, False))
    row_wise = run_ranks(world_size=2, fn=_digests, arg=([*SMALL, "sparse.sharding=row_wise"], False))
    assert table_wise == [one, one]
    assert row_wise == [one, one]


def test_digest_sees_one_ulp():
    (plain,) = run_ranks(world_size=1, fn=_digest_after_edit, arg=(SMALL, False))
    (nudged,) = run_ranks(world_size=1, fn=_digest_after_edit, arg=(SMALL, True))
    assert nudged != plain
