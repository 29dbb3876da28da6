"""Evaluation metrics and the run directory's metrics.jsonl / summary.json writers.

Every file written here is strict JSON (RFC 8259): a non-finite float (an AUC over constant labels, a
rate over zero seconds, a diverged loss) is written as ``null``, never as the bare ``NaN`` / ``Infinity``
tokens Python's ``json`` emits by default, which strict parsers (``jq``, JavaScript, most JSON
libraries) reject. ``allow_nan=False`` then makes any float that escapes the cleaning raise instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

__all__ = ["auc_logloss", "MetricsLog", "write_json", "json_safe", "to_json", "rewind_metrics"]

log = logging.getLogger("recsys")


def auc_logloss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """ROC AUC and mean log loss of (N,) logits against (N,) {0, 1} labels."""
    logits = logits.double()
    labels = labels.double()
    logloss = F.binary_cross_entropy_with_logits(logits, labels).item()
    if labels.min() == labels.max():
        return math.nan, logloss
    return binary_auroc(torch.sigmoid(logits), labels.long()).item(), logloss


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and numpy / torch scalars and arrays as Python values.

    Recurses into dicts, lists and tuples; any other type is returned as it is (``json.dumps`` then
    raises for what it cannot write, as before).
    """
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):  # numpy's float64 is a float too
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_key(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic | np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, torch.Tensor):
        return json_safe(value.detach().cpu().tolist())
    return value


def _key(key: Any) -> Any:
    return key.item() if isinstance(key, np.generic) else key


def to_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`json_safe` (``obj``) with ``allow_nan=False``: always strict JSON."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a temporary file, synced, then renamed over it (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON (:func:`to_json`) atomically (temporary file then rename)."""
    _write_atomic(path, to_json(obj, indent=2, sort_keys=False) + "\n")


def rewind_metrics(path: Path, step: int) -> None:
    """Cut ``metrics.jsonl`` back to the records of steps ``<= step`` (a resumed run redoes the rest).

    Records without a numeric ``step`` are kept. A last line without its newline (a run killed mid-write)
    is dropped, as is any line that is not a JSON object; kept records are rewritten as strict JSON (old
    ``NaN`` tokens become ``null``). The file is replaced atomically; no file, nothing to do.

    Args:
        path: the run's ``metrics.jsonl``.
        step: the step the run resumes from (the checkpoint's step).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    lines = data.split(b"\n")
    # b"" after a final newline, or the torn remainder of a line that never got its newline.
    dropped = int(bool(lines.pop()))
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # also UnicodeDecodeError: a torn or overwritten line
            record = None
        if not isinstance(record, dict):
            dropped += bool(line.strip())
            continue
        at = record.get("step")
        if isinstance(at, int | float) and not isinstance(at, bool) and at > step:
            continue
        kept.append(to_json(record) + "\n")
    if dropped:
        log.warning("%s: dropped %d unreadable line(s) when rewinding to step %d", path, dropped, step)
    _write_atomic(path, "".join(kept))


class MetricsLog:
    """Appends one strict-JSON object per line to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._start = time.perf_counter()

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        record = {"time_s": round(time.perf_counter() - self._start, 3), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(to_json(record) + "\n")
