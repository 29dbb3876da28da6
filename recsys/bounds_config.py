"""Bounded tables (``[store.bounds]``): admission, expiry and a row cap per table (issue-free summary in
docs/tiers.md, the rules in :mod:`embedding_store.bounds`).

In TOML the section's integer keys apply to every bounded table, and a sub-table per sparse feature
overrides them for that table::

    [store.bounds]
    admit_after = 2            # an id gets a row of its own at its 2nd occurrence
    expire_after_steps = 20000 # a row unused for 20,000 steps leaves the model
    [store.bounds.cat_3]
    max_rows = 1000000         # and cat_3 keeps at most a million rows per owner

The bounded tables are those of ``store.tables`` (every sparse feature when it is empty), in tiered and
in-memory runs alike, so ``store.tiered = false`` applies the same rules and trains the same model.
Importing this module loads neither torch nor numba.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["RULE_KEYS", "TableBoundsConfig", "split_bounds"]

RULE_KEYS = ("admit_after", "admit_window_steps", "expire_after_steps", "max_rows")


@dataclass(kw_only=True, frozen=True, slots=True)
class TableBoundsConfig:
    """One table's overrides of ``[store.bounds]`` (None: the section's value).

    Attributes:
        admit_after: occurrences (lookups in training batches) within ``admit_window_steps`` that give an
            id a row of its own; until then it reads the table's shared, trainable default row (1: no
            admission).
        admit_window_steps: a candidate's count restarts when its previous occurrence is more than this
            many steps old; it bounds the candidates held to the distinct new ids of that many steps.
        expire_after_steps: a row unused for more than this many training steps is deleted with its
            optimizer state and the id starts over (0: never).
        max_rows: rows per table and owner rank at most; the least recently used go first (0: no cap).
    """

    admit_after: int | None = None
    admit_window_steps: int | None = None
    expire_after_steps: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")

    def values(self) -> dict[str, int]:
        """The keys this table sets."""
        return {k: getattr(self, k) for k in RULE_KEYS if getattr(self, k) is not None}


def split_bounds(
    bounds: dict[str, int | TableBoundsConfig],
) -> tuple[dict[str, int], dict[str, TableBoundsConfig]]:
    """``[store.bounds]`` as (the section's rule keys, each feature's overrides).

    Raises:
        ValueError: an integer under a key that is no rule key (a misspelt key), or a table under a rule
            key, named with the valid keys.
    """
    common: dict[str, int] = {}
    per_feature: dict[str, TableBoundsConfig] = {}
    for key, value in bounds.items():
        if key in RULE_KEYS:
            if not isinstance(value, int):
                raise ValueError(f"bounds.{key} must be an integer, got a table")
            common[key] = value
        elif isinstance(value, TableBoundsConfig):
            per_feature[key] = value
        else:
            raise ValueError(
                f"bounds.{key} = {value!r}: unknown key; the keys of [store.bounds] are {', '.join(RULE_KEYS)} "
                "and one table per sparse feature"
            )
    return common, per_feature
