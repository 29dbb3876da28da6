"""The small synthetic tiered run that the end-to-end reliability tests share, as a TOML config text."""

from __future__ import annotations

import json
from typing import Any

# Four 20k-id tables on all three tiers: 1,400 device and 400 host rows per table, the rest in LMDB.
BASE: dict[str, dict[str, Any]] = {
    "synthetic": {"num_sparse": 4, "id_space": 20000, "eval_samples": 512},
    "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [32]},
    "train": {"batch_size": 256, "threads_per_rank": 1},
    "store": {"tiered": True, "device_rows": 1400, "host_rows": 400},
    "eval": {"batch_size": 256},
}


def tiny_config(**sections: dict[str, Any]) -> str:
    """``BASE`` with each keyword's keys set in that section, as TOML (values: numbers, booleans, lists)."""
    merged = {name: dict(values) for name, values in BASE.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    lines = []
    for name, values in merged.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]  # JSON scalars are TOML
        lines.append("")
    return "\n".join(lines)
