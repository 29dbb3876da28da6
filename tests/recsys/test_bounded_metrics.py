"""What bounded tables decided shows in metrics.jsonl, the fit's summary and the progress line
(recsys/tier_metrics.py BoundsMetrics): the figures of every log window add up to the counters the
trainer holds at the end, summed over ranks, and tiered and in-memory runs report the same numbers,
window for window, although their pipelines decide different distances ahead."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from recsys.config import config_from_dict
from tests.multiprocess import run_ranks
from tests.recsys.test_bounded import BASE, BOUNDS

# 4 * (dim 8 + 1 row-wise Adagrad state float)
ROW_BYTES = 36
RUNS = (("untiered", "false"), ("tiered", "true"))
TOTALS = {
    "admitted": "admitted_total",
    "expired": "expired_total",
    "capped": "capped_total",
    "lookups": "lookups_total",
    "default_lookups": "default_lookups_total",
}


class _Bar:
    """A progress bar that keeps every postfix it is given."""

    postfixes: list[dict] = []

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        type(self).postfixes = []

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, postfix: dict) -> None:
        self.postfixes.append(dict(postfix))

    def write(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


def _train(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Each rank's counters and rank 0's records, summary figures and postfixes, in memory and tiered."""
    from recsys.distributed import init_distributed

    env = init_distributed(threads_per_rank=1)
    settings = [*BASE, *overrides, f"train.nproc={world_size}"]
    return {run: _fit(env, [*settings, f"store.tiered={tiered}"]) for run, tiered in RUNS}


def _fit(env, settings: list[str], out_dir: Path | None = None, *, resume: bool = False) -> dict:
    """Fit in ``out_dir`` (a temporary one when None); the counters, records, summary and postfixes."""
    if out_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return _fit(env, settings, Path(tmp))
    from recsys.build import TrainSpec
    from recsys.metrics import MetricsLog
    from recsys.trainer import Trainer

    cfg = config_from_dict({}, [*settings, f"store.path={out_dir / 'store'}"])
    trainer = Trainer(cfg, env, out_dir=out_dir, spec=TrainSpec(progress=_Bar))
    trainer.start(resume=resume)
    log = out_dir / "metrics.jsonl"
    summary = trainer.fit(MetricsLog(log, enabled=env.is_main))
    bounded = trainer.binding.bounded
    out = {
        "counters": {} if bounded is None else bounded.counters(),
        "records": [json.loads(line) for line in log.read_text().splitlines()] if env.is_main else [],
        "summary_bounds": summary.get("bounds"),
        "postfixes": _Bar.postfixes,
    }
    trainer.close()
    return out


def _resumed(rank: int, world_size: int, overrides: list[str]) -> dict:
    """A tiered run in one go, and one stopped at step 80 and resumed to 160."""
    from recsys.distributed import init_distributed

    env = init_distributed(threads_per_rank=1)
    settings = [*BASE, *overrides, f"train.nproc={world_size}", "store.tiered=true"]
    out = {"one_go": _fit(env, settings)}
    with tempfile.TemporaryDirectory() as tmp:
        _fit(env, [*settings, "train.steps=80"], Path(tmp))
        out["resumed"] = _fit(env, settings, Path(tmp), resume=True)
    return out


def _summed(results: list[dict], run: str) -> dict[str, dict[str, int]]:
    """Per table, the trainer's counters at the end summed over ranks."""
    total: dict[str, dict[str, int]] = {}
    for r in results:
        for table, counters in r[run]["counters"].items():
            slot = total.setdefault(table, dict.fromkeys(counters, 0))
            for key, value in counters.items():
                slot[key] += value
    return total


def _check_figures(figures: dict, counters: dict[str, dict[str, int]]) -> None:
    """Figures over a span that ends at the counters (and starts at zero where they are totals)."""
    assert set(figures["tables"]) == set(counters)
    for table, c in counters.items():
        f = figures["tables"][table]
        assert (f["rows"], f["candidates"]) == (c["rows"], c["candidates"]), table
        assert f["stored_bytes"] == c["rows"] * ROW_BYTES
        assert {k: f[k] for k in TOTALS} == {k: c[v] for k, v in TOTALS.items()}, table


@pytest.mark.parametrize(
    ("world_size", "sharding", "mode"),
    [(1, "table_wise", "pipelined"), (2, "row_wise", "pipelined")],
)
def test_bounds_metrics_add_up_to_the_counters_tiered_and_in_memory_alike(world_size, sharding, mode):
    results = run_ranks(
        world_size=world_size,
        fn=_train,
        arg=[BOUNDS, f"sparse.sharding={sharding}", f"pipeline.mode={mode}", "train.log_every=10"],
    )
    main = results[0]
    for run in ("untiered", "tiered"):
        counters = _summed(results, run)
        records = [r for r in main[run]["records"] if r["kind"] == "train"]
        windows = [r["bounds"] for r in records]
        assert [r["step"] for r in records] == list(range(10, 161, 10))
        # the windows' counts add up to the totals; rows and candidates are the last window's
        added = {
            t: {
                **{k: sum(w["tables"][t][k] for w in windows) for k in TOTALS},
                "rows": windows[-1]["tables"][t]["rows"],
                "candidates": windows[-1]["tables"][t]["candidates"],
                "stored_bytes": windows[-1]["tables"][t]["stored_bytes"],
            }
            for t in counters
        }
        _check_figures({"tables": added}, counters)
        _check_figures(main[run]["summary_bounds"], counters)
        for w in windows:
            lookups = sum(f["lookups"] for f in w["tables"].values())
            default = sum(f["default_lookups"] for f in w["tables"].values())
            assert lookups > 0 and math.isclose(w["default_share"], default / lookups)
            for f in w["tables"].values():
                assert math.isclose(f["default_share"], f["default_lookups"] / f["lookups"])
        assert [p["dflt"] for p in main[run]["postfixes"]] == [f"{w['default_share']:.2f}" for w in windows]
        acted = {k: sum(f[k] for w in windows for f in w["tables"].values()) for k in TOTALS}
        assert all(acted.values()), acted  # every rule acted
        # mid-run windows see rows come and go, not only the last one
        assert sum(w["tables"]["t_cat_0"]["expired"] > 0 for w in windows) > 1
    # the same decisions, the same figures, window by window (JSON: a NaN share is null in both)
    untiered = [r["bounds"] for r in main["untiered"]["records"] if r["kind"] == "train"]
    tiered = [r["bounds"] for r in main["tiered"]["records"] if r["kind"] == "train"]
    assert tiered == untiered
    assert main["tiered"]["summary_bounds"] == main["untiered"]["summary_bounds"]


def test_a_run_without_bounds_reports_none():
    """No [store.bounds]: no bounds figures anywhere, tiered or in memory."""
    (result,) = run_ranks(world_size=1, fn=_train, arg=["train.steps=20", "train.log_every=10"])
    for run in ("untiered", "tiered"):
        assert result[run]["counters"] == {}
        records = result[run]["records"]
        assert records and all("bounds" not in r for r in records)
        assert result[run]["summary_bounds"] is None
        assert result[run]["postfixes"] and all("dflt" not in p for p in result[run]["postfixes"])


def test_a_resumed_run_reports_what_a_run_in_one_go_does():
    """The window after a resume starts from the checkpoint's counters, and the summary's totals count
    the steps before the resume (they are part of the checkpoint)."""
    (result,) = run_ranks(
        world_size=1, fn=_resumed, arg=[BOUNDS, "train.log_every=10", "train.checkpoint_every=0"]
    )
    one_go, resumed = result["one_go"], result["resumed"]
    windows = {
        name: [(r["step"], r["bounds"]) for r in run["records"] if r["kind"] == "train"]
        for name, run in result.items()
    }
    assert [s for s, _ in windows["resumed"]] == list(range(10, 161, 10))
    assert windows["resumed"] == windows["one_go"]
    assert resumed["summary_bounds"] == one_go["summary_bounds"]
    assert resumed["counters"] == one_go["counters"]
