"""The ``[synthetic]`` section: the settings of :class:`recsys.data.synthetic.SyntheticCriteo`.

Kept apart from the generator so that reading a config imports neither torch nor torchrec.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_ARRIVAL_BLOCK", "MAX_ID_SPACE", "SyntheticConfig"]

MAX_ID_SPACE = 1 << 63
# The most samples an interleaved arrival block may hold: each batch sorts the whole blocks it touches.
MAX_ARRIVAL_BLOCK = 1 << 16


@dataclass(kw_only=True, frozen=True, slots=True)
class SyntheticConfig:
    """Synthetic Criteo-layout data (section ``[synthetic]``).

    Attributes:
        num_dense: dense features (Criteo has 13).
        num_sparse: sparse features (Criteo has 26).
        id_space: ids of each sparse feature lie in [0, id_space); up to 2**63 (raw hashed ids).
        id_spaces: optional per-feature id spaces, overriding ``id_space`` (length ``num_sparse``).
        multi_hot: the most ids per feature per sample; lengths are uniform in [1, multi_hot].
        zipf_alpha: exponent of the Zipf law over id popularity ranks (> 0).
        hidden_dim: size of the hidden per-id vectors whose pairwise products drive the labels.
        interaction_strength: weight of the pairwise interactions in the hidden logit.
        linear_strength: weight of the per-id linear effects in the hidden logit.
        eval_samples: size of the held-out split.
        drift_ranks_per_sample: popularity ranks ``d`` the ids slide down per sample of the stream (in
            [0, 2**63]; 0: no drift). The sample at global index ``i`` draws at rank ``r`` the id that rank
            ``r - floor(i * d)`` has at index 0, so a brand-new id takes the top rank every ``1 / d``
            samples and older ids fall into the tail; counted in samples, so the drift does not depend on
            the batch size or the world size.
        request_size: samples per request ``k`` (in [1, 2**63]; 1: every sample is a request of its own).
            Sample ``i`` belongs to request ``i // k``.
        user_features: the first ``user_features`` sparse features (in [0, num_sparse]) are user-side: every
            sample of a request has that feature of the request's first sample (ids, lengths and the drift
            of index ``k * (i // k)``), so one draw per request. The others are item-side, drawn per
            sample. With ``request_size = 1`` they are ordinary features and the stream is unchanged.
        interleave: requests that arrive interleaved (>= 1; 1: in order, each request's samples
            contiguous). The stream is cut into blocks of ``interleave * request_size`` positions (at most
            2**16), and each block serves its samples in an order fixed by (seed, split, block) alone.
    """

    num_dense: int = 13
    num_sparse: int = 26
    id_space: int = 100_000
    id_spaces: tuple[int, ...] = ()
    multi_hot: int = 1
    zipf_alpha: float = 1.05
    hidden_dim: int = 2
    interaction_strength: float = 1.0
    linear_strength: float = 0.6
    eval_samples: int = 65_536
    drift_ranks_per_sample: float = 0.0
    request_size: int = 1
    user_features: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")
        if self.num_sparse < 1:
            raise ValueError(f"num_sparse must be >= 1, got {self.num_sparse}")
        for space in (self.id_space, *self.id_spaces):
            if not 1 <= space <= MAX_ID_SPACE:
                raise ValueError(f"id_space must be in [1, 2**63], got {space}")
        if self.id_spaces and len(self.id_spaces) != self.num_sparse:
            raise ValueError(
                f"id_spaces needs num_sparse={self.num_sparse} entries, got {len(self.id_spaces)}"
            )
        if self.multi_hot < 1:
            raise ValueError(f"multi_hot must be >= 1, got {self.multi_hot}")
        if not self.zipf_alpha > 0:
            raise ValueError(f"zipf_alpha must be > 0, got {self.zipf_alpha}")
        if self.hidden_dim < 1:
            raise ValueError(f"hidden_dim must be >= 1, got {self.hidden_dim}")
        if self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {self.eval_samples}")
        # The bound keeps index * rate finite for every uint64 index (NaN fails both comparisons).
        if not 0.0 <= self.drift_ranks_per_sample <= MAX_ID_SPACE:
            raise ValueError(
                f"drift_ranks_per_sample must be in [0, 2**63], got {self.drift_ranks_per_sample}"
            )
        if not 1 <= self.request_size <= MAX_ID_SPACE:
            raise ValueError(f"request_size must be in [1, 2**63], got {self.request_size}")
        if not 0 <= self.user_features <= self.num_sparse:
            raise ValueError(
                f"user_features must be in [0, num_sparse={self.num_sparse}], got {self.user_features}"
            )
        if self.interleave < 1:
            raise ValueError(f"interleave must be >= 1, got {self.interleave}")
        if self.interleave > 1 and self.interleave * self.request_size > MAX_ARRIVAL_BLOCK:
            raise ValueError(
                f"interleave must be 1 or at most 2**16 // request_size = {MAX_ARRIVAL_BLOCK // self.request_size}"
                f" (samples per arrival block), got {self.interleave}"
            )

    @property
    def feature_names(self) -> list[str]:
        return [f"cat_{i}" for i in range(self.num_sparse)]

    def feature_id_space(self, index: int) -> int:
        return self.id_spaces[index] if self.id_spaces else self.id_space
