"""End to end: `recsys train` with 2 gloo ranks, run twice, and killed then resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.recsys.tiny import run_train

CONFIG = """
[synthetic]
num_sparse = 4
id_space = 2000
eval_samples = 4096

[model]
embedding_dim = 8
dense_arch = [16, 8]
over_arch = [32]

[train]
steps = 300
batch_size = 256
nproc = 2
log_every = 50
checkpoint_every = 20
keep_checkpoints = 3

[eval]
every = 100
"""


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, config_file, repo_root_module, python_module, env_module) -> Path:
    out = tmp_path_factory.mktemp("run_a")
    run_train(config_file, out, env=env_module)
    return out


@pytest.fixture(scope="module")
def repo_root_module() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def python_module() -> str:
    import sys

    return sys.executable


@pytest.fixture(scope="module")
def env_module(repo_root_module) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = str(repo_root_module)
    return env


def test_two_rank_run_writes_summary_and_metrics(first_run):
    summary = json.loads((first_run / "summary.json").read_text())
    for key in (
        "auc",
        "logloss",
        "steps",
        "samples",
        "samples_per_s",
        "world_size",
        "config",
        "model_digest",
    ):
        assert key in summary
    assert summary["world_size"] == 2 and summary["steps"] == 300 and summary["samples"] == 300 * 256
    assert summary["config"]["train"]["batch_size"] == 256
    assert summary["auc"] > 0.55  # it learns
    records = [json.loads(line) for line in (first_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [100, 200, 300]
    assert evals[-1]["auc"] == summary["auc"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(50, 301, 50))
    assert train[-1]["loss"] < train[0]["loss"]


def test_same_config_twice_gives_same_digest(
    first_run, tmp_path, config_file, repo_root_module, python_module, env_module
):
    proc = run_train(config_file, tmp_path, env=env_module)
    a = json.loads((first_run / "summary.json").read_text())["model_digest"]
    b = json.loads((tmp_path / "summary.json").read_text())["model_digest"]
    assert a == b
    # the workers leave without the interpreter's teardown: they must not leave named semaphores behind
    assert "leaked semaphore" not in proc.stderr


TIERED = ["--set", "store.tiered=true", "--set", "store.device_rows=1400", "--set", "store.host_rows=400",
          "--set", "eval.batch_size=256"]  # fmt: skip


@pytest.mark.parametrize("extra", [[], pytest.param(TIERED, id="tiered")], ids=["in_memory", "tiered"])
def test_killed_run_resumes_to_the_same_digest(
    extra, first_run, tmp_path, config_file, repo_root_module, python_module, env_module
):
    """Killed after a checkpoint and resumed, a run ends as the uninterrupted in-memory run (tiered too)."""
    proc = subprocess.Popen(
        [
            python_module,
            "-m",
            "recsys",
            "train",
            "--config",
            str(config_file),
            "--out",
            str(tmp_path),
            *extra,
        ],
        cwd=repo_root_module,
        env=env_module,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = tmp_path / "checkpoints" / "step_00000040" / "meta.json"
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (tmp_path / "summary.json").exists(), "the kill must land mid-run"
    resumed = run_train(config_file, tmp_path, "--resume", *extra, env=env_module)
    assert "resumed from" in resumed.stderr
    a = json.loads((first_run / "summary.json").read_text())["model_digest"]
    b = json.loads((tmp_path / "summary.json").read_text())["model_digest"]
    assert a == b
