"""The dense part of the trained models in plain torch: DLRM, DLRM-DCNv2 and logistic regression.

Each module mirrors the attribute names of TorchRec's ``DLRM`` / ``DLRM_DCN`` (and of
:class:`recsys.models.LogisticRegression`), so the checkpoint's state dict loads with ``strict=True``
once its ``model.`` prefix (the training wrapper) is dropped: a renamed or missing parameter fails the
load instead of being silently left at its initial value. The computations are the same operations in
the same order (``nn.Linear`` + ReLU, a batched dot product over the upper triangle, the low-rank cross
layers), so the logits equal the trainer's for the same inputs.

Inputs are the pooled embeddings of the sparse features, ``(B, F, D)``, in the bundle's feature order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["build_dense_model", "STATE_PREFIX"]

# The trainer wraps the model (recsys.models.TrainModel.model): every checkpoint name starts with it.
STATE_PREFIX = "model."


class _Perceptron(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self._linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self._linear(x))


class _MLP(nn.Module):
    """TorchRec's ``MLP`` with ReLU after every layer."""

    def __init__(self, in_features: int, sizes: list[int]) -> None:
        super().__init__()
        widths = [in_features, *sizes]
        self._mlp = nn.Sequential(*(_Perceptron(a, b) for a, b in zip(widths, widths[1:], strict=False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x)


class _DenseArch(nn.Module):
    def __init__(self, in_features: int, sizes: list[int]) -> None:
        super().__init__()
        self.model = _MLP(in_features, sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _OverArch(nn.Module):
    """An MLP over all but the last size, then a plain linear layer to the last (the logit)."""

    def __init__(self, in_features: int, sizes: list[int]) -> None:
        super().__init__()
        self.model = nn.Sequential(_MLP(in_features, sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class _LowRankCrossNet(nn.Module):
    """DCNv2's low-rank cross layers: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.W_kernels = nn.ParameterList(torch.empty(in_features, low_rank) for _ in range(num_layers))
        self.V_kernels = nn.ParameterList(torch.empty(low_rank, in_features) for _ in range(num_layers))
        self.bias = nn.ParameterList(torch.empty(in_features) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, v), w) + b) + x
        return x


class _DotInteraction(nn.Module):
    """The dense embedding and the F pooled embeddings, then every pairwise dot product of the F + 1."""

    def __init__(self, num_sparse: int) -> None:
        super().__init__()
        self.register_buffer(
            "triu", torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1), persistent=False
        )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
        interactions = torch.bmm(combined, torch.transpose(combined, 1, 2))
        return torch.cat((dense, interactions[:, self.triu[0], self.triu[1]]), dim=1)


class _DCNInteraction(nn.Module):
    def __init__(self, num_sparse: int, dim: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.crossnet = _LowRankCrossNet((num_sparse + 1) * dim, num_layers, low_rank)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
        return self.crossnet(combined.reshape([dense.shape[0], -1]))


class _DLRM(nn.Module):
    """``(dense (B, num_dense), pooled (B, F, D)) -> logits (B,)``."""

    def __init__(self, arch: dict[str, Any], *, num_dense: int, num_sparse: int) -> None:
        super().__init__()
        dim = int(arch["embedding_dim"])
        over = [*arch["over_arch"], 1]
        self.dense_arch = _DenseArch(num_dense, list(arch["dense_arch"]))
        if arch["name"] == "dcn":
            self.inter_arch: nn.Module = _DCNInteraction(
                num_sparse, dim, int(arch["dcn_num_layers"]), int(arch["dcn_low_rank_dim"])
            )
            over_in = (num_sparse + 1) * dim
        else:
            self.inter_arch = _DotInteraction(num_sparse)
            over_in = dim + num_sparse + num_sparse * (num_sparse - 1) // 2
        self.over_arch = _OverArch(over_in, over)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.inter_arch(self.dense_arch(dense), pooled)).squeeze(-1)


class _Logistic(nn.Module):
    """``w·dense + b + the sum of every pooled component`` (each id's weight is the sum of its row)."""

    def __init__(self, *, num_dense: int) -> None:
        super().__init__()
        self.dense_arch = nn.Linear(num_dense, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        # (B, F * dim) as TorchRec's KeyedTensor lays it out, summed in one reduction like training.
        flat = pooled.reshape(pooled.shape[0], -1)
        return (self.dense_arch(dense) + flat.sum(dim=1, keepdim=True)).squeeze(-1)


def build_dense_model(
    arch: dict[str, Any], state: dict[str, torch.Tensor], *, num_dense: int, num_sparse: int
) -> nn.Module:
    """The model of ``arch`` (a bundle's ``model`` section) with the checkpoint's dense ``state`` loaded.

    Raises:
        ValueError: ``state`` does not fit the architecture (a missing, unexpected or misshapen name).
    """
    model: nn.Module
    if arch["name"] == "logistic":
        model = _Logistic(num_dense=num_dense)
    else:
        model = _DLRM(arch, num_dense=num_dense, num_sparse=num_sparse)
    local = {name.removeprefix(STATE_PREFIX): value for name, value in state.items()}
    try:
        model.load_state_dict(local, strict=True)
    except RuntimeError as err:
        first = " ".join(str(err).split())[:200]
        raise ValueError(f"the dense weights do not fit a {arch['name']} model: {first}") from None
    return model.eval()
