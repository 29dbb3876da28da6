"""Hypothesis drives the store against a dict reference (docs/design.md, invariants 1, 2 and 6).

Random sequences of lookahead / prefetch / make_resident / in-place updates of the bound slot tensors /
release / evict / delete / flush / close+reopen, on tiny capacities that force constant eviction through
every tier.
Every row the store exposes — in the slot table after make_resident, through read_rows, through
iter_rows, after reopening — must equal the reference bit for bit.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch
from es_helpers import bits, init_packed, packed_at, slot_tensors
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from embedding_store import LmdbOptions, OptimizerKind, PolicyKind, StoreConfig, TableSpec, TieredStore

SEED = 7
DEVICE_SLOTS = 6
MAX_IN_FLIGHT = 2
MAX_BATCH_IDS = DEVICE_SLOTS // MAX_IN_FLIGHT  # distinct ids per batch: pins never exceed the slots
TABLES = [
    # unbounded: raw 64-bit ids spread over the whole space (hash map path)
    TableSpec(name="wide", dim=3, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, init_scale=0.5),
    # bounded: dense map path; per-weight optimizer state
    TableSpec(
        name="small", dim=2, optimizer=OptimizerKind.EXACT_ADAGRAD, num_embeddings=40, host_capacity_rows=2
    ),
    TableSpec(name="sgd", dim=4, optimizer=OptimizerKind.EXACT_SGD, num_embeddings=1 << 40),
]
ID_POOL = {
    "wide": [(i * 0x9E3779B97F4A7C15) % (1 << 63) for i in range(1, 25)],
    "small": list(range(40)),
    "sgd": [i << 30 for i in range(24)],
}

ids_strategy = st.fixed_dictionaries(
    {name: st.lists(st.integers(0, len(pool) - 1), max_size=6) for name, pool in ID_POOL.items()}
)


def _batch_ids(picks: dict[str, list[int]]) -> dict[str, list[int]]:
    """Pool picks -> ids, keeping duplicates but at most MAX_BATCH_IDS distinct ids per table."""
    out = {}
    for name, idx in picks.items():
        keep = set(list(dict.fromkeys(idx))[:MAX_BATCH_IDS])
        out[name] = [ID_POOL[name][i] for i in idx if i in keep]
    return out


class StoreMachine(RuleBasedStateMachine):
    """The store vs. ``self.ref``: id -> packed row, per table."""

    policy = PolicyKind.LRU
    layout = "log"  # the SSD backend (LmdbOptions.layout)

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="es-stateful-", dir="/tmp")
        self.config = StoreConfig(
            seed=SEED,
            device_capacity_rows=DEVICE_SLOTS,
            host_capacity_rows=3,
            policy=self.policy,
            lookahead_batches=2,
            lmdb=LmdbOptions(
                layout=self.layout,
                initial_map_size_bytes=1 << 20,
                writer_batch_rows=4,
                writer_max_pending_rows=8,
                log_segment_rows=16,  # the log layout compacts all along
            ),
        )
        self.ref: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in TABLES}
        self.resident_ever: dict[str, set[int]] = {t.name: set() for t in TABLES}
        self.announced_ever: dict[str, set[int]] = {t.name: set() for t in TABLES}
        # deleted and not prefetched or made resident since: on no tier
        self.gone: dict[str, set[int]] = {t.name: set() for t in TABLES}
        self.next_batch = 0
        self.announced: dict[int, dict[str, list[int]]] = {}
        self.in_flight: dict[int, dict[str, np.ndarray]] = {}  # batch -> table -> slots
        self._open()

    def _open(self) -> None:
        self.store = TieredStore(self.dir, config=self.config, tables=TABLES)
        self.tensors = {}
        for spec in TABLES:
            weights, state = slot_tensors(spec, DEVICE_SLOTS)
            self.store.bind(spec.name, weights=weights, state=state)
            self.tensors[spec.name] = (weights, state)

    def _expected(self, spec: TableSpec, ids: list[int]) -> np.ndarray:
        rows = init_packed(spec, SEED, np.array(ids, dtype=np.int64).reshape(-1))
        for k, i in enumerate(ids):
            if i in self.ref[spec.name]:
                rows[k] = self.ref[spec.name][i]
        return rows

    def teardown(self) -> None:
        self.store.close(flush=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _pick(self, data, batches) -> int:
        return data.draw(st.sampled_from(sorted(batches)))

    @rule(picks=ids_strategy)
    def announce(self, picks):
        self._announce(picks)

    def _announce(self, picks: dict[str, list[int]]) -> int:
        ids = _batch_ids(picks)
        batch = self.next_batch
        self.next_batch += 1
        self.store.lookahead(batch, {k: np.array(v, dtype=np.int64) for k, v in ids.items()})
        self.announced[batch] = ids
        for name, v in ids.items():
            self.announced_ever[name].update(v)
        return batch

    @precondition(lambda self: self.announced)
    @rule(data=st.data())
    def prefetch(self, data):
        batch = self._pick(data, self.announced)
        self.store.prefetch(batch)
        self._touched(batch)

    def _touched(self, batch: int) -> None:
        """A prefetch or make_resident of ``batch`` may park its ids' rows (init rows included)."""
        for name, ids in self.announced[batch].items():
            self.gone[name].difference_update(ids)

    @precondition(
        lambda self: len(self.in_flight) < MAX_IN_FLIGHT and set(self.announced) - set(self.in_flight)
    )
    @rule(data=st.data())
    def make_resident(self, data):
        self.announced_batch_resident(self._pick(data, set(self.announced) - set(self.in_flight)))

    def announced_batch_resident(self, batch: int) -> None:
        ids = self.announced[batch]
        slots = self.store.make_resident(batch, {k: np.array(v, dtype=np.int64) for k, v in ids.items()})
        self._touched(batch)
        self.in_flight[batch] = {k: v.numpy() for k, v in slots.items()}
        for spec in TABLES:
            weights, state = self.tensors[spec.name]
            got = packed_at(weights, state, slots[spec.name])
            assert (bits(got) == bits(self._expected(spec, ids[spec.name]))).all()
            self.resident_ever[spec.name].update(ids[spec.name])

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), salt=st.integers(0, 2**32 - 1))
    def update_in_place(self, data, salt):
        """What the fused optimizer does: rewrite a pinned batch's rows in the slot table."""
        self._update(self._pick(data, self.in_flight), salt)

    def _update(self, batch: int, salt: int) -> None:
        rng = np.random.default_rng(salt)
        for spec in TABLES:
            ids = self.announced[batch][spec.name]
            slots = self.in_flight[batch][spec.name]
            weights, state = self.tensors[spec.name]
            for i, s in dict(zip(ids, slots.tolist(), strict=True)).items():
                row = rng.standard_normal(spec.row_floats).astype(np.float32)
                weights[s] = torch_row(row[: spec.dim])
                if state is not None:
                    state[s] = torch_row(row[spec.dim :]).reshape(state[s].shape)
                self.ref[spec.name][i] = row

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def release(self, data):
        batch = self._pick(data, self.in_flight)
        self.store.release(batch)
        del self.in_flight[batch]
        self.announced.pop(batch, None)

    @precondition(lambda self: len(self.in_flight) < MAX_IN_FLIGHT)
    @rule(picks=ids_strategy, salt=st.integers(0, 2**32 - 1), prefetch=st.booleans())
    def train_step(self, picks, salt, prefetch):
        """A whole batch as the trainer runs it: announce, (prefetch), resident, update, release."""
        batch = self._announce(picks)
        if prefetch:
            self.store.prefetch(batch)
            self._touched(batch)
        self.announced_batch_resident(batch)
        self._update(batch, salt)
        self.store.release(batch)
        del self.in_flight[batch]
        del self.announced[batch]

    @rule(
        name=st.sampled_from([t.name for t in TABLES]),
        picks=st.none() | st.lists(st.integers(0, 23), max_size=4),
    )
    def evict(self, name, picks):
        """Write unpinned rows back to the lower tiers on demand."""
        pinned = {i for b in self.in_flight for i in self.announced[b][name]}
        if picks is None:
            self.store.evict(name)
            return
        ids = [ID_POOL[name][p] for p in picks if ID_POOL[name][p] not in pinned]
        self.store.evict(name, np.array(ids, dtype=np.int64))

    @rule(
        name=st.sampled_from([t.name for t in TABLES]),
        picks=st.lists(st.integers(0, 23), min_size=1, max_size=4),
    )
    def delete(self, name, picks):
        """Rows leave the model from every tier: afterwards each id reads as never seen."""
        ids = [ID_POOL[name][p] for p in picks]
        pinned = {i for b in self.in_flight for i in self.announced[b][name]}
        if pinned & set(ids):
            with pytest.raises(ValueError, match="pinned by an in-flight batch"):
                self.store.delete(name, np.array(ids, dtype=np.int64))
            return  # and nothing changed: the reference stays as it is
        self.store.delete(name, np.array(ids, dtype=np.int64))
        for i in ids:
            self.ref[name].pop(i, None)
            self.resident_ever[name].discard(i)
            self.gone[name].add(i)

    @rule()
    def flush(self):
        self.store.flush()

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self.in_flight.clear()
        self.announced.clear()
        self._open()

    @rule(name=st.sampled_from([t.name for t in TABLES]), picks=st.lists(st.integers(0, 23), max_size=6))
    def read_rows(self, name, picks):
        spec = next(t for t in TABLES if t.name == name)
        ids = [ID_POOL[name][p] for p in picks]
        chunk = self.store.read_rows(name, np.array(ids, dtype=np.int64))
        got = packed_at(chunk.weights, chunk.state, slice(None))
        assert (bits(got) == bits(self._expected(spec, ids))).all()

    @invariant()
    def iter_rows_match_reference(self):
        for spec in TABLES:
            chunks = list(self.store.iter_rows(spec.name, chunk_rows=3))
            ids = np.concatenate([c.ids.numpy() for c in chunks]) if chunks else np.empty(0, np.int64)
            assert (np.diff(ids) > 0).all(), "iter_rows must be strictly ascending"
            assert self.resident_ever[spec.name] <= set(ids.tolist()) <= self.announced_ever[spec.name]
            assert not self.gone[spec.name] & set(ids.tolist()), "a deleted id is still streamed"
            got = (
                np.concatenate([packed_at(c.weights, c.state, slice(None)) for c in chunks])
                if chunks
                else None
            )
            if got is not None:
                assert (bits(got) == bits(self._expected(spec, ids.tolist()))).all()


def torch_row(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy())


def _machine(policy: PolicyKind, examples: int, steps: int, layout: str = "log") -> type:
    machine = type(
        f"StoreMachine{policy.name}{layout}", (StoreMachine,), {"policy": policy, "layout": layout}
    )
    case = machine.TestCase
    case.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None)
    return case


TestStoreLru = _machine(PolicyKind.LRU, 15, 40)
TestStoreLfu = _machine(PolicyKind.LFU, 15, 40)
TestStoreLookahead = _machine(PolicyKind.LOOKAHEAD, 15, 40)
# The same machine over the other backends (the store's contract does not depend on its SSD backend).
TestStoreLruBtree = _machine(PolicyKind.LRU, 10, 40, "btree")
TestStoreLookaheadBtree = _machine(PolicyKind.LOOKAHEAD, 10, 40, "btree")
TestStoreLruMemory = _machine(PolicyKind.LRU, 10, 40, "memory")
TestStoreLookaheadMemory = _machine(PolicyKind.LOOKAHEAD, 10, 40, "memory")

TestStoreLruSlow = pytest.mark.slow(_machine(PolicyKind.LRU, 200, 80))
TestStoreLfuSlow = pytest.mark.slow(_machine(PolicyKind.LFU, 200, 80))
TestStoreLookaheadSlow = pytest.mark.slow(_machine(PolicyKind.LOOKAHEAD, 200, 80))
