"""Shared fixtures: small configs and a clean environment for subprocesses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def subprocess_env() -> dict[str, str]:
    """Environment for running ``python -m recsys`` in a subprocess (no inherited torchrun variables)."""
    env = {
        k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"}
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running ``python -m recsys`` in a subprocess (no inherited torchrun variables)."""
    return subprocess_env()


@pytest.fixture
def python() -> str:
    return sys.executable
