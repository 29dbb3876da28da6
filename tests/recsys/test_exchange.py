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
from recsys.sparse import ExchangeKind
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
    # each distinct (feature, id) is requested exactly once, from its owner, in (owner, feature, first
    # use) order
    first_use = {key: occurrences.index(key) for key in uses}
    expected = sorted(uses, key=lambda key: (owners[key][0], key[0], first_use[key]))
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


RUNS = (("pooled", []), ("rows", ["sparse.exchange=rows"]), ("seed", ["train.seed=7"]))


def _train(rank: int, world_size: int, arg: tuple[list[str], tuple]) -> dict:
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.sharding import local_shards
    from recsys.trainer import Trainer

    overrides, runs = arg
    env = init_distributed(threads_per_rank=1)
    out = {}
    for name, extra in runs:
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
        (
            1,
            [
                "sparse.sharding=row_wise",
                "pipeline.frozen_windows=3",
                'sparse.exchange_tables={cat_1 = "pooled"}',
            ],
        ),
        (2, ["sparse.sharding=row_wise", "pipeline.frozen_windows=4", "pipeline.cluster=keys"]),
        (2, ["sparse.sharding=table_wise", "sparse.optimizer=exact_sgd"]),
        (
            2,
            [
                "sparse.sharding=row_wise",
                "pipeline.frozen_windows=2",
                'sparse.exchange_tables={cat_0 = "pooled"}',
            ],
        ),
        (
            2,
            [
                "sparse.sharding=table_wise",
                "pipeline.frozen_windows=4",
                'sparse.exchange_tables={cat_2 = "pooled"}',
            ],
        ),
    ],
)
def test_rows_trains_the_model_pooled_trains(world_size, overrides) -> None:
    """On one rank with one window rows and pooled train the same model bit for bit: the rows come back unchanged (bags of
    one row), each window's bags are summed in occurrence order as FBGEMM sums them, and a row's gradient
    is summed in occurrence order before FBGEMM's optimizer sees it once. On more ranks a row's gradient is
    summed per requester, then the owner adds the requesters' sums, where the pooled exchange sums every
    occurrence in one pass, and with windows a row's gradient is summed per window, then over windows:
    the models agree to rounding, and another seed is far away. (Element-wise
    Adagrad turns the rounding of a gradient near zero into a step of +-learning_rate, so the multi-rank
    cases use row-wise Adagrad and SGD.) A table set to ``pooled`` goes through the rows exchange as pooled
    vectors, and the same holds."""
    mixed = any(o.startswith("sparse.exchange_tables") for o in overrides)
    for r in run_ranks(world_size=world_size, fn=_train, arg=(overrides, RUNS)):
        if world_size == 1 and not any(o.startswith("pipeline.frozen_windows") for o in overrides):
            for key, value in r["pooled"]["state"].items():
                assert np.array_equal(r["rows"]["state"][key], value), key
        assert _max_rel(r["rows"]["state"], r["pooled"]["state"]) < 1e-3
        assert _max_rel(r["seed"]["state"], r["pooled"]["state"]) > 0.5
        assert r["rows"]["logloss"] == pytest.approx(r["pooled"]["logloss"], rel=1e-5)
        exchange = r["rows"]["summary"]["exchange"]
        assert exchange["kind"] == ("mixed" if mixed else "rows")
        pooled = r["pooled"]["summary"]["exchange"]
        assert pooled["kind"] == "pooled"
        if world_size > 1:  # what crossed: rows and row gradients, and pooled vectors for pooled tables
            assert exchange["rows"] >= exchange["grad_rows"] > 0 and (exchange["pooled"] > 0) == mixed
            assert pooled["pooled"] > 0 and pooled["rows"] == 0
        else:
            assert exchange["bytes"] == pooled["bytes"] == 0


def test_auto_picks_the_cheaper_exchange_of_each_table() -> None:
    """A 50-id table repeats its ids (rows are cheaper), two 200,000-id multi-hot ones do not (pooled is):
    ``auto``, choosing over the first 16 batches of a 16-step run, sends for each table exactly the bytes
    of the cheaper of the all-pooled and all-rows runs."""
    overrides = ["synthetic.id_spaces=[50, 200000, 200000]", "train.steps=16", "pipeline.frozen_windows=2"]
    runs = (("pooled", []), ("rows", ["sparse.exchange=rows"]), ("auto", ["sparse.exchange=auto"]))
    r = run_ranks(world_size=2, fn=_train, arg=(overrides, runs))[0]
    tables = {name: r[name]["summary"]["exchange"]["tables"] for name, _ in runs}
    assert {t: v["kind"] for t, v in tables["auto"].items()} == {
        "t_cat_0": "rows",
        "t_cat_1": "pooled",
        "t_cat_2": "pooled",
    }
    for t, v in tables["auto"].items():
        assert v["bytes_per_sample"] == min(
            tables["pooled"][t]["bytes_per_sample"], tables["rows"][t]["bytes_per_sample"]
        )
    detail = r["auto"]["summary"]["exchange"]["auto"]
    assert all((d["rows"] < d["pooled"]) == (tables["auto"][t]["kind"] == "rows") for t, d in detail.items())


def test_exchange_tables_naming_an_unknown_feature_is_refused() -> None:
    from recsys.sparse import SparseConfig

    with pytest.raises(ValueError, match="exchange_tables names unknown features"):
        SparseConfig(exchange_tables={"nope": ExchangeKind.ROWS}).exchange_kinds(["cat_0"])
