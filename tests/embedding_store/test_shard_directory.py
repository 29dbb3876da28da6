"""A shard's lifecycle under one lock: refused before deletion, opened fresh / from a snapshot /
re-partitioned, closed; and the store's choice of index from a table's id space."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from embedding_store import (
    DirectoryLock,
    IdOutOfRangeError,
    LmdbOptions,
    OptimizerKind,
    ShardDirectory,
    StoreClosedError,
    StoreConfig,
    StoreError,
    StoreLockedError,
    TableSpec,
    TieredStore,
    num_embeddings_for,
)
from tests.embedding_store.es_helpers import slot_tensors

SPEC = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
CONFIG = StoreConfig(
    seed=3, device_capacity_rows=8, host_capacity_rows=0, lmdb=LmdbOptions(initial_map_size_bytes=1 << 20)
)


def _write(store: TieredStore, ids: list[int], value: float) -> None:
    """Give ``ids`` the weight ``value`` and flush them to LMDB."""
    weights, state = slot_tensors(SPEC, 8)
    store.bind("t", weights=weights, state=state)
    slots = store.make_resident(0, {"t": torch.tensor(ids)})["t"]
    weights[slots] = value
    state[slots] = 0.0
    store.release(0)
    store.flush()


def _rows(store: TieredStore) -> dict[int, float]:
    return {
        int(i): float(w[0])
        for chunk in store.iter_rows("t")
        for i, w in zip(chunk.ids, chunk.weights, strict=True)
    }


def test_a_second_claim_is_refused_before_anything_is_deleted(tmp_path):
    path = tmp_path / "store" / "rank_0"
    with ShardDirectory(path) as shard:
        _write(shard.open_fresh(config=CONFIG, tables=[SPEC]), [1, 2], 1.0)
        with pytest.raises(
            StoreLockedError, match=f"^store {path} is in use by process {os.getpid()}$"
        ) as info:
            ShardDirectory(path)
        assert info.value.holder == str(os.getpid())
        assert (path / "data.mdb").is_file()  # the refused claim touched nothing
        assert not (path / "tierrec.lock").exists()  # one lock: beside the directory, not in it
        assert (tmp_path / "store" / "rank_0.lock").read_text().strip() == str(os.getpid())
    ShardDirectory(path).close()  # released on close


def test_open_fresh_empties_the_directory(tmp_path):
    path = tmp_path / "rank_0"
    with ShardDirectory(path) as shard:
        _write(shard.open_fresh(config=CONFIG, tables=[SPEC]), [1, 2], 1.0)
    with ShardDirectory(path) as shard:
        assert _rows(shard.open_fresh(config=CONFIG, tables=[SPEC])) == {}


def test_open_snapshot_and_open_resharded_replace_the_directory(tmp_path):
    snaps = [tmp_path / "snap_0", tmp_path / "snap_1"]
    for q, snap in enumerate(snaps):
        with ShardDirectory(tmp_path / f"old_{q}") as shard:
            store = shard.open_fresh(config=CONFIG, tables=[SPEC])
            _write(store, [10 * q + 1, 10 * q + 2, 10 * q + 3], float(q + 1))
            store.snapshot(snap)
    path = tmp_path / "rank_0"
    with ShardDirectory(path) as shard:
        _write(shard.open_fresh(config=CONFIG, tables=[SPEC]), [99], 9.0)  # replaced by each open below
    with ShardDirectory(path) as shard:
        assert _rows(shard.open_snapshot(snaps[1], config=CONFIG, tables=[SPEC])) == {
            11: 2.0,
            12: 2.0,
            13: 2.0,
        }
    with ShardDirectory(path) as shard:
        store = shard.open_resharded(
            snaps, config=CONFIG, tables=[SPEC], keep=lambda name, ids: (ids % 2 == 1) & (name == "t")
        )
        assert _rows(store) == {1: 1.0, 3: 1.0, 11: 2.0, 13: 2.0}


def test_open_twice_and_after_close_are_refused(tmp_path):
    shard = ShardDirectory(tmp_path / "rank_0")
    shard.open_fresh(config=CONFIG, tables=[SPEC])
    with pytest.raises(StoreError, match="is open"):
        shard.open_fresh(config=CONFIG, tables=[SPEC])
    shard.close()
    shard.close()  # idempotent
    with pytest.raises(StoreClosedError):
        shard.open_fresh(config=CONFIG, tables=[SPEC])


def test_a_claim_without_a_store_releases_its_lock_on_close(tmp_path):
    path = tmp_path / "deep" / "rank_1"  # a rank that owns no tiered table never opens a store
    shard = ShardDirectory(path)
    shard.close()
    assert not path.exists()
    ShardDirectory(path).close()


def test_a_store_given_a_released_lock_is_refused(tmp_path):
    lock = DirectoryLock(tmp_path, name="rank_0.lock")
    lock.release()
    with pytest.raises(ValueError, match="must be held"):
        TieredStore(tmp_path / "rank_0", config=CONFIG, tables=[SPEC], lock=lock)


@pytest.mark.parametrize(
    ("space", "bound"), [(1, 1), (1 << 26, 1 << 26), ((1 << 26) + 1, None), (1 << 40, None)]
)
def test_num_embeddings_for_bounds_small_id_spaces_only(space, bound):
    assert num_embeddings_for(space) == bound
    if bound is not None:
        assert TableSpec(name="t", dim=1, num_embeddings=num_embeddings_for(space)).num_embeddings == space


def test_ids_outside_a_bounded_id_space_are_refused(tmp_path):
    spec = TableSpec(name="t", dim=4, num_embeddings=num_embeddings_for(100))
    with ShardDirectory(tmp_path / "rank_0") as shard:
        store = shard.open_fresh(config=CONFIG, tables=[spec])
        with pytest.raises(IdOutOfRangeError):
            store.lookahead(0, {"t": np.array([100])})
