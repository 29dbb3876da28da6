"""The tuner's replay of bounded tables (recsys/tune/replay.py BoundsReplay): ids without a row of their own
enter the trace as the table's default row, so the cache is sized for the admitted rows only. The oracle
is recsys.bounded.BoundedTables run by hand, owner by owner, on the same batches in step order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.bounded import DEFAULT, BoundedTables, default_id
from recsys.config import config_from_dict
from recsys.data.source import build_dataset
from recsys.routing import owner_of_ids, values_by_feature
from recsys.tune.replay import replay

BASE = [
    "synthetic.num_sparse=2",
    "synthetic.eval_samples=256",
    "store.tiered=true",
    "train.batch_size=64",
    "train.steps=40",
    "eval.batch_size=64",
]
NAME, FEATURE = "t_cat_0", "cat_0"


def _expected(cfg, world: int, row_wise: bool) -> tuple[list[list[set[int]]], list[set[int]], int, int]:
    """Per owner, each replayed batch's distinct ids as the run routes them (training, then the final
    evaluation); per owner the ids admitted at some step; the default row's id; rows held at the end."""
    data = build_dataset(cfg.data, synthetic=cfg.synthetic, seed=cfg.train.seed)
    rule = cfg.store.bounds_rules(data.feature_names)[FEATURE]
    default = default_id(dict(zip(data.feature_names, data.id_spaces, strict=True))[FEATURE])
    owners = world if row_wise else 1
    tables = [BoundedTables({NAME: rule}, {NAME: default}, {NAME}) for _ in range(owners)]

    def owner_of(ids: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(ids)
        return owner_of_ids(t, world).numpy() if owners > 1 else np.zeros(ids.shape[0], np.int64)

    def batch(ranks: list, step: int | None) -> list[set[int]]:
        values = [values_by_feature(b.sparse)[FEATURE].numpy() for b in ranks]
        uniq, counts = np.unique(np.concatenate(values), return_counts=True)
        mapped = {}
        for o, table in enumerate(tables):
            mine, occ = uniq[owner_of(uniq) == o], counts[owner_of(uniq) == o]
            ids = {NAME: torch.from_numpy(mine)}
            if step is None:
                got = table.lookup(ids)[NAME].numpy()
            else:
                got = table.decide(step, ids, {NAME: torch.from_numpy(occ)}).owner_ids[NAME].numpy()
                admitted[o] |= set(mine[got != DEFAULT].tolist())
            mapped.update(zip(mine.tolist(), np.where(got == DEFAULT, default, got).tolist(), strict=True))
        sent = {mapped[i] for v in values for i in v.tolist()} | {default}
        return [{i for i in sent if owner_of(np.array([i]))[0] == o} for o in range(owners)]

    admitted: list[set[int]] = [set() for _ in range(owners)]
    batches: list[list[set[int]]] = [[] for _ in range(owners)]
    sources = [
        data.train_batches(rank=r, world_size=world, batch_size=cfg.train.batch_size, start_step=0)
        for r in range(world)
    ]
    for step in range(cfg.train.steps):
        for o, ids in enumerate(batch([next(s) for s in sources], step)):
            batches[o].append(ids)
    evals = [
        data.eval_batches(rank=r, world_size=world, batch_size=cfg.eval.batch_size) for r in range(world)
    ]
    for parts in zip(*evals, strict=True):
        for o, ids in enumerate(batch(list(parts), None)):
            batches[o].append(ids)
    rows = sum(t.counters()[NAME]["rows"] for t in tables)
    return batches, admitted, default, rows


@pytest.mark.parametrize(
    ("world", "sharding", "id_space"),
    # 30 ids: soon every id is admitted, and a batch holds the default row only because the run routes it
    [(1, "table_wise", 5000), (2, "row_wise", 5000), (1, "table_wise", 30)],
)
def test_replayed_traces_hold_the_admitted_ids_and_the_default_row(world, sharding, id_space):
    overrides = [
        *BASE,
        f"sparse.sharding={sharding}",
        f"train.nproc={world}",
        f"synthetic.id_space={id_space}",
    ]
    cfg = config_from_dict({}, [*overrides, "store.bounds={admit_after=3, cat_1={admit_after=1}}"])
    result = replay(cfg)
    batches, admitted, default, rows = _expected(cfg, world, sharding == "row_wise")
    assert result.bounded_rows == {NAME: rows}  # cat_1's rule is inactive: not bounded
    home = int(owner_of_ids(torch.tensor([default]), world)[0]) if sharding == "row_wise" else 0
    assert all(admitted)  # every owner admitted some ids
    for o, trace in enumerate(result.traces[NAME]):
        distinct = sorted(admitted[o] | ({default} if o == home else set()))
        assert trace.num_ids == len(distinct)
        # compact ids are ranks among the trace's sorted distinct raw ids: decode them, batch by batch
        raw = np.array(distinct, dtype=np.int64)
        got = [
            set(raw[trace.ids[a:b]].tolist())
            for a, b in zip(trace.offsets[:-1], trace.offsets[1:], strict=True)
        ]
        assert got == batches[o]
    unbounded = replay(config_from_dict({}, overrides))
    if id_space > 1000:
        assert sum(t.num_ids for t in unbounded.traces[NAME]) > 2 * sum(len(a) for a in admitted)
    assert unbounded.bounded_rows == {}
    # an unbounded table replays as before
    assert [t.num_ids for t in result.traces["t_cat_1"]] == [t.num_ids for t in unbounded.traces["t_cat_1"]]
