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
            bounded = (
                trainer.tiered.bounded
                if trainer.tiered is not None
                else getattr(trainer.bounded, "bounded", None)
            )
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
    [(1, "table_wise", "pipelined"), (2, "row_wise", "pipelined"), (2, "table_wise", "sequential")],
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
