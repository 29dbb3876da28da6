"""What the end-to-end tests share: a small synthetic tiered run as TOML, and ``recsys train`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

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


def run_train(
    config: Path, out: Path, *extra: str, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess:
    """``python -m recsys train --config CONFIG --out OUT EXTRA...`` from the repository root (5 min limit);
    with ``check`` a non-zero exit fails the test with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "recsys", "train", "--config", str(config), "--out", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
