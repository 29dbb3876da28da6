"""A real full filesystem (a small tmpfs), under the store or under the run directory.

Either way the run stops with one line naming the path and "no space left on device", exit 2; the last
complete checkpoint verifies, and after space is freed (the tmpfs remounted larger) ``--resume`` finishes
the run. The oracle for the resumed model is the same run never interrupted. Needs root for ``mount``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from recsys.checkpoint import latest_checkpoint, verify_checkpoint
from tests.recsys.tiny import run_train, tiny_config

STEPS = 160
CONFIG = tiny_config(
    train={"steps": STEPS, "nproc": 2, "log_every": 20, "checkpoint_every": 10, "keep_checkpoints": 100}
)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _grow(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, str]:
    """Digests of the uninterrupted run, tiered and untiered (they are the same model)."""
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("whole")
    (tmp / "c.toml").write_text(CONFIG)
    run_train(tmp / "c.toml", tmp / "run", env=subprocess_env())
    return json.loads((tmp / "run" / "summary.json").read_text())["model_digest"]


def _last_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_full_filesystem_under_the_store(tmp_path, cli_env, uninterrupted):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    run = tmp_path / "run"
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        full = run_train(config, run, "--set", f"store.path={mnt / 'store'}", env=cli_env, check=False)
        last = _last_line(full)
        assert re.fullmatch(
            rf"recsys: error: .*store {re.escape(str(mnt))}/store/rank_\d is full: no space left on device.*",
            last,
        ), last
        checkpoint = latest_checkpoint(run / "checkpoints")
        assert checkpoint is not None and verify_checkpoint(checkpoint) == []
        _grow(mnt, "64m")
        resumed = run_train(config, run, "--resume", "--set", f"store.path={mnt / 'store'}", env=cli_env)
        assert "resumed from" in resumed.stderr
    assert json.loads((run / "summary.json").read_text())["model_digest"] == uninterrupted


def test_a_full_run_directory_still_reports_the_cause(tmp_path, cli_env, uninterrupted):
    """Untiered: the checkpoints fill the run directory's filesystem; even the failure records cannot be
    written there, and the cause still reaches the user."""
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    with tmpfs(tmp_path / "mnt", "3m") as mnt:
        run = mnt / "run"
        full = run_train(config, run, "--set", "store.tiered=false", env=cli_env, check=False)
        last = _last_line(full)
        pattern = rf"recsys: error: no space left on device writing {re.escape(str(run))}/\S+; free disk space, then continue with --resume"
        assert re.fullmatch(pattern, last), last
        checkpoint = latest_checkpoint(run / "checkpoints")
        assert checkpoint is not None and verify_checkpoint(checkpoint) == []
        _grow(mnt, "64m")
        resumed = run_train(config, run, "--resume", "--set", "store.tiered=false", env=cli_env)
        assert "resumed from" in resumed.stderr
        assert json.loads((run / "summary.json").read_text())["model_digest"] == uninterrupted
