"""Tiered training is bitwise identical to untiered training (docs/design.md, invariant 4).

A fused FBGEMM TBE (what TorchRec's FUSED EmbeddingBagCollection runs on CPU) trains 50 steps
through the store — slot table <= 5% of the touched rows, host arena <= 20%, the rest in LMDB, batches
with lookahead two batches ahead and the prefetch of batch i+2 running in another thread during batch
i's forward/backward — and must end with the same
losses, rows and optimizer state, bit for bit, as the same TBE holding every row in memory,
initialised by the same ``init_rows``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from es_helpers import bits

from embedding_store import (
    LmdbOptions,
    OptimizerKind,
    PolicyKind,
    StoreConfig,
    TableSpec,
    Tier,
    TieredStore,
    WeightsPrecision,
    init_rows,
)

fbgemm = pytest.importorskip("fbgemm_gpu")
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

SEED = 3
DIM = 8
STEPS = 50
BATCH = 8  # bags per step
MAX_BAG = 3
POOL = 3000  # distinct raw ids the data draws from
OPTIMIZERS = {
    OptimizerKind.EXACT_SGD: EmbOptimType.EXACT_SGD,
    OptimizerKind.EXACT_ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    OptimizerKind.EXACT_ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
}


def _tbe(
    rows: int, optimizer: OptimizerKind, precision: WeightsPrecision = WeightsPrecision.FP32
) -> SplitTableBatchedEmbeddingBagsCodegen:
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OPTIMIZERS[optimizer],
        learning_rate=0.05,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP16 if precision is WeightsPrecision.FP16 else SparseType.FP32,
        stochastic_rounding=False,  # no effect on CPU (FBGEMM's CPU kernels round to nearest even)
    )


def _state(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> torch.Tensor | None:
    states = tbe.split_optimizer_states()
    return states[0][0] if states else None


def _batches() -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Raw 62-bit ids (Zipf-skewed over a pool) in bags: [(values (N,), offsets (B+1,))]."""
    rng = np.random.default_rng(SEED)
    pool = np.unique(rng.integers(0, 1 << 62, size=POOL, dtype=np.int64))
    weights = 1.0 / np.arange(1, pool.shape[0] + 1) ** 0.6
    batches = []
    for _ in range(STEPS):
        lengths = rng.integers(1, MAX_BAG + 1, size=BATCH)
        values = rng.choice(pool, size=int(lengths.sum()), p=weights / weights.sum())
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        batches.append((torch.from_numpy(values), torch.from_numpy(offsets)))
    return pool, batches


def _loss(pooled: torch.Tensor, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    proj = torch.randn(DIM, generator=gen)  # (D,)
    target = torch.randn(pooled.shape[0], generator=gen)  # (B,)
    return ((pooled @ proj - target) ** 2).mean()


@pytest.mark.parametrize("precision", list(WeightsPrecision), ids=lambda p: p.value)
@pytest.mark.parametrize("policy", [PolicyKind.LOOKAHEAD, PolicyKind.LRU])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=lambda o: o.name)
def test_tiered_training_is_bitwise_identical(
    tmp_path, optimizer: OptimizerKind, policy: PolicyKind, precision: WeightsPrecision
) -> None:
    pool, batches = _batches()
    touched = np.unique(torch.cat([v for v, _ in batches]).numpy())
    device_rows = int(0.05 * touched.shape[0])
    host_rows = int(0.20 * touched.shape[0])
    assert max(len(np.unique(v.numpy())) for v, _ in batches) <= device_rows

    # Untiered reference: every pool id at a fixed dense row.
    ref = _tbe(pool.shape[0], optimizer, precision)  # fp16: the init rows rounded to nearest even
    ref.split_embedding_weights()[0].copy_(init_rows(pool, dim=DIM, seed=SEED, table="t", scale=0.1))
    ref_losses = []
    for step, (values, offsets) in enumerate(batches):
        dense = torch.from_numpy(np.searchsorted(pool, values.numpy()))
        loss = _loss(ref(dense, offsets), step)
        loss.backward()
        ref_losses.append(loss.detach())

    # Tiered: the TBE holds only `device_rows` slots; raw ids go through make_resident.
    spec = TableSpec(name="t", dim=DIM, optimizer=optimizer, init_scale=0.1, weights_precision=precision)
    config = StoreConfig(
        seed=SEED,
        device_capacity_rows=device_rows,
        host_capacity_rows=host_rows,
        policy=policy,
        lookahead_batches=2,
        lmdb=LmdbOptions(initial_map_size_bytes=1 << 20, writer_batch_rows=64),
    )
    tiered = _tbe(device_rows, optimizer, precision)
    losses = []
    with TieredStore(tmp_path / "store", config=config, tables=[spec]) as store:
        store.bind("t", weights=tiered.split_embedding_weights()[0], state=_state(tiered))
        for b in range(min(3, STEPS)):
            store.lookahead(b, {"t": batches[b][0]})
        store.prefetch(0)
        store.prefetch(1)
        with ThreadPoolExecutor(1) as prefetcher:
            for step, (values, offsets) in enumerate(batches):
                if step + 3 < STEPS:
                    store.lookahead(step + 3, {"t": batches[step + 3][0]})
                slots = store.make_resident(step, {"t": values})["t"]
                ahead = prefetcher.submit(store.prefetch, step + 2) if step + 2 < STEPS else None
                loss = _loss(tiered(slots, offsets), step)
                loss.backward()
                losses.append(loss.detach())
                store.release(step)
                if ahead is not None:
                    ahead.result()
        stats = store.stats().tables["t"]
        chunks = list(store.iter_rows("t", chunk_rows=100))

    assert [bits(x.numpy()).item() for x in losses] == [bits(x.numpy()).item() for x in ref_losses]
    ids = torch.cat([c.ids for c in chunks]).numpy()
    np.testing.assert_array_equal(ids, touched)
    dense = np.searchsorted(pool, ids)
    got_w = torch.cat([c.weights for c in chunks]).numpy()
    assert (bits(got_w) == bits(ref.split_embedding_weights()[0][dense].detach().numpy())).all()
    ref_state = _state(ref)
    if ref_state is not None:
        got_s = torch.cat([c.state for c in chunks]).numpy()
        assert (bits(got_s) == bits(ref_state[dense].detach().numpy())).all()
        assert (got_s != 0).any()  # the optimizer state really travelled
    # The run really went through every tier.
    assert stats[Tier.DEVICE].evictions > 0 and stats[Tier.HOST].evictions > 0
    assert stats[Tier.SSD].hits > 0 and stats[Tier.SSD].rows_in > 0
