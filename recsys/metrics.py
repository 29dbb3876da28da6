"""Evaluation metrics and the run directory's metrics.jsonl / summary.json writers."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

__all__ = ["auc_logloss", "MetricsLog", "write_json"]


def auc_logloss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """ROC AUC and mean log loss of (N,) logits against (N,) {0, 1} labels."""
    logits = logits.double()
    labels = labels.double()
    logloss = F.binary_cross_entropy_with_logits(logits, labels).item()
    if labels.min() == labels.max():
        return math.nan, logloss
    return binary_auroc(torch.sigmoid(logits), labels.long()).item(), logloss


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary file then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._start = time.perf_counter()

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        record = {"time_s": round(time.perf_counter() - self._start, 3), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
