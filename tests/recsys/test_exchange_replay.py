"""``recsys plan-exchange`` (recsys/exchange_replay.py): the replay against real runs, its ownership
against TorchRec's block rule, and the command's output and errors.

Oracles: a real 2-rank training's ``summary.json["exchange"]`` (the replay at world 2 must give its counts
and bytes exactly, table-wise and row-wise, in memory and tiered); the run's sharding plan (the replay's
owners at world 2); TorchRec's documented row-wise rule, blocks of ``ceil(rows / world)`` rows on ranks 0,
1, ... (the replay's owners at other world sizes).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recsys.cli import main
from recsys.config import config_from_dict
from recsys.exchange_replay import (
    EXCHANGES,
    ReplaySetup,
    plan_exchange,
    replay_world,
    replayed_ranks,
    world_ownership,
)
from recsys.pipeline_config import ClusterKind
from tests.multiprocess import run_ranks

# Requests of 4 samples, 4 interleaved, whose first 2 features are shared: key-clustered windows send fewer
# rows than arrival-order ones, so the two replays differ and each is checked.
BASE = [
    "synthetic.num_sparse=3",
    "synthetic.id_space=500",
    "synthetic.multi_hot=2",
    "synthetic.request_size=4",
    "synthetic.user_features=2",
    "synthetic.interleave=4",
    "synthetic.eval_samples=64",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "train.batch_size=64",
    "train.nproc=2",
    "train.steps=6",
    "train.threads_per_rank=1",
    "eval.batch_size=64",
    "eval.every=0",
    "pipeline.frozen_windows=4",
]
ROWS = ["sparse.exchange=rows", "pipeline.cluster=keys"]
TIERED = [
    "store.tiered=true",
    'store.tables=["cat_0", "cat_2"]',
    "store.device_rows=200",
    "store.host_rows=50",
]
# (name, overrides): every run of the byte-for-byte test, trained in one pair of processes.
RUNS = [
    ("table_wise pooled", ["sparse.sharding=table_wise"]),
    ("table_wise rows", ["sparse.sharding=table_wise", *ROWS]),
    ("table_wise rows arrival", ["sparse.sharding=table_wise", "sparse.exchange=rows"]),
    ("row_wise pooled", ["sparse.sharding=row_wise"]),
    ("row_wise rows", ["sparse.sharding=row_wise", *ROWS]),
    ("tiered table_wise rows", ["sparse.sharding=table_wise", *ROWS, *TIERED]),
    ("tiered row_wise rows", ["sparse.sharding=row_wise", *ROWS, *TIERED]),
    ("tiered row_wise pooled", ["sparse.sharding=row_wise", *TIERED]),
]
FIELDS = ("ids", "lengths", "rows", "grad_rows", "pooled", "bytes", "bytes_per_sample", "tables")


def _train(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> dict:
    """Each run's ``summary["exchange"]`` and its plan: per table, ``[(first row, rank)]`` of its shards."""
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out = {}
    for name, overrides in runs:
        cfg = config_from_dict({}, [*BASE, *overrides])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            summary = trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            (module_plan,) = trainer.dmp.plan.plan.values()
            plan = {
                t.name: sorted(
                    (s.shard_offsets[0], s.placement.rank()) for s in module_plan[t.name].sharding_spec.shards
                )
                for t in trainer.tables
            }
            tables = [(t.name, t.num_embeddings) for t in trainer.tables]
            out[name] = {
                "exchange": summary["exchange"],
                "plan": plan,
                "tables": tables,
                "fold": trainer.fold,
            }
            trainer.close()
    return out


@pytest.fixture(scope="module")
def real_runs() -> dict:
    return run_ranks(world_size=2, fn=_train, arg=RUNS)[0]


@pytest.mark.parametrize("name", [name for name, _ in RUNS])
def test_the_replay_at_world_2_is_a_real_run_to_the_byte(real_runs, name) -> None:
    """The replay counts what a 2-rank run counted, field by field: the same batches (folded, clustered),
    the same owners, the same planning code. Tiered runs send slots where the replay keeps ids: the same
    bytes."""
    overrides = dict(RUNS)[name]
    setup = ReplaySetup.from_config(config_from_dict({}, [*BASE, *overrides]))
    world = replay_world(setup, 2, steps=setup.config.train.steps)
    run = real_runs[name]["exchange"]
    clustered = setup.config.pipeline.cluster is ClusterKind.KEYS
    exchange = "pooled" if run["kind"] == "pooled" else "rows_clustered" if clustered else "rows"
    replayed = world.summary(exchange)
    assert {k: replayed[k] for k in FIELDS} == {k: run[k] for k in FIELDS}
    assert run["bytes"] > 0
    # the replay's tables, folds and owners are the run's
    assert [(t.name, t.num_embeddings) for t in setup.tables(2)] == real_runs[name]["tables"]
    assert setup.fold == real_runs[name]["fold"]
    owners = world_ownership(setup, 2).ownership
    for f, table in enumerate(t.name for t in setup.tables(2)):
        shards = real_runs[name]["plan"][table]
        assert owners.ranks[f] == [r for _, r in shards], table
        if f not in world_ownership(setup, 2).shard_of:  # a tiered table's shards are re-keyed
            assert owners.starts[f] == [s for s, _ in shards], table


def test_clustering_changes_what_the_tiny_config_sends(real_runs) -> None:
    """The oracle runs tell arrival order from clustered windows (else the test above could not)."""
    assert (
        real_runs["table_wise rows"]["exchange"]["rows"]
        < real_runs["table_wise rows arrival"]["exchange"]["rows"]
    )


def test_replayed_ranks_are_all_or_8_spread_evenly() -> None:
    assert replayed_ranks(2) == [0, 1]
    assert replayed_ranks(8) == list(range(8))
    assert replayed_ranks(64) == list(range(0, 64, 8))
    assert replayed_ranks(512) == list(range(0, 512, 64))
    assert replayed_ranks(10) == [0, 1, 2, 3, 5, 6, 7, 8]


@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_row_wise_owners_are_torchrecs_blocks(world) -> None:
    """TorchRec's row-wise rule: blocks of ceil(rows / world) rows on ranks 0, 1, ... (the last ones short
    or empty), so row ``i`` lives on rank ``i // ceil(rows / world)``."""
    cfg = config_from_dict({}, [*BASE, "sparse.sharding=row_wise", "synthetic.id_spaces=[500, 7, 1000]"])
    setup = ReplaySetup.from_config(cfg, device_type="cpu")
    ownership = world_ownership(setup, world).ownership
    for f, rows in enumerate([500, 7, 1000]):
        ids = torch.arange(rows)
        located, local = ownership.locate((f << 48) | ids)
        block = math.ceil(rows / world)
        assert torch.equal(located, ids // block), (world, rows)
        assert torch.equal(local, ids % block), (world, rows)


@pytest.mark.parametrize("world", [2, 8, 64, 512])
def test_table_wise_owners_hold_whole_tables(world) -> None:
    """Every table whole on one rank of the world (which one: the run's plan, checked at world 2 above)."""
    setup = ReplaySetup.from_config(config_from_dict({}, BASE), device_type="cpu")
    ownership = world_ownership(setup, world).ownership
    assert ownership.starts == [[0]] * 3
    ranks = [r for (r,) in ownership.ranks]
    assert all(0 <= r < world for r in ranks)


def test_tiered_ids_keep_their_owner_and_their_equalities() -> None:
    setup = ReplaySetup.from_config(config_from_dict({}, [*BASE, "sparse.sharding=row_wise", *TIERED]))
    owners = world_ownership(setup, 8)
    batch = next(setup.data.train_batches(rank=3, world_size=8, batch_size=8 * setup.batch, start_step=0))
    sparse = batch.sparse
    keyed = torch.split(owners.keyed_values(sparse), sparse.length_per_key())
    for f, ids in enumerate(torch.split(sparse.values(), sparse.length_per_key())):
        if f in owners.shard_of:
            same = ids[:, None] == ids[None, :]
            assert torch.equal(same, keyed[f][:, None] == keyed[f][None, :])
            located, _ = owners.ownership.locate((f << 48) | keyed[f])
            assert torch.equal(located, owners.tiers.owners(owners.shard_of[f][0], ids))
        else:
            assert torch.equal(keyed[f], ids)


def test_plan_exchange_prints_a_table_then_one_json_line(tmp_path, capsys) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text("")
    code = main(
        ["plan-exchange", "--config", str(config), *[a for o in BASE for a in ("--set", o)], "--steps", "2"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    last = json.loads(lines[-1])
    assert list(last) == ["world_2", "world_8", "world_64", "world_512"]
    assert all(list(v) == list(EXCHANGES) and v["pooled"] > 0 for v in last.values())
    assert any(line.split()[:2] == ["512", "8"] for line in lines), lines


def test_plan_exchange_without_windows_clusters_nothing() -> None:
    cfg = config_from_dict({}, [*BASE, "pipeline.frozen_windows=1"])
    (world,) = plan_exchange(ReplaySetup.from_config(cfg), steps=1, world_sizes=(2,), progress=False)
    assert world.summary("rows") == world.summary("rows_clustered")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["--set", "pipeline.frozen_windows=16"], "the rows exchange takes 1 to 15 windows"),
        (["--set", "pipeline.frozen_windows=33"], "is more than the 32 samples of a rank's batch"),
        (
            ["--set", "store.bounds={admit_after=2, admit_window_steps=50, expire_after_steps=20}"],
            "does not replay bounded tables",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, message, tmp_path, capsys) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text("")
    code = main(["plan-exchange", "--config", str(config), *[a for o in BASE for a in ("--set", o)], *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["tiered row_wise rows", "tiered row_wise pooled"])
def test_a_tiered_run_is_not_its_in_memory_twin(real_runs, name) -> None:
    """Row-wise tiers route ids to owners by hash, in-memory tables by blocks: replaying a tiered run's
    batches with in-memory owners counts other bytes, so the replay keys tiered ids by their tiers' owners."""
    setup = ReplaySetup.from_config(config_from_dict({}, [*BASE, *dict(RUNS)[name]]))
    in_memory = replace(setup, tiered=[], device_rows={})
    exchange = "pooled" if "pooled" in name else "rows_clustered"
    twin = replay_world(in_memory, 2, steps=setup.config.train.steps).summary(exchange)
    assert twin["bytes"] != real_runs[name]["exchange"]["bytes"]
