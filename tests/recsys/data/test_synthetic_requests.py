"""Requests in the synthetic stream (``[synthetic] request_size``, ``user_features``, ``interleave``).

Oracles: digests of the stream recorded before the keys existed (the defaults change nothing); the
stream without requests, read sample by sample (a sample keeps its dense values, item-side ids and the
label's own draw, and takes its user-side ids from its request's first sample); the documented arrival
order, recomputed with plain Python integers; and the world-size-1 batch.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.data.block import Block
from recsys.data.synthetic import SyntheticConfig, SyntheticCriteo
from tests.recsys.data.test_synthetic_portable import stream_digest

_SPACES = (100_000,) * 13 + (20_000,) * 13
_MULTI_HOT_DRIFT = {"multi_hot": 4, "drift_ranks_per_sample": 0.013, "id_spaces": _SPACES}

# (config, seed, steps, batch size, split, digest), recorded at ea048fd, before the request keys existed.
BEFORE_REQUESTS: list[tuple[dict, int, list[int], int, str, str]] = [
    (_MULTI_HOT_DRIFT, 3, [0, 2, 999], 384, "train", "39231b3e29d06f1e"),
    (_MULTI_HOT_DRIFT, 3, [0, 1], 500, "eval", "d45f8f117f4e0cf5"),
    ({"num_sparse": 5, "multi_hot": 2, "id_space": 2**63}, 1, [7, 123456], 256, "train", "77a782fde7b7e3cd"),
    ({}, 0, [4], 1000, "eval", "1d636dc39a1c7c72"),
]


@pytest.mark.parametrize(
    "requests",
    [{}, {"request_size": 1, "user_features": 0, "interleave": 1}, {"user_features": 2}],
    ids=["absent", "defaults", "one-sample-requests"],
)
@pytest.mark.parametrize(("config", "seed", "steps", "batch_size", "split", "digest"), BEFORE_REQUESTS)
def test_the_defaults_keep_the_stream_of_before(requests, config, seed, steps, batch_size, split, digest):
    """Dense values, ids, lengths and labels of train and eval batches are byte for byte those of before;
    user-side features of one-sample requests are ordinary features."""
    data = SyntheticCriteo(SyntheticConfig(**config, **requests), seed=seed)
    assert stream_digest(data, steps, batch_size, split) == digest


# -- a plain-Python reading of the stream -----------------------------------------------------------

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser on a Python int."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _key(*parts: int | str) -> int:
    acc = 0
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else part & _MASK
        acc = _mix(acc ^ ((value + 0x9E3779B97F4A7C15) & _MASK))
    return acc


def _documented_sample(position: int, *, seed: int, split: int, width: int) -> int:
    """The sample a stream position serves: its block's slots sorted by ``mix64(slot ^ key)``."""
    start = position - position % width
    key = _key(seed, "arrival", split)
    order = sorted(range(start, start + width), key=lambda slot: _mix(slot ^ key))
    return order[position - start]


def _rows(block: Block) -> list[tuple[tuple[float, ...], tuple[tuple[int, ...], ...], float]]:
    """(dense values, the ids of each feature, label) of each sample, read one by one."""
    bags = []
    for jagged in block.ids:
        values, lengths, at = jagged.values.tolist(), jagged.lengths.tolist(), 0
        bags.append([])
        for n in lengths:
            bags[-1].append(tuple(values[at : at + n]))
            at += n
    return [
        (tuple(block.dense[i].tolist()), tuple(bag[i] for bag in bags), float(block.labels[i]))
        for i in range(block.labels.shape[0])
    ]


def _read(config: SyntheticConfig, positions: range, *, seed: int = 0, split: str = "train") -> list:
    data = SyntheticCriteo(config, seed=seed)
    return _rows(data.sample_block(np.arange(positions.start, positions.stop, dtype=np.uint64), split=split))


def _plain(config: SyntheticConfig) -> SyntheticConfig:
    return dataclasses.replace(config, request_size=1, user_features=0, interleave=1)


_REQUESTS = SyntheticConfig(
    num_sparse=6,
    id_space=10**6,
    multi_hot=3,
    drift_ranks_per_sample=0.05,
    request_size=5,
    user_features=2,
    interleave=7,
)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_each_position_serves_the_documented_sample_with_its_requests_user_features(split):
    """Position p serves sample i (the documented order): i's dense values and item-side bags, and the
    user-side bags of sample k * (i // k), as the stream without requests has them; the first sample of a
    request is that stream's sample whole, label included."""
    cfg, width = _REQUESTS, _REQUESTS.request_size * _REQUESTS.interleave
    start, stop = 3 * width - 4, 6 * width + 9  # partial blocks at both ends
    got = _read(cfg, range(start, stop), seed=4, split=split)
    plain = _read(_plain(cfg), range(start - 2 * width, stop + 2 * width), seed=4, split=split)
    offset = start - 2 * width
    split_no = {"train": 1, "eval": 2}[split]
    firsts = 0
    for position, (dense, bags, label) in zip(range(start, stop), got, strict=True):
        sample = _documented_sample(position, seed=4, split=split_no, width=width)
        first = sample - sample % cfg.request_size
        own, head = plain[sample - offset], plain[first - offset]
        assert dense == own[0]
        assert bags[: cfg.user_features] == head[1][: cfg.user_features]
        assert bags[cfg.user_features :] == own[1][cfg.user_features :]
        if sample == first:
            assert label == own[2]
            firsts += 1
    assert firsts > 10


def test_labels_keep_their_own_draw():
    """Without id effects the label depends on the sample's dense values and its own draw only: it is the
    label the stream without requests gives the sample."""
    cfg = dataclasses.replace(_REQUESTS, linear_strength=0.0, interaction_strength=0.0)
    width = cfg.request_size * cfg.interleave
    got = _read(cfg, range(0, 4 * width))
    plain = _read(_plain(cfg), range(0, 4 * width))
    for position, row in enumerate(got):
        assert row[2] == plain[_documented_sample(position, seed=0, split=1, width=width)][2]


def test_a_request_shares_its_user_side_bags_and_varies_its_item_side_ones():
    cfg = dataclasses.replace(_REQUESTS, interleave=1, request_size=8, user_features=3)
    rows = _read(cfg, range(0, 8 * 200))
    requests = [rows[at : at + 8] for at in range(0, len(rows), 8)]  # in order without interleaving
    alike = defaultdict(int)
    for request in requests:
        for feature in range(cfg.num_sparse):
            bags = {row[1][feature] for row in request}
            if feature < cfg.user_features:
                assert len(bags) == 1
            else:
                alike[feature] += len(bags) == 1
    assert all(alike[f] <= 10 for f in range(cfg.user_features, cfg.num_sparse))  # item ids vary
    users = {request[0][1][: cfg.user_features] for request in requests}
    assert len(users) > 150  # requests draw their own user-side bags
    assert len({row[0] for row in rows}) == len(rows)  # dense values are per sample


def test_interleaved_blocks_are_permutations_of_their_samples():
    """Found by their dense values and item-side bags (per sample), the samples of each block of interleave * k positions
    are exactly the block's samples, and most requests' samples are not contiguous."""
    cfg = _REQUESTS
    width = cfg.request_size * cfg.interleave
    got = _read(cfg, range(0, 20 * width))
    plain = _read(_plain(cfg), range(0, 20 * width))
    items = cfg.user_features
    sample_of = {(row[0], row[1][items:]): i for i, row in enumerate(plain)}
    assert len(sample_of) == len(plain)
    served = [sample_of[(row[0], row[1][items:])] for row in got]
    for start in range(0, len(served), width):
        assert sorted(served[start : start + width]) == list(range(start, start + width))
    assert served != list(range(len(served)))
    where = defaultdict(list)
    for position, sample in enumerate(served):
        where[sample // cfg.request_size].append(position)
    spread = [max(p) - min(p) + 1 > cfg.request_size for p in where.values()]
    assert sum(spread) > 0.9 * len(spread)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shares_and_batch_sizes_read_slices_of_one_stream(world_size):
    """Blocks of 35 positions straddle the batches: rank r of W still reads the r-th slice of the global
    batch, and batches of 256 are halves of batches of 512."""
    data = SyntheticCriteo(_REQUESTS, seed=2)
    whole = data.batch(step=5, rank=0, world_size=1, batch_size=512)
    parts = [data.batch(step=5, rank=r, world_size=world_size, batch_size=512) for r in range(world_size)]
    halves = [data.batch(step=s, rank=0, world_size=1, batch_size=256) for s in (10, 11)]
    for split in (parts, halves):
        assert torch.equal(torch.cat([p.dense for p in split]), whole.dense)
        assert torch.equal(torch.cat([p.labels for p in split]), whole.labels)
        for key in whole.sparse.keys():
            assert torch.equal(torch.cat([p.sparse[key].values() for p in split]), whole.sparse[key].values())
            assert torch.equal(
                torch.cat([p.sparse[key].lengths() for p in split]), whole.sparse[key].lengths()
            )


def test_eval_shares_cover_the_split_whatever_the_world_size():
    data = SyntheticCriteo(dataclasses.replace(_REQUESTS, eval_samples=1000), seed=0)
    full = torch.cat([b.dense for b in data.eval_batches(rank=0, world_size=1, batch_size=300)])
    shares = [
        torch.cat([b.dense for b in data.eval_batches(rank=r, world_size=3, batch_size=128)])
        for r in range(3)
    ]
    assert torch.equal(torch.cat(shares), full)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"request_size": 0}, "request_size must be in [1, 2**63], got 0"),
        ({"request_size": 2**63 + 1}, f"request_size must be in [1, 2**63], got {2**63 + 1}"),
        ({"user_features": -1}, "user_features must be in [0, num_sparse=26], got -1"),
        ({"user_features": 27}, "user_features must be in [0, num_sparse=26], got 27"),
        ({"num_sparse": 4, "user_features": 5}, "user_features must be in [0, num_sparse=4], got 5"),
        ({"interleave": 0}, "interleave must be >= 1, got 0"),
        (
            {"request_size": 16, "interleave": 4097},
            "interleave must be 1 or at most 2**16 // request_size = 4096 (samples per arrival block), got 4097",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(changes, message):
    with pytest.raises(ValueError) as info:
        SyntheticConfig(**changes)
    assert str(info.value) == message


def test_the_largest_values_are_accepted():
    SyntheticConfig(request_size=16, interleave=4096, user_features=26)
    SyntheticConfig(request_size=2**63, user_features=1)  # one request; no arrival block without interleave


def test_the_run_config_reads_the_keys_and_names_a_bad_value():
    from recsys.config import ConfigError, config_from_dict

    cfg = config_from_dict({"synthetic": {"request_size": 4, "user_features": 2, "interleave": 3}})
    assert (cfg.synthetic.request_size, cfg.synthetic.user_features, cfg.synthetic.interleave) == (4, 2, 3)
    with pytest.raises(ConfigError, match=r"^\[synthetic\] interleave must be >= 1, got 0$"):
        config_from_dict({}, ["synthetic.interleave=0"])


def test_requests_toml_is_the_quickstart_with_a_request_stream(repo_root: Path):
    from recsys.config import config_to_dict, load_config

    quick, requests = (load_config(repo_root / "configs" / f"{n}.toml") for n in ("quickstart", "requests"))
    cfg = requests.synthetic
    assert (cfg.request_size, cfg.user_features, cfg.interleave) == (16, 13, 8)
    assert cfg.id_spaces == (100_000,) * 13 + (20_000,) * 13 and cfg.zipf_alpha == 1.05
    synthetic_only = {k: v for k, v in config_to_dict(quick).items() if k != "synthetic"}
    assert {k: v for k, v in config_to_dict(requests).items() if k != "synthetic"} == synthetic_only

    block = SyntheticCriteo(cfg, seed=0).sample_block(np.arange(4096, dtype=np.uint64))
    user = np.stack([block.ids[f].values for f in range(13)])  # (13, B): one id per sample
    item = np.stack([block.ids[f].values for f in range(13, 26)])
    assert user.max() < 100_000 and user.max() >= 20_000 and item.max() < 20_000
    distinct_users = {tuple(col) for col in user.T.tolist()}
    assert len(distinct_users) == 4096 // 16  # every sample of a request has its user-side ids
