"""The minimum device capacity: ``recsys tune-cache``'s ``min_device_rows`` is the boundary training finds.

Training fills a batch beside the rows of the training batches still in flight: three in
``pipeline.mode = "sequential"``, four in ``pipelined`` mode when the fill stage runs ahead of the release
(thread timing decides; :func:`_worst_case` forces it), and an evaluation beside those filled and not yet
released. With ``min_device_rows`` slots training must succeed; with one fewer it must fail with the
device-tier error, whose store part states the minimum itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_store import OptimizerKind, PolicyKind, StoreCapacityError, StoreConfig, TableSpec, TieredStore
from recsys.config import config_from_dict
from recsys.tune.replay import batches_in_flight, replay
from recsys.tune.trace import SIM_POLICIES, CapacityTooSmall, Trace, TraceBuilder, min_capacity, simulate
from recsys.tune.tuner import min_device_rows, min_device_rows_by_feature, tune
from tests.multiprocess import run_ranks

# One tiered table; every batch, the rows of the batches in flight and the evaluations beside them need
# a few hundred slots.
TRAIN_BOUND = [
    "synthetic.num_sparse=2",
    "synthetic.id_space=5000",
    "synthetic.eval_samples=512",
    "model.embedding_dim=8",
    "model.dense_arch=[16, 8]",
    "model.over_arch=[16]",
    "store.tiered=true",
    'store.tables=["cat_0"]',
    "store.host_rows=400",
    "train.steps=12",
    "train.batch_size=128",
    "train.log_every=4",
    "train.threads_per_rank=1",
    "eval.batch_size=256",
]
# Evaluations of 1,024 samples every 4 steps: their batches, beside the training batches in flight, are
# what needs the most slots.
EVAL_BOUND = [*TRAIN_BOUND, "synthetic.eval_samples=1024", "eval.every=4", "eval.batch_size=1024"]


def _config(overrides: list[str]):
    return config_from_dict({}, overrides)


# -- the arithmetic ------------------------------------------------------------------------------------


def _random_trace(seed: int, pinned: int) -> Trace:
    """Zipf batches, a fifth of them evaluation batches beside the ``pinned - 1`` training batches before
    them; then evaluation batches after the last training batch, beside fewer and fewer of them (as the
    run's last batches are released)."""
    rng = np.random.default_rng(seed)
    builder = TraceBuilder()
    for b in range(90):
        ids = np.unique(rng.zipf(1.1, 30) % 300)
        builder.add(ids, np.ones(ids.shape[0], np.int64), train=rng.random() > 0.2 or b < 3, held=pinned - 1)
    for held in sorted(rng.integers(0, pinned, 6).tolist(), reverse=True):
        ids = np.unique(rng.zipf(1.1, 200) % 300)  # larger: the last ones may need the most rows
        builder.add(ids, np.zeros(ids.shape[0], np.int64), train=False, held=held)
    return builder.build()


def _brute_force_min(trace: Trace, pinned: int) -> int:
    """The most distinct ids of a batch and the training batches pinned beside it, with Python sets."""
    best, done = 0, []
    for b in range(trace.num_batches):
        ids = set(trace.ids[trace.offsets[b] : trace.offsets[b + 1]].tolist())
        assert trace.held is not None
        beside = pinned - 1 if trace.train[b] else int(trace.held[b])
        best = max(best, len(ids.union(*(done[-beside:] if beside else []))))
        if trace.train[b]:
            done.append(ids)
    return best


@pytest.mark.parametrize("seed", range(3))
def test_minimum_with_evaluations_beside_some_batches_equals_brute_force_and_is_tight(seed):
    for pinned in (3, 4):
        trace = _random_trace(seed, pinned)
        floor = min_capacity(trace, pinned_batches=pinned)
        assert floor == _brute_force_min(trace, pinned)
        for policy in SIM_POLICIES:  # the simulated store runs the whole trace with that many rows...
            simulate(trace, floor, policy=policy, lookahead=2, pinned_batches=pinned)
        with pytest.raises(CapacityTooSmall):  # ...and not with one fewer
            simulate(trace, floor - 1, policy=PolicyKind.LOOKAHEAD, lookahead=2, pinned_batches=pinned)


def test_store_error_states_the_slots_the_batch_needs_beside_the_pinned_ones(tmp_path):
    spec = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=100)
    config = StoreConfig(seed=0, device_capacity_rows=8, host_capacity_rows=8)
    with TieredStore(tmp_path / "s", config=config, tables=[spec]) as store:
        store.bind("t", weights=torch.zeros(8, 4))
        store.make_resident(0, {"t": torch.arange(5)})
        store.make_resident(1, {"t": torch.arange(5, 7)})
        store.release(1)  # 5, 6 evictable, 7 free
        # Ids 3, 4 are resident; 50..53 are new: the 5 rows of batch 0 and 4 new ones need 9 slots of 8.
        with pytest.raises(StoreCapacityError, match=r"needs 4 new slots, only 3 free .* needs at least 9$"):
            store.make_resident(2, {"t": torch.tensor([3, 4, 50, 51, 52, 53])})


# -- the replay: where evaluations go and what they hold ---------------------------------------------------


@pytest.mark.parametrize(("mode", "pinned"), [("pipelined", 4), ("sequential", 3)])
def test_evaluations_run_beside_the_training_batches_filled_before_them(mode, pinned):
    cfg = _config(
        [*TRAIN_BOUND, "train.steps=8", "eval.every=3", "eval.batch_size=512", f"pipeline.mode={mode}"]
    )
    assert batches_in_flight(cfg) == pinned
    (trace,) = replay(cfg).traces["t_cat_0"]
    layout = []  # ("T", training index) / ("E", training batches before it, held)
    k = 0
    assert trace.held is not None
    for b in range(trace.num_batches):
        if trace.train[b]:
            layout.append(("T", k))
            k += 1
        else:
            layout.append(("E", k, int(trace.held[b])))
    # After step 3 the run has filled batches 3 .. 3 + pinned - 2; after step 6, up to batch 7 (the last);
    # the final evaluation after step 8 holds nothing.
    first = 3 + pinned - 1
    expected = [("T", i) for i in range(first)] + [("E", first, first - 3)]
    expected += [("T", i) for i in range(first, 8)] + [("E", 8, 2), ("E", 8, 0)]
    assert layout == expected


# -- tune-cache and the function of the error path -------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world"),
    [
        (EVAL_BOUND, 1),
        ([*TRAIN_BOUND, "pipeline.mode=sequential"], 1),
        ([*EVAL_BOUND, "sparse.sharding=row_wise", "store.tables=[]"], 2),
    ],
)
def test_min_device_rows_is_what_tune_cache_reports(overrides, world):
    cfg = _config([*overrides, f"train.nproc={world}"])
    doc = tune(cfg, device_budget=64 << 20, host_budget=64 << 20).doc
    reported = {t["feature"]: t["min_device_rows"] for t in doc["tables"].values()}
    assert min_device_rows_by_feature(cfg, world_size=world) == reported
    feature = sorted(reported)[-1]
    assert min_device_rows(cfg, feature, world_size=world) == reported[feature]
    # A prefix of the run (the error path's bound) is what `tune-cache --batches` reports.
    prefix = tune(cfg, device_budget=64 << 20, host_budget=64 << 20, batches=5).doc
    assert (
        min_device_rows(cfg, feature, world_size=world, batches=5)
        == (prefix["tables"][f"t_{feature}"]["min_device_rows"])
    )


# -- the boundary that training finds ----------------------------------------------------------------------


def _capacity(n: int) -> str:
    return f"store.capacity={{cat_0={{device={n}}}}}"


def _cli(python: str, env: dict, root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "recsys", *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _cli_boundary(tmp_path: Path, python: str, env: dict, root: Path, overrides: list[str]) -> None:
    """``recsys tune-cache``'s minimum trains; one fewer exits 2 with the device-tier error stating it."""
    config = tmp_path / "c.toml"
    config.write_text("")
    sets = [a for o in overrides for a in ("--set", o)]
    budgets = ["--device-budget", "64MiB", "--host-budget", "64MiB"]
    proc = _cli(
        python,
        env,
        root,
        "tune-cache",
        "--config",
        str(config),
        *sets,
        *budgets,
        "--out",
        str(tmp_path / "t"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    minimum = json.loads((tmp_path / "t" / "tune.json").read_text())["tables"]["t_cat_0"]["min_device_rows"]
    train = ["train", "--config", str(config), *sets]
    ok = _cli(python, env, root, *train, "--out", str(tmp_path / "ok"), "--set", _capacity(minimum))
    assert ok.returncode == 0, ok.stderr[-2000:]
    short = _cli(python, env, root, *train, "--out", str(tmp_path / "short"), "--set", _capacity(minimum - 1))
    err = [line for line in short.stderr.splitlines() if line.startswith("recsys: error:")]
    assert short.returncode == 2 and len(err) == 1, short.stderr[-2000:]
    assert "device tier is too small" in err[0] and _states(err[0], minimum), err[0]


# Sequential: the same batches are in flight at every fill of every run, so the boundary is exact.
def test_tune_cache_minimum_is_the_smallest_capacity_training_accepts(tmp_path, python, cli_env, repo_root):
    _cli_boundary(tmp_path, python, cli_env, repo_root, [*EVAL_BOUND, "pipeline.mode=sequential"])


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("overrides", [TRAIN_BOUND, EVAL_BOUND], ids=["training-bound", "evaluation-bound"])
def test_tune_cache_minimum_is_the_boundary_on_two_ranks(
    tmp_path, python, cli_env, repo_root, overrides, sharding
):
    sets = [*overrides, "pipeline.mode=sequential", "train.nproc=2", f"sparse.sharding={sharding}"]
    _cli_boundary(tmp_path, python, cli_env, repo_root, sets)


def _states(message: str, minimum: int) -> bool:
    """Whether the error names ``minimum`` as the slots needed (the store's figure, or train.py's)."""
    return re.search(rf"needs at least ({minimum}|{minimum:,})\b", message) is not None


def _worst_case(tables, steps: int) -> None:
    """Make every fill of the pipelined run find the most batches in flight that the pipeline allows:
    batch i's release waits until the fill stage has filled batch i + 3 (it may as soon as TorchRec takes
    batch i + 2, during step i), so that fill — and an evaluation after step i + 1 — still sees batch i's
    rows pinned."""
    from recsys.tiered import TRAIN

    cond = threading.Condition()
    state = {"filled": -1, "failed": False}
    fill, release = tables.fill, tables.release

    def traced_fill(routed):
        try:
            out = fill(routed)
        except BaseException:
            with cond:
                state["failed"] = True
                cond.notify_all()
            raise
        if routed.channel == TRAIN:
            with cond:
                state["filled"] = routed.batch_id
                cond.notify_all()
        return out

    def traced_release(batch_id: int) -> None:
        if batch_id < steps:  # a training batch
            target = min(batch_id + 3, steps - 1)
            with cond:
                assert cond.wait_for(lambda: state["failed"] or state["filled"] >= target, timeout=60)
        release(batch_id)

    tables.fill, tables.release = traced_fill, traced_release


def _train_at(rank: int, world_size: int, arg: tuple[list[str], list[int]]) -> list[str]:
    """Train the config with each device capacity on this rank, forced into the worst case; '' or the
    error of each run."""
    from recsys.distributed import init_distributed
    from recsys.errors import UserError
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    overrides, capacities = arg
    env = init_distributed(threads_per_rank=1)
    out = []
    for n in capacities:
        cfg = config_from_dict({}, [*overrides, f"train.nproc={world_size}", _capacity(n)])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            assert trainer.tiered is not None
            _worst_case(trainer.tiered, cfg.train.steps)
            trainer.start(resume=False)
            try:
                trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
                out.append("")
            except UserError as err:
                out.append(str(err))
            finally:
                trainer.close(flush=False)
    return out


def _pipelined(overrides: list[str], world: int, sharding: str) -> tuple[list[str], int]:
    overrides = [*overrides, "pipeline.mode=pipelined", f"sparse.sharding={sharding}"]
    return overrides, min_device_rows(
        _config([*overrides, f"train.nproc={world}"]), "cat_0", world_size=world
    )


@pytest.mark.parametrize("overrides", [TRAIN_BOUND, EVAL_BOUND], ids=["training-bound", "evaluation-bound"])
def test_pipelined_minimum_is_the_boundary_when_the_fill_runs_ahead(overrides):
    overrides, minimum = _pipelined(overrides, 1, "table_wise")
    ok, short = run_ranks(world_size=1, fn=_train_at, arg=(overrides, [minimum, minimum - 1]))[0]
    assert ok == "", ok
    assert "device tier is too small" in short and _states(short, minimum), short


# Two ranks: only the minimum (a rank whose peer failed would leave its stage threads in collectives).
@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("overrides", [TRAIN_BOUND, EVAL_BOUND], ids=["training-bound", "evaluation-bound"])
def test_pipelined_minimum_trains_on_two_ranks_when_the_fill_runs_ahead(overrides, sharding):
    overrides, minimum = _pipelined(overrides, 2, sharding)
    assert run_ranks(world_size=2, fn=_train_at, arg=(overrides, [minimum])) == [[""], [""]]
