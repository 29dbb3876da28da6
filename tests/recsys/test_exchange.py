"""The rows exchange (recsys/exchange.py, recsys/exchange_plan.py).

Oracles: for the requests and the counters, a plain Python reference of the same batch (sets of
(feature, id) per window and per owner); for training, the pooled exchange of the same config. Tiered ==
in-memory under the rows exchange is in tests/recsys/test_tiered.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.config import config_from_dict
from recsys.exchange_plan import ID_BITS, Ownership, plan_rows, pooled_counts, rows_counts
from recsys.windows import window_sizes
from tests.multiprocess import run_ranks


def _batch(seed: int, *, features: int, batch: int, multi_hot: int, ids: int):
    """Random bags: lengths (F * B,) in [0, multi_hot], values drawn from [0, ids) with repeats."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, multi_hot + 1, size=features * batch)
    values = (rng.zipf(1.3, size=int(lengths.sum())) - 1) % ids
    return torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)


def _reference(values, lengths, *, features, batch, windows, owner_of):
    """Per (feature, id): its windows; and the owner of each, from plain Python loops."""
    sizes = window_sizes(batch, windows)
    window_of = [w for w, n in enumerate(sizes) for _ in range(n)]
    uses: dict[tuple[int, int], set[int]] = {}
    occurrences = []
    it = iter(values.tolist())
    for f in range(features):
        for s in range(batch):
            for _ in range(int(lengths[f * batch + s])):
                key = (f, next(it))
                uses.setdefault(key, set()).add(window_of[s])
                occurrences.append(key)
    return uses, occurrences, {key: owner_of(*key) for key in uses}


OWNERSHIPS = {
    # table-wise: each feature's table whole on one rank
    "table_wise": Ownership(
        features=["a", "b", "c"], starts=[[0], [0], [0]], ranks=[[1], [0], [2]], dims=[4] * 3
    ),
    # row-wise: blocks of 7 rows on ranks 0, 1, 2
    "row_wise": Ownership(
        features=["a", "b", "c"], starts=[[0, 7, 14]] * 3, ranks=[[0, 1, 2]] * 3, dims=[4] * 3
    ),
}


def _owner(ownership: Ownership):
    def owner_of(f: int, i: int) -> tuple[int, int]:
        starts, ranks = ownership.starts[f], ownership.ranks[f]
        shard = max(k for k, s in enumerate(starts) if s <= i)
        return ranks[shard], i - starts[shard]

    return owner_of


@pytest.mark.parametrize("sharding", sorted(OWNERSHIPS))
@pytest.mark.parametrize(("windows", "multi_hot"), [(1, 1), (4, 1), (3, 5)])
def test_requests_and_counts_match_a_python_reference(sharding, windows, multi_hot) -> None:
    ownership, features, batch, rank = OWNERSHIPS[sharding], 3, 37, 1
    values, lengths = _batch(windows + multi_hot, features=features, batch=batch, multi_hot=multi_hot, ids=21)
    owner_of = _owner(ownership)
    uses, occurrences, owners = _reference(
        values, lengths, features=features, batch=batch, windows=windows, owner_of=owner_of
    )
    req = plan_rows(
        values,
        lengths,
        lengths_per_key=lengths.view(features, batch).sum(dim=1).tolist(),
        batch=batch,
        windows=windows,
        ownership=ownership,
        world_size=3,
    )
    # each distinct (feature, id) is requested exactly once, from its owner, in (owner, feature, id) order
    expected = sorted(uses, key=lambda key: (owners[key][0], key))
    got = [(int(f), int(s) & ((1 << ID_BITS) - 1)) for f, s in zip(req.feature, req.sent, strict=True)]
    assert got == [(f, owners[(f, i)][1]) for f, i in expected]
    assert req.owner.tolist() == [owners[key][0] for key in expected]
    assert req.per_owner == [sum(1 for key in uses if owners[key][0] == r) for r in range(3)]
    masks = [sum(1 << w for w in uses[key]) for key in expected]
    assert req.mask.tolist() == masks
    assert (req.sent >> ID_BITS).tolist() == masks
    # every id occurrence reads the request of its own (feature, id)
    assert [expected[int(i)] for i in req.occurrence] == occurrences
    # counters: only what crosses between ranks
    counts = rows_counts(req, rank=rank, num_features=features, dims=ownership.dims)
    remote = [key for key in uses if owners[key][0] != rank]
    assert counts.ids == [sum(1 for k in remote if k[0] == f) for f in range(features)]
    assert counts.grad_rows == counts.ids
    assert counts.rows == [sum(len(uses[k]) for k in remote if k[0] == f) for f in range(features)]
    assert counts.bytes_per_feature() == [
        8 * i + 4 * 4 * (r + g) for i, r, g in zip(counts.ids, counts.rows, counts.grad_rows, strict=True)
    ]


def test_pooled_counts_match_a_python_reference() -> None:
    ownership, features, batch, rank = OWNERSHIPS["row_wise"], 3, 16, 2
    values, lengths = _batch(5, features=features, batch=batch, multi_hot=3, ids=21)
    counts = pooled_counts(
        values,
        lengths,
        lengths_per_key=lengths.view(features, batch).sum(dim=1).tolist(),
        batch=batch,
        ownership=ownership,
        rank=rank,
    )
    _, occurrences, owners = _reference(
        values, lengths, features=features, batch=batch, windows=1, owner_of=_owner(ownership)
    )
    assert counts.ids == [
        sum(1 for k in occurrences if k[0] == f and owners[k][0] != rank) for f in range(features)
    ]
    assert counts.pooled == [batch * 2] * features  # a partial sum from each of the two other shards
    assert counts.lengths == [batch * 2] * features


def test_ids_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="ids must lie in"):
        plan_rows(
            torch.tensor([1 << ID_BITS]),
            torch.tensor([1]),
            lengths_per_key=[1],
            batch=1,
            windows=1,
            ownership=Ownership(features=["a"], starts=[[0]], ranks=[[0]], dims=[4]),
            world_size=1,
        )


BASE = [
    "synthetic.num_sparse=3",
    "synthetic.id_space=500",
    "synthetic.multi_hot=3",
    "synthetic.eval_samples=256",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
    "train.steps=20",
    "eval.batch_size=64",
    "eval.every=0",
]


def _train(rank: int, world_size: int, overrides: list[str]) -> dict:
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out = {}
    for name, extra in (("pooled", []), ("rows", ["sparse.exchange=rows"]), ("seed", ["train.seed=7"])):
        cfg = config_from_dict({}, [*BASE, *overrides, *extra, f"train.nproc={world_size}"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            summary = trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            state = {
                k: v.detach().numpy().copy()
                for k, v in trainer.dmp.named_parameters()
                if "embedding" not in k
            }
            for shard in local_shards(trainer.dmp, trainer.tables):
                state[shard.table] = shard.weight.detach().numpy().copy()
            out[name] = {"logloss": summary["logloss"], "state": state, "summary": summary}
            trainer.close()
    return out


def _max_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


@pytest.mark.parametrize(
    ("world_size", "overrides"),
    [
        (1, ["sparse.sharding=table_wise"]),
        (2, ["sparse.sharding=row_wise", "pipeline.frozen_windows=4", "pipeline.cluster=keys"]),
        (2, ["sparse.sharding=table_wise", "sparse.optimizer=exact_sgd"]),
    ],
)
def test_rows_trains_the_model_pooled_trains(world_size, overrides) -> None:
    """On one rank rows and pooled train the same model bit for bit: the rows come back unchanged (bags of
    one row), each window's bags are summed in occurrence order as FBGEMM sums them, and a row's gradient
    is summed in occurrence order before FBGEMM's optimizer sees it once. On more ranks a row's gradient is
    summed per requester, then the owner adds the requesters' sums, where the pooled exchange sums every
    occurrence in one pass: the models agree to rounding, and another seed is far away. (Element-wise
    Adagrad turns the rounding of a gradient near zero into a step of +-learning_rate, so the multi-rank
    cases use row-wise Adagrad and SGD.)"""
    for r in run_ranks(world_size=world_size, fn=_train, arg=overrides):
        if world_size == 1:
            for key, value in r["pooled"]["state"].items():
                assert np.array_equal(r["rows"]["state"][key], value), key
        assert _max_rel(r["rows"]["state"], r["pooled"]["state"]) < 1e-3
        assert _max_rel(r["seed"]["state"], r["pooled"]["state"]) > 0.5
        assert r["rows"]["logloss"] == pytest.approx(r["pooled"]["logloss"], rel=1e-5)
        exchange = r["rows"]["summary"]["exchange"]
        assert exchange["kind"] == "rows" and r["pooled"]["summary"]["exchange"]["kind"] == "pooled"
        pooled = r["pooled"]["summary"]["exchange"]
        if world_size > 1:  # what crossed: rows and row gradients, or pooled vectors
            assert exchange["rows"] >= exchange["grad_rows"] > 0 and exchange["pooled"] == 0
            assert pooled["pooled"] > 0 and pooled["rows"] == 0
        else:
            assert exchange["bytes"] == pooled["bytes"] == 0
