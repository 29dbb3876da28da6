"""Models: DLRM, DLRM-DCNv2 and a logistic-regression baseline, all over one EmbeddingBagCollection.

Every model maps ``(dense (B, num_dense), sparse KJT)`` to logits ``(B,)``; :class:`TrainModel` adds the
loss in the ``(loss, output)`` form that TorchRec's train pipelines expect.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.data.batch import Batch
from recsys.windows import sparse_module, windowed_rest

torch.fx.wrap("windowed_rest")  # TorchRec's fx tracer sees the sharded lookup, not the windows' loop

__all__ = ["ModelName", "ModelConfig", "build_model", "table_configs", "TrainModel", "LogisticRegression"]


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


class LogisticRegression(nn.Module):
    """logit = w·dense + b + sum over features of per-id weights (each the sum of a 4-wide row).

    Summing the components of each row keeps the model linear in the one-hot features: this is plain
    logistic regression over the same features as the other models.
    """

    def __init__(self, ebc: EmbeddingBagCollection, *, num_dense: int) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.dense_arch = nn.Linear(num_dense, 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features).values()  # (B, F * LOGISTIC_DIM)
        return self.dense_arch(dense_features) + pooled.sum(dim=1, keepdim=True)  # (B, 1)


def table_configs(
    feature_names: list[str], *, dim: int, num_embeddings: list[int]
) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per sparse feature, named ``t_<feature>``."""
    return [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=dim,
            num_embeddings=rows,
            feature_names=[feature],
            pooling=PoolingType.SUM,
        )
        for feature, rows in zip(feature_names, num_embeddings, strict=True)
    ]


def build_model(
    config: ModelConfig, tables: list[EmbeddingBagConfig], *, num_dense: int, device: torch.device
) -> nn.Module:
    """The model with its EmbeddingBagCollection on the meta device (DMP materialises it)."""
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if config.name is ModelName.LOGISTIC:
        return _logistic(ebc, num_dense, device)
    over = [*config.over_arch, 1]
    if config.name is ModelName.DCN:
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(config.dense_arch),
            over_arch_layer_sizes=over,
            dcn_num_layers=config.dcn_num_layers,
            dcn_low_rank_dim=config.dcn_low_rank_dim,
            dense_device=device,
        )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=list(config.dense_arch),
        over_arch_layer_sizes=over,
        dense_device=device,
    )


def _logistic(ebc: EmbeddingBagCollection, num_dense: int, device: torch.device) -> nn.Module:
    model = LogisticRegression(ebc, num_dense=num_dense)
    model.dense_arch.to(device)
    return model


class TrainModel(nn.Module):
    """Wraps a model with its loss: ``batch -> (loss, (loss, logits, labels))``, all detached but the loss."""

    def __init__(self, model: nn.Module, *, windows: int = 1) -> None:
        super().__init__()
        self.model = model
        self.windows = windows  # frozen windows per training batch (recsys.windows); 1: unsplit
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.training and self.windows > 1:
            parts = sparse_module(self.model)(batch.sparse)  # one awaitable KeyedTensor per window
            logits = windowed_rest(self.model, batch.dense, parts, self.windows).squeeze(-1)
        else:
            logits = self.model(batch.dense, batch.sparse).squeeze(-1)  # (B,)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)
