"""Data loading: the Batch type, the Dataset protocol and the readers that produce batches.

The names are loaded on first use: reading a config (``recsys.data.source``) imports neither torch nor
torchrec, so the CLI answers a bad config, and the launcher starts its workers, without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Batch", "DataConfig", "Dataset", "SyntheticConfig", "SyntheticCriteo", "build_dataset"]

_WHERE = {
    "Batch": "recsys.data.batch",
    "DataConfig": "recsys.data.source",
    "Dataset": "recsys.data.source",
    "build_dataset": "recsys.data.source",
    "SyntheticConfig": "recsys.data.synthetic_config",
    "SyntheticCriteo": "recsys.data.synthetic",
}

if TYPE_CHECKING:
    from recsys.data.batch import Batch
    from recsys.data.source import DataConfig, Dataset, build_dataset
    from recsys.data.synthetic import SyntheticCriteo
    from recsys.data.synthetic_config import SyntheticConfig


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'recsys.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
