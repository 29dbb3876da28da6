"""Held-out evaluation of a trainer's model: its logits, AUC and log loss over the whole held-out split,
and the constant predictor's log loss beside them.

:class:`Evaluator` is given the model's parts (the sharded model, the data, the tier binding) and the
rank's place in the job; the training loop calls it every ``eval.every`` steps and after the last, and
``recsys evaluate`` calls the same code on a restored checkpoint (:mod:`recsys.serving.evaluate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from recsys.binding import EVAL
from recsys.build import ModelParts, fold_ids
from recsys.data.stats import SplitStats, constant_logloss, split_stats_of
from recsys.distributed import DistEnv
from recsys.errors import UserError
from recsys.metrics import auc_logloss
from recsys.ranking import ranking_metrics
from recsys.tier_metrics import TierMetrics

__all__ = ["EVAL_BATCH_BASE", "Evaluator", "HeldOutScores"]

# Batch ids of evaluation batches in the store, apart from training steps.
EVAL_BATCH_BASE = 1 << 40


@dataclass(kw_only=True, frozen=True, slots=True)
class HeldOutScores:
    """One evaluation over the whole held-out split (all ranks).

    Attributes:
        auc: area under the ROC curve (NaN when the split has one label only).
        logloss: mean binary cross-entropy.
        held_out: the split's ``rows`` and ``positives``.
        ranking: with ``eval.group_by``, :func:`~recsys.ranking.ranking_metrics` of the split; else {}.
    """

    auc: float
    logloss: float
    held_out: dict[str, int]
    ranking: dict[str, float | int]


class Evaluator:
    """Scores the held-out split with a trainer's model (every method is collective).

    Args:
        parts: the model's parts (:func:`recsys.build.build_parts`): model, data, folding, tier binding.
        env: this process's place in the job.
        batch_size: the global evaluation batch (``eval.batch_size``).
        tier_metrics: the tiers' counters, told when evaluation batches start and stop (None: untiered).
        group_by: the sparse feature whose id groups the samples for the ranking metrics ("": none).

    Raises:
        UserError: ``group_by`` is not one of the data's sparse features.
    """

    def __init__(
        self,
        parts: ModelParts,
        *,
        env: DistEnv,
        batch_size: int,
        tier_metrics: TierMetrics | None,
        group_by: str = "",
    ) -> None:
        self.parts = parts
        self.env = env
        self.batch_size = batch_size
        self.tier_metrics = tier_metrics
        self.group_by = group_by
        features = list(parts.data.feature_names)
        if group_by and group_by not in features:
            raise UserError(
                f"eval.group_by = {group_by!r}: not a sparse feature of the data ({', '.join(features)})"
            )
        self._train_split: SplitStats | None = None

    @torch.no_grad()
    def predict(self, pipeline: TrainPipelineSparseDist | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits (N,) and labels (N,) of its share of the held-out split."""
        logits, labels, _ = self.predict_groups(pipeline)
        return logits, labels

    @torch.no_grad()
    def predict_groups(
        self, pipeline: TrainPipelineSparseDist | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's logits (N,), labels (N,) and group keys (N,) of its share of the held-out split
        (a sample's key: the first id of its ``group_by`` bag, as read, -1 for an empty bag; all -1
        without ``group_by``).

        A train pipeline rewrites the sparse modules' forward; it is detached for the evaluation (its
        in-flight batches are kept) and re-attaches itself on its next ``progress``.
        """
        p, env = self.parts, self.env
        if pipeline is not None:
            pipeline.detach()
        if self.tier_metrics is not None:
            self.tier_metrics.evaluation_started()
        p.dmp.eval()
        logits, labels, groups = [], [], []
        batches = p.data.eval_batches(rank=env.rank, world_size=env.world_size, batch_size=self.batch_size)
        for index, batch in enumerate(batches):
            groups.append(_group_keys(batch, self.group_by))
            batch = fold_ids(batch, p.fold)
            batch = p.binding.remap(EVAL_BATCH_BASE + index, batch, channel=EVAL)
            _, (_, out, lab) = p.dmp(batch.to(env.device))
            p.binding.release(EVAL_BATCH_BASE + index)
            logits.append(out.cpu())
            labels.append(lab.cpu())
        p.dmp.train()
        if self.tier_metrics is not None:
            self.tier_metrics.evaluation_done()
        return torch.cat(logits), torch.cat(labels), torch.cat(groups)

    def evaluate(self, pipeline: TrainPipelineSparseDist | None = None) -> HeldOutScores:
        """AUC and log loss over the whole held-out split (every rank scores its share), and with
        ``group_by`` the ranking metrics."""
        mine = self.predict_groups(pipeline)
        parts = [mine]
        if self.env.world_size > 1:
            parts = [None] * self.env.world_size  # type: ignore[list-item]
            dist.all_gather_object(parts, mine)
        logits_all = torch.cat([p[0] for p in parts])
        labels_all = torch.cat([p[1] for p in parts])
        auc, logloss = auc_logloss(logits_all, labels_all)
        held_out = {"rows": int(labels_all.numel()), "positives": int(labels_all.sum())}
        ranking: dict[str, float | int] = {}
        if self.group_by:
            groups_all = torch.cat([p[2] for p in parts])
            ranking = ranking_metrics(logits_all.numpy(), labels_all.numpy(), groups_all.numpy())
        return HeldOutScores(auc=auc, logloss=logloss, held_out=held_out, ranking=ranking)

    def baseline(self, held_out: dict[str, int] | None) -> dict[str, Any]:
        """Rows and positive rates of both splits, and the held-out log loss of the constant predictor
        (the training split's positive rate); a split is None while unknown (the held-out one until an
        evaluation has counted it, ``held_out``; the training one when the dataset does not report it).
        Not collective."""
        train = self.train_split()
        held = (
            None if held_out is None else SplitStats(rows=held_out["rows"], positives=held_out["positives"])
        )
        out: dict[str, Any] = {
            "splits": {
                name: None if s is None else s.as_dict() for name, s in (("train", train), ("eval", held))
            },
            "constant_logloss": None,
        }
        if train is not None and held is not None:
            constant = constant_logloss(train, held)
            out["constant_logloss"] = None if math.isnan(constant) else constant
        return out

    def train_split(self) -> SplitStats | None:
        """Rows and positives of the training split as the dataset reports them (None: it does not)."""
        if self._train_split is None:
            found = split_stats_of(self.parts.data)
            self._train_split = None if not found else found.get("train")
        return self._train_split


def _group_keys(batch: Any, feature: str) -> torch.Tensor:
    """(B,) int64: the first id of each sample's ``feature`` bag, -1 for an empty bag (all -1 without a
    feature)."""
    size = int(batch.labels.shape[0])
    if not feature:
        return torch.full((size,), -1, dtype=torch.int64)
    bags = batch.sparse[feature]
    lengths = bags.lengths().to(torch.int64)
    first = torch.cumsum(lengths, 0) - lengths
    values = bags.values().to(torch.int64)
    if values.numel() == 0:
        return torch.full((size,), -1, dtype=torch.int64)
    return torch.where(lengths > 0, values[first.clamp(max=values.numel() - 1)], -1)
