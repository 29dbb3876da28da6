"""The one rule that names an embedding table after its sparse feature: ``cat_0`` → ``t_cat_0``.

Tables carry this name in the model (``EmbeddingBagConfig.name``), the checkpoint, the store, the tuner's
report and the serving bundle; every module derives it here. No imports, so the serving runtime and the
tuner can use it without loading torch.
"""

from __future__ import annotations

__all__ = ["PREFIX", "feature_of", "table_name"]

PREFIX = "t_"


def table_name(feature: str) -> str:
    """The table of ``feature``."""
    return PREFIX + feature


def feature_of(table: str) -> str:
    """The feature of ``table`` (the name itself when it lacks the prefix)."""
    return table.removeprefix(PREFIX)
