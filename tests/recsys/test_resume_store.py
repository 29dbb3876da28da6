"""A resume across a ``[store]`` change continues the same model or is refused in one line naming the setting.

Oracles: the uninterrupted run's digest (a continued run must end with it), the checkpoint's own digest
(a resume with no further steps must reproduce it), and the check inside the restore itself (a
checkpoint whose recorded digest the restored model does not have stops the run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.recsys.tiny import run_train, tiny_config

SAVED = 40  # the newest checkpoint of the base runs
MORE = 60  # steps of a continued run
CONFIG = tiny_config(train={"nproc": 2, "checkpoint_every": 20, "keep_checkpoints": 3, "steps": SAVED})


def _digest(run: Path) -> str:
    return json.loads((run / "summary.json").read_text())["model_digest"]


def _meta(run: Path, step: int = SAVED) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, {name: run})``: tiered and untiered base runs of SAVED steps, and the uninterrupted
    tiered run of MORE steps."""
    root = tmp_path_factory.mktemp("resume_store")
    (root / "c.toml").write_text(CONFIG)
    env = subprocess_env()
    out = {}
    for name, extra in {
        "tiered": (),
        "untiered": ("--set", "store.tiered=false"),
        "reference": ("--set", f"train.steps={MORE}"),
    }.items():
        run_train(root / "c.toml", root / name, *extra, env=env)
        out[name] = root / name
    return root, out


def _resume(runs, base: str, dest: Path, *extra: str, check: bool = True):
    root, made = runs
    shutil.copytree(made[base], dest)
    return run_train(root / "c.toml", dest, "--resume", *extra, env=subprocess_env(), check=check)


def test_checkpoints_record_their_store_tables_and_digest(runs):
    _, made = runs
    assert _meta(made["tiered"])["store_tables"] == ["t_cat_0", "t_cat_1", "t_cat_2", "t_cat_3"]
    assert _meta(made["untiered"])["store_tables"] == []
    # The final checkpoint's recorded digest is the run's own (tiered rows read from its snapshot).
    assert _meta(made["tiered"])["digest"] == _digest(made["tiered"])
    assert _meta(made["untiered"])["digest"] == _digest(made["untiered"])


@pytest.mark.parametrize("nproc", ["2", pytest.param("1", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        ("untiered", ["--set", "store.tiered=true"], "store.tiered=true"),
        ("tiered", ["--set", "store.tiered=false"], "store.tiered=false"),
        ("tiered", ["--set", 'store.tables=["cat_0"]'], "store.tables=['cat_0']"),
    ],
    ids=["untiered-to-tiered", "tiered-to-untiered", "fewer-tables"],
)
def test_moving_tables_in_or_out_of_the_store_is_refused_in_one_line(
    runs, tmp_path, base, change, named, nproc
):
    for steps in (SAVED, MORE):  # no further step, and more
        dest = tmp_path / f"run_{steps}"
        proc = _resume(
            runs, base, dest, "--nproc", nproc, "--set", f"train.steps={steps}", *change, check=False
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert lines[-1].startswith("recsys: error: checkpoint ") and named in lines[-1], lines[-1]
        assert "Traceback" not in proc.stderr
        assert not (dest / "checkpoints" / f"step_{steps:08d}").exists() or steps == SAVED
        shutil.rmtree(dest)


def test_other_device_capacities_on_the_same_ranks_continue_the_same_model(runs, tmp_path):
    """Slot tables of another size: the store restores every row into an empty device tier."""
    _, made = runs
    continued = _resume(
        runs, "tiered", tmp_path / "more", "--set", f"train.steps={MORE}", "--set", "store.device_rows=1600"
    )
    assert continued.returncode == 0
    assert _digest(tmp_path / "more") == _digest(made["reference"])
    # No further step: the restored model is the checkpoint's (checked in the restore, and here).
    _resume(
        runs, "tiered", tmp_path / "same", "--set", f"train.steps={SAVED}", "--set", "store.device_rows=1500"
    )
    assert _digest(tmp_path / "same") == _meta(made["tiered"])["digest"]


@pytest.mark.slow
def test_other_capacities_on_another_number_of_ranks_restore_the_same_model(runs, tmp_path):
    _, made = runs
    args = ("--nproc", "1", "--set", f"train.steps={SAVED}", "--set", "store.device_rows=2000")
    _resume(runs, "tiered", tmp_path / "one", *args, "--set", "store.host_rows=900")
    assert _digest(tmp_path / "one") == _meta(made["tiered"])["digest"]


def test_a_restore_that_does_not_reproduce_the_saved_digest_stops_the_run(runs, tmp_path):
    """The check inside the restore: a checkpoint whose recorded digest the restored model lacks."""
    _, made = runs
    dest = tmp_path / "run"
    shutil.copytree(made["tiered"], dest)
    meta_path = dest / "checkpoints" / f"step_{SAVED:08d}" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["digest"] = "0" * 32
    meta_path.write_text(json.dumps(meta))
    root, _ = runs
    proc = run_train(
        root / "c.toml", dest, "--resume", "--set", f"train.steps={MORE}", env=subprocess_env(), check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "was saved with model digest 00000000000000000000000000000000" in line
    assert not (dest / "checkpoints" / f"step_{MORE:08d}").exists()
