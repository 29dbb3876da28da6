"""Checkpoint manifests: a truncated or altered file is named on resume and an older checkpoint is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.checkpoint import DAMAGED_PREFIX, META, _describe, resumable_checkpoint, verify_checkpoint
from tests.recsys.tiny import run_train, tiny_config

CONFIG = tiny_config(
    synthetic={"num_sparse": 3, "id_space": 3000, "eval_samples": 256},
    model={"over_arch": [16]},
    train={
        "steps": 60,
        "batch_size": 128,
        "nproc": 1,
        "log_every": 20,
        "checkpoint_every": 20,
        "keep_checkpoints": 3,
    },
    store={"device_rows": 700, "host_rows": 300},
)


def _fake_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    path = root / f"step_{step:08d}"
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    manifest = _describe(path, [path / name for name in files])
    (path / META).write_text(json.dumps({"format": 2, "step": step, "world_size": 1, "files": manifest}))
    return path


def test_verify_names_missing_truncated_and_altered_files(tmp_path):
    path = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"x" * 100, "store_rank_0/data.mdb": b"y" * 50})
    assert verify_checkpoint(path) == []
    (path / "rank_0.pt").write_bytes(b"x" * 99)
    assert verify_checkpoint(path) == [
        f"{path / 'rank_0.pt'} is truncated or altered (99 bytes, the manifest says 100)"
    ]
    (path / "rank_0.pt").write_bytes(b"x" * 99 + b"z")
    assert verify_checkpoint(path) == [f"{path / 'rank_0.pt'} is altered (checksum mismatch)"]
    (path / "store_rank_0" / "data.mdb").unlink()
    assert f"{path / 'store_rank_0' / 'data.mdb'} is missing" in verify_checkpoint(path)
    (path / META).write_text("{not json")
    assert "unreadable meta.json" in verify_checkpoint(path)[0]


def test_resumable_skips_damaged_and_incomplete_checkpoints(tmp_path, caplog):
    good = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"a" * 10})
    bad = _fake_checkpoint(tmp_path, 20, {"rank_0.pt": b"b" * 10})
    incomplete = tmp_path / "step_00000030"
    incomplete.mkdir()
    (incomplete / "rank_0.pt").write_bytes(b"c")  # killed before meta.json: never resumed from
    (bad / "rank_0.pt").write_bytes(b"B" * 10)
    with caplog.at_level("WARNING", logger="recsys"):
        assert resumable_checkpoint(tmp_path) == good
    assert f"{bad / 'rank_0.pt'} is altered (checksum mismatch)" in caplog.text
    assert (tmp_path / (DAMAGED_PREFIX + bad.name)).is_dir() and not bad.exists()
    assert resumable_checkpoint(tmp_path) == good  # the damaged one is out of the way now


def _digest(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["model_digest"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """The config file and the digest of the run without damage."""
    from tests.conftest import subprocess_env

    tmp = tmp_path_factory.mktemp("whole")
    config = tmp / "c.toml"
    config.write_text(CONFIG)
    run_train(config, tmp / "out", env=subprocess_env())
    return config, _digest(tmp / "out")


@pytest.mark.parametrize("damage", ["truncate_rank_file", "alter_store_snapshot"])
def test_damaged_checkpoint_falls_back_and_resumes_exactly(
    damage, uninterrupted, tmp_path, cli_env, python, repo_root
):
    config, whole = uninterrupted
    run = tmp_path / "run"
    run_train(config, run, "--set", "train.steps=40", env=cli_env)  # checkpoints 20, 40
    newest = run / "checkpoints" / "step_00000040"
    if damage == "truncate_rank_file":
        bad = newest / "rank_0.pt"
        bad.write_bytes(bad.read_bytes()[:-17])
        why = "is truncated or altered"
    else:
        bad = newest / "store_rank_0" / "data.mdb"
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0x40
        bad.write_bytes(bytes(data))
        why = "is altered (checksum mismatch)"
    resumed = run_train(config, run, "--resume", env=cli_env)
    assert f"checkpoint {newest} is damaged: {bad} {why}" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000020 (step 20)" in resumed.stderr
    assert _digest(run) == whole
