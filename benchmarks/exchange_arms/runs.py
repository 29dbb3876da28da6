"""One arm of ``bench_exchange.py``, run through the CLI: ``recsys train`` on 2 local ranks (the CLI spawns
its workers), or as 2 torchrun "nodes" of one rank each on this host (this program starts both agents);
and ``recsys plan-exchange``, where the tree has it.

CPU: the user + system seconds of the finished child process trees, ``getrusage(RUSAGE_CHILDREN)`` before
and after. A process's children count there once it has waited for them, so the sum holds the launcher's
spawned workers (``recsys.launch`` joins them) and torchrun's (its agent waits for them): on this machine
it matched a ``/proc`` sampling of every process of the tree to 0.1%, for both.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_real_data import cli_env

from recsys.local_env import free_port

ROOT = Path(__file__).resolve().parents[2]
MODES = ("local", "two_node")
RUN_TIMEOUT_S = 3 * 3600.0


@dataclass(frozen=True)
class ArmRun:
    """What to run: ``recsys train --config config`` with ``sets``, into ``out``, started as ``mode``."""

    config: str
    sets: tuple[str, ...]
    out: Path
    mode: str = "local"


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished and waited-for descendants so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def commands(run: ArmRun) -> list[list[str]]:
    """The command lines of one run: one ``recsys train``, or the two torchrun agents (static rendezvous at
    a free port on the loopback interface, node ranks 0 and 1, one worker each, no restarts)."""
    train = ["-m", "recsys", "train", "--config", run.config, "--out", str(run.out)]
    train += [a for s in run.sets for a in ("--set", s)]
    if run.mode == "local":
        return [[sys.executable, *train]]
    if run.mode != "two_node":
        raise ValueError(f"unknown mode {run.mode!r}; valid: {', '.join(MODES)}")
    port = str(free_port())
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    agent += ["--master-addr", "127.0.0.1", "--master-port", port, "--max-restarts", "0"]
    return [[*agent, "--node-rank", str(rank), *train] for rank in (0, 1)]


def reason(log: Path) -> str:
    """The line of a failed run's log that says why: the CLI's last ``recsys: error:`` line, else the last
    line that is not a rule of ``=`` or ``-`` (torchrun ends its report with one)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if line.startswith("recsys: error:")]
    text = [line for line in lines if line.strip("=-")]
    return (errors or text or ["(no output)"])[-1]


def wait_all(procs: list[subprocess.Popen[bytes]]) -> list[int | None]:
    """Wait until every process has ended, one has failed (its peer would wait for a rendezvous that never
    comes) or ``RUN_TIMEOUT_S`` has passed; their exit codes then (None: still running)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    return [p.poll() for p in procs]


def train(run: ArmRun) -> dict[str, Any]:
    """Run it (a previous run in ``out`` removed first) and return its record: from ``summary.json`` the
    exchange's counts (its per-table part left out), ``bytes_per_sample``, ``steps``, ``samples``,
    ``train_seconds`` and ``step_time_ms`` (train_seconds / steps), ``model_digest``; ``cpu_s`` (every
    process of the run, start-up, the final evaluation and the summary included) and ``wall_s``.
    A failed run raises; torchrun's ends the program with one line."""
    shutil.rmtree(run.out, ignore_errors=True)
    run.out.mkdir(parents=True)
    logs = [run.out.parent / f"{run.out.name}.{i}.log" for i in range(2 if run.mode == "two_node" else 1)]
    cpu0, start = children_cpu_s(), time.perf_counter()
    procs = []
    for cmd, log in zip(commands(run), logs, strict=True):
        with log.open("w") as sink:  # files, not pipes: two agents at once cannot block on a full pipe
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=sink, stderr=subprocess.STDOUT)
            )
    try:
        codes = wait_all(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall_s, cpu_s = time.perf_counter() - start, children_cpu_s() - cpu0
    if any(c != 0 for c in codes):
        failed = next(i for i, c in enumerate(codes) if c != 0)
        where = f"torchrun node {failed}" if run.mode == "two_node" else "recsys train"
        how = "ran past the time limit" if codes[failed] is None else f"exited with {codes[failed]}"
        message = f"{where} {how} ({logs[failed]}): {reason(logs[failed])}"
        if run.mode == "two_node":
            raise SystemExit(f"bench_exchange: 2 torchrun nodes on this host failed: {message}")
        raise RuntimeError(f"{message}\n{logs[failed].read_text(errors='replace')[-3000:]}")
    summary = json.loads((run.out / "summary.json").read_text())
    exchange = {k: v for k, v in summary["exchange"].items() if k != "tables"}
    steps = int(summary["steps"])
    return {
        "bytes_per_sample": exchange["bytes_per_sample"],
        "exchange": exchange,
        "steps": steps,
        "samples": int(summary["samples"]),
        "world_size": summary["world_size"],
        "train_seconds": summary["train_seconds"],
        "step_time_ms": 1e3 * summary["train_seconds"] / steps,
        "model_digest": summary["model_digest"],
        "cpu_s": cpu_s,
        "wall_s": wall_s,
    }


def plan_exchange(config: str, sets: tuple[str, ...]) -> tuple[dict[str, Any] | None, str]:
    """``recsys plan-exchange --config config --set ...`` (the stream's and the windows' overrides): its
    last line's JSON object and a note; None where the subcommand is not in this tree or it failed."""
    base = [sys.executable, "-m", "recsys", "plan-exchange"]
    probe = subprocess.run([*base, "--help"], cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    if probe.returncode != 0:
        return None, "recsys plan-exchange is not in this tree: no simulated world sizes"
    args = [*base, "--config", config, *(a for s in sets for a in ("--set", s))]
    proc = subprocess.run(args, cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    try:
        if proc.returncode == 0 and lines:
            return json.loads(
                lines[-1]
            ), f"from `recsys plan-exchange --config {config}` with the runs' --set"
    except json.JSONDecodeError:
        pass
    error = (proc.stderr.strip().splitlines() or ["no JSON last line"])[-1]
    return None, f"recsys plan-exchange failed (exit {proc.returncode}): {error}"


def threads_per_rank() -> int:
    """Intra-op threads per rank: what the local launcher gives each of 2 ranks (the cores halved), set
    for the torchrun nodes too, each of which would otherwise take every core of the host."""
    return max(1, (os.cpu_count() or 1) // 2)
