"""The ``[model]`` section: which model and its sizes (built by :mod:`recsys.models`).

Kept apart from the models so that reading a config imports neither torch nor torchrec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["LOGISTIC_DIM", "ModelConfig", "ModelName"]


class ModelName(enum.Enum):
    DLRM = "dlrm"  # MLP over dense features, pairwise dot-product interactions, MLP on top
    DCN = "dcn"  # DLRM with a low-rank DCNv2 cross network as the interaction
    LOGISTIC = "logistic"  # a weight per id plus a linear layer over dense features


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """The model (section ``[model]``).

    Attributes:
        name: ``dlrm``, ``dcn`` or ``logistic``.
        embedding_dim: dimension of every sparse feature's embedding (``logistic`` uses its own).
        dense_arch: hidden sizes of the bottom MLP; the last must equal ``embedding_dim``.
        over_arch: hidden sizes of the top MLP; a final layer of size 1 is appended.
        dcn_num_layers: cross layers of DCNv2 (``dcn`` only).
        dcn_low_rank_dim: rank of each cross layer (``dcn`` only).
    """

    name: ModelName = ModelName.DLRM
    embedding_dim: int = 16
    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (128, 64)
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 32

    def __post_init__(self) -> None:
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {self.embedding_dim}")
        if not self.dense_arch or any(s < 1 for s in self.dense_arch):
            raise ValueError(f"dense_arch must be non-empty positive sizes, got {list(self.dense_arch)}")
        if any(s < 1 for s in self.over_arch):
            raise ValueError(f"over_arch sizes must be positive, got {list(self.over_arch)}")
        if self.dcn_num_layers < 1 or self.dcn_low_rank_dim < 1:
            raise ValueError(
                f"dcn_num_layers and dcn_low_rank_dim must be >= 1, got {self.dcn_num_layers}, {self.dcn_low_rank_dim}"
            )

    @property
    def table_dim(self) -> int:
        return LOGISTIC_DIM if self.name is ModelName.LOGISTIC else self.embedding_dim


# FBGEMM kernels need row sizes divisible by 4: a logistic model's per-id weight is the sum of a 4-wide row.
LOGISTIC_DIM = 4
