"""A failing background worker stops the whole run promptly with that worker's error, on every rank.

Faults are injected into a real 2-rank `recsys train` by tests/faults/sitecustomize.py (test-only): the
writer thread's LMDB commit, the prefetch stage's SSD read and the key-routing stage fail on rank 1. Rank
0 is then blocked in a collective with rank 1; the run must end within seconds, reporting rank 1's error
with its traceback, and not rank 0's echo of it.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.recsys.tiny import tiny_config

FAULTS = Path(__file__).resolve().parents[1] / "faults"

CONFIG = tiny_config(train={"steps": 120, "nproc": 2})

# Seconds from the injected fault to the CLI's exit; generous for a loaded 2-core machine (about 4 s idle).
PROMPT_S = 30


def fault_env(cli_env: dict[str, str], spec: str, log: Path) -> dict[str, str]:
    """``cli_env`` with the test-only fault injector on PYTHONPATH and ``TIERREC_FAULT=spec``."""
    env = dict(cli_env)
    env["PYTHONPATH"] = str(FAULTS) + os.pathsep + env["PYTHONPATH"]
    env.update(TIERREC_FAULT=spec, TIERREC_FAULT_LOG=str(log))
    return env


@pytest.mark.parametrize(
    ("site", "n", "message"),
    [
        ("writer", 2, "StoreError: background LMDB writer failed: injected fault at writer"),
        pytest.param(
            "prefetch",
            30,
            "StageFailed: pipeline stage 'prefetch' failed on batch 29: RuntimeError: injected fault at prefetch",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "route",
            30,
            "StageFailed: pipeline stage 'route' failed on batch 29: RuntimeError: injected fault at route",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_worker_failure_stops_the_run_promptly(site, n, message, tmp_path, cli_env, python, repo_root):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    log = tmp_path / "fault.log"
    proc = subprocess.run(
        [python, "-m", "recsys", "train", "--config", str(config), "--out", str(tmp_path / "run")],
        cwd=repo_root,
        env=fault_env(cli_env, f"{site}:raise:{n}:1", log),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ended = time.time()
    assert log.exists(), f"the fault at {site} never fired: {proc.stderr[-2000:]}"
    fired = float(log.read_text().split()[-1])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("recsys: error: worker 1 failed: ") and message in last, proc.stderr[-2000:]
    # The root cause's traceback, printed by the launcher; no worker printed its own (rank 0's is an echo).
    assert "injected fault" in proc.stderr.split("Traceback (most recent call last)", 1)[-1]
    assert "Process tierrec-rank-" not in proc.stderr, proc.stderr[-2000:]
    assert ended - fired < PROMPT_S, f"the run took {ended - fired:.1f} s to stop after the fault"
    assert not (tmp_path / "run" / "summary.json").exists()


def _silent_peer(rank: int, port: int, result: object) -> None:
    from recsys.distributed import collective_timeout, init_distributed, set_local_rank_env

    set_local_rank_env(rank, 2, port)
    init_distributed(threads_per_rank=1, timeout_s=3)
    group = dist.new_group(backend="gloo", timeout=collective_timeout())
    assert collective_timeout() == datetime.timedelta(seconds=3)
    if rank == 1:
        time.sleep(20)  # alive, but never joins the collective
        return
    import torch

    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as err:
        result.put((time.monotonic() - start, str(err).splitlines()[0]))  # type: ignore[attr-defined]
        return
    result.put((time.monotonic() - start, "no error"))  # type: ignore[attr-defined]


def test_collectives_time_out_instead_of_hanging():
    """A rank whose peer never joins a key-routing-style group's collective fails after the timeout."""
    from recsys.distributed import free_port

    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = mp.start_processes(
        _silent_peer, args=(free_port(), result), nprocs=2, join=False, start_method="spawn"
    )
    try:
        waited, error = result.get(timeout=120)
    finally:
        for p in procs.processes:
            p.kill()
    assert error != "no error" and waited < 15, (waited, error)
