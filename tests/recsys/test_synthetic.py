"""Synthetic Criteo-layout data: determinism, disjoint rank shares, id spaces, learnable labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo


def _ids(batch):
    return batch.sparse.values()


def test_same_seed_same_batch_and_other_seed_differs():
    a = SyntheticCriteo(SyntheticConfig(), seed=1).batch(step=3, rank=0, world_size=1, batch_size=256)
    b = SyntheticCriteo(SyntheticConfig(), seed=1).batch(step=3, rank=0, world_size=1, batch_size=256)
    c = SyntheticCriteo(SyntheticConfig(), seed=2).batch(step=3, rank=0, world_size=1, batch_size=256)
    assert torch.equal(a.dense, b.dense) and torch.equal(_ids(a), _ids(b)) and torch.equal(a.labels, b.labels)
    assert not torch.equal(_ids(a), _ids(c))


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shares_are_slices_of_the_global_batch(world_size):
    """Ranks read disjoint samples whose union is the world-size-1 batch, so data never depends on W."""
    data = SyntheticCriteo(SyntheticConfig(multi_hot=3), seed=0)
    whole = data.batch(step=5, rank=0, world_size=1, batch_size=512)
    parts = [data.batch(step=5, rank=r, world_size=world_size, batch_size=512) for r in range(world_size)]
    assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    for key in whole.sparse.keys():
        joined = torch.cat([p.sparse[key].values() for p in parts])
        assert torch.equal(joined, whole.sparse[key].values())


def test_eval_split_shares_are_disjoint_and_cover_it():
    data = SyntheticCriteo(SyntheticConfig(eval_samples=1000), seed=0)
    full = torch.cat([b.dense for b in data.eval_batches(rank=0, world_size=1, batch_size=300)])
    shares = [
        torch.cat([b.dense for b in data.eval_batches(rank=r, world_size=3, batch_size=128)])
        for r in range(3)
    ]
    assert full.shape[0] == 1000
    assert torch.equal(torch.cat(shares), full)
    train = data.batch(step=0, rank=0, world_size=1, batch_size=1000)
    assert not torch.equal(train.dense, full)  # a different split


def test_layout_multi_hot_and_id_spaces():
    cfg = SyntheticConfig(multi_hot=4, id_spaces=tuple([2**63] * 13 + [7] * 13))
    batch = SyntheticCriteo(cfg, seed=0).batch(step=0, rank=0, world_size=1, batch_size=2000)
    assert batch.dense.shape == (2000, 13) and batch.dense.dtype == torch.float32
    assert batch.sparse.keys() == [f"cat_{i}" for i in range(26)]
    lengths = batch.sparse.lengths()
    assert int(lengths.min()) == 1 and int(lengths.max()) == 4
    huge = batch.sparse["cat_0"].values()
    small = batch.sparse["cat_20"].values()
    assert int(huge.min()) >= 0 and int(huge.max()) > 2**62  # raw 63-bit ids really occur
    assert set(small.tolist()) <= set(range(7))
    assert set(torch.unique(batch.labels).tolist()) == {0.0, 1.0}


def test_ids_are_zipf_skewed():
    cfg = SyntheticConfig(id_space=1_000_000, zipf_alpha=1.05)
    ids = (
        SyntheticCriteo(cfg, seed=0)
        .batch(step=0, rank=0, world_size=1, batch_size=50_000)
        .sparse["cat_3"]
        .values()
    )
    _, counts = np.unique(ids.numpy(), return_counts=True)
    counts = np.sort(counts)[::-1]
    assert counts[:100].sum() / counts.sum() > 0.3  # heavy head
    assert len(counts) > 5_000  # long tail


def test_labels_follow_the_hidden_model():
    """The hidden logit separates the labels well (the data is learnable), its linear part much less."""
    from torchmetrics.functional.classification import binary_auroc

    data = SyntheticCriteo(SyntheticConfig(id_space=1000), seed=0)
    cfg = data.config
    batch = data.batch(step=0, rank=0, world_size=1, batch_size=30_000)
    ids = batch.sparse.values().view(cfg.num_sparse, -1, 1).numpy()
    lengths = np.ones(ids.shape[:2], dtype=np.int64)
    logit = torch.from_numpy(data._hidden_logit(batch.dense.numpy(), ids, lengths))
    assert binary_auroc(logit, batch.labels.long()).item() > 0.8


def test_config_validation():
    with pytest.raises(ValueError, match="id_space must be in"):
        SyntheticConfig(id_space=0)
    with pytest.raises(ValueError, match="id_spaces needs num_sparse=26 entries"):
        SyntheticConfig(id_spaces=(5, 5))
