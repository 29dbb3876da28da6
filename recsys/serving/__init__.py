"""Serving a trained model: bundles written by ``recsys export`` and the scorer that reads them.

``load_bundle(path)`` returns a :class:`~recsys.serving.scorer.Scorer` (see its docstring). The runtime
modules (``bundle``, ``bounded``, ``cache``, ``model``, ``scorer``) need torch, numpy, lmdb and
safetensors only; an import-linter contract keeps TorchRec and FBGEMM out of them. The commands that
produce and use bundles (``export``, ``evaluate``, ``predict``, ``commands``) read checkpoints and
datasets and are imported only by the CLI; of them only ``evaluate`` (the trainer's model) needs TorchRec.

Names are resolved on first use, so that ``recsys --help`` (which registers the commands) does not
import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BundleError", "CacheStats", "DefaultStats", "Scorer", "load_bundle"]

_WHERE = {
    "BundleError": "recsys.serving.bundle",
    "CacheStats": "recsys.serving.cache",
    "DefaultStats": "recsys.serving.bounded",
    "Scorer": "recsys.serving.scorer",
    "load_bundle": "recsys.serving.scorer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'recsys.serving' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
