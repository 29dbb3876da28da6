"""A full disk while a checkpoint is written (issue 50): every checkpoint file goes through one write path
(:func:`recsys.checkpoint.files.write_file_durably`: temporary name, fsync, rename, folder fsync), so a full
disk is an OSError with ``errno.ENOSPC`` wherever it strikes, which ``writing()`` turns into the documented
one line; no partial file is left under a final name, nor a temporary one.

The full disk is a real tmpfs, filled to its last byte (mounting one needs root; the tests skip otherwise).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from embedding_store.bounds_rule import BoundsRule
from recsys.bounded import BoundedTables
from recsys.checkpoint import latest_checkpoint
from recsys.checkpoint.files import write_file_durably
from recsys.checkpoint.manager import Checkpoint, save_checkpoint
from recsys.checkpoint.parts import BoundsState, ConfigRecord
from recsys.config import config_from_dict, config_to_dict
from recsys.errors import UserError, no_space_left
from recsys.metrics import write_json
from recsys.writing import writing
from tests.conftest import needs_root
from tests.recsys.tiny import run_train, tiny_config

BOUNDS = "bounds_rank_0.safetensors"


def _fill(folder: Path) -> None:
    """Fill the filesystem of ``folder`` to its last byte, with a file beside ``folder``."""
    with open(folder.parent / f"{folder.name}.filler", "wb", buffering=0) as f, pytest.raises(OSError) as err:
        while True:
            f.write(b"\0" * 4096)
    assert err.value.errno == errno.ENOSPC
    assert os.statvfs(folder).f_bavail == 0


def _bounded(ids: int = 5000) -> BoundedTables:
    """One bounded table (admission at the 2nd occurrence) that has seen ``ids`` ids, a fifth of them twice:
    rows and candidates, a few hundred KB of state."""
    bounded = BoundedTables({"t_cat_0": BoundsRule(admit_after=2)}, {"t_cat_0": 1 << 40}, {"t_cat_0"})
    seen = torch.arange(ids, dtype=torch.int64)
    again = seen[: ids // 5]
    bounded.decide(0, {"t_cat_0": seen}, {"t_cat_0": torch.ones_like(seen)})
    bounded.decide(1, {"t_cat_0": again}, {"t_cat_0": torch.ones_like(again)})
    return bounded


def _into(path: Path, step: int = 2) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    return Checkpoint(path=path, step=step, rank=0, world_size=1)


def _no_owner(table: str, ids: np.ndarray) -> np.ndarray:
    return np.ones(ids.shape[0], dtype=bool)


def _one_line(path: Path) -> str:
    return f"no space left on device writing {path}; free disk space, then continue with --resume"


# -- the parts that write a file ---------------------------------------------------------------------


@needs_root
def test_bounds_state_on_a_full_disk_is_enospc_and_leaves_no_file(tmpfs):
    into = _into(tmpfs("1m") / "step_00000002")
    _fill(into.path)
    part = BoundsState(_bounded(), _no_owner)
    with pytest.raises(OSError) as err:  # not safetensors' SafetensorError
        part.save(into)
    assert err.value.errno == errno.ENOSPC and no_space_left(err.value) is err.value
    assert os.listdir(into.path) == []  # neither the bounds file nor its temporary one

    with pytest.raises(UserError) as err, writing(into.path):
        part.save(into)
    assert str(err.value) == _one_line(into.path)
    assert os.listdir(into.path) == []


@needs_root
def test_config_record_on_a_full_disk_is_enospc_and_leaves_no_file(tmpfs):
    into = _into(tmpfs("1m") / "step_00000002")
    _fill(into.path)
    with pytest.raises(UserError) as err, writing(into.path):
        ConfigRecord(config_from_dict({}, [])).save(into)
    assert str(err.value) == _one_line(into.path)
    assert no_space_left(err.value) is not None
    assert os.listdir(into.path) == []


class _FillsTheDisk:
    """A part that writes nothing, but after which the disk is full: ``meta.json`` cannot be written."""

    def save(self, into: Checkpoint) -> list[Path]:
        _fill(into.path)
        return []

    def restore(self, source: Checkpoint) -> None:
        """Nothing."""


@needs_root
def test_meta_json_on_a_full_disk_is_enospc_and_leaves_an_incomplete_checkpoint(tmpfs):
    root = tmpfs("1m") / "checkpoints"
    with pytest.raises(UserError) as err, writing(root):
        save_checkpoint(root, step=2, parts={"fills": _FillsTheDisk()}, keep=2)
    assert str(err.value) == _one_line(root)
    assert os.listdir(root / "step_00000002") == []  # no meta.json, no .meta.json.tmp
    assert latest_checkpoint(root) is None


def test_parts_write_the_same_bytes_as_before(tmp_path):
    """The bounds file is the bytes ``save_file`` wrote, config.json those ``write_json`` wrote."""
    into = _into(tmp_path / "step_00000002")
    bounded = _bounded()
    assert BoundsState(bounded, _no_owner).save(into) == [into.path / BOUNDS]
    state = {k: np.ascontiguousarray(v) for k, v in bounded.state(trained=2).items()}
    save_file(state, str(tmp_path / "before.safetensors"))
    assert (into.path / BOUNDS).read_bytes() == (tmp_path / "before.safetensors").read_bytes()
    assert load_file(str(into.path / BOUNDS)).keys() == state.keys()

    config = config_from_dict({}, [])
    assert ConfigRecord(config).save(into) == [into.path / "config.json"]
    write_json(tmp_path / "before.json", config_to_dict(config))
    assert (into.path / "config.json").read_bytes() == (tmp_path / "before.json").read_bytes()
    assert sorted(os.listdir(into.path)) == [BOUNDS, "config.json"]


# -- the write path itself ----------------------------------------------------------------------------


@needs_root
def test_a_rewrite_that_runs_out_of_space_keeps_the_previous_file(tmpfs):
    mnt = tmpfs("64k")
    path = mnt / "rank_0.pt"
    old = bytes(range(256)) * 40  # 10 KiB
    assert write_file_durably(path, lambda f: f.write(old)) == path
    assert path.read_bytes() == old
    with pytest.raises(OSError) as err:
        write_file_durably(path, lambda f: f.write(b"\1" * (1 << 20)))
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == old
    assert os.listdir(mnt) == ["rank_0.pt"]  # no .rank_0.pt.tmp


def test_a_write_that_fails_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "meta.json"
    write_file_durably(path, lambda f: f.write(b"{}"))

    def half_then_fail(f) -> None:
        f.write(b'{"step": ')
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_file_durably(path, half_then_fail)
    assert path.read_bytes() == b"{}"
    assert os.listdir(tmp_path) == ["meta.json"]


# -- end to end ---------------------------------------------------------------------------------------

# In memory, bounded: a checkpoint is rank_0.pt (~3 MB), config.json, then the bounds file (~160 KB).
CONFIG = (
    tiny_config(
        synthetic={"eval_samples": 256}, train={"steps": 20, "log_every": 100}, store={"tiered": False}
    )
    + "[store.bounds]\nadmit_after = 2\n"
)


def _pages(size: int) -> int:
    return -(-size // 4096) * 4096


@needs_root
def test_a_run_whose_disk_fills_during_the_bounds_file_stops_with_one_line(tmpfs, tmp_path, cli_env):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    # The same run on a roomy disk gives the sizes: room for everything before the bounds file and half of it.
    whole = tmp_path / "whole"
    run_train(config, whole, env=cli_env)
    [step] = (whole / "checkpoints").glob("step_*")
    sizes = {p.name: p.stat().st_size for p in step.iterdir()}
    room = _pages(sizes["rank_0.pt"]) + _pages(sizes["config.json"]) + 8 * 4096 + sizes[BOUNDS] // 2
    assert sizes[BOUNDS] // 2 > 8 * 4096  # the margin either way is larger than the small files' pages

    run = tmpfs(f"{room // 1024}k") / "run"
    proc = run_train(config, run, env=cli_env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"recsys: error: {_one_line(run / 'checkpoints')}"
    [step] = (run / "checkpoints").glob("step_*")
    assert sorted(os.listdir(step)) == ["config.json", "rank_0.pt"]  # no bounds file, no temporary, no meta
    assert latest_checkpoint(run / "checkpoints") is None
    assert json.loads((step / "config.json").read_text()) == json.loads(
        (whole / "checkpoints" / step.name / "config.json").read_text()
    )
