"""Synthetic click data in Criteo layout with a hidden ground-truth model.

Every value of every sample is a pure function of ``(seed, split, sample index, field)`` through a
counter-based hash, so a batch is reproducible for any (seed, rank, step), ranks read disjoint samples,
and the data a step sees does not depend on the world size (rank r of W reads the r-th slice of the
global batch).

Ids follow a bounded Zipf law over ranks, and ranks are scattered over the feature's id space by a hash,
like hashed categorical features: an id space of up to 2**63 gives raw 64-bit ids. Labels are drawn
from a hidden model with per-id linear effects plus pairwise interactions between features, so a model
that learns feature interactions (DLRM) can beat logistic regression, and learning is measurable.

Drift (``drift_ranks_per_sample = d > 0``): the sample at global index ``i`` hashes popularity rank ``r``
as the rank ``r - floor(i * d)`` (mod 2**64), so every ``1 / d`` samples a brand-new id takes the top rank
and every older id slides one rank down the tail, where it is drawn ever more rarely: the set of ids last
used long ago keeps growing, as in a stream of new users and items. The Zipf shape at any one index is
unchanged, the offset is a function of the index alone (so the same for any world size), and the hidden
model's per-id effects are hashes of the id, so new ids get effects of their own. The held-out split
applies the same rule to its own indices: it has the ids of the start of the training stream.

Requests (``request_size = k``, ``user_features = u``, ``interleave = m``), as in impression logs: sample ``i``
belongs to request ``i // k``, and its first ``u`` sparse features are user-side: they are those of the
request's first sample ``k * (i // k)`` (ids, lengths, drift), so one draw per request that all its samples
share; the item-side features, the dense features and the label's own draw stay the sample's. Requests
arrive interleaved: the stream is cut into blocks of ``m * k`` positions, and block ``b`` serves its samples
``b*m*k + s`` in the order of the hashes ``mix64((b*m*k + s) ^ key(seed, "arrival", split))`` (a stable sort),
a function of (seed, split, block) alone. So a batch is still a pure function of the positions it reads.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from embedding_store.hashing import mix64 as _mix
from recsys.data import portable_math
from recsys.data.block import Block, Jagged
from recsys.data.stats import SplitStats
from recsys.data.synthetic_config import MAX_ID_SPACE, SyntheticConfig

if TYPE_CHECKING:  # batches need torch and TorchRec, imported when batches are made (blocks do not)
    from recsys.data.batch import Batch

__all__ = ["SyntheticConfig", "SyntheticCriteo", "MAX_ID_SPACE"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SPLITS = {"train": 1, "eval": 2}


def _key(*parts: int | str) -> np.uint64:
    acc = np.array([0], dtype=np.uint64)
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else part & 0xFFFFFFFFFFFFFFFF
        acc = _mix(acc ^ np.array([value], dtype=np.uint64) + _GOLDEN)
    return acc[0]


def _sum_along(x: np.ndarray, axis: int) -> np.ndarray:
    """``x.sum(axis)`` added strictly in index order, one elementwise add at a time: the same bits on every
    CPU (a reduction's grouping is the kernel's choice)."""
    parts = np.moveaxis(x, axis, 0)
    acc = np.zeros(parts.shape[1:], dtype=np.float64)
    for part in parts:
        acc = acc + part
    return acc


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniform in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class SyntheticCriteo:
    """Generates batches of synthetic Criteo-layout samples.

    Args:
        config: the data section.
        seed: the run's seed; it fixes the hidden model and every sample.

    Example:
        >>> data = SyntheticCriteo(SyntheticConfig(num_sparse=2, id_space=100), seed=0)
        >>> batch = data.batch(step=0, rank=0, world_size=1, batch_size=8)
        >>> batch.dense.shape, batch.sparse.keys()
        (torch.Size([8, 13]), ['cat_0', 'cat_1'])
    """

    def __init__(self, config: SyntheticConfig, *, seed: int) -> None:
        self.config = config
        self.seed = seed
        cfg = config
        # Uniform draws only (integer bits, + and x): numpy's normal sampler calls the C library's exp and log.
        rng = np.random.default_rng([seed, 0x5EED])
        self._dense_w = rng.uniform(-1.0, 1.0, cfg.num_dense) * (
            0.5 * np.sqrt(3.0) / np.sqrt(max(1, cfg.num_dense))
        )
        self._dense_scale = rng.uniform(1.0, 50.0, cfg.num_dense)
        self._dense_center = portable_math.log(1.0 + self._dense_scale) - 0.58
        # Interactions within disjoint pairs of features (0-1, 2-3, ...).
        f = cfg.num_sparse
        self._pairs = np.array([(i, i + 1) for i in range(0, f - 1, 2)], dtype=np.int64).reshape(-1, 2)
        self._feature_keys = [_key(seed, "id", i) for i in range(f)]
        self._hidden_keys = [_key(seed, "hidden", i) for i in range(f)]
        self._arrival_keys = {split: _key(seed, "arrival", n) for split, n in _SPLITS.items()}
        # Centre the logit so that roughly a quarter of the samples are positive, as in click logs.
        self._bias = -1.1
        self._stats: dict[str, SplitStats] | None = None

    # -- the Dataset protocol ---------------------------------------------------------------------

    @property
    def feature_names(self) -> list[str]:
        return self.config.feature_names

    @property
    def id_spaces(self) -> list[int]:
        return [self.config.feature_id_space(i) for i in range(self.config.num_sparse)]

    @property
    def num_dense(self) -> int:
        return self.config.num_dense

    def train_batches(
        self, *, rank: int, world_size: int, batch_size: int, start_step: int
    ) -> Iterator[Batch]:
        """Unbounded: the training split has a sample for every index."""
        step = start_step
        while True:
            yield self.batch(step=step, rank=rank, world_size=world_size, batch_size=batch_size)
            step += 1

    def batch(self, *, step: int, rank: int, world_size: int, batch_size: int, split: str = "train") -> Batch:
        """Rank ``rank``'s share of global step ``step``; ``batch_size`` is the global batch size."""
        local = batch_size // world_size
        start = step * batch_size + rank * local
        return self.samples(np.arange(start, start + local, dtype=np.uint64), split=split)

    def eval_batches(self, *, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """This rank's disjoint, contiguous share of the held-out split.

        Every rank yields the same number of batches (collectives run once per batch), each of at most
        ``batch_size`` samples; the shares together cover the whole split.
        """
        total = self.config.eval_samples
        lo = total * rank // world_size
        hi = total * (rank + 1) // world_size
        largest = -(-total // world_size)
        num_batches = max(1, -(-largest // batch_size))
        for part in np.array_split(np.arange(lo, hi, dtype=np.uint64), num_batches):
            yield self.samples(part, split="eval")

    def split_stats(self) -> dict[str, SplitStats]:
        """Rows and positives: ``"eval"`` exactly (its ``eval_samples`` rows); ``"train"`` from the first
        ``eval_samples`` samples of the endless training stream (``sampled=True``). Counted once."""
        if self._stats is None:
            n = self.config.eval_samples
            self._stats = {
                "train": self._count(n, "train", sampled=True),
                "eval": self._count(n, "eval", sampled=False),
            }
        return self._stats

    def _count(self, rows: int, split: str, *, sampled: bool) -> SplitStats:
        positives = 0
        for start in range(0, rows, 65536):  # bounded memory for any eval_samples
            index = np.arange(start, min(rows, start + 65536), dtype=np.uint64)
            positives += int(self.sample_block(index, split=split).labels.sum())
        return SplitStats(rows=rows, positives=positives, sampled=sampled)

    def samples(self, index: np.ndarray, *, split: str = "train") -> Batch:
        """The samples at the given global positions (uint64) of a split."""
        from recsys.data.batch import block_batch

        return block_batch(self.sample_block(index, split=split), self.config.feature_names)

    def sample_block(self, index: np.ndarray, *, split: str = "train") -> Block:
        """The samples at the given global positions (uint64) of a split, as a block (no origin)."""
        cfg = self.config
        sample = self._arrival(index, split)  # (B,) the sample each position serves
        b = sample.shape[0]
        base = self._base(sample, split)  # (B,)

        def uniform(*salt: int) -> np.ndarray:
            return _unit(_mix(base + _key(*salt)))

        # Dense: heavy-tailed counts, log-transformed as Criteo pipelines do.
        dense = np.empty((b, cfg.num_dense), dtype=np.float32)
        for j in range(cfg.num_dense):
            counts = np.floor(
                -portable_math.log(1.0 - uniform(1, j)) * self._dense_scale[j]
            )  # 1 - u is exact
            dense[:, j] = portable_math.log(1.0 + counts)

        users = cfg.user_features if cfg.request_size > 1 else 0  # one-sample requests: the stream of before
        lengths = np.empty((cfg.num_sparse, b), dtype=np.int64)
        ids = np.empty((cfg.num_sparse, b, cfg.multi_hot), dtype=np.int64)
        if users:  # drawn once per request, from its first sample's index
            first, back = np.unique(sample - sample % np.uint64(cfg.request_size), return_inverse=True)
            user_lengths, user_ids = self._sparse(self._base(first, split), first, range(users))
            lengths[:users], ids[:users] = user_lengths[:, back], user_ids[:, back]
        lengths[users:], ids[users:] = self._sparse(base, sample, range(users, cfg.num_sparse))

        logit = self._hidden_logit(dense, ids, lengths)
        labels = (uniform(4) < 1.0 / (1.0 + portable_math.exp(-logit))).astype(np.float32)

        mask = np.arange(cfg.multi_hot)[None, None, :] < lengths[:, :, None]  # (F, B, L)
        jagged = tuple(Jagged(ids[f][mask[f]], lengths[f]) for f in range(cfg.num_sparse))
        return Block(dense, jagged, labels)

    # -- internals --------------------------------------------------------------------------------

    def _base(self, sample: np.ndarray, split: str) -> np.ndarray:
        """The per-sample hash every field of the samples ``sample`` (B,) is drawn from."""
        return _mix(sample ^ _key(self.seed, "split", _SPLITS[split]))

    def _arrival(self, index: np.ndarray, split: str) -> np.ndarray:
        """The sample each stream position serves, shape (B,) uint64: the position itself unless requests
        interleave; else the position's slot in its block's hash-sorted order (see the module docstring).
        Each block the positions touch is sorted whole, hence the cap on its size (``MAX_ARRIVAL_BLOCK``)."""
        cfg = self.config
        if cfg.interleave == 1:
            return index
        width = np.uint64(cfg.interleave * cfg.request_size)
        blocks, back = np.unique(index // width, return_inverse=True)  # (N,), (B,)
        starts = blocks * width  # (N,)
        slots = starts[:, None] + np.arange(int(width), dtype=np.uint64)  # (N, m*k)
        order = np.argsort(_mix(slots ^ self._arrival_keys[split]), axis=1, kind="stable")  # (N, m*k)
        return starts[back] + order[back, (index % width).astype(np.int64)].astype(np.uint64)

    def _sparse(self, base: np.ndarray, sample: np.ndarray, features: range) -> tuple[np.ndarray, np.ndarray]:
        """Lengths (F', B) and padded ids (F', B, multi_hot) of ``features`` for the samples ``sample`` (B,)
        whose hashes are ``base`` (B,)."""
        cfg = self.config
        shift = self._drift_offset(sample)  # (B,) uint64 or None
        lengths = np.ones((len(features), sample.shape[0]), dtype=np.int64)
        ids = np.empty((len(features), sample.shape[0], cfg.multi_hot), dtype=np.int64)
        for row, f in enumerate(features):
            if cfg.multi_hot > 1:
                u = _unit(_mix(base + _key(2, f)))
                lengths[row] = 1 + np.floor(u * cfg.multi_hot).astype(np.int64)
            for s in range(cfg.multi_hot):
                ids[row, :, s] = self._zipf_ids(_unit(_mix(base + _key(3, f, s))), f, shift)
        return lengths, ids

    def _drift_offset(self, index: np.ndarray) -> np.ndarray | None:
        """``floor(index * drift_ranks_per_sample)`` mod 2**64 as uint64, shape (B,); None without drift."""
        rate = self.config.drift_ranks_per_sample
        if rate == 0.0:
            return None  # no arithmetic at all: streams without drift stay bit for bit what they were
        # fmod keeps the float below 2**64, so the cast is defined; the hash needs the offset mod 2**64 only.
        return np.fmod(np.floor(index.astype(np.float64) * rate), 2.0**64).astype(np.uint64)

    def _zipf_ids(self, u: np.ndarray, feature: int, shift: np.ndarray | None = None) -> np.ndarray:
        """Bounded Zipf ranks in [0, n) by inverse CDF of a power law, hashed into the id space.

        The inverse CDF uses ``portable_math``: numpy's ``exp``/``log``/``**`` differ in the last bit between
        CPUs, and at 2**63 ids one bit of a rank near 1e18 is hundreds of ranks, so another id.
        ``shift`` (B,) uint64 is the drift offset: rank ``r`` hashes as ``r - shift`` (mod 2**64), so a
        larger shift puts ids never drawn before on the top ranks.
        """
        n = float(self.config.feature_id_space(feature))
        a = self.config.zipf_alpha
        if abs(a - 1.0) < 1e-9:
            rank = portable_math.exp(u * portable_math.log(n + 1.0)) - 1.0
        else:
            top = portable_math.power(n + 1.0, 1.0 - a)
            rank = portable_math.power(1.0 + u * (top - 1.0), 1.0 / (1.0 - a)) - 1.0
        rank_u = np.minimum(np.floor(rank), n - 1).astype(np.uint64)
        if shift is not None:
            rank_u = rank_u - shift  # wraps mod 2**64 by design
        space = np.uint64(self.config.feature_id_space(feature))
        return (_mix(rank_u + self._feature_keys[feature]) % space).astype(np.int64)

    def _hidden(self, ids: np.ndarray, lengths: np.ndarray, feature: int) -> np.ndarray:
        """Mean over each sample's ids of the hidden (1 + hidden_dim)-vector; shape (B, 1 + k)."""
        k = 1 + self.config.hidden_dim
        h = _mix(ids.astype(np.uint64)[..., None] ^ self._hidden_keys[feature])  # (B, L, 1)
        cols = (np.arange(k, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        vec = _unit(_mix(h + cols)) * 2.0 - 1.0  # (B, L, k)
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None])[..., None]
        return _sum_along(vec * mask, axis=1) / lengths[:, None]

    def _hidden_logit(self, dense: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        cfg = self.config
        hidden = np.stack([self._hidden(ids[f], lengths[f], f) for f in range(cfg.num_sparse)])  # (F, B, 1+k)
        linear = _sum_along(hidden[:, :, 0], axis=0) * cfg.linear_strength / np.sqrt(cfg.num_sparse)
        vec = hidden[:, :, 1:] * np.sqrt(3.0)  # unit variance per component
        inter = np.zeros(dense.shape[0])
        if len(self._pairs):
            prods = _sum_along(vec[self._pairs[:, 0]] * vec[self._pairs[:, 1]], axis=2)  # (P, B)
            inter = (
                _sum_along(prods, axis=0)
                * cfg.interaction_strength
                / np.sqrt(len(self._pairs) * cfg.hidden_dim)
            )
        # Centred by a constant (E[log X] of the counts), never by batch statistics: a sample's label must
        # not depend on which batch it is generated in. No BLAS: its kernels (and their sums' order) vary by CPU.
        centred = dense.astype(np.float64) - self._dense_center  # (B, D)
        dense_term = _sum_along(centred * self._dense_w, axis=1) if cfg.num_dense else 0.0
        return self._bias + linear + 1.6 * inter + dense_term

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self.config)
