"""Fixtures for the data tests: files in exact Criteo layout and small column-mapped files, with oracles."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest


def criteo_lines(n: int, *, seed: int = 0, label: bool = True) -> list[str]:
    """Lines in the exact Criteo layout: empty fields, negative counts, hex ids of 8 digits up to 2**32-1."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        fields = [str(int(rng.integers(0, 2)))] if label else []
        for _ in range(13):
            r = rng.random()
            fields.append(
                ""
                if r < 0.15
                else str(int(rng.integers(-3, 0)))
                if r < 0.2
                else str(int(rng.integers(0, 10**6)))
            )
        for _ in range(26):
            r = rng.random()
            value = int(rng.integers(2**31, 2**32)) if r < 0.4 else int(rng.integers(0, 2**31))
            fields.append("" if r > 0.9 else format(value, "08x"))
        lines.append("\t".join(fields))
    return lines


def criteo_oracle(line: str, *, label: bool = True) -> tuple[list[float], list[int], float]:
    """What a Criteo line means, computed the slow, obvious way (TorchRec's conventions + DLRM's log)."""
    parts = line.split("\t")
    y = float(parts[0]) if label else 0.0
    rest = parts[1:] if label else parts
    dense = [float(np.float32(math.log1p(max(int(x or "0"), 0)))) for x in rest[:13]]
    ids = [int(x or "0", 16) for x in rest[13:]]
    return dense, ids, y


@pytest.fixture
def criteo_file(tmp_path: Path) -> tuple[Path, list[str]]:
    lines = criteo_lines(3000, seed=1)
    path = tmp_path / "day_0"
    path.write_text("\n".join(lines) + "\n")
    return path, lines
