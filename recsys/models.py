"""Models: DLRM, DLRM-DCNv2 and a logistic-regression baseline, all over one EmbeddingBagCollection.

Every model maps ``(dense (B, num_dense), sparse KJT)`` to logits ``(B,)``; :class:`TrainModel` adds the
loss in the ``(loss, output)`` form that TorchRec's train pipelines expect.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.data.batch import Batch
from recsys.model_config import ModelConfig, ModelName
from recsys.table_names import table_name
from recsys.windows import sparse_module, windowed_rest

torch.fx.wrap("windowed_rest")  # TorchRec's fx tracer sees the sharded lookup, not the windows' loop

__all__ = [
    "ModelName",
    "ModelConfig",
    "build_model",
    "table_configs",
    "interaction_order",
    "TrainModel",
    "LogisticRegression",
]


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
    feature_names: list[str], *, dim: int, num_embeddings: list[int], fp16: bool = False
) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per sparse feature, named ``t_<feature>`` (``fp16``: half-precision weights,
    FBGEMM's ``weights_precision``)."""
    return [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=dim,
            num_embeddings=rows,
            feature_names=[feature],
            pooling=PoolingType.SUM,
            data_type=DataType.FP16 if fp16 else DataType.FP32,
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


def interaction_order(model: nn.Module, tables: list[EmbeddingBagConfig]) -> list[str]:
    """The sparse features in the order the model's interaction layer consumes their pooled embeddings.

    DLRM and DCN stack the pooled embeddings in their ``SparseArch``'s ``sparse_feature_names`` order
    (which is not the order of a checkpoint's sorted state-dict keys); the logistic model sums them, in
    the collection's table order. ``model`` may be wrapped (``TrainModel``, DistributedModelParallel).
    """
    inner = model
    for attr in ("module", "model"):  # DistributedModelParallel.module, then TrainModel.model
        inner = getattr(inner, attr, inner)
    names = getattr(getattr(inner, "sparse_arch", None), "sparse_feature_names", None)
    if names is None:
        names = [f for t in tables for f in t.feature_names]
    return list(names)


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
