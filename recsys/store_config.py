"""Tiered tables (section ``[store]``): which tables live on device slots ← host DRAM ← LMDB, and how big."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from embedding_store import PolicyKind
from embedding_store.config import LOOKAHEAD_BATCHES
from recsys.bounds_config import TableBoundsConfig, split_bounds
from recsys.errors import UserError
from recsys.table_names import feature_of

if TYPE_CHECKING:
    from embedding_store.bounds_rule import BoundsRule

__all__ = [
    "StoreSection",
    "TableCapacity",
    "load_tune",
    "parse_size",
    "rows_of",
]

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Bytes of a size: an int (bytes) or a string such as ``"64MiB"``, ``"1.5GB"``, ``"512K"``.

    ``KiB``/``MiB``/``GiB``/``TiB`` and the bare ``K``/``M``/``G``/``T`` are powers of 1024; ``KB``/``MB``/
    ``GB``/``TB`` are powers of 1000; ``B`` or no unit is bytes.

    >>> parse_size("64MiB"), parse_size("2GB"), parse_size(4096)
    (67108864, 2000000000, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"expected a size such as 4096, '64MiB' or '1.5GB', got {text!r}")
    number, prefix, binary, unit_b = match.groups()
    base = 1000 if (prefix and unit_b and not binary) else 1024
    return int(float(number) * base ** _POWER[prefix.lower()])


def rows_of(value: int | str, row_bytes: int) -> int:
    """Rows of a capacity given in rows (an int) or as a size string (bytes, rounded down to rows)."""
    if isinstance(value, int):
        return value
    return parse_size(value) // row_bytes


@dataclass(kw_only=True, frozen=True, slots=True)
class TableCapacity:
    """Capacities of one tiered table (``[store.capacity]``, keyed by sparse feature).

    Attributes:
        device: device slots on each owning rank: rows (an int) or a size (``"64MiB"``, rows of the table's
            packed size: weights plus optimizer state); None keeps the ``[store]`` default.
        host: host-DRAM rows on each owning rank, the same way.
    """

    device: int | str | None = None
    host: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("device", "host"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    parse_size(value)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
            elif value is not None and value < (1 if name == "device" else 0):
                raise ValueError(f"{name} must be >= {1 if name == 'device' else 0} rows, got {value}")


@dataclass(kw_only=True, frozen=True, slots=True)
class StoreSection:
    """Tiered embedding tables (section ``[store]``).

    Attributes:
        tiered: put the tables on the three tiers; ``false`` keeps every table fully in memory (the
            reference: same model, same digest).
        tables: sparse features whose tables are tiered (empty: all of them).
        device_rows: slots per tiered table on each rank that owns (a part of) it; they must hold the
            distinct ids of the batches in flight (three with TorchRec's pipeline) plus evaluation.
        host_rows: host-DRAM rows per tiered table per owning rank (0: no host tier).
        policy: eviction policy of both caches (``embedding_store.PolicyKind``): ``lookahead``, ``lru`` or
            ``lfu``.
        lookahead: batches whose ids are announced ahead of use (LOOKAHEAD protects their rows and the
            prefetcher reads them from LMDB early).
        path: store directory (default: ``<run directory>/store``); one LMDB environment per rank.
        capacity: per-table overrides, keyed by sparse feature (``[store.capacity]`` in TOML:
            ``cat_0 = { device = 6000, host = "2MiB" }``); they win over ``capacities_from``.
        capacities_from: a ``tune.json`` written by ``recsys tune-cache``; its per-table ``device_rows``
            and ``host_rows`` win over ``device_rows``/``host_rows``, and the run reports its predicted hit
            rates beside the measured ones.
        max_lmdb_bytes: cap on each rank's LMDB map (0: none, grow until the disk is full). A write that
            would pass it stops the run with a one-line error naming the store and the space it needed;
            nothing is half-written.
        unmap_every_rows: 0 keeps every LMDB page a read touched mapped into the process (fastest while the
            store fits in memory; the pages count toward RSS); N > 0 drops the mapping's pages after every N
            rows read or written (the page cache keeps them), which bounds RSS for a store larger than RAM
            (``embedding_store.LmdbOptions.unmap_every_rows``).
        bounds: admission, expiry and a row cap for the tables of ``tables`` (all when empty), tiered or
            not (:mod:`recsys.bounds_config`): ``admit_after``, ``admit_window_steps``,
            ``expire_after_steps``, ``max_rows`` for every such table, a sub-table per feature for one.
            Empty: no bounds, every id keeps its row forever.
    """

    tiered: bool = False
    tables: tuple[str, ...] = ()
    device_rows: int = 16_384
    host_rows: int = 65_536
    policy: PolicyKind = PolicyKind.LOOKAHEAD
    lookahead: int = LOOKAHEAD_BATCHES
    path: str = ""
    capacity: dict[str, TableCapacity] = field(default_factory=dict)
    capacities_from: str = ""
    max_lmdb_bytes: int = 0
    unmap_every_rows: int = 0
    bounds: dict[str, TableBoundsConfig | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bounds_rules(())  # validates [store.bounds]
        if self.unmap_every_rows < 0:
            raise ValueError(
                f"unmap_every_rows must be 0 (off) or a positive number of rows, got {self.unmap_every_rows}"
            )
        if self.max_lmdb_bytes != 0 and self.max_lmdb_bytes < 1 << 16:
            raise ValueError(f"max_lmdb_bytes must be 0 (no cap) or >= 65536, got {self.max_lmdb_bytes}")
        if self.device_rows < 1:
            raise ValueError(f"device_rows must be >= 1, got {self.device_rows}")
        if self.host_rows < 0:
            raise ValueError(f"host_rows must be >= 0, got {self.host_rows}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if len(set(self.tables)) != len(self.tables):
            raise ValueError(f"tables must be distinct, got {list(self.tables)}")

    def bounds_rules(self, features: Sequence[str]) -> dict[str, BoundsRule]:
        """The active bounds rule of each of ``features`` that ``[store.bounds]`` bounds (a feature of
        ``tables``, or any when ``tables`` is empty); none when the section is empty.

        Raises:
            ValueError: a key or value of ``[store.bounds]`` is invalid, or it names an unknown feature
                (checked when ``features`` is given).
        """
        if not self.bounds:
            return {}
        from embedding_store.bounds_rule import BoundsRule

        common, per_feature = split_bounds(self.bounds)
        # Only the tables of store.tables are bounded: a sub-table for another one would do nothing.
        if self.tables:
            for feature in per_feature:
                if feature not in self.tables:
                    raise ValueError(
                        f"bounds.{feature} bounds a table that store.tables does not list "
                        f"({', '.join(self.tables)}): add {feature!r} to store.tables, or remove "
                        f"[store.bounds.{feature}]"
                    )
        unknown = sorted(set(per_feature) - set(features)) if features else []
        if unknown:
            raise ValueError(f"bounds names unknown features {unknown}; features are {list(features)}")
        out = {}
        for feature in ["", *(features or per_feature)]:  # "": the section's own keys
            values = common | (per_feature[feature].values() if feature in per_feature else {})
            try:
                rule = BoundsRule(**values)
            except ValueError as err:
                where = f"bounds.{feature}" if feature in per_feature else "bounds"
                raise ValueError(f"{where}: {str(err).removeprefix('BoundsRule.')}") from None
            if (
                feature
                and feature in features
                and rule.active
                and (not self.tables or feature in self.tables)
            ):
                out[feature] = rule
        return out


def load_tune(path: str | Path) -> dict[str, dict[str, object]]:
    """Per sparse feature, the entry of a ``tune.json`` (``device_rows``, ``host_rows``, predictions)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        tables = doc["tables"]
        out = {}
        for name, entry in tables.items():
            feature = entry.get("feature", feature_of(name))
            for key in ("device_rows", "host_rows"):
                if not isinstance(entry.get(key), int) or entry[key] < 0:
                    raise ValueError(f"tables.{name}.{key} must be an int >= 0, got {entry.get(key)!r}")
            out[feature] = entry
        return out
    except FileNotFoundError:
        raise UserError(f"store.capacities_from: file not found: {path}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"store.capacities_from = {str(path)!r} is not a tune.json: {err}") from None
