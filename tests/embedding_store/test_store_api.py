"""The store's API edges: errors, evict, snapshots, stats, and concurrent prefetch vs. a reference."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from es_helpers import bits, init_packed, packed_at, slot_tensors

from embedding_store import (
    IdOutOfRangeError,
    LmdbOptions,
    OptimizerKind,
    PolicyKind,
    StoreCapacityError,
    StoreClosedError,
    StoreConfig,
    StoreError,
    StoreIncompatibleError,
    TableSpec,
    Tier,
    TieredStore,
    restore_snapshot,
)
from embedding_store.tiered_table import TieredTable

SPEC = TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD)
BOUNDED = TableSpec(name="b", dim=2, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=100)
CONFIG = StoreConfig(
    seed=3, device_capacity_rows=8, host_capacity_rows=4, lmdb=LmdbOptions(initial_map_size_bytes=1 << 20)
)


def _open(path: Path, config: StoreConfig = CONFIG, tables=(SPEC, BOUNDED)) -> TieredStore:
    store = TieredStore(path, config=config, tables=list(tables))
    for spec in tables:
        weights, state = slot_tensors(spec, config.device_rows(spec))
        store.bind(spec.name, weights=weights, state=state)
    return store


def test_bad_ids_raise_id_out_of_range(store_dir) -> None:
    with _open(store_dir) as store:
        with pytest.raises(IdOutOfRangeError, match="negative"):
            store.make_resident(0, {"t": torch.tensor([1, -2])})
        with pytest.raises(IdOutOfRangeError, match="num_embeddings"):
            store.make_resident(0, {"b": torch.tensor([100])})
        with pytest.raises(IdOutOfRangeError):
            store.lookahead(0, {"b": torch.tensor([5, 200])})
        with pytest.raises(ValueError, match="unknown table"):
            store.make_resident(0, {"nope": torch.tensor([1])})
        with pytest.raises(TypeError):
            store.make_resident(0, {"t": torch.tensor([1.0])})
        store.make_resident(0, {"t": torch.tensor([1, 2]), "b": torch.tensor([99])})  # nothing left pinned


def test_batch_larger_than_free_slots_raises_capacity_and_pins_nothing(store_dir) -> None:
    with _open(store_dir) as store:
        store.make_resident(0, {"t": torch.arange(6)})  # 6 of 8 slots pinned
        with pytest.raises(StoreCapacityError):
            store.make_resident(1, {"t": torch.arange(100, 104), "b": torch.arange(3)})
        store.release(0)
        slots = store.make_resident(1, {"t": torch.arange(100, 108)})["t"]  # all 8 slots are free again
        assert sorted(slots.tolist()) == list(range(8))
        with pytest.raises(ValueError, match="already resident"):
            store.make_resident(1, {"t": torch.arange(2)})
    with _open(store_dir) as store, pytest.raises(ValueError, match="not resident"):
        store.release(1)


def test_reopen_with_other_dim_optimizer_or_seed_is_incompatible(store_dir) -> None:
    _open(store_dir).close()
    for spec in (
        TableSpec(name="t", dim=8, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD),
        TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_ADAGRAD),
        TableSpec(name="t", dim=4, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, num_embeddings=10),
    ):
        with pytest.raises(StoreIncompatibleError, match="'t'"):
            TieredStore(store_dir, config=CONFIG, tables=[spec])
    with pytest.raises(StoreIncompatibleError, match="seed"):
        TieredStore(
            store_dir, config=StoreConfig(seed=4, device_capacity_rows=8, host_capacity_rows=4), tables=[SPEC]
        )
    TieredStore(
        store_dir, config=CONFIG, tables=[SPEC, TableSpec(name="new", dim=3)]
    ).close()  # adding is fine


def test_closed_store_refuses_calls(store_dir) -> None:
    store = _open(store_dir)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.make_resident(0, {"t": torch.tensor([1])})


def test_bind_checks_shapes(store_dir) -> None:
    with TieredStore(store_dir, config=CONFIG, tables=[SPEC]) as store:
        with pytest.raises(ValueError, match="rows"):
            store.bind("t", weights=torch.zeros(7, 4), state=torch.zeros(7))
        with pytest.raises(ValueError, match="optimizer state"):
            store.bind("t", weights=torch.zeros(8, 4), state=None)
        with pytest.raises(StoreError, match="bind"):
            store.make_resident(0, {"t": torch.tensor([1])})


def test_writer_failure_surfaces_on_the_next_call_not_a_hang(store_dir, monkeypatch) -> None:
    store = _open(store_dir)
    monkeypatch.setattr(store._backend, "put_rows", lambda writes: (_ for _ in ()).throw(OSError("boom")))
    # The writer thread may fail before any of these calls returns: the error must surface on one of them.
    with pytest.raises(StoreError, match="boom") as info:
        store.make_resident(0, {"t": torch.arange(8)})
        store.release(0)
        store.make_resident(1, {"t": torch.arange(8, 16)})  # evicts 8 rows -> host (4) -> writer -> fails
        store.release(1)
        for batch in range(2, 10):
            store.make_resident(batch, {"t": torch.arange(batch * 8, batch * 8 + 8)})
            store.release(batch)
            store.wait_for_writes()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StoreError):
        store.close()


def test_evict_snapshot_restore_and_stats(tmp_path) -> None:
    store = TieredStore(tmp_path / "a", config=CONFIG, tables=[SPEC])
    weights, state = slot_tensors(SPEC, 8)
    store.bind("t", weights=weights, state=state)
    slots = store.make_resident(0, {"t": torch.tensor([5, 6, 7])})["t"]
    weights[slots] = 1.5
    state[slots] = 2.5
    with pytest.raises(ValueError, match="pinned"):
        store.evict("t", torch.tensor([5]))
    store.release(0)
    assert store.evict("t", torch.tensor([5, 999])) == 1
    assert store.evict("t") == 2
    stats = store.stats()
    assert stats.resident_rows["t"][Tier.DEVICE] == 0
    assert stats.tables["t"][Tier.DEVICE].evictions == 3
    assert stats.tables["t"][Tier.DEVICE].bytes_out == 3 * SPEC.row_bytes
    store.snapshot(tmp_path / "snap")
    slots = store.make_resident(1, {"t": torch.tensor([5])})["t"]
    weights[slots] = -1.0  # after the snapshot: not in it
    store.close()
    restore_snapshot(tmp_path / "snap", tmp_path / "b")
    with pytest.raises(StoreError):
        restore_snapshot(tmp_path / "snap", tmp_path / "b")
    with TieredStore(tmp_path / "b", config=CONFIG, tables=[SPEC]) as restored:
        chunk = restored.read_rows("t", torch.tensor([5, 6, 7, 8]))
        assert chunk.weights[:3].eq(1.5).all() and chunk.state[:3].eq(2.5).all()
        assert (
            bits(packed_at(chunk.weights, chunk.state, slice(3, 4)))
            == bits(init_packed(SPEC, 3, np.array([8])))
        ).all()
    with TieredStore(tmp_path / "a", config=CONFIG, tables=[SPEC]) as original:
        assert original.read_rows("t", torch.tensor([5])).weights.eq(-1.0).all()


@pytest.mark.parametrize("policy", list(PolicyKind))
def test_prefetch_in_another_thread_matches_a_reference(store_dir, policy) -> None:
    """The pipeline's shape: batch i trains while batch i+2 is prefetched by another thread."""
    config = StoreConfig(seed=3, device_capacity_rows=32, host_capacity_rows=16, policy=policy)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 200, size=20) for _ in range(60)]
    ref: dict[int, np.ndarray] = {}
    with TieredStore(store_dir, config=config, tables=[SPEC]) as store:
        weights, state = slot_tensors(SPEC, 32)
        store.bind("t", weights=weights, state=state)
        for b in range(2):
            store.lookahead(b, {"t": batches[b]})
        for step, ids in enumerate(batches):
            ahead = None
            if step + 2 < len(batches):
                store.lookahead(step + 2, {"t": batches[step + 2]})
                ahead = threading.Thread(target=store.prefetch, args=(step + 2,))
                ahead.start()
            slots = store.make_resident(step, {"t": torch.from_numpy(ids)})["t"]
            uniq, first = np.unique(ids, return_index=True)
            want = init_packed(SPEC, 3, uniq)
            for k, i in enumerate(uniq.tolist()):
                if i in ref:
                    want[k] = ref[i]
            got = packed_at(weights, state, slots[first])
            assert (bits(got) == bits(want)).all(), f"step {step}"
            weights[slots[first]] += 0.5
            state[slots[first]] += 1.0
            for k, i in enumerate(uniq.tolist()):
                ref[i] = packed_at(weights, state, slots[first][k : k + 1])[0]
            store.release(step)
            if ahead is not None:
                ahead.join()
        host = store.stats().tables["t"][Tier.HOST]
        assert host.hits > 0 and host.evictions > 0


@pytest.mark.parametrize("announced", [[3, 5, 9], [3, 3, 5, 9, 9]], ids=["sorted-unique", "sorted-repeats"])
def test_prefetch_reads_the_ids_announced_not_a_later_edit_of_the_array(store_dir, announced) -> None:
    """Routed ids arrive sorted and unique and are taken as they are; the store must keep its own copy
    and still deduplicate sorted input that repeats ids."""
    with _open(store_dir) as store:
        ids = np.array(announced, dtype=np.int64)
        store.lookahead(0, {"t": ids})
        ids[:] = 40  # the caller reuses its array
        store.prefetch(0)
        assert store.stats().resident_rows["t"][Tier.HOST] == 3
        store.make_resident(0, {"t": torch.tensor([3, 5, 9])})
        host = store.stats().tables["t"][Tier.HOST]
        assert (host.hits, host.misses) == (3, 0)


def test_prefetch_of_rows_all_above_lmdb_does_not_read_lmdb(store_dir, monkeypatch) -> None:
    """A batch whose rows all sit in the host or device tier (a cache that fits) costs no LMDB read."""
    with _open(store_dir) as store:
        store.lookahead(0, {"t": np.array([3, 5, 9])})
        store.prefetch(0)  # first touches: read (none stored), then parked in the host tier
        reads: list[np.ndarray] = []
        backend = store._backend
        get_rows = backend.get_rows
        monkeypatch.setattr(backend, "get_rows", lambda table, ids: reads.append(ids) or get_rows(table, ids))
        store.lookahead(1, {"t": np.array([3, 5, 9])})
        store.prefetch(1)
        assert reads == []
        store.lookahead(2, {"t": np.array([5, 11])})
        store.prefetch(2)  # 11 is on no tier: read
        assert [r.tolist() for r in reads] == [[11]]
        assert store.stats().resident_rows["t"][Tier.HOST] == 4


def _seconds_while_lock_held(store: TieredStore, monkeypatch, fill_ids: dict, call) -> tuple[float, object]:
    """Run ``call()`` while another thread sits inside ``make_resident(2, fill_ids)`` holding the store
    lock; returns how long it took and what it returned (the other thread is let go and joined after)."""
    inside, go_on = threading.Event(), threading.Event()
    fetch_up = TieredTable._fetch_up

    def slow_fetch_up(self, ids, future):
        inside.set()
        go_on.wait(10)
        return fetch_up(self, ids, future)

    monkeypatch.setattr(TieredTable, "_fetch_up", slow_fetch_up)
    fill = threading.Thread(target=store.make_resident, args=(2, fill_ids))
    fill.start()
    assert inside.wait(10)  # the other thread now holds the store lock
    start = time.perf_counter()
    out = call()
    waited = time.perf_counter() - start
    go_on.set()
    fill.join()
    monkeypatch.undo()
    return waited, out


def test_release_does_not_wait_for_a_call_that_holds_the_store_lock(store_dir, monkeypatch) -> None:
    """The training thread releases batch i while the fill stage is inside make_resident of batch i+2."""
    with _open(store_dir) as store:
        store.make_resident(0, {"t": torch.arange(8)})  # every slot of "t" pinned
        waited, _ = _seconds_while_lock_held(
            store, monkeypatch, {"b": torch.tensor([1, 2])}, lambda: store.release(0)
        )
        assert waited < 2.0
        with pytest.raises(ValueError, match="not resident"):
            store.release(0)
        # The queued unpin is applied before the next call does anything: all 8 slots are free for it.
        slots = store.make_resident(1, {"t": torch.arange(100, 108)})["t"]
        assert sorted(slots.tolist()) == list(range(8))


def test_counters_do_not_wait_for_a_call_that_holds_the_store_lock(store_dir, monkeypatch) -> None:
    """The training thread polls the tier counters while the fill stage is inside make_resident."""
    with _open(store_dir) as store:
        store.make_resident(0, {"t": torch.tensor([1, 2, 2]), "b": torch.tensor([7])})
        store.make_resident(1, {"t": torch.tensor([2, 3])})
        exact = store.stats().tables
        assert store.counters() == exact  # idle: the same numbers as the locked copy
        assert exact["t"][Tier.DEVICE].hits == 1 and exact["t"][Tier.DEVICE].misses == 4
        waited, polled = _seconds_while_lock_held(
            store, monkeypatch, {"t": torch.tensor([4])}, store.counters
        )
        assert waited < 2.0
        assert polled["t"][Tier.DEVICE].hits == 1
        polled["t"][Tier.DEVICE].hits = 99  # a copy: the store's counters are not touched
        assert store.stats().tables["t"][Tier.DEVICE].hits == 1


def test_concurrent_prefetch_plans_are_removed_by_identity():
    """Two prefetches in flight: finishing the later one must not compare plans (their ids are arrays)."""
    from embedding_store.tiered_table import PrefetchPlan

    first = PrefetchPlan(ids=np.arange(3), epoch=0)
    second = PrefetchPlan(ids=np.arange(5), epoch=0)
    plans = [first, second]
    plans.remove(second)  # compared by value, numpy arrays of other lengths would raise here
    assert plans == [first] and plans[0] is first
    assert PrefetchPlan(ids=np.arange(3), epoch=0) not in plans  # equal contents, another plan
