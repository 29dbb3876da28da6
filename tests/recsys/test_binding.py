"""The owners' row-change stream (recsys/binding.py) against an oracle built from the batches alone.

Every rank records the changes its binding emits during a fit, and the ids of the batches it trained on
(read again from the dataset). The oracle takes, per step and table, the unique ids of all ranks'
batches: each must be put by exactly one rank (its owner: the hash of the id row-wise, one rank per
table table-wise). With bounds, the oracle decides each owner's share itself with
``embedding_store.bounds.TableBounds`` (ids and their occurrences over all ranks' batches, in step
order): the puts are the ids that read their own row, plus the default row on its owner, and the
deletions are exactly the rows the rules removed. A tiered run and an in-memory run emit the same stream.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks
from tests.recsys.test_bounded import BASE

STEPS = 80
BOUNDS = (
    "store.bounds={admit_after=2, admit_window_steps=50, expire_after_steps=20, "
    "cat_1={expire_after_steps=0, max_rows=100}}"
)


def _stream(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Per placement (tiered, in memory): the changes this rank's binding emitted, the ids of its batches
    per step and feature, and the bounded tables' default ids."""
    from recsys.build import fold_source
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.routing import values_by_feature
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out = {}
    for placement in ("tiered", "memory"):
        cfg = config_from_dict(
            {},
            [
                *BASE,
                *overrides,
                f"train.steps={STEPS}",
                f"train.nproc={world_size}",
                f"store.tiered={str(placement == 'tiered').lower()}",
            ],
        )
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            changes = []
            trainer.binding.changes.subscribe(changes.append)
            trainer.start(resume=False)
            trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            bounded = trainer.binding.bounded
            trainer.close()
            batches = trainer.data.train_batches(
                rank=rank, world_size=world_size, batch_size=cfg.train.batch_size, start_step=0
            )
            ids = {
                step: {f: v.numpy() for f, v in values_by_feature(batch.sparse).items()}
                for step, batch in fold_source(batches, trainer.fold, (0, STEPS))
            }
        out[placement] = {
            "changes": [(c.batch_id, c.table, c.deleted.tolist(), c.put.tolist()) for c in changes],
            "ids": ids,
            "defaults": {} if bounded is None else dict(bounded.default_ids),
        }
    return out


def _oracle(
    results: list[dict], placement: str, *, world_size: int, row_wise: bool, rules: dict
) -> dict[tuple[int, str], tuple[set[int], set[int]]]:
    """(step, table) -> (deleted, put) over all ranks, from the batches alone."""
    import torch

    from embedding_store.bounds import TableBounds
    from recsys.routing import owner_of_ids

    runs = [r[placement] for r in results]
    defaults = runs[0]["defaults"]
    features = sorted(runs[0]["ids"][0])
    # the owner of a table-wise table: the one rank that emitted changes of it (checked unique below)
    table_owner = {}
    for rank, run in enumerate(runs):
        for _, table, _, _ in run["changes"]:
            assert table_owner.setdefault(table, rank) == rank or row_wise
    bounds = {}
    expected = {}
    for step in range(STEPS):
        for f in features:
            table = f"t_{f}"
            values = np.concatenate([run["ids"][step][f] for run in runs])
            uniq, counts = np.unique(values, return_counts=True)
            if row_wise and world_size > 1:
                owners = owner_of_ids(torch.from_numpy(uniq), world_size).numpy()
            else:
                owners = np.full(uniq.shape[0], table_owner.get(table, 0))
            put: set[int] = set()
            deleted: set[int] = set()
            for owner in range(world_size):
                mine = owners == owner
                if table in rules:
                    tb = bounds.setdefault((table, owner), TableBounds(rules[table]))
                    decision = tb.decide(step, uniq[mine], counts[mine])
                    put |= set(uniq[mine][decision.own].tolist())
                    deleted |= set(decision.removed.tolist())
                else:
                    put |= set(uniq[mine].tolist())
            if table in defaults:
                put.add(defaults[table])
            expected[(step, table)] = (deleted, put)
    return expected


@pytest.mark.parametrize(
    ("world_size", "sharding", "mode", "bounds"),
    [
        (1, "table_wise", "pipelined", True),
        (2, "row_wise", "pipelined", True),
        pytest.param(2, "table_wise", "sequential", True, marks=pytest.mark.slow),
        pytest.param(2, "row_wise", "sequential", False, marks=pytest.mark.slow),
    ],
)
def test_row_changes_are_the_batches_ids_on_their_owners_and_the_bounds_decisions(
    world_size, sharding, mode, bounds
):
    overrides = [f"sparse.sharding={sharding}", f"pipeline.mode={mode}"] + ([BOUNDS] if bounds else [])
    results = run_ranks(world_size=world_size, fn=_stream, arg=overrides)
    rules = {}
    if bounds:
        cfg = config_from_dict({}, [*BASE, *overrides])
        features = sorted(results[0]["tiered"]["ids"][0])
        rules = {f"t_{f}": r for f, r in cfg.store.bounds_rules(features).items()}
    row_wise = sharding == "row_wise"
    placements = ("tiered", "memory") if bounds else ("tiered",)
    for placement in placements:
        expected = _oracle(results, placement, world_size=world_size, row_wise=row_wise, rules=rules)
        got: dict[tuple[int, str], tuple[set[int], set[int]]] = {}
        for r in results:
            steps = [c[0] for c in r[placement]["changes"]]
            assert steps == sorted(steps), "emitted in batch order"
            for step, table, deleted, put in r[placement]["changes"]:
                assert put == sorted(set(put)) and deleted == sorted(set(deleted))
                d, p = got.setdefault((step, table), (set(), set()))
                assert not (p & set(put)), f"step {step} {table}: an id put by two ranks"
                d |= set(deleted)
                p |= set(put)
        assert got == expected, placement
        if bounds:
            assert any(d for d, _ in got.values()), "the rules removed rows"
    if bounds:  # where the rows live cannot change the stream
        assert [r["tiered"]["changes"] for r in results] == [r["memory"]["changes"] for r in results]
    else:  # plain in-memory tables are not routed: nothing is emitted
        assert all(not r["memory"]["changes"] for r in results)


def test_nothing_is_kept_while_no_reader_listens_and_a_reader_can_leave():
    import torch

    from recsys.binding import OwnerRouting

    routing = OwnerRouting({"t"}, names=["t"], row_wise=False)

    routing.route(0, {"t": torch.tensor([3, 1, 3])}, channel="train")
    routing.finish(0)
    assert not routing._pending
    seen = []
    leave = routing.changes.subscribe(seen.append)
    routing.route(1, {"t": torch.tensor([5, 2, 5])}, channel="train")
    routing.route(2, {"t": torch.tensor([7])}, channel="eval")  # evaluation changes nothing
    routing.finish(2)
    assert seen == []  # not before the batch's optimizer step
    routing.finish(1)
    assert [(c.batch_id, c.table, c.put.tolist(), c.deleted.tolist()) for c in seen] == [(1, "t", [2, 5], [])]
    leave()
    routing.route(3, {"t": torch.tensor([9])}, channel="train")
    routing.finish(3)
    assert len(seen) == 1
