"""What a rank's batch asks of the tables' owners under the ``rows`` exchange, and what crosses the wire.

Pure functions of a batch and the tables' ownership: no process group. :mod:`recsys.exchange` runs them
on every training batch, ``auto`` runs them over a run's first batches, and ``recsys plan-exchange``
replays a config's batches through them for world sizes no machine here has, so the replay and a real
run count the same bytes.

The ``rows`` exchange of one rank's batch of ``B`` samples cut into ``W`` windows (:func:`plan_rows`):

- the ids of each table are deduplicated over the whole batch; each distinct id goes once to the rank
  that owns its row, with a ``W``-bit mask of the windows that use it packed above the id (one int64);
- for window ``w`` each owner sends back, once, every requested row whose mask has bit ``w``
  (``rows_sent`` = the sum over windows of the window's distinct ids);
- the requester pools each window's bags locally from those rows, as the EmbeddingBagCollection would;
- the backward sums each distinct id's row gradient over all windows of the batch and sends it once
  (``grad_rows_sent`` = the batch's distinct ids).

The ``pooled`` exchange (TorchRec's EmbeddingBagCollection output distribution) sends every id of every
sample with one length per sample, and for each sample one pooled vector per owner back and one gradient
vector forward again. Only traffic between different ranks is counted: what a rank asks of itself never
leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from recsys.exchange_kernels import ID_BITS, plan_requests
from recsys.windows import window_sizes

__all__ = [
    "ID_BITS",
    "MAX_ROWS_WINDOWS",
    "ExchangeCounts",
    "Ownership",
    "RowRequests",
    "batch_counts",
    "plan_rows",
    "value_features",
    "pooled_counts",
    "rows_counts",
]

MAX_ROWS_WINDOWS = 63 - ID_BITS  # mask bits left below int64's sign bit
ID_BYTES = 8  # an id (or a length) on the wire: int64
VALUE_BYTES = 4  # an embedding value on the wire: float32


@dataclass(frozen=True)
class Ownership:
    """Which rank owns which rows of each feature's table: the sharding plan's id-to-owner map.

    Attributes:
        features: the features in the batch's key order.
        starts: per feature, the first row of each shard, ascending (table-wise: ``[0]``).
        ranks: per feature, the rank holding each shard.
        dims: per feature, the embedding dimension.
    """

    features: list[str]
    starts: list[list[int]]
    ranks: list[list[int]]
    dims: list[int]

    def __post_init__(self) -> None:
        bounds, owner = [], []
        for f, (starts, ranks) in enumerate(zip(self.starts, self.ranks, strict=True)):
            bounds += [(f << ID_BITS) | s for s in starts]
            owner += ranks
        object.__setattr__(self, "_bounds", torch.tensor(bounds, dtype=torch.int64))
        object.__setattr__(
            self, "_starts", torch.tensor([s for ss in self.starts for s in ss], dtype=torch.int64)
        )
        object.__setattr__(self, "_owner", torch.tensor(owner, dtype=torch.int64))

    def shards(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every shard's first key (``feature << ID_BITS | row``, ascending), first row and rank."""
        return (
            self._bounds.numpy(),  # type: ignore[attr-defined]
            self._starts.numpy(),  # type: ignore[attr-defined]
            self._owner.numpy(),  # type: ignore[attr-defined]
        )

    def locate(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For keys ``(feature << ID_BITS) | id``: (owner rank, the id's row on its owner's shard)."""
        shard = torch.searchsorted(self._bounds, keys, right=True) - 1  # type: ignore[attr-defined]
        local = (keys & ((1 << ID_BITS) - 1)) - self._starts[shard]  # type: ignore[attr-defined]
        return self._owner[shard], local  # type: ignore[attr-defined]


@dataclass
class ExchangeCounts:
    """What one batch sends between different ranks, per feature (arrays of length F).

    Attributes:
        ids: ids sent to owners (``rows``: distinct ids with their window masks; ``pooled``: every id).
        lengths: per-sample bag lengths sent to owners (``pooled`` only).
        rows: rows owners send back, summed over windows.
        grad_rows: row gradients sent to owners, once per distinct id.
        pooled: pooled vectors owners send back, and as many gradient vectors sent to them.
        header: int64 values of the rows exchange's header (per other rank: one count per feature and
            the batch size), not a table's.
    """

    ids: list[int]
    lengths: list[int]
    rows: list[int]
    grad_rows: list[int]
    pooled: list[int]
    dims: list[int] = field(default_factory=list)
    header: int = 0

    def bytes_per_feature(self) -> list[int]:
        """Bytes on the wire per feature: ids and lengths as int64, vectors as float32."""
        return [
            ID_BYTES * (i + n) + VALUE_BYTES * d * (r + g + 2 * p)
            for i, n, r, g, p, d in zip(
                self.ids, self.lengths, self.rows, self.grad_rows, self.pooled, self.dims, strict=True
            )
        ]

    def add(self, other: ExchangeCounts) -> None:
        """Add ``other``'s counts to these, feature by feature."""
        for name in ("ids", "lengths", "rows", "grad_rows", "pooled"):
            setattr(
                self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name), strict=True)]
            )
        self.header += other.header

    def total_bytes(self) -> int:
        """Bytes on the wire, the header's included."""
        return sum(self.bytes_per_feature()) + ID_BYTES * self.header

    def merged(self, other: ExchangeCounts, take: list[bool]) -> ExchangeCounts:
        """Per feature, ``other``'s counts where ``take`` is True, these elsewhere; headers added."""
        pick = {
            name: [
                b if t else a for a, b, t in zip(getattr(self, name), getattr(other, name), take, strict=True)
            ]
            for name in ("ids", "lengths", "rows", "grad_rows", "pooled")
        }
        return ExchangeCounts(**pick, dims=self.dims, header=self.header + other.header)


@dataclass(frozen=True)
class RowRequests:
    """One rank's ``rows`` requests for a batch, in send order (owner, then feature, then first use in the batch).

    Shapes: ``U`` distinct (feature, id) pairs, ``N`` id occurrences in the batch, ``W`` windows.

    Attributes:
        sent: (U,) int64, ``local row | mask << ID_BITS``: what each owner receives.
        feature: (U,) feature index of each request.
        owner: (U,) owner rank of each request (ascending).
        per_owner: (world,) requests sent to each rank.
        mask: (U,) int64 bit ``w`` set when window ``w`` uses the id.
        occurrence: (N,) the request each id occurrence of the batch reads (index into ``sent``).
        windows: the window sizes in samples.
        asked: (world, F) requests per owner and feature.
        uses: (world, F) rows the windows receive per owner and feature (the masks' bits).
    """

    sent: torch.Tensor
    feature: torch.Tensor
    owner: torch.Tensor
    per_owner: list[int]
    mask: torch.Tensor
    occurrence: torch.Tensor
    windows: list[int]
    asked: torch.Tensor
    uses: torch.Tensor


def value_features(lengths_per_key: list[int]) -> torch.Tensor:
    """(N,) the feature index of every id occurrence of a KJT's values (features in key order)."""
    return torch.repeat_interleave(torch.arange(len(lengths_per_key)), torch.tensor(lengths_per_key))


def _keys(values: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """(N,) ``feature << ID_BITS | id`` of every id occurrence (``feature``: :func:`value_features`)."""
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << ID_BITS):
        raise ValueError(f"ids must lie in [0, 2**{ID_BITS}) for the rows exchange")
    return (feature << ID_BITS) | values.to(torch.int64)


def plan_rows(
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    lengths_per_key: list[int],
    batch: int,
    windows: int,
    ownership: Ownership,
    world_size: int,
    features: torch.Tensor | None = None,
) -> RowRequests:
    """The ``rows`` requests of one rank's batch (a KJT's values and lengths); ``features``: (F,) bool,
    the features exchanged as rows (None: all). The occurrences of other features read request -1.

    Shapes: values (N,) ids, features in key order; lengths (F * B,).
    """
    if not 1 <= windows <= MAX_ROWS_WINDOWS:
        raise ValueError(f"the rows exchange takes 1 to {MAX_ROWS_WINDOWS} windows, got {windows}")
    sizes = window_sizes(batch, windows)
    rows_feature = (
        np.ones(len(lengths_per_key), dtype=np.bool_)
        if features is None
        else features.numpy().astype(np.bool_)
    )
    sent, feature, owner, per_owner, mask, occurrence, asked, uses = plan_requests(
        _int64(values),
        _int64(lengths),
        batch,
        np.repeat(np.arange(windows, dtype=np.int64), sizes),
        rows_feature,
        *ownership.shards(),
        world_size,
    )
    return RowRequests(
        sent=torch.from_numpy(sent),
        feature=torch.from_numpy(feature),
        owner=torch.from_numpy(owner),
        per_owner=per_owner.tolist(),
        mask=torch.from_numpy(mask),
        occurrence=torch.from_numpy(occurrence),
        windows=sizes,
        asked=torch.from_numpy(asked),
        uses=torch.from_numpy(uses),
    )


def _int64(x: torch.Tensor) -> np.ndarray:
    """A tensor's values as a contiguous int64 array (no copy where they already are one)."""
    return np.ascontiguousarray(x.detach().to(torch.int64).numpy())


def rows_counts(requests: RowRequests, *, rank: int, num_features: int, dims: list[int]) -> ExchangeCounts:
    """What ``requests`` send between different ranks, per feature."""
    remote = torch.arange(requests.asked.shape[0]) != rank
    ids = requests.asked[remote].sum(dim=0).tolist()
    zero = [0] * num_features
    return ExchangeCounts(
        ids=ids,
        lengths=list(zero),
        rows=requests.uses[remote].sum(dim=0).tolist(),
        grad_rows=list(ids),
        pooled=list(zero),
        dims=list(dims),
    )


def pooled_counts(
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    lengths_per_key: list[int],
    batch: int,
    ownership: Ownership,
    rank: int,
    features: torch.Tensor | None = None,
) -> ExchangeCounts:
    """What the ``pooled`` exchange of a batch sends between different ranks, per feature: each id to its
    owner, one bag length per sample to every remote shard owner, one pooled vector per sample back from
    each of them (row-wise: a partial sum per shard) and one gradient vector to each. ``features``: (F,)
    bool, the features counted (None: all; others count 0)."""
    num_features = len(lengths_per_key)
    feature = value_features(lengths_per_key)
    owner, _ = ownership.locate(_keys(values, feature))
    counted = torch.ones(num_features, dtype=torch.bool) if features is None else features
    ids = torch.bincount(feature[(owner != rank) & counted[feature]], minlength=num_features).tolist()
    remote_shards = [sum(1 for r in set(ranks) if r != rank) for ranks in ownership.ranks]
    per_sample = [batch * n if c else 0 for n, c in zip(remote_shards, counted.tolist(), strict=True)]
    return ExchangeCounts(
        ids=ids,
        lengths=per_sample,
        rows=[0] * num_features,
        grad_rows=[0] * num_features,
        pooled=per_sample,
        dims=list(ownership.dims),
    )


def batch_counts(
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    lengths_per_key: list[int],
    batch: int,
    windows: int,
    ownership: Ownership,
    rank: int,
    world_size: int,
    rows: torch.Tensor,
) -> tuple[ExchangeCounts, RowRequests | None]:
    """What one rank's batch sends between ranks when the features ``rows`` ((F,) bool) go as rows and
    the others pooled: TorchRec's pooled exchange when none goes as rows, else the rows exchange with its
    header. Also the rows requests (None without rows features)."""
    num_features = len(lengths_per_key)
    args = {"lengths_per_key": lengths_per_key, "batch": batch, "ownership": ownership}
    if not bool(rows.any()):
        return pooled_counts(values, lengths, rank=rank, **args), None
    if bool(rows.all()):
        zero = [0] * num_features
        pooled = ExchangeCounts(
            list(zero), list(zero), list(zero), list(zero), list(zero), dims=list(ownership.dims)
        )
    else:
        pooled = pooled_counts(values, lengths, rank=rank, features=~rows, **args)
    requests = plan_rows(values, lengths, windows=windows, world_size=world_size, features=rows, **args)
    counts = rows_counts(requests, rank=rank, num_features=num_features, dims=ownership.dims)
    merged = pooled.merged(counts, rows.tolist())
    merged.header = (world_size - 1) * (num_features + 1)
    return merged, requests
