"""A store in use refuses a second run (naming the holder's pid); a killed holder's stale lock is recovered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from embedding_store import DirectoryLock, StoreLockedError
from tests.recsys.tiny import tiny_config

HOLD = """
import sys, time
from pathlib import Path
from embedding_store import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), name="rank_0.lock")
print("locked", flush=True)
time.sleep(600)
"""


def test_second_holder_is_refused_with_the_pid(tmp_path):
    with DirectoryLock(tmp_path, name="rank_0.lock"):
        with pytest.raises(StoreLockedError, match=f"in use by process {os.getpid()}") as info:
            DirectoryLock(tmp_path, name="rank_0.lock")
        assert info.value.holder == str(os.getpid())
    DirectoryLock(tmp_path, name="rank_0.lock").release()  # free again after release


def test_stale_lock_of_a_killed_process_is_recovered(tmp_path, cli_env):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], env=cli_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"process {child.pid}"):
            DirectoryLock(tmp_path, name="rank_0.lock")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (tmp_path / "rank_0.lock").read_text().strip() == str(child.pid)  # the stale file stays...
    with DirectoryLock(tmp_path, name="rank_0.lock"):  # ...and does not block the next owner
        assert (tmp_path / "rank_0.lock").read_text().strip() == str(os.getpid())


CONFIG = tiny_config(
    synthetic={"num_sparse": 3, "id_space": 3000, "eval_samples": 256},
    model={"over_arch": [16]},
    train={
        "steps": 1000000,
        "batch_size": 128,
        "nproc": 1,
        "checkpoint_every": 50,
        "keep_checkpoints": 1000000,
    },
    store={"device_rows": 700, "host_rows": 300},
)


def test_second_run_on_a_store_in_use_is_refused(tmp_path, cli_env, python, repo_root):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    cmd = [python, "-m", "recsys", "train", "--config", str(config), "--out", str(out)]
    first = subprocess.Popen(
        cmd,
        cwd=repo_root,
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        checkpoint = out / "checkpoints" / "step_00000050" / "meta.json"
        deadline = time.monotonic() + 240
        while not checkpoint.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checkpoint.exists(), "the first run must write a checkpoint"
        holder = (out / "store" / "rank_0.lock").read_text().strip()
        # Another run directory (the same one is refused by the run lock first), the first run's store.
        other = [*cmd[:-1], str(tmp_path / "other"), "--set", f"store.path={out / 'store'}"]
        second = subprocess.run(
            other, cwd=repo_root, env=cli_env, capture_output=True, text=True, timeout=240
        )
        assert first.poll() is None, "the first run must still hold the store"
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert lines[-1] == (
            f"recsys: error: store {out / 'store' / 'rank_0'} is in use by process {holder} "
            "(another training run?); stop it or set store.path to another directory"
        ), second.stderr
        assert "Traceback" not in second.stderr
        # The refused run touched nothing: the first run's checkpoint and store are where they were.
        assert checkpoint.exists() and (out / "store" / "rank_0" / "data.mdb").is_file()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
