"""The device tier on a real accelerator: a store bound to CUDA slot tensors (pinned host arena,
non_blocking copies) must hold exactly the rows that a store bound to CPU tensors holds, after the same
random sequence of batches, in-place updates and evictions. On a machine without CUDA the CPU variant runs
alone and checks the same sequence against a plain dict of updated rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding_store import OptimizerKind, PolicyKind, StoreConfig, TableSpec, TieredStore, init_rows

SEED = 11
SLOTS = 64
SPECS = [
    TableSpec(name="rowwise", dim=8, optimizer=OptimizerKind.EXACT_ROWWISE_ADAGRAD, init_scale=0.1),
    TableSpec(name="adagrad", dim=4, optimizer=OptimizerKind.EXACT_ADAGRAD, init_scale=0.1),
    TableSpec(name="sgd", dim=4, optimizer=OptimizerKind.EXACT_SGD, init_scale=0.1),
]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def _slot_tensors(spec: TableSpec, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    weights = torch.full((SLOTS, spec.dim), float("nan"), device=device)
    if spec.optimizer is OptimizerKind.EXACT_SGD:
        return weights, None
    shape = (SLOTS,) if spec.optimizer is OptimizerKind.EXACT_ROWWISE_ADAGRAD else (SLOTS, spec.dim)
    return weights, torch.full(shape, float("nan"), device=device)


def _drive(path, device: str, policy: PolicyKind) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Train-like traffic: batches of Zipf ids, rows updated in place in their slots, then released."""
    rng = np.random.default_rng(0)
    config = StoreConfig(seed=SEED, device_capacity_rows=SLOTS, host_capacity_rows=48, policy=policy)
    with TieredStore(path, config=config, tables=SPECS) as store:
        tensors = {}
        for spec in SPECS:
            tensors[spec.name] = _slot_tensors(spec, device)
            store.bind(spec.name, weights=tensors[spec.name][0], state=tensors[spec.name][1])
        batches = [{s.name: (rng.zipf(1.2, 24) * 7919) % 5000 for s in SPECS} for _ in range(60)]
        for b, ids in enumerate(batches):
            store.lookahead(b, ids)
            if b >= 1:
                store.prefetch(b)
        for b, ids in enumerate(batches):
            slots = store.make_resident(b, ids)
            for spec in SPECS:
                weights, state = tensors[spec.name]
                where = torch.unique(slots[spec.name]).to(device)
                # an optimizer-like in-place update: depends on the row's current value (bitwise exact)
                weights[where] = weights[where] * 0.5 + 0.25
                if state is not None:
                    state[where] = state[where] + 1.0
            store.release(b)
        store.flush()
        out = {}
        for spec in SPECS:
            chunks = list(store.iter_rows(spec.name))
            ids = np.concatenate([c.ids.numpy() for c in chunks])
            parts = [np.concatenate([c.weights.numpy() for c in chunks])]
            if chunks[0].state is not None:
                parts.append(np.concatenate([c.state.reshape(len(c.ids), -1).numpy() for c in chunks]))
            out[spec.name] = (ids, np.concatenate(parts, axis=1))
        stats = store.stats()
        assert all(
            stats.tables[s.name][t].evictions > 0
            for s in SPECS
            for t in stats.tables[s.name]
            if t.value != "ssd"
        )
    return out


def _reference() -> dict[str, dict[int, np.ndarray]]:
    """The same traffic on a dict: every touched row updated once per batch it appears in."""
    rng = np.random.default_rng(0)
    batches = [{s.name: (rng.zipf(1.2, 24) * 7919) % 5000 for s in SPECS} for _ in range(60)]
    ref: dict[str, dict[int, np.ndarray]] = {s.name: {} for s in SPECS}
    for ids in batches:
        for spec in SPECS:
            for i in np.unique(ids[spec.name]).tolist():
                if i not in ref[spec.name]:
                    w = init_rows(
                        torch.tensor([i]), dim=spec.dim, seed=SEED, table=spec.name, scale=spec.init_scale
                    )
                    ref[spec.name][i] = np.concatenate(
                        [w.numpy()[0], np.zeros(spec.state_floats, np.float32)]
                    )
                row = ref[spec.name][i].copy()
                row[: spec.dim] = (torch.from_numpy(row[: spec.dim]) * 0.5 + 0.25).numpy()
                row[spec.dim :] += 1.0
                ref[spec.name][i] = row
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [PolicyKind.LOOKAHEAD, PolicyKind.LRU])
def test_device_tier_on_each_device_matches_the_reference(tmp_path, device, policy):
    got = _drive(tmp_path / "store", device, policy)
    ref = _reference()
    for spec in SPECS:
        ids, rows = got[spec.name]
        assert ids.tolist() == sorted(ref[spec.name])
        want = np.stack([ref[spec.name][i] for i in ids.tolist()])
        assert np.array_equal(rows.view(np.uint32), want.view(np.uint32)), spec.name
