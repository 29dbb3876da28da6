"""Checkpoint manifests: a damaged checkpoint is named on resume and an older one is used.

Damaged: a file missing, truncated, altered or not listed; a manifest entry that points outside the
checkpoint (never opened); ``format``, ``step`` or ``world_size`` that do not hold up. Also the config
fingerprint and the fsyncs that make a checkpoint durable.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import recsys.checkpoint as ckpt
from recsys.checkpoint import (
    DAMAGED_PREFIX,
    META,
    CheckpointError,
    ModelState,
    _describe,
    _short,
    checkpoint_meta,
    fingerprint_mismatch,
    load_checkpoint,
    model_fingerprint,
    resumable_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from recsys.config import config_from_dict
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


def _fake_checkpoint(
    root: Path, step: int, files: dict[str, bytes], meta: dict[str, Any] | None = None
) -> Path:
    """A checkpoint directory holding ``files``, all listed; ``meta`` replaces keys of its meta.json."""
    path = root / f"step_{step:08d}"
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    manifest = _describe(path, [path / name for name in files])
    doc = {"format": 2, "step": step, "world_size": 1, "files": manifest} | (meta or {})
    (path / META).write_text(json.dumps(doc))
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


def _entry(data: bytes) -> dict[str, Any]:
    """The manifest entry of a file holding ``data``."""
    import hashlib

    return {"bytes": len(data), "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}


@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """Every path this process opens during the test (``os.open`` and ``open``), resolved."""
    seen: list[Path] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *args, **kwargs):
        seen.append(Path(path).resolve())
        return real_os_open(path, *args, **kwargs)

    def py_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike):
            seen.append(Path(file).resolve())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    return seen


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlinked_file", "symlinked_folder"])
def test_manifest_entry_outside_the_checkpoint_is_damage_and_never_opened(kind, tmp_path, opened, caplog):
    secret = tmp_path / "outside" / "data.mdb"
    secret.parent.mkdir()
    secret.write_bytes(b"s" * 64)
    root = tmp_path / "checkpoints"
    good = _fake_checkpoint(root, 10, {"rank_0.pt": b"a" * 10})
    bad = _fake_checkpoint(root, 20, {"rank_0.pt": b"b" * 10})
    name = {
        "absolute": str(secret),
        "dotdot": "store_rank_0/../../../outside/data.mdb",
        "symlinked_file": "leak.bin",
        "symlinked_folder": "store_rank_0/data.mdb",
    }[kind]
    if kind == "symlinked_file":
        (bad / name).symlink_to(secret)
    elif kind == "symlinked_folder":
        (bad / "store_rank_0").symlink_to(secret.parent, target_is_directory=True)
    meta = json.loads((bad / META).read_text())
    meta["files"][name] = _entry(secret.read_bytes())  # size and checksum right: only the name is wrong
    (bad / META).write_text(json.dumps(meta))
    why = {
        "absolute": f"manifest entry {_short(name)} is an absolute path",  # a long tmp path is cut
        "dotdot": f"manifest entry {name!r} contains '..'",
        "symlinked_file": f"manifest entry {name!r} resolves to {secret}, outside it",
        "symlinked_folder": f"manifest entry {name!r} resolves to {secret}, outside it",
    }[kind]
    assert verify_checkpoint(bad) == [f"{bad / META}: {why}"]
    with pytest.raises(CheckpointError, match="outside it|absolute|'..'"):
        checkpoint_meta(bad)
    with caplog.at_level("WARNING", logger="recsys"):
        assert resumable_checkpoint(root) == good
    assert f"checkpoint {bad} is damaged: {bad / META}: {why}" in caplog.text
    assert secret.resolve() not in opened
    assert opened, "the recorder saw no open at all"


def test_empty_manifest_with_a_truncated_rank_file_falls_back(tmp_path, caplog):
    good = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"a" * 10})
    bad = _fake_checkpoint(tmp_path, 20, {"rank_0.pt": b"b" * 5}, {"files": {}})
    why = f"{bad / META}: world_size is 1 but the manifest lists no rank_0.pt"
    assert verify_checkpoint(bad) == [why]
    with pytest.raises(CheckpointError, match="lists no rank_0.pt"):  # not OSError from torch.load
        load_checkpoint(bad, dmp=None, dense_optimizer=None)
    with caplog.at_level("WARNING", logger="recsys"):
        assert resumable_checkpoint(tmp_path) == good
    assert f"checkpoint {bad} is damaged: {why}" in caplog.text


def test_unlisted_files_are_damage_and_temporary_names_are_not(tmp_path):
    path = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"a" * 10})
    (path / ".rank_0.pt.tmp").write_bytes(b"left by a killed writer")
    (path / ".store_rank_0.tmp").mkdir()
    (path / ".store_rank_0.tmp" / "data.mdb").write_bytes(b"half a snapshot")
    assert verify_checkpoint(path) == []
    (path / "store_rank_0").mkdir()
    (path / "store_rank_0" / "data.mdb").write_bytes(b"z" * 7)
    (path / "notes").symlink_to("/dev/null")  # a symlink counts as a file, and is not followed
    assert verify_checkpoint(path) == [
        f"{path / 'notes'} is not listed in the manifest",
        f"{path / 'store_rank_0' / 'data.mdb'} is not listed in the manifest",
    ]


def test_lmdbs_lock_file_beside_a_listed_snapshot_is_tolerated_and_nothing_else(tmp_path):
    # An LMDB tool opening a snapshot, even read-only, creates lock.mdb (reader table only, no data).
    path = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"a" * 10, "store_rank_0/data.mdb": b"d" * 8})
    (path / "store_rank_0" / "lock.mdb").write_bytes(b"reader table")
    assert verify_checkpoint(path) == []
    (path / "store_rank_0" / "lock.mdb").unlink()
    (path / "store_rank_0" / "lock.mdb").symlink_to(path / "rank_0.pt")  # not a regular file
    (path / "store_rank_0" / "data.mdb-lock").write_bytes(b"x")  # another name
    (path / "lock.mdb").write_bytes(b"x")  # not in a store snapshot
    (path / "store_rank_1").mkdir()  # a snapshot the manifest does not list
    (path / "store_rank_1" / "lock.mdb").write_bytes(b"x")
    assert verify_checkpoint(path) == [
        f"{path / name} is not listed in the manifest"
        for name in (
            "lock.mdb",
            "store_rank_0/data.mdb-lock",
            "store_rank_0/lock.mdb",
            "store_rank_1/lock.mdb",
        )
    ]


def test_a_fifo_in_place_of_a_listed_file_does_not_block(tmp_path):
    path = _fake_checkpoint(tmp_path, 10, {"rank_0.pt": b"a" * 10})
    (path / "rank_0.pt").unlink()
    os.mkfifo(path / "rank_0.pt")
    assert verify_checkpoint(path) == [f"{path / 'rank_0.pt'} is unreadable (not a regular file)"]


RANKS = {"rank_0.pt": b"a" * 10}


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"world_size": -3}, "world_size must be an integer >= 1, got -3"),
        ({"world_size": "1"}, "world_size must be an integer >= 1, got '1'"),
        ({"world_size": True}, "world_size must be an integer >= 1, got True"),
        ({"world_size": 1.0}, "world_size must be an integer >= 1, got 1.0"),
        ({"world_size": None}, "world_size must be an integer >= 1, got None"),
        ({"world_size": 2}, "world_size is 2 but the manifest lists no rank_1.pt"),
        ({"world_size": 10**12}, "world_size is 1000000000000 but the manifest lists no rank_1.pt"),
        ({"step": -1}, "step must be an integer >= 0, got -1"),
        ({"step": "10"}, "step must be an integer >= 0, got '10'"),
        ({"step": 10.0}, "step must be an integer >= 0, got 10.0"),
        ({"step": 20}, "step 20 does not match the directory name step_00000010"),
        ({"format": 1}, "format 1 is not 2, the format this version reads"),
        ({"format": "2"}, "format '2' is not 2, the format this version reads"),
        ({"files": []}, "the manifest (files) must be an object, got list"),
        ({"fingerprint": [1]}, "fingerprint must be an object, got [1]"),
        ({"bounds": [1]}, "bounds must map table names to default row ids in [1, 2**63), got [1]"),
        ({"bounds": {"t": 0}}, "bounds must map table names to default row ids in [1, 2**63), got {'t': 0}"),
        (
            {"bounds": {"t": True}},
            "bounds must map table names to default row ids in [1, 2**63), got {'t': True}",
        ),
        (
            {"bounds": {"t": 2**63}},
            f"bounds must map table names to default row ids in [1, 2**63), got {{'t': {2**63}}}",
        ),
    ],
)
def test_bad_format_step_and_world_size_are_damage(meta, why, tmp_path):
    path = _fake_checkpoint(tmp_path, 10, RANKS, meta)
    assert verify_checkpoint(path) == [f"{path / META}: {why}"]
    with pytest.raises(CheckpointError) as info:
        checkpoint_meta(path)
    assert str(info.value) == f"{path / META}: {why}"
    with pytest.raises(CheckpointError):
        load_checkpoint(path, dmp=None, dense_optimizer=None)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("rank_1.pt", "manifest entry 'rank_1.pt' is of rank 1, but world_size is 1"),
        ("rank_00.pt", "manifest entry 'rank_00.pt' is not a rank's name (that would be 'rank_0.pt')"),
        ("store_rank_3/data.mdb", "manifest entry 'store_rank_3/data.mdb' is of rank 3, but world_size is 1"),
        ("./extra.bin", "manifest entry './extra.bin' is not a normalised relative path"),
        ("a//extra.bin", "manifest entry 'a//extra.bin' is not a normalised relative path"),
        ("", "manifest entry '' is not a file name"),
    ],
)
def test_manifest_names_that_do_not_fit_the_layout_are_damage(name, why, tmp_path):
    path = _fake_checkpoint(tmp_path, 10, RANKS)
    meta = json.loads((path / META).read_text())
    meta["files"][name] = _entry(b"")
    (path / META).write_text(json.dumps(meta))
    assert verify_checkpoint(path) == [f"{path / META}: {why}"]


def test_odd_values_give_one_short_line_and_symlink_loops_are_damage(tmp_path):
    path = _fake_checkpoint(tmp_path, 10, RANKS, {"world_size": "many\n" * 1000})
    [why] = verify_checkpoint(path)
    assert why.startswith(f"{path / META}: world_size must be an integer >= 1, got 'many\\nmany")
    assert "\n" not in why and len(why) < len(str(path)) + 200
    path = _fake_checkpoint(tmp_path, 20, RANKS)
    (path / "loop").symlink_to("loop")
    meta = json.loads((path / META).read_text())
    meta["files"]["loop"] = _entry(b"")
    (path / META).write_text(json.dumps(meta))
    [why] = verify_checkpoint(path)
    assert why.startswith(f"{path / META}: manifest entry 'loop' cannot be resolved (")


def test_bad_manifest_entry_is_damage(tmp_path):
    path = _fake_checkpoint(tmp_path, 10, RANKS)
    for entry in ({"bytes": -1, "blake2b": "0" * 32}, {"bytes": 10}, {"bytes": 10, "blake2b": "xyz"}, 7):
        meta = json.loads((path / META).read_text())
        meta["files"]["rank_0.pt"] = entry
        (path / META).write_text(json.dumps(meta))
        assert verify_checkpoint(path) == [f"{path / META}: bad manifest entry for 'rank_0.pt': {entry!r}"]


class _Fused:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state}


class _Model:
    """What save_checkpoint and load_checkpoint use of a DistributedModelParallel."""

    def __init__(self) -> None:
        self.weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        self.fused_optimizer = _Fused({"weight.momentum": torch.full((4,), 0.5)})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}


class _Dense(torch.optim.SGD):
    def init_state(self) -> None:
        """The trainer's optimizers create lazy state here; SGD without momentum has none."""


def _trained() -> tuple[_Model, _Dense]:
    model = _Model()
    return model, _Dense([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


class _Fingerprint:
    """A checkpoint part that only records a fingerprint in meta.json."""

    def __init__(self, fingerprint):
        self.fingerprint = fingerprint

    def save(self, into):
        into.meta["fingerprint"] = self.fingerprint
        return []

    def restore(self, source):
        pass


def test_save_verify_load_round_trip_with_fingerprint(tmp_path):
    model, dense = _trained()
    fingerprint = model_fingerprint(config_from_dict({}, ["train.batch_size=512"]))
    parts = {"model": ModelState(model, dense), "fingerprint": _Fingerprint(fingerprint)}
    path = save_checkpoint(tmp_path, step=7, parts=parts, keep=2)
    assert verify_checkpoint(path) == []
    meta = checkpoint_meta(path)
    assert (meta["step"], meta["world_size"], meta["fingerprint"]) == (7, 1, fingerprint)
    assert set(meta["files"]) == {"rank_0.pt"}
    saved = model.weight.clone()
    model.weight.zero_()
    model.fused_optimizer.state["weight.momentum"].zero_()
    assert load_checkpoint(path, dmp=model, dense_optimizer=dense) == 7
    assert torch.equal(model.weight, saved)
    assert torch.equal(model.fused_optimizer.state["weight.momentum"], torch.full((4,), 0.5))
    plain = save_checkpoint(tmp_path, step=8, parts={"model": ModelState(model, dense)}, keep=2)
    assert checkpoint_meta(plain)["fingerprint"] is None


def test_unloadable_rank_files_raise_one_line_checkpoint_errors(tmp_path):
    model, dense = _trained()
    garbage = _fake_checkpoint(tmp_path, 1, {"rank_0.pt": b"not a torch file at all"})
    assert verify_checkpoint(garbage) == []  # intact against its manifest, yet unloadable
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(garbage, dmp=model, dense_optimizer=dense)
    assert str(info.value).startswith(f"checkpoint file {garbage / 'rank_0.pt'} cannot be loaded (")
    assert "\n" not in str(info.value) and "weights_only" not in str(info.value)  # no advice to unpickle

    good = save_checkpoint(tmp_path, step=2, parts={"model": ModelState(model, dense)}, keep=5)
    data = (good / "rank_0.pt").read_bytes()
    truncated = _fake_checkpoint(tmp_path, 3, {"rank_0.pt": data[: len(data) // 2]})
    with pytest.raises(CheckpointError, match="cannot be loaded") as info:
        load_checkpoint(truncated, dmp=model, dense_optimizer=dense)
    assert "\n" not in str(info.value)

    moved = _fake_checkpoint(tmp_path, 4, {"rank_0.pt": data})  # step 2's file under step 4
    with pytest.raises(CheckpointError, match=r"rank_0.pt has step 2, meta.json says 4"):
        load_checkpoint(moved, dmp=model, dense_optimizer=dense)

    other = _Model()
    other.weight = torch.zeros(5, 3)  # another model: the saved shape does not fit
    with pytest.raises(CheckpointError, match=r"model.weight: shape \(4, 3\) vs \(5, 3\)"):
        load_checkpoint(good, dmp=other, dense_optimizer=dense)
    other = _Model()
    wrong_dense = _Dense([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(CheckpointError, match="does not fit this run \\(ValueError"):
        load_checkpoint(good, dmp=other, dense_optimizer=wrong_dense)


def test_directories_are_fsynced_around_every_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync_dir, real_replace = ckpt.files._fsync_dir, os.replace

    def fsync_dir(path: Path) -> None:
        events.append(("fsync", str(Path(path).relative_to(tmp_path))))
        real_fsync_dir(path)

    def replace(src, dst) -> None:
        events.append(("rename", str(Path(dst).relative_to(tmp_path))))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.files, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "replace", replace)
    model, dense = _trained()
    root = tmp_path / "out" / "checkpoints"
    (tmp_path / "out").mkdir()
    save_checkpoint(root, step=1, parts={"model": ModelState(model, dense)}, keep=1)
    step1, step2 = "out/checkpoints/step_00000001", "out/checkpoints/step_00000002"
    assert events == [
        ("fsync", "out"),  # checkpoints/ was created
        ("fsync", "out/checkpoints"),  # step_00000001/ was created
        ("rename", f"{step1}/rank_0.pt"),
        ("fsync", step1),
        ("fsync", step1),  # before meta.json: the checkpoint is complete only once all of it is durable
        ("rename", f"{step1}/meta.json"),
        ("fsync", step1),
    ]
    events.clear()
    save_checkpoint(root, step=2, parts={"model": ModelState(model, dense)}, keep=1)
    assert events == [
        ("fsync", "out/checkpoints"),
        ("rename", f"{step2}/rank_0.pt"),
        ("fsync", step2),
        ("fsync", step2),
        ("rename", f"{step2}/meta.json"),
        ("fsync", step2),
        ("fsync", "out/checkpoints"),  # step_00000001 pruned
    ]
    assert not (tmp_path / step1).exists()
    events.clear()
    (tmp_path / step2 / "rank_0.pt").write_bytes(b"damaged")
    assert resumable_checkpoint(root) is None
    assert events == [("fsync", "out/checkpoints")]  # renamed damaged_step_00000002
    assert (root / "damaged_step_00000002").is_dir()


def test_model_fingerprint_holds_what_changes_the_model():
    base = config_from_dict({})
    fingerprint = model_fingerprint(base)
    assert json.loads(json.dumps(fingerprint)) == fingerprint  # flat and JSON-safe
    assert {"train.seed", "train.batch_size", "train.dense_optimizer", "train.dense_learning_rate"} <= set(
        fingerprint
    )
    assert {"sparse.optimizer", "sparse.learning_rate", "sparse.sharding", "sparse.init_scale"} <= set(
        fingerprint
    )
    assert {"model.name", "model.dense_arch", "data.source", "synthetic.num_sparse"} <= set(fingerprint)
    assert (
        fingerprint["model.dense_arch"] == [64, 16]
        and fingerprint["sparse.optimizer"] == "exact_rowwise_adagrad"
    )
    # of [store], only the bounds change the model (which rows exist); where rows live does not
    assert [k for k in fingerprint if k.split(".")[0] in {"store", "pipeline", "eval"}] == ["store.bounds"]
    assert not {"train.steps", "train.nproc", "synthetic.eval_samples", "data.path"} & set(fingerprint)
    same = config_from_dict(
        {"store": {"tiered": True, "device_rows": 8}, "pipeline": {"mode": "sequential"}},
        ["train.steps=5000", "train.nproc=2", "eval.every=10", "synthetic.eval_samples=100"],
    )
    assert fingerprint_mismatch(fingerprint, model_fingerprint(same)) == []
    other = dataclasses.replace(base, data=dataclasses.replace(base.data, source="movielens-1m"))
    assert not any(k.startswith("synthetic.") for k in model_fingerprint(other))


def test_fingerprint_mismatch_lists_every_changed_key():
    saved = model_fingerprint(config_from_dict({}))
    saved = json.loads(json.dumps(saved))  # as read back from meta.json
    now = model_fingerprint(
        config_from_dict(
            {}, ["train.batch_size=512", "sparse.learning_rate=0.1", "model.dense_arch=[32, 16]"]
        )
    )
    assert fingerprint_mismatch(saved, now) == [
        "model.dense_arch: saved [64, 16], now [32, 16]",
        "sparse.learning_rate: saved 0.05, now 0.1",
        "train.batch_size: saved 1024, now 512",
    ]
    assert fingerprint_mismatch(None, now) == []  # saved without a fingerprint: nothing to compare
    assert fingerprint_mismatch({"a": 1, "b": "x"}, {"b": "y", "c": True}) == [
        "a: saved 1, now (none)",
        'b: saved "x", now "y"',
        "c: saved (none), now true",
    ]
    assert fingerprint_mismatch({"a": 1}, {"a": True}) == ["a: saved 1, now true"]  # 1 == True, yet differs


def test_a_setting_added_after_the_checkpoint_matches_at_its_default():
    """A checkpoint saved before a setting existed resumes while the setting keeps its default, and is
    refused once it does not (synthetic.drift_ranks_per_sample came after older checkpoints)."""
    older = model_fingerprint(config_from_dict({}))
    del older["synthetic.drift_ranks_per_sample"]
    older = json.loads(json.dumps(older))
    assert fingerprint_mismatch(older, model_fingerprint(config_from_dict({}))) == []
    drifting = model_fingerprint(config_from_dict({}, ["synthetic.drift_ranks_per_sample=0.001"]))
    assert fingerprint_mismatch(older, drifting) == [
        "synthetic.drift_ranks_per_sample: saved (none), now 0.001"
    ]


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


@pytest.mark.parametrize(
    "damage", ["truncate_rank_file", "alter_store_snapshot", "unlisted_truncated_rank_file"]
)
def test_damaged_checkpoint_falls_back_and_resumes_exactly(
    damage, uninterrupted, tmp_path, cli_env, python, repo_root
):
    config, whole = uninterrupted
    run = tmp_path / "run"
    run_train(config, run, "--set", "train.steps=40", env=cli_env)  # checkpoints 20, 40
    newest = run / "checkpoints" / "step_00000040"
    assert sorted(checkpoint_meta(newest)["files"]) == ["config.json", "rank_0.pt", "store_rank_0/data.mdb"]
    assert verify_checkpoint(newest) == []  # nothing unlisted: the snapshot holds data.mdb only
    if damage in ("truncate_rank_file", "unlisted_truncated_rank_file"):
        bad = newest / "rank_0.pt"
        bad.write_bytes(bad.read_bytes()[:-17])
        why = f"{bad} is truncated or altered"
        if damage == "unlisted_truncated_rank_file":  # an empty manifest once let torch.load fail (OSError)
            meta = json.loads((newest / META).read_text())
            (newest / META).write_text(json.dumps(meta | {"files": {}}))
            why = f"{newest / META}: world_size is 1 but the manifest lists no rank_0.pt"
    else:
        bad = newest / "store_rank_0" / "data.mdb"
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0x40
        bad.write_bytes(bytes(data))
        why = f"{bad} is altered (checksum mismatch)"
    resumed = run_train(config, run, "--resume", env=cli_env)
    assert f"checkpoint {newest} is damaged: {why}" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000020 (step 20)" in resumed.stderr
    assert _digest(run) == whole
    for step in (20, 40, 60):  # resuming from step 20 wrote nothing into it
        assert verify_checkpoint(run / "checkpoints" / f"step_{step:08d}") == []


def test_snapshots_opened_by_an_lmdb_tool_still_resume_from_the_newest(uninterrupted, tmp_path, cli_env):
    import lmdb

    config, whole = uninterrupted
    run = tmp_path / "run"
    run_train(config, run, "--set", "train.steps=40", env=cli_env)
    kept = sorted((run / "checkpoints").glob("step_*"))
    assert [p.name for p in kept] == ["step_00000020", "step_00000040"]
    for path in kept:  # inspected as with mdb_stat: a read-only open with LMDB's lock creates lock.mdb
        env = lmdb.open(str(path / "store_rank_0"), readonly=True)
        assert env.stat()["entries"] > 0
        env.close()
        assert (path / "store_rank_0" / "lock.mdb").is_file()
        assert verify_checkpoint(path) == []
    # Resuming never reads a snapshot's lock file, so even a bogus one changes nothing.
    junk = b"not an LMDB lock file" * 50
    (kept[-1] / "store_rank_0" / "lock.mdb").write_bytes(junk)
    resumed = run_train(config, run, "--resume", env=cli_env)
    assert "damaged" not in resumed.stderr, resumed.stderr[-3000:]
    assert f"resumed from {kept[-1]} (step 40)" in resumed.stderr
    assert _digest(run) == whole
    assert (run / "store" / "rank_0" / "lock.mdb").read_bytes() != junk  # not copied into the live store
    assert verify_checkpoint(kept[-1]) == []
