"""Bounded tables (admission, expiry, a row cap) train the same model tiered and in memory, bit for bit
(recsys/bounded.py): the rules are decided on each id's owner in batch order, so where the rows live
cannot change a decision."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks
from tests.recsys.test_tiered import BASE as TIERED_BASE

BASE = [b for b in TIERED_BASE if not b.startswith("store.")] + [
    "store.lookahead=2",
    "store.device_rows=120",
    "store.host_rows=360",
]
# every table admits at the 2nd occurrence; cat_0 and cat_2 expire rows unused for 40 steps; cat_1 has a
# cap of 100 rows per owner instead (a cap this small also keeps expiry from ever acting)
BOUNDS = (
    "store.bounds={admit_after=2, admit_window_steps=50, expire_after_steps=40, "
    "cat_1={expire_after_steps=0, max_rows=100}}"
)


def _train(rank: int, world_size: int, overrides: list[str]) -> dict:
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out = {}
    for name, extra in (("untiered", ["store.tiered=false"]), ("tiered", ["store.tiered=true"])):
        cfg = config_from_dict({}, [*BASE, *overrides, *extra, f"train.nproc={world_size}"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, env, out_dir=Path(tmp))
            trainer.start(resume=False)
            summary = trainer.fit(MetricsLog(Path(tmp) / "m.jsonl", enabled=False))
            bounded = trainer.binding.bounded
            counters = {} if bounded is None else bounded.counters()
            out[name] = {"digest": trainer.digest(), "auc": summary["auc"], "counters": counters}
            if trainer.tiered is not None:
                out[name]["stored_equals_rows"] = _stored_equals_rows(trainer.tiered)
            trainer.close()
    return out


def _stored_equals_rows(tiered) -> bool:
    """Whether the store holds exactly the rows the bounds gave (plus the default row where it lives):
    no unadmitted id ever got a row, and every expired or capped row left every tier."""
    for name, bounds in tiered.bounded.tables.items():
        stored = {int(i) for ids, _, _ in tiered.local_rows(name) for i in ids.tolist()}
        rows = {int(i) for i in bounds.state()["row_ids"].tolist()}
        if stored - {tiered.bounded.default_ids[name]} != rows:
            return False
    return True


@pytest.mark.parametrize(
    ("world_size", "sharding", "mode"),
    [
        (1, "table_wise", "pipelined"),
        (2, "row_wise", "pipelined"),
        (2, "table_wise", "sequential"),
        pytest.param(1, "row_wise", "sequential", marks=pytest.mark.slow),
        pytest.param(2, "row_wise", "sequential", marks=pytest.mark.slow),
        pytest.param(2, "table_wise", "pipelined", marks=pytest.mark.slow),
    ],
)
def test_bounded_tiered_digest_equals_in_memory(world_size, sharding, mode):
    results = run_ranks(
        world_size=world_size,
        fn=_train,
        arg=[BOUNDS, f"sparse.sharding={sharding}", f"pipeline.mode={mode}"],
    )
    for r in results:
        assert r["tiered"]["digest"] == r["untiered"]["digest"]
        assert r["tiered"]["auc"] == r["untiered"]["auc"]
        assert r["tiered"]["counters"] == r["untiered"]["counters"]
    totals = {k: 0 for k in ("admitted_total", "expired_total", "capped_total", "default_lookups_total")}
    for r in results:
        for c in r["tiered"]["counters"].values():
            for k in totals:
                totals[k] += c[k]
        assert r["tiered"]["counters"].get("t_cat_1", {"rows": 0})["rows"] <= 100
        assert r["tiered"]["stored_equals_rows"]
    assert all(v > 0 for v in totals.values()), totals  # every rule acted


def _part(rank: int, world_size: int, arg: tuple[int, bool, list[str]]) -> dict:
    """Train to step ``arg[0]`` in ``arg[2][-1]``, resuming what is there when ``arg[1]``; the digest and
    the bounded rows at the end."""
    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    steps, resume, overrides = arg
    out_dir = Path(overrides[-1])
    cfg = config_from_dict(
        {},
        [
            *BASE,
            *overrides[:-1],
            f"train.nproc={world_size}",
            f"train.steps={steps}",
            "train.checkpoint_every=0",
        ]
        + [f"store.path={out_dir / 'store'}"],
    )
    trainer = Trainer(cfg, env, out_dir=out_dir)
    trainer.start(resume=resume)
    trainer.fit(MetricsLog(out_dir / "m.jsonl", enabled=False))
    bounded = trainer.binding.bounded
    out = {"digest": trainer.digest(), "rows": sum(c["rows"] for c in bounded.counters().values())}
    trainer.close()
    return out


@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 1)])
def test_a_resume_between_admission_and_expiry_trains_the_same_model(before, after):
    """Stopped at step 70 and resumed (on the same or another number of ranks, row-wise: the bounds'
    per-id state re-partitioned by the new ownership), tiered equals in memory stopped and resumed the
    same way, and on one number of ranks both equal a run in one go: admission counts, rows and last-use
    steps are part of the checkpoint. Admission and expiry only: a cap per owner does not survive a
    re-partition (the run warns)."""
    common = [
        "store.bounds={admit_after=2, admit_window_steps=50, expire_after_steps=40}",
        "sparse.sharding=row_wise",
    ]
    results = {}
    for tiered in ("false", "true"):
        with tempfile.TemporaryDirectory() as out:
            args = [*common, f"store.tiered={tiered}", out]
            run_ranks(world_size=before, fn=_part, arg=(70, False, args))
            (results[tiered], *_) = run_ranks(world_size=after, fn=_part, arg=(160, True, args))
    assert results["true"] == results["false"] and results["true"]["rows"] > 0
    if before == after:
        with tempfile.TemporaryDirectory() as out:
            (whole, *_) = run_ranks(world_size=after, fn=_part, arg=(160, False, [*common, out]))
        assert whole == results["true"]


def _checkpointed_mid_run(rank: int, world_size: int, overrides: list[str]) -> dict:
    """160 pipelined steps with a checkpoint at step 70 (taken while the pipeline has routed, and so
    decided, batches ahead of training); then the later checkpoints removed and the run resumed from step
    70 to 160. The digests of both ends."""
    import shutil

    from recsys.distributed import init_distributed
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    env = init_distributed(threads_per_rank=1)
    out_dir = Path(overrides[-1])
    cfg = config_from_dict(
        {},
        [
            *BASE,
            *overrides[:-1],
            f"train.nproc={world_size}",
            "train.steps=160",
            "train.checkpoint_every=70",
            "train.keep_checkpoints=5",
        ]
        + ["pipeline.mode=pipelined", "store.lookahead=4", f"store.path={out_dir / 'store'}"],
    )
    digests = []
    for resume in (False, True):
        trainer = Trainer(cfg, env, out_dir=out_dir)
        trainer.start(resume=resume)
        trainer.fit(MetricsLog(out_dir / "m.jsonl", enabled=False))
        digests.append(trainer.digest())
        trainer.close()
        if not resume:
            if rank == 0:
                for path in (out_dir / "checkpoints").glob("step_*"):
                    if path.name != "step_00000070":
                        shutil.rmtree(path)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
    return {"whole": digests[0], "resumed": digests[1]}


@pytest.mark.parametrize("tiered", ["true", "false"])
def test_a_checkpoint_taken_while_the_pipeline_decided_ahead_resumes_exactly(tiered):
    """The bounds decide a step when its batch is routed, ahead of training; a checkpoint saves the state
    with the decisions of the steps decided ahead, and the resumed run replays them instead of deciding
    them again: it ends with the model of the run that did not stop."""
    rules = "store.bounds={admit_after=2, admit_window_steps=50, expire_after_steps=40, max_rows=100}"
    with tempfile.TemporaryDirectory() as out:
        (r,) = run_ranks(world_size=1, fn=_checkpointed_mid_run, arg=[rules, f"store.tiered={tiered}", out])
    assert r["resumed"] == r["whole"]
