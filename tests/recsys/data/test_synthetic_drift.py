"""Drift of the synthetic id stream (``[synthetic] drift_ranks_per_sample``, issue 38 point 5).

Oracles: the world-size-1 batch (rank shares and other batch sizes must be slices of it), the stream without drift
(same Zipf shape per window, far more overlap between the start and the end), and a per-id logistic model
trained online on the stream (labels stay learnable when new ids keep arriving).
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch

from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from recsys.metrics import auc_logloss


def test_drift_is_off_by_default():
    """Without drift the stream is the recorded one (tests/recsys/data/test_synthetic_portable.py)."""
    assert SyntheticConfig().drift_ranks_per_sample == 0.0


def _ids(rate: float, lo: int, hi: int, *, id_space: int = 10**6) -> np.ndarray:
    """Feature 0's ids of training samples [lo, hi) of a one-feature stream drifting by ``rate``."""
    cfg = SyntheticConfig(num_sparse=1, num_dense=0, id_space=id_space, drift_ranks_per_sample=rate)
    return SyntheticCriteo(cfg, seed=0).sample_block(np.arange(lo, hi, dtype=np.uint64)).ids[0].values


def _overlap(rate: float, *, length: int = 400_000, part: int = 50_000) -> tuple[float, int, int]:
    """How much the last ``part`` samples of a stream reuse the ids of its first ``part``: the share of the
    end's lookups whose id the start has, the distinct ids both have, and the ids both draw twice or more."""
    start, end = _ids(rate, 0, part), _ids(rate, length - part, length)
    start_ids, start_counts = np.unique(start, return_counts=True)
    end_ids, end_counts = np.unique(end, return_counts=True)
    return (
        float(np.isin(end, start).mean()),
        int(np.intersect1d(start_ids, end_ids).shape[0]),
        int(np.intersect1d(start_ids[start_counts >= 2], end_ids[end_counts >= 2]).shape[0]),
    )


def test_drift_replaces_the_ids_in_use():
    """After 3,500 ranks of drift the end of a stream shares far fewer ids with its start."""
    lookups, distinct, repeated = _overlap(0.0)
    drift_lookups, drift_distinct, drift_repeated = _overlap(0.01)
    assert lookups > 0.6 and repeated > 1_000  # without drift the head is shared
    assert drift_lookups < 0.25 * lookups
    assert drift_distinct < 0.8 * distinct
    assert drift_repeated < 0.5 * repeated


def test_top_ids_of_the_start_slide_down_and_new_ids_take_the_top():
    """The start's most used id is rarely drawn at the end, and the end's most used id is brand new."""
    start, end = _ids(0.001, 0, 1_000), _ids(0.001, 399_000, 400_000)
    values, counts = np.unique(start, return_counts=True)
    top_start = values[counts.argmax()]
    values, counts = np.unique(end, return_counts=True)
    top_end = values[counts.argmax()]
    assert counts.max() > 30  # a real head at the end too
    assert (end == top_start).sum() <= 2
    assert not np.isin(top_end, _ids(0.001, 0, 200_000))


def test_the_zipf_shape_per_window_is_unchanged():
    """Within windows shorter than one rank of drift, the top id's share is that of the stream without
    drift (the ids change, the popularity curve does not)."""

    def top_share(rate: float) -> float:
        shares = []
        for start in range(0, 40_000, 500):
            _, counts = np.unique(_ids(rate, start, start + 500), return_counts=True)
            shares.append(counts.max() / 500)
        return float(np.mean(shares))

    without, drifting = top_share(0.0), top_share(0.001)
    assert without > 0.05
    assert drifting == pytest.approx(without, rel=0.1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_drifting_rank_shares_are_slices_of_the_global_batch(world_size):
    """The drift is a function of the global sample index: any world size sees the same samples."""
    data = SyntheticCriteo(SyntheticConfig(multi_hot=3, num_sparse=4, drift_ranks_per_sample=0.37), seed=3)
    whole = data.batch(step=9, rank=0, world_size=1, batch_size=512)
    parts = [data.batch(step=9, rank=r, world_size=world_size, batch_size=512) for r in range(world_size)]
    assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    for key in whole.sparse.keys():
        assert torch.equal(torch.cat([p.sparse[key].values() for p in parts]), whole.sparse[key].values())
        assert torch.equal(torch.cat([p.sparse[key].lengths() for p in parts]), whole.sparse[key].lengths())


def test_drift_is_counted_in_samples_not_batches():
    """Step 3 of batches of 256 holds the same samples as the second half of step 1 of batches of 512."""
    data = SyntheticCriteo(SyntheticConfig(num_sparse=2, drift_ranks_per_sample=2.5), seed=0)
    small = data.batch(step=3, rank=0, world_size=1, batch_size=256)
    large = data.batch(step=1, rank=0, world_size=1, batch_size=512)
    plain = SyntheticCriteo(SyntheticConfig(num_sparse=2), seed=0).batch(
        step=3, rank=0, world_size=1, batch_size=256
    )
    for key in small.sparse.keys():
        assert torch.equal(small.sparse[key].values(), large.sparse[key].values()[256:])
        assert not torch.equal(small.sparse[key].values(), plain.sparse[key].values())  # the drift is on
    assert torch.equal(small.labels, large.labels[256:])


def test_a_huge_offset_wraps_mod_2_to_the_64():
    """Offsets past 2**64 (the largest rate, late indices) are taken mod 2**64, without an invalid cast:
    at rate 2**63 the even indices (offset 0 mod 2**64) draw the ids of the stream without drift, the odd
    ones (offset 2**63) others."""
    drifting = SyntheticCriteo(SyntheticConfig(num_sparse=1, drift_ranks_per_sample=2.0**63), seed=0)
    plain = SyntheticCriteo(SyntheticConfig(num_sparse=1), seed=0)
    even, odd = np.array([0, 2, 2**40, 2**62], dtype=np.uint64), np.array([1, 3, 2**40 + 1], dtype=np.uint64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns on a float -> uint64 cast out of range
        assert np.array_equal(
            drifting.sample_block(even).ids[0].values, plain.sample_block(even).ids[0].values
        )
        moved, kept = drifting.sample_block(odd).ids[0].values, plain.sample_block(odd).ids[0].values
    assert (moved != kept).all()


def _online_logistic_auc(rate: float, *, samples: int = 200_000, batch: int = 2_000) -> float:
    """Progressive AUC (predict each batch, then learn from it) of a per-id logistic model with Adagrad,
    over the second half of a two-feature stream whose labels depend on the ids only."""
    cfg = SyntheticConfig(
        num_sparse=2,
        num_dense=0,
        id_space=10**6,
        linear_strength=3.0,
        interaction_strength=0.0,
        drift_ranks_per_sample=rate,
    )
    block = SyntheticCriteo(cfg, seed=0).sample_block(np.arange(samples, dtype=np.uint64))
    ids = np.stack([j.values for j in block.ids])  # (F, N)
    _, slot = np.unique(ids + (np.arange(2)[:, None] << 40), return_inverse=True)  # features apart
    slot = slot.reshape(ids.shape)  # (F, N)
    weights = np.zeros(int(slot.max()) + 1)
    squares = np.full_like(weights, 1e-8)
    labels = block.labels.astype(np.float64)
    logits = np.empty(samples)
    for start in range(0, samples, batch):
        rows = slot[:, start : start + batch]  # (F, b)
        logits[start : start + batch] = weights[rows].sum(axis=0)
        error = 1.0 / (1.0 + np.exp(-logits[start : start + batch])) - labels[start : start + batch]
        grad = np.bincount(rows.ravel(), weights=np.tile(error, 2), minlength=weights.shape[0])
        touched = np.unique(rows)
        squares[touched] += grad[touched] ** 2
        weights[touched] -= 0.5 * grad[touched] / np.sqrt(squares[touched])
    half = slice(samples // 2, samples)
    return auc_logloss(torch.from_numpy(logits[half]), torch.from_numpy(labels[half]))[0]


def test_labels_stay_learnable_on_a_drifting_stream():
    """New ids get hidden effects of their own: a per-id logistic model keeps up with the drift."""
    without, drifting = _online_logistic_auc(0.0), _online_logistic_auc(0.001)
    assert without > 0.7
    assert drifting > 0.65
    assert drifting > without - 0.08


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, -math.inf, 2.0**64])
def test_negative_non_finite_or_huge_drift_is_refused(value):
    with pytest.raises(
        ValueError, match=rf"^drift_ranks_per_sample must be in \[0, 2\*\*63\], got {re.escape(str(value))}$"
    ):
        SyntheticConfig(drift_ranks_per_sample=value)


def test_the_run_config_reads_the_key_and_names_a_bad_value():
    from recsys.config import ConfigError, config_from_dict

    cfg = config_from_dict({"synthetic": {"drift_ranks_per_sample": 2}})
    assert cfg.synthetic.drift_ranks_per_sample == 2.0 and isinstance(
        cfg.synthetic.drift_ranks_per_sample, float
    )
    with pytest.raises(
        ConfigError, match=r"^\[synthetic\] drift_ranks_per_sample must be in \[0, 2\*\*63\], got nan$"
    ):
        config_from_dict({}, ["synthetic.drift_ranks_per_sample=nan"])


def test_the_dataset_spec_lists_the_key_with_its_default():
    import tomllib
    from pathlib import Path

    spec = tomllib.loads((Path(__file__).resolve().parents[3] / "datasets" / "synthetic.toml").read_text())
    assert spec["synthetic"]["drift_ranks_per_sample"] == SyntheticConfig().drift_ranks_per_sample == 0.0
