"""Process lifetime: signals to the launcher or a worker end every process; the run directory is locked.

The oracle for a stopped run is the same run never interrupted: a run stopped by SIGTERM writes a
checkpoint, and ``--resume`` from it ends with the uninterrupted run's digest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embedding_store.lockfile import DirectoryLock
from recsys.runlock import RUN_LOCK
from tests.recsys.tiny import ROOT, run_train, tiny_config

STEPS = 200
CONFIG = tiny_config(train={"steps": STEPS, "nproc": 2, "log_every": 10, "checkpoint_every": 100})
LONG = tiny_config(train={"steps": 100_000, "nproc": 2, "log_every": 10})


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _workers(launcher: int) -> list[int]:
    """The training workers of a launcher (its children other than multiprocessing's resource tracker)."""
    pids = []
    for pid in _children(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            pids.append(pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(config: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "recsys", "train", "--config", str(config), "--out", str(out), *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_training(proc: subprocess.Popen, out: Path, timeout_s: float = 120.0) -> None:
    """Until the first train record is in metrics.jsonl (every rank is inside its training loop)."""
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            return
        time.sleep(0.1)
    raise AssertionError("the run did not start training")


def _training(
    tmp_path: Path, text: str, env: dict[str, str]
) -> tuple[Path, Path, subprocess.Popen, list[int]]:
    """A 2-rank run of config ``text`` that has started training: (config, run dir, launcher, worker pids)."""
    config = tmp_path / "c.toml"
    config.write_text(text)
    out = tmp_path / "run"
    proc = _start(config, out, env)
    _wait_for_training(proc, out)
    return config, out, proc, _workers(proc.pid)


def _wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until every pid has exited; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - t0 < timeout_s, (
            f"still alive after {timeout_s} s: {[p for p in pids if _alive(p)]}"
        )
        time.sleep(0.05)
    return time.monotonic() - t0


def _unlocked(out: Path) -> None:
    """The run directory's lock and every rank's store lock are free."""
    for parent, name in [(out, RUN_LOCK), (out / "store", "rank_0.lock"), (out / "store", "rank_1.lock")]:
        DirectoryLock(parent, name=name).release()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("whole")
    (tmp / "c.toml").write_text(CONFIG)
    run_train(tmp / "c.toml", tmp / "run", env=subprocess_env())
    return json.loads((tmp / "run" / "summary.json").read_text())["model_digest"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_to_the_launcher_stops_every_worker_with_a_checkpoint_that_resumes_exactly(
    signum, tmp_path, cli_env, uninterrupted
):
    config, out, proc, workers = _training(tmp_path, CONFIG, cli_env)
    assert len(workers) == 2
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    _wait_gone(workers, timeout_s=5)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert (
        last
        == f"recsys: stopped by {signal.Signals(signum).name}; a checkpoint was written, continue with --resume"
    )
    assert "Traceback" not in stderr
    _unlocked(out)
    stopped_at = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert stopped_at < STEPS
    resumed = run_train(config, out, "--resume", env=cli_env)
    assert "resumed from" in resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_digest"] == uninterrupted
    assert summary["samples"] == STEPS * 256  # the whole run's samples, not only the resumed part
    # metrics.jsonl was cut back to the checkpoint: every train step is logged once, in order.
    steps = [
        r["step"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert steps == list(range(10, STEPS + 1, 10))


def test_sigkill_to_the_launcher_ends_every_worker_and_frees_the_locks(tmp_path, cli_env):
    _, out, proc, workers = _training(tmp_path, LONG, cli_env)
    assert len(workers) == 2
    proc.kill()
    proc.communicate(timeout=30)
    _wait_gone(workers, timeout_s=5)
    _unlocked(out)


def test_sigterm_to_one_worker_stops_all_ranks_at_the_same_step_with_a_checkpoint(tmp_path, cli_env):
    config, out, proc, workers = _training(tmp_path, LONG, cli_env)
    os.kill(max(workers), signal.SIGTERM)  # one rank only: the others learn of it in the step's collective
    _, stderr = proc.communicate(timeout=60)
    _wait_gone(workers, timeout_s=5)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "a checkpoint was written" in stderr.strip().splitlines()[-1]
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "meta.json").is_file()
    assert {p.name for p in checkpoints[0].glob("rank_*.pt")} == {"rank_0.pt", "rank_1.pt"}


def test_a_second_run_on_the_same_run_directory_is_refused_and_the_first_is_untouched(tmp_path, cli_env):
    config, out, first, _ = _training(tmp_path, LONG, cli_env)
    try:
        before = (out / "metrics.jsonl").stat().st_ino
        second = run_train(config, out, "--set", f"store.path={tmp_path / 'other'}", env=cli_env, check=False)
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert lines[-1] == (
            f"recsys: error: run directory {out} is in use by process {first.pid} (another training run?); "
            "wait for it to finish or choose another --out"
        ), second.stderr[-3000:]
        assert not (tmp_path / "other").exists()
        assert first.poll() is None  # still training, its files in place
        assert (out / "metrics.jsonl").stat().st_ino == before
    finally:
        first.kill()
        first.communicate(timeout=30)


def test_the_run_lock_is_taken_by_rank_0_when_there_is_no_launcher(tmp_path):
    """Under torchrun, ``run()`` locks the run directory itself; a held lock refuses it in one line."""
    from recsys.config import config_from_dict
    from recsys.errors import UserError
    from recsys.train import run

    held = DirectoryLock(tmp_path, name=RUN_LOCK)
    try:
        config = config_from_dict({"train": {"steps": 1, "batch_size": 64}, "synthetic": {"num_sparse": 2}})
        with pytest.raises(UserError, match=r"run directory .* is in use by process \d+"):
            run(config, tmp_path)
    finally:
        held.release()
