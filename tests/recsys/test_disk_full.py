"""A store that runs out of space stops the run with one line naming it; store and checkpoints stay intact.

The LMDB map of each rank is capped (``store.max_lmdb_bytes``) below what the run's tables grow to, which
is how a full disk looks to the store: a write transaction that does not fit is aborted whole.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import lmdb
import pytest

from embedding_store import OptimizerKind, StoreConfig, TableSpec, TieredStore
from recsys.checkpoint import latest_checkpoint, verify_checkpoint
from tests.recsys.tiny import run_train, tiny_config

CONFIG = tiny_config(
    synthetic={"eval_samples": 1024},
    train={"steps": 120, "nproc": 2, "log_every": 50, "checkpoint_every": 20, "keep_checkpoints": 10},
)

CAP = 1 << 20  # the stores grow past 2 MiB; the first checkpoints fit


def _reopen(path: Path, seed: int) -> int:
    """Open a rank's store as it was left and read every row of every table; returns the row count."""
    env = lmdb.open(str(path), readonly=True, max_dbs=64, lock=False)
    with env.begin() as txn:
        meta = json.loads(bytes(txn.get(b"format", db=env.open_db(b"__meta__", txn=txn, create=False))))
    env.close()
    specs = [
        TableSpec(
            name=name,
            dim=t["dim"],
            optimizer=OptimizerKind(t["optimizer"]),
            num_embeddings=t["num_embeddings"],
            init_scale=t["init_scale"],
        )
        for name, t in meta["tables"].items()
    ]
    config = StoreConfig(seed=seed, device_capacity_rows=16, host_capacity_rows=16)
    rows = 0
    with TieredStore(path, config=config, tables=specs) as store:
        for spec in specs:
            rows += sum(len(chunk.ids) for chunk in store.iter_rows(spec.name))
    return rows


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(config, run directory, result) of a run whose stores hit the cap."""
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("full")
    config = tmp / "c.toml"
    config.write_text(CONFIG)
    run = tmp / "run"
    proc = run_train(config, run, "--set", f"store.max_lmdb_bytes={CAP}", env=subprocess_env(), check=False)
    return config, run, proc


def test_full_store_stops_with_one_line_naming_store_and_space(full_run):
    _, run, full = full_run
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]
    pattern = (
        rf"recsys: error: .*store {re.escape(str(run / 'store'))}/rank_\d is full: its LMDB map is at the cap "
        rf"of {CAP} bytes \(\d+ in use\) and a write of \d+ rows needed \d+ bytes more; "
        r"raise store\.max_lmdb_bytes or free disk space"
    )
    assert re.fullmatch(pattern, last), last
    assert not (run / "summary.json").exists()


def test_full_store_and_last_checkpoint_reopen_intact(full_run):
    _, run, _ = full_run
    for rank_dir in sorted((run / "store").glob("rank_*/")):
        assert _reopen(rank_dir, seed=0) > 0
    last = latest_checkpoint(run / "checkpoints")
    assert last is not None and verify_checkpoint(last) == []


@pytest.mark.slow
def test_resume_after_a_full_store_reaches_the_uninterrupted_model(full_run, tmp_path, cli_env):
    config, run, _ = full_run
    whole = tmp_path / "whole"
    run_train(config, whole, env=cli_env)
    resumed = run_train(config, run, "--resume", env=cli_env)  # no cap now
    assert "is damaged" not in resumed.stderr and "resumed from" in resumed.stderr
    digest = [json.loads((d / "summary.json").read_text())["model_digest"] for d in (whole, run)]
    assert digest[0] == digest[1]
