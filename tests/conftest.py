"""Shared fixtures: small configs and a clean environment for subprocesses."""

from __future__ import annotations

import os
import subprocess
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


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size) -> folder``: a real tmpfs of that size (unmounted after the test)."""
    mounts = []

    def mount(size: str) -> Path:
        path = tmp_path / f"mnt{len(mounts)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
