"""Durability (docs/design.md, invariant 5): SIGKILL after flush, the lock file, a full LMDB map, snapshots
written under a temporary name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from es_helpers import bits

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    StoreConfig,
    StoreFullError,
    StoreLockedError,
    TableSpec,
    TieredStore,
    restore_snapshot,
)

CHILD = Path(__file__).with_name("es_child.py")
sys.path.insert(0, str(CHILD.parent))
import es_child  # noqa: E402


def _spawn(mode: str, store: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(store), str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _wait_for(proc: subprocess.Popen, word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == word, f"child said {line!r}, expected {word!r} (rc={proc.poll()})"


def _rows(store: TieredStore) -> dict[str, np.ndarray]:
    chunks = list(store.iter_rows("t", chunk_rows=7))
    return {
        "ids": torch.cat([c.ids for c in chunks]).numpy(),
        "weights": torch.cat([c.weights for c in chunks]).numpy(),
        "state": torch.cat([c.state for c in chunks]).numpy(),
    }


@pytest.mark.parametrize("mode", ["flush_then_wait", "flush_then_work"])
def test_sigkill_after_flush_keeps_exactly_the_flushed_rows(tmp_path: Path, mode: str) -> None:
    store_dir, dump = tmp_path / "store", tmp_path / "flushed.npz"
    child = _spawn(mode, store_dir, dump)
    try:
        _wait_for(child, "FLUSHED")
        if mode == "flush_then_work":  # let it evict, rewrite and commit for a while
            import time

            time.sleep(0.5)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    flushed = np.load(dump)
    assert flushed["ids"].shape[0] > 24  # more rows than the device and host tiers hold
    with TieredStore(store_dir, config=es_child.CONFIG, tables=[es_child.SPEC]) as store:
        got = _rows(store)
    if mode == "flush_then_wait":
        np.testing.assert_array_equal(got["ids"], flushed["ids"])
    else:  # post-flush work only touched ids >= 1000; every flushed row is still exactly there
        keep = got["ids"] < 1000
        np.testing.assert_array_equal(got["ids"][keep], flushed["ids"])
        got = {k: v[keep] for k, v in got.items()}
    assert (bits(got["weights"]) == bits(flushed["weights"])).all()
    assert (bits(got["state"]) == bits(flushed["state"])).all()


def test_second_process_gets_store_locked_error_and_stale_lock_does_not_block(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with TieredStore(store_dir, config=es_child.CONFIG, tables=[es_child.SPEC]):
        other = _spawn("open", store_dir, tmp_path / "unused")
        assert other.communicate(timeout=60)[0].strip() == "StoreLockedError"
        with pytest.raises(StoreLockedError):  # a second handle in this process too
            TieredStore(store_dir, config=es_child.CONFIG, tables=[es_child.SPEC])
    holder = _spawn("hold", store_dir, tmp_path / "unused")
    _wait_for(holder, "OPEN")
    other = _spawn("open", store_dir, tmp_path / "unused")
    assert other.communicate(timeout=60)[0].strip() == "StoreLockedError"
    os.kill(holder.pid, signal.SIGKILL)  # dies holding the lock: the kernel drops it
    holder.wait()
    assert (store_dir / "tierrec.lock").exists()
    TieredStore(store_dir, config=es_child.CONFIG, tables=[es_child.SPEC]).close()


def test_full_map_raises_store_full_and_reopens_with_flushed_rows(tmp_path: Path) -> None:
    spec = TableSpec(name="t", dim=64, optimizer=OptimizerKind.EXACT_ADAGRAD)  # 512-byte rows
    cap = 1 << 20
    config = StoreConfig(
        seed=5,
        device_capacity_rows=64,
        host_capacity_rows=64,
        lmdb=LmdbOptions(initial_map_size_bytes=256 << 10, max_map_size_bytes=cap, writer_batch_rows=256),
    )
    flushed: dict[str, np.ndarray] | None = None
    store = TieredStore(tmp_path / "store", config=config, tables=[spec])
    weights, state = torch.zeros(64, 64), torch.zeros(64, 64)
    store.bind("t", weights=weights, state=state)
    with pytest.raises(StoreFullError) as info:
        for batch in range(10_000):  # 10k * 48 rows * 512 B >> 1 MiB: the map must fill up
            ids = torch.arange(batch * 48, (batch + 1) * 48)
            slots = store.make_resident(batch, {"t": ids})["t"]
            weights[slots] += 1.0
            state[slots] += 2.0
            store.release(batch)
            if batch % 5 == 4:
                store.flush()
                flushed = _rows(store)
    assert flushed is not None and flushed["ids"].shape[0] > 500
    assert info.value.__cause__ is not None  # the LMDB error is chained
    assert store.stats().map_size_bytes == cap  # it grew on demand up to the cap, no further
    with pytest.raises(StoreFullError):  # the failed writer keeps failing, never hangs
        store.close()
    with TieredStore(tmp_path / "store", config=config, tables=[spec]) as reopened:
        got = _rows(reopened)
        keep = np.isin(got["ids"], flushed["ids"])
        np.testing.assert_array_equal(got["ids"][keep], flushed["ids"])  # every flushed row is there
        assert (bits(got["weights"][keep]) == bits(flushed["weights"])).all()
        assert (bits(got["state"][keep]) == bits(flushed["state"])).all()


def _trained_store(path: Path) -> TieredStore:
    store, weights, state = es_child.open_store(str(path))
    rng = np.random.default_rng(3)
    for batch in range(12):  # more ids than the 16 slots + 8 host rows: some rows reach LMDB
        es_child.train(store, weights, state, rng.integers(0, 60, size=10), batch)
    return store


def test_snapshot_is_written_under_a_temporary_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import embedding_store.snapshot as snapshot_module
    from embedding_store.backends.lmdb_env import LmdbRows

    store = _trained_store(tmp_path / "store")
    dest, tmp = tmp_path / "ckpt" / "snap", tmp_path / "ckpt" / ".snap.tmp"
    real_copy = LmdbRows.snapshot

    def copy_then_fail(self: LmdbRows, where: Path) -> None:
        real_copy(self, where)  # the whole copy is written: only the rename is missing
        assert where == tmp and (where / "data.mdb").stat().st_size > 0 and not dest.exists()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LmdbRows, "snapshot", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.snapshot(dest)
    assert not dest.exists() and not tmp.exists()
    monkeypatch.undo()

    tmp.mkdir()  # left by a snapshot that was killed: replaced, never published
    (tmp / "stale").write_bytes(b"x")
    synced: list[tuple[Path, bool]] = []
    real_fsync = snapshot_module.fsync

    def fsync(path: Path) -> None:
        synced.append((path, dest.exists()))
        real_fsync(path)

    monkeypatch.setattr(snapshot_module, "fsync", fsync)
    store.snapshot(dest)
    # data.mdb and the temporary folder are durable before the rename, the parent after it
    assert synced == [(tmp / "data.mdb", False), (tmp, False), (dest.parent, True)]
    assert sorted(p.name for p in dest.iterdir()) == ["data.mdb"] and not tmp.exists()
    with pytest.raises(FileExistsError):
        store.snapshot(dest)
    expected = _rows(store)
    store.close()
    synced.clear()
    restore_snapshot(dest, tmp_path / "restored")
    assert synced == [(tmp_path / "restored" / ".data.mdb.tmp", True), (tmp_path / "restored", True)]
    with TieredStore(tmp_path / "restored", config=es_child.CONFIG, tables=[es_child.SPEC]) as restored:
        got = _rows(restored)
    np.testing.assert_array_equal(got["ids"], expected["ids"])
    assert (bits(got["weights"]) == bits(expected["weights"])).all()
    assert (bits(got["state"]) == bits(expected["state"])).all()


def test_failed_restore_leaves_no_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    store = _trained_store(tmp_path / "store")
    store.snapshot(tmp_path / "snap")
    store.close()
    real_copyfile = shutil.copyfile

    def half_copy(src: Path, dst: Path) -> None:
        Path(dst).write_bytes(Path(src).read_bytes()[:4096])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", half_copy)
    with pytest.raises(OSError, match="No space left"):
        restore_snapshot(tmp_path / "snap", tmp_path / "restored")
    assert list((tmp_path / "restored").iterdir()) == []  # no partial data.mdb, no temporary file
    monkeypatch.setattr(shutil, "copyfile", real_copyfile)
    restore_snapshot(tmp_path / "snap", tmp_path / "restored")  # the directory is still usable
    assert (tmp_path / "restored" / "data.mdb").read_bytes() == (tmp_path / "snap" / "data.mdb").read_bytes()
